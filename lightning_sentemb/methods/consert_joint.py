"""Supervised ConSERT (Yan et al., ACL 2021, "joint"): SBERT's NLI classifier and ConSERT's contrastive
loss trained together on labelled NLI pairs. The paper's best supervised row ("joint-unsup", the 79.37
of BERT-base that DCPCSE's Table 1 quotes) then trains unsupervised ConSERT on the STS sentences from
this model: `experiments/consert_sup.yaml`, then `experiments/consert_sup_unsup.yaml` (docs/methods.md).

A batch of N pairs holds each premise and each hypothesis twice, one copy per view (`augmentations`,
ConSERT's, drawn by ConSERT's collator): rows [premises, hypotheses] of view 0, then of view 1. The loss
is, as the reference's `AdvCLSoftmaxLoss` computes it (its `--add_cl` without `--cl_loss_only`):

    L = CE(W · (u, v, |u − v|, max(u, v)²), y) + loss_weight · (NT-Xent(P⁰, P¹) + NT-Xent(H⁰, H¹))

u, v the premises' and hypotheses' embeddings of view `classifier_view` (the reference's rep_a, rep_b:
the sentences as they are, its view 0), NT-Xent ConSERT's Eq. 1 (`losses.nt_xent`, the mean over the 2N
anchors) over the premises' two views alone, and over the hypotheses' alone: premises are never the
hypotheses' negatives (the reference's `contrastive_loss_a + contrastive_loss_b`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ..data.nli_pairs import pair_labels, premises_then_hypotheses
from ..errors import SentEmbUserError
from ..losses.nli_softmax import NLISoftmaxLoss
from .consert import Augmentation, ConSERT, ConSERTViews
from .sbert import SBERTViews, refuse_options

__all__ = ["ConSERTJoint"]


class ConSERTJointViews(ConSERTViews):
    """ConSERT's two views of the premises, then the hypotheses, and the pairs' labels (SBERT's input)."""

    required_columns = SBERTViews.required_columns
    corpus_hint = SBERTViews.corpus_hint

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self.views(premises_then_hypotheses(examples)), "labels": pair_labels(examples)}


class ConSERTJoint(ConSERT):
    """ConSERT's joint NLI stage (module docstring). Its trainer, the reference's vendored `fit`, clips to
    norm 1 and runs apex O1: experiments/consert_sup.yaml sets both (docs/methods.md lists what differs).

    Defaults are the reference's scripts/sup-consert-joint-base.sh (github.com/yym6472/ConSERT): the
    sentence as it is (the backbone's dropout kept) against its token cutoff at rate 0.1
    (`--data_augmentation_strategy cutoff --cutoff_direction row --cutoff_rate 0.1`), τ 0.1, the
    contrastive weight `--cl_rate 0.15` on its sum of both directions' means, i.e. `loss_weight` 0.3 on
    the mean here, the classifier over (u, v, |u − v|, max(u, v)²) (`--concatenation_sent_max_square`),
    average pooling, lr 2e-5 (its default), batch 96, one epoch over AllNLI. The paper's text was not at
    hand when this was written (docs/methods.md, ConSERT); it writes the joint objective L_ce + α·L_con
    and describes SBERT's classifier; without the max-square trick (which the reference also gives its
    SBERT re-implementation) that is `concatenation_sent_max_square: false`.

    Where this differs from the reference: one forward of all 4N rows instead of four (the same up to the
    dropout draws; average pooling ignores the padding either way).

    Args:
        augmentations: the two views' (ConSERT's, `adversarial` excepted: the reference's joint attack is
            the gradient of the classification loss alone, on the first forward's own rows, not built).
        classifier_view: the view the classifier reads (0; the reference's `shuffle-cutoff` strategy
            classifies its second view: 1).
        loss_weight: the contrastive terms' weight, see above.
        concatenation_sent_rep, concatenation_sent_difference, concatenation_sent_multiplication,
            concatenation_sent_max_square: what the classifier reads (`losses.nli_softmax`).
        lr: default 2e-5, the reference's.
        **kwargs: see `ConSERT` and `SentEmbMethod` (no guide, no Matryoshka).
    """

    collator_class = ConSERTJointViews

    def __init__(self, backbone: str, augmentations: Sequence[Augmentation] = ("none", "token_cutoff"),
                 classifier_view: int = 0, loss_weight: float = 0.3, concatenation_sent_rep: bool = True,
                 concatenation_sent_difference: bool = True, concatenation_sent_multiplication: bool = False,
                 concatenation_sent_max_square: bool = True, lr: float = 2e-5, **kwargs: Any) -> None:
        refuse_options(type(self).__name__, kwargs, guide="the joint loss takes no guide's mask")
        if "adversarial" in augmentations:
            raise SentEmbUserError("model.init_args.augmentations: adversarial is not built for ConSERTJoint (its "
                                   "attack would follow the joint loss, the reference's the classifier's); choose "
                                   "another augmentation")
        if classifier_view not in (0, 1):
            raise SentEmbUserError(f"model.init_args.classifier_view must be 0 or 1, got {classifier_view!r}")
        super().__init__(backbone, augmentations=augmentations, loss_weight=loss_weight, lr=lr, **kwargs)
        self.loss_fn = NLISoftmaxLoss.from_options(self.output_size, self.hparams)

    def embedding_loss(self, embeddings: Tensor, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        views = [view.unflatten(0, (2, -1)) for view in embeddings.unflatten(0, (2, -1))]  # [premises, hypotheses]
        premises, hypotheses = views[self.hparams.classifier_view]
        classification, logs = self.loss_fn(premises, hypotheses, batch["labels"])
        contrastive = sum(self.contrastive_loss(views[0][part], views[1][part]) for part in (0, 1))
        loss = classification + self.hparams.loss_weight * contrastive
        return loss, {**logs, "classification_loss": classification.detach(), "contrastive_loss": contrastive.detach()}
