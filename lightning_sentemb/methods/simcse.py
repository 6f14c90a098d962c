"""SimCSE (Gao et al., 2021): dropout views (unsupervised) or NLI pairs with hard negatives."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..data.corpus import nli_columns
from ..distributed import gather_with_grad, local_labels
from ..losses.info_nce import InfoNCELoss
from .base import SentEmbMethod
from .collator import Collator


class SimCSEViews(Collator):
    """The sentence twice (dropout is the augmentation), or its NLI columns; MLM rows when enabled."""

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, Any]:
        columns = nli_columns(examples[0]) if "sent1" in examples[0] else ["sent0", "sent0"]
        rows = [example[column] for column in columns for example in examples]
        batch = {"features": self.format.build(rows, max_length=None), "num_views": len(columns)}
        return self.add_guide_texts(self.add_mlm_inputs(batch), rows)


class SimCSE(SentEmbMethod):
    """Unsupervised when the corpus has one column (the sentence twice: dropout is the
    augmentation); supervised when it has `sent1` (entailment positive) and optionally
    `hard_neg` (contradiction), or k hard negatives `hard_neg_1..k` (`data.corpus.nli_columns`), each
    anchor's own k in its batch. Negatives are the global batch under DDP.

    Defaults are the paper's; its code agrees on each, and its trainer clips gradients to norm 1.0 (the
    seed-row configs set `trainer.gradient_clip_val`; docs/methods.md, reproduction configs).

    Args:
        hard_negative_weight: SimCSE's additive logit bias on each anchor's own hard negative.
        **kwargs: see `SentEmbMethod`.
    """

    collator_class = SimCSEViews

    def __init__(self, backbone: str, hard_negative_weight: float = 0.0, **kwargs: Any) -> None:
        super().__init__(backbone, **kwargs)
        self.loss_fn = InfoNCELoss(self.hparams.temperature, hard_negative_weight)

    def embedding_loss(
        self, embeddings: Tensor, batch: dict[str, Any], drop: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        views = embeddings.unflatten(0, (batch["num_views"], -1))
        anchors = views[0]
        positives = gather_with_grad(views[1])
        hard_negatives = torch.cat([gather_with_grad(view) for view in views[2:]]) if batch["num_views"] > 2 else None
        labels = local_labels(anchors.size(0), anchors.device)
        return self.loss_fn(anchors, positives, labels, hard_negatives, drop), {}
