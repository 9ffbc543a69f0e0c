"""kvrelay.kernels"""
