"""Sentence-embedding methods; each is one file on the shared `SentEmbMethod` base."""

from .base import SentEmbMethod
from .simcse import SimCSE

__all__ = ["SentEmbMethod", "SimCSE"]
