"""Sentence-embedding methods; each is one file on the shared `SentEmbMethod` base."""

from .base import SentEmbMethod
from .building import build_method
from .clusterns import ClusterNS, ClusterNSPrefix, ClusterNSPrompt
from .conpvp import ConPVP
from .consert import ConSERT
from .consert_joint import ConSERTJoint
from .dclr import DCLR
from .dcpcse import DCPCSE
from .esimcse import ESimCSE
from .flow import BERTFlow
from .mixcse import MixCSE
from .mntp import MNTP
from .promptbert import PromptBERT
from .sbert import SBERT
from .scpcse import SCPCSE
from .simcse import SimCSE
from .sncse import SNCSE

__all__ = [
    "DCLR", "DCPCSE", "MNTP", "SBERT", "SCPCSE", "SNCSE", "BERTFlow", "ClusterNS", "ClusterNSPrefix",
    "ClusterNSPrompt", "ConPVP", "ConSERT", "ConSERTJoint", "ESimCSE", "MixCSE", "PromptBERT", "SentEmbMethod",
    "SimCSE", "build_method",
]
