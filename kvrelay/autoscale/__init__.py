"""kvrelay.autoscale"""
