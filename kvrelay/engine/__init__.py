"""kvrelay.engine"""
