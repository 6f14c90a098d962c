"""SimCSE, PromptBERT, DCPCSE (and SCPCSE), ConPVP and ClusterNS: the reference settings of their seed rows."""

from . import Setting

SETTINGS: list[Setting] = []
