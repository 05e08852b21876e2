"""Helpers for plugin authors."""
