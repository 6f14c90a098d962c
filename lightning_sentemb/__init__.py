"""Sentence-embedding learning (SimCSE, PromptBERT, DCPCSE, ConPVP, ClusterNS) on PyTorch Lightning."""

from ._compat import install as _install_moved_modules

_install_moved_modules()  # old exports name modules that have moved (see `_compat`)
