"""kvrelay.router"""
