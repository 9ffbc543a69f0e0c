"""kvrelay.decode"""
