"""Transforms v2: names only."""

from . import functional

__all__ = ["functional"]
