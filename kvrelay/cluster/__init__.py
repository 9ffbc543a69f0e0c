"""kvrelay.cluster"""
