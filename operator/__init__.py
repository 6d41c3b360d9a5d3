"""kvserve.operator"""
