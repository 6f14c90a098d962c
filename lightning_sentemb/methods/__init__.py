"""Sentence-embedding methods; each is one file on the shared `SentEmbMethod` base."""

from .base import SentEmbMethod
from .building import build_method
from .clusterns import ClusterNS, ClusterNSPrefix, ClusterNSPrompt
from .conpvp import ConPVP
from .dcpcse import DCPCSE
from .esimcse import ESimCSE
from .mixcse import MixCSE
from .mntp import MNTP
from .promptbert import PromptBERT
from .simcse import SimCSE

__all__ = [
    "DCPCSE", "MNTP", "ClusterNS", "ClusterNSPrefix", "ClusterNSPrompt", "ConPVP", "PromptBERT", "SentEmbMethod",
    "SimCSE", "build_method",
]
__all__ += ["ESimCSE", "MixCSE"]
