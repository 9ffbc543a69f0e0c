"""kvrelay.engine.models"""
