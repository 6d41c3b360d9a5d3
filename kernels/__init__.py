"""kvserve.kernels"""
