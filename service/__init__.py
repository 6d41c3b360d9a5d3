"""kvserve.service"""
