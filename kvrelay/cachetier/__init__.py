"""kvrelay.cachetier"""
