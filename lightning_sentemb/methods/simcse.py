"""SimCSE (Gao et al., 2021): dropout views (unsupervised) or NLI pairs with hard negatives."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..data.corpus import nli_columns
from ..data.mixture import MixtureSource
from ..distributed import gather_with_grad, local_labels
from ..errors import SentEmbUserError
from ..losses.info_nce import InfoNCELoss
from .base import SentEmbMethod
from .collator import Collator


class SimCSEViews(Collator):
    """The sentence twice (dropout is the augmentation), or its NLI columns; MLM rows when enabled. From a
    mixture's dataset (`"mixture"`), its instruction before the anchors and the dataset as `dataset`."""

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        columns = nli_columns(examples[0]) if "sent1" in examples[0] else ["sent0", "sent0"]
        views = [[example[column] for example in examples] for column in columns]
        source = examples[0].get("mixture")
        batch = {"features": self.view_features(views, source), "num_views": len(columns)}
        if source is not None:
            batch["dataset"] = source
        # the guide reads the texts without the instruction
        return self.add_guide_texts(self.add_mlm_inputs(batch), [row for view in views for row in view])


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
    mixture_options = frozenset({"instruction", "in_batch_negatives", "query_max_len", "doc_max_len"})

    def __init__(self, backbone: str, hard_negative_weight: float = 0.0, **kwargs: Any) -> None:
        super().__init__(backbone, **kwargs)
        self.loss_fn = InfoNCELoss(self.hparams.temperature, hard_negative_weight)

    def embedding_loss(
        self, embeddings: Tensor, batch: dict[str, Any], drop: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        views = embeddings.unflatten(0, (batch["num_views"], -1))
        source = batch.get("dataset")
        if source is not None and not source.in_batch_negatives:
            return self.own_candidates_loss(views, source, drop), {}
        anchors = views[0]
        positives = gather_with_grad(views[1])
        hard_negatives = torch.cat([gather_with_grad(view) for view in views[2:]]) if batch["num_views"] > 2 else None
        labels = local_labels(anchors.size(0), anchors.device)
        return self.loss_fn(anchors, positives, labels, hard_negatives, drop), {}

    def own_candidates_loss(self, views: Tensor, source: MixtureSource, drop: Tensor | None) -> Tensor:
        """Each anchor against its own positive and hard negatives only (no gathering under DDP); the
        guide's `drop`, over the global batch's columns, read at each anchor's own columns."""
        if views.size(0) < 3:
            raise SentEmbUserError(f"data.datasets.{source.name}.in_batch_negatives false: the dataset has no hard "
                                   "negatives, so each query would score its positive alone (a loss of 0); give it "
                                   "hard negatives (triplets) or keep in-batch negatives")
        candidates = views[1:].transpose(0, 1)
        if drop is not None:
            per_view = drop.size(1) // candidates.size(1)
            own = local_labels(views.size(1), views.device)[:, None] + per_view * torch.arange(
                candidates.size(1), device=views.device)
            drop = drop.gather(1, own)
        return self.loss_fn.own_candidates(views[0], candidates, drop)
