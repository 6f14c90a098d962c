"""ESimCSE, MixCSE, DCLR, SNCSE, ConSERT, SBERT and BERT-flow: the reference settings of their seed rows."""

from . import Setting

SETTINGS: list[Setting] = []
