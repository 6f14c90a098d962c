"""SNCSE (Wang et al., 2022): PromptBERT's template views plus a soft negative, the sentence's
negation, kept at a margin from the positive by the bidirectional margin loss (`losses.sncse`).

Reference (github.com/Sense-GVT/SNCSE, `train_SNCSE.py`, `simcse/models.py`) details, and the choices
made here:

- Views: the sentence under template 0 (the anchor, and the evaluation template), the sentence under
  template 1 (the positive) and its negation under template 1 (the soft negative), the [MASK] state of
  each, the training MLP over it (`--pooler_type cls --mlp_only_train`), no template denoising.
- Negations are made before training (`sentemb data negate`, `data.negation`, the reference's rule) and
  read from the corpus column `negation` (csv `sent0,negation`). The reference falls back to "Not " +
  the sentence where its negation file has none; here every row carries its own.
- The reference appends " ." to sentences and negations without final punctuation before tokenizing;
  we do not rewrite the corpus (as for PromptBERT).
- RoBERTa: the reference's templates are `This sentence : " [X] " means <mask> .` (and "of"); see
  `experiments/sncse_roberta_base.yaml`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ..data.negation import NEGATION_COLUMN
from ..distributed import gather_with_grad, local_labels
from ..losses.sncse import SNCSELoss
from .promptbert import PromptBERT, TemplateViews

__all__ = ["SNCSE"]


class SNCSEViews(TemplateViews):
    """The sentence under template 0 and under template 1 (template 0 again when only one is given),
    then its negation under the positive's template."""

    required_columns = ("sent0", NEGATION_COLUMN)
    corpus_hint = (f"sentences beside their negations: a csv sent0,{NEGATION_COLUMN} as `sentemb data negate` "
                   "writes it, or a one-sentence corpus with data.negate set (docs/data.md)")

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, Any]:
        n = len(examples)
        second = 1 if len(self.format.templates) > 1 else 0
        return self.views(examples, ["sent0", "sent0", NEGATION_COLUMN], [[0] * n, [second] * n, [second] * n])


class SNCSE(PromptBERT):
    """SNCSE on a corpus of sentences and their negations (`sent0,negation`). The defaults are the
    reference's where the paper is silent; its trainer's clipping (1.0), fp32 and selection are set by the
    seed-row configs, which list what still differs (docs/methods.md).

    Args:
        bml_weight: λ, the weight of the bidirectional margin loss (reference: 1e-3 BERT, 5e-4 RoBERTa).
        bml_alpha: α, the soft negative at least α less similar to the anchor than the positive...
        bml_beta: β, ...and at most β less (reference: 0.1, 0.3).
        denoise_train: template denoising in training; off (the reference has none).
        lr: default 1e-5, the reference's for base models (5e-6 for large ones).
        **kwargs: see `PromptBERT` (templates: BERT's pair by default) and `SentEmbMethod`.
    """

    collator_class = SNCSEViews
    guide_candidate_views = 1  # the InfoNCE scores the positives; the negations only meet the BML term

    def __init__(self, backbone: str, bml_weight: float = 1e-3, bml_alpha: float = 0.1, bml_beta: float = 0.3,
                 denoise_train: bool = False, lr: float = 1e-5, **kwargs: Any) -> None:
        super().__init__(backbone, denoise_train=denoise_train, lr=lr, **kwargs)
        self.loss_fn = SNCSELoss(self.hparams.temperature, bml_weight, bml_alpha, bml_beta)

    def embedding_loss(
        self, embeddings: Tensor, batch: dict[str, Any], drop: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        anchors, positives, soft_negatives = embeddings.unflatten(0, (3, -1))
        positives = gather_with_grad(positives)
        labels = local_labels(anchors.size(0), anchors.device)
        return self.loss_fn(anchors, positives, labels, soft_negatives, drop)
