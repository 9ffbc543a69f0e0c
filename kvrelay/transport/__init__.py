"""kvrelay.transport"""
