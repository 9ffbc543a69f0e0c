"""kvrelay.prefill"""
