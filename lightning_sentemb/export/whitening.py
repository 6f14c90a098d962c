"""`sentemb export --whiten`: the whitening (`evaluation.whitening`) as sentence-transformers' own Dense
module after the pooling, so `SentenceTransformer(OUT)` serves x̃ = (x − μ)·W[:, :k] without our code:
the linear layer's weight is W[:, :k]ᵀ and its bias −μ·W[:, :k] (computed in fp64, stored in fp32),
the activation the identity."""

from __future__ import annotations

from pathlib import Path

from sentence_transformers.models import Dense
from torch import nn

from ..evaluation.whitening import Whitening
from .plain import append_module

# the module's folder, `<index>_Whitening`: what `sentemb evaluate --pooler` on the export calls it
WHITENING_MODULE = "Whitening"


def whitening_module(whitening: Whitening) -> Dense:
    dim, kept = whitening.kernel.shape
    return Dense(dim, kept, bias=True, activation_function=nn.Identity(),
                 init_weight=whitening.kernel.T.float().contiguous(),
                 init_bias=(-whitening.mean @ whitening.kernel).float())


def append_whitening(folder: Path, whitening: Whitening) -> None:
    """The whitening module after the folder's last module (`<index>_Whitening`)."""
    append_module(folder, WHITENING_MODULE, whitening_module(whitening))


def whitening_card(source: str, whitening: Whitening) -> str:
    """The model card's paragraph on the whitening."""
    dim, kept = whitening.kernel.shape
    return (f"\n## Whitening\n\nBERT-whitening (Su et al., 2021) after the pooling, fitted on `{source}`: "
            f"x̃ = (x − μ)·W[:, :{kept}] ({dim} → {kept} dimensions), sentence-transformers' Dense module "
            f"(`{WHITENING_MODULE}`) with weight W[:, :{kept}]ᵀ and bias −μ·W[:, :{kept}].\n")
