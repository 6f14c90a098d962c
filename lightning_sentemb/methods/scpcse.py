"""SCPCSE (Jiang & Wang, 2022, DCPCSE paper §3.3 and Appendix A): unsupervised SimCSE through a frozen
backbone steered by a shallow continuous prompt, DCPCSE's own ablation.

`[p_1]…[p_m] [X] [p_m+1]…[p_l] [MASK]`: trainable vectors at the input layer only, initialized from
the manual template `This sentence : "[X]" means [MASK] .` (each vector the input embedding of its
token, at its position), every backbone parameter frozen, the [MASK] state the sentence embedding.
It is `TemplateEncoder`'s continuous mode (`encoders.template`) on a frozen backbone, trained like
PromptBERT with one template: the two views are the same input under dropout (the backbone stays in
train mode), the training MLP as SimCSE's, no template denoising (the paper mentions none).

The paper does not say whether the "." after [MASK] is a prompt vector: here every token of the
template text but the mask is (the tokenizer's special tokens stay). Checkpoints hold the trainable
tensors only (prompt and MLP), as DCPCSE's; exports hold the backbone and the prompt vectors.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..encoders.template import TemplateEncoder
from .promptbert import PromptBERT, default_templates

__all__ = ["SCPCSE"]


class SCPCSE(PromptBERT):
    """Shallow continuous prompt on a frozen backbone.

    Defaults are the paper's (§3.3, Appendix A); no code was published: its seed-row config adds the clip to
    norm 1.0 of the DCPCSE code's trainer (docs/methods.md, reproduction configs).

    Args:
        templates: one template whose text becomes the prompt vectors; None = the family's first
            PromptBERT template (BERT: `This sentence : "[X]" means [MASK] .`, the paper's).
        denoise_train: template denoising in training; off (the paper's).
        lr: default 1e-3 (paper, Appendix A: batch 256, 5 epochs).
        **kwargs: see `PromptBERT` and `SentEmbMethod`.
    """

    def __init__(self, backbone: str, templates: Sequence[str] | None = None, denoise_train: bool = False,
                 lr: float = 1e-3, **kwargs: Any) -> None:
        super().__init__(backbone, templates=templates, denoise_train=denoise_train, lr=lr, **kwargs)

    def build_encoder(self) -> TemplateEncoder:
        templates = self.hparams.templates or default_templates(self.family)[:1]
        return TemplateEncoder(self.hparams.backbone, templates, continuous=True, freeze_backbone=True)
