"""kvserve.engine.models"""
