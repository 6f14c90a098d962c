"""SBERT (Reimers & Gurevych, 2019): a siamese encoder fine-tuned on NLI by classifying each
(premise, hypothesis) pair as entailment, neutral or contradiction from (u, v, |u - v|) (`losses.nli_softmax`).

Paper and reference (sentence-transformers' `training_nli.py` with `SoftmaxLoss`) settings: mean pooling,
batch 16, Adam(W) at lr 2e-5 with linear warm-up over 10% of the steps, one epoch over SNLI + MNLI
(`sentemb data download --what allnli`; `experiments/sbert_sup.yaml`). The classifier serves training
only: evaluation and exports read the pooled embedding.

The loss is per pair, with no in-batch negatives: under DDP each rank's mean over its pairs, averaged by
DDP, is the global batch's; gradient caching is exact (the classifier runs on the cached embeddings, like
any loss here). No guide (nothing to filter) and no Matryoshka (one classifier reads the full size).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..data.nli_pairs import LABELLED_COLUMNS, pair_labels, premises_then_hypotheses
from ..errors import SentEmbUserError
from ..losses.nli_softmax import NLISoftmaxLoss
from .base import MlpMode, Pooler, SentEmbMethod
from .collator import Collator

__all__ = ["SBERT"]


class SBERTViews(Collator):
    """The premises, then the hypotheses, and the pairs' labels."""

    required_columns = LABELLED_COLUMNS
    corpus_hint = ("labelled NLI pairs: a csv premise,hypothesis,label or a folder in SentEval's NLI layout "
                   "(`sentemb data download --what allnli`; docs/data.md)")

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = {"features": self.format.build(premises_then_hypotheses(examples), max_length=None), "num_views": 2,
                 "labels": pair_labels(examples)}
        return self.add_mlm_inputs(batch)


class SBERT(SentEmbMethod):
    """SBERT's NLI classification objective. The defaults are the paper's; sentence-transformers' `fit`,
    which trained the released models, also clips to norm 1 and decays weights by 0.01, as
    experiments/sbert_sup.yaml sets (docs/methods.md).

    Args:
        pooler: "avg", the paper's mean pooling (any other of `SentEmbMethod`'s poolers may be set).
        mlp: "none" (SBERT has no projection).
        lr: default 2e-5, the paper's.
        concatenation_sent_rep, concatenation_sent_difference, concatenation_sent_multiplication: what the
            classifier reads, (u, v), |u - v| and u * v (paper: the first two; Table 6 ablates them).
        concatenation_sent_max_square: max(u, v)² too (off; ConSERT's re-implementation of SBERT, its
            scripts/sup-sbert-base.sh, turns it on).
        **kwargs: see `SentEmbMethod` (`temperature` is unused).
    """

    collator_class = SBERTViews

    def __init__(self, backbone: str, pooler: Pooler | None = "avg", mlp: MlpMode = "none", lr: float = 2e-5,
                 concatenation_sent_rep: bool = True, concatenation_sent_difference: bool = True,
                 concatenation_sent_multiplication: bool = False, concatenation_sent_max_square: bool = False,
                 **kwargs: Any) -> None:
        refuse_options(type(self).__name__, kwargs, guide="its classification loss has no in-batch negatives to "
                       "filter")
        super().__init__(backbone, pooler=pooler, mlp=mlp, lr=lr, **kwargs)
        self.loss_fn = NLISoftmaxLoss.from_options(self.output_size, self.hparams)

    def embedding_loss(self, embeddings: Tensor, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        premises, hypotheses = embeddings.unflatten(0, (2, -1))
        return self.loss_fn(premises, hypotheses, batch["labels"])


def refuse_options(method: str, kwargs: dict[str, Any], **why_not: str) -> None:
    """One line for a shared option a classifier over pairs cannot apply: Matryoshka (the classifier reads
    the embedding at full size), and each of `why_not`'s, option -> why."""
    reasons = {**why_not, "matryoshka_dims": "its classifier reads the embedding at full size"}
    for option, why in reasons.items():
        if kwargs.get(option):
            raise SentEmbUserError(f"model.init_args.{option}: not for {method}, {why}; remove it")
