"""ConSERT (Yan et al., ACL 2021): two views of each sentence made at the embedding layer, NT-Xent.

Each view takes one augmentation (`augmentations`, the first for view 0, the second for view 1):

- `shuffle`: the order of the sentence's tokens (every real one, [CLS]/[SEP] included, as the reference);
  on learned absolute positions (BERT, RoBERTa) by permuting the position ids, the paper's way; on other
  bidirectional encoders (ModernBERT: rotary positions, windows that follow the token order) by
  permuting the tokens, the same augmentation under average pooling; refused on causal decoders;
- `token_cutoff`: int(L·rate) of the L tokens' embedding rows set to zero;
- `feature_cutoff`: int(d·rate) of the d embedding columns set to zero, in every token;
- `span_cutoff`: `erase` (default, the cutoff of Shen et al. 2020 that the paper describes; the paper
  itself trains only token and feature cutoff): a contiguous span of int(L·rate) tokens zeroed; `keep`
  (the reference's "span" strategy): the row cut to a contiguous span of max(int(L·(1-rate)), 1) tokens,
  kept at its positions (the reference also mean-pools over the dropped positions' states; here the
  pooling covers the span);
- `dropout`: elements of the L×d embedding output zeroed, without rescaling: each with probability
  rate (`dropout_draw: bernoulli`, the paper's "by a specific probability") or exactly int(L·d·rate) of
  them (`exact`, the reference);
- `adversarial`: Fast Gradient Value (the paper's choice): the clean embedding output plus, per token,
  `adversarial_norm` · g / ‖g‖, g the gradient of the training loss with respect to it. The paper uses it
  only with NLI supervision (its gradient is the supervised loss's); unsupervised here, g is the
  gradient of the method's own loss between the other view and the clean one;
- `none`: the sentence as it is (with the backbone's dropout, if any).

Every random choice is drawn in the collator from its generator (seeded per batch: a resumed run draws
what the uninterrupted one drew), view after view, row after row, in the row's order of draws above.
Rates, counts and spans are over the row's real tokens, special tokens included (the reference's L).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from ..distributed import gather_with_grad, local_labels
from ..encoders.augmented import AugmentedEncoder, fgv_perturbation
from ..encoders.plain import POOLERS, pad_rows
from ..errors import SentEmbUserError
from ..grad_cache import rows_of
from ..losses.nt_xent import nt_xent
from .base import MlpMode, Pooler, SentEmbMethod
from .collator import Collator

Augmentation = Literal["none", "shuffle", "token_cutoff", "feature_cutoff", "span_cutoff", "dropout", "adversarial"]
AUGMENTATIONS: tuple[str, ...] = Augmentation.__args__


def randint(high: int, generator: torch.Generator) -> int:
    """A uniform integer in [0, high)."""
    return int(torch.randint(high, (1,), generator=generator))


class ConSERTViews(Collator):
    """The sentence twice, each copy with its view's augmentation drawn here (the module docstring)."""

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, Any]:
        return self.views([example["sent0"] for example in examples])

    def views(self, sentences: list[list[int]]) -> dict[str, Any]:
        """The batch of both views of `sentences` (token ids without special tokens)."""
        rows = [self.format.wrap(ids, None) for ids in sentences]
        drawn = [self.draw(augmentation, row) for augmentation in self.hparams.augmentations for row in rows]
        features = pad_rows([row for row, _ in drawn], self.format.pad_id)
        features.update(self.edit_tensors([edit for _, edit in drawn], features["input_ids"].shape[1]))
        batch = {"features": features, "num_views": 2}
        return self.add_guide_texts(self.add_mlm_inputs(batch), sentences * 2)

    def draw(self, augmentation: str, row: list[int]) -> tuple[list[int], dict[str, Any]]:
        """The row as the view reads it, and its edits: {edit key: what to put in the row's entry}."""
        hp, generator, length = self.hparams, self.generator, len(row)
        if augmentation == "shuffle":
            order = torch.randperm(length, generator=generator)
            if self.format.token_shuffle == "positions":
                return row, {"shuffle_index": order}
            shuffled = [0] * length  # token t goes where its shuffled position puts it
            for token, position in zip(row, order.tolist(), strict=True):
                shuffled[position] = token
            return shuffled, {}
        if augmentation == "token_cutoff":
            return row, {"token_drop": self.some(length, hp.token_cutoff_rate)}
        if augmentation == "span_cutoff":
            if hp.span_cutoff == "keep":
                kept = max(int(length * (1 - hp.span_cutoff_rate)), 1)
                start = randint(length - kept + 1, generator)
                return row[start : start + kept], {"position_shift": start}
            cut = int(length * hp.span_cutoff_rate)
            start = randint(length - cut + 1, generator)
            return row, {"token_drop": torch.arange(start, start + cut)}
        if augmentation == "feature_cutoff":
            width = self.format.embedding_width
            return row, {"feature_drop": self.some(width, hp.feature_cutoff_rate)}
        if augmentation == "dropout":
            width = self.format.embedding_width
            if hp.dropout_draw == "exact":
                flat = torch.ones(length * width, dtype=torch.bool)
                flat[self.some(length * width, hp.dropout_rate)] = False
                return row, {"element_keep": flat.view(length, width)}
            return row, {"element_keep": torch.rand(length, width, generator=generator) >= hp.dropout_rate}
        return row, {}  # none; adversarial (made in the training step)

    def some(self, n: int, rate: float) -> Tensor:
        """int(n · rate) of range(n), drawn uniformly without repetition (a prefix of a permutation)."""
        return torch.randperm(n, generator=self.generator)[: int(n * rate)]

    def edit_tensors(self, edits: list[dict[str, Any]], width: int) -> dict[str, Tensor]:
        """The batch's edit features (`encoders.augmented`), for the kinds some row has; the other rows
        get the identity."""
        kinds = {key for edit in edits for key in edit}
        rows, embedding_width = len(edits), self.format.embedding_width
        out: dict[str, Tensor] = {}
        if "shuffle_index" in kinds:  # rows without a shuffle, and padding, keep their own positions
            out["shuffle_index"] = torch.arange(width).repeat(rows, 1)
            for r, edit in enumerate(edits):
                if "shuffle_index" in edit:
                    out["shuffle_index"][r, : edit["shuffle_index"].numel()] = edit["shuffle_index"]
        if "position_shift" in kinds:
            out["position_shift"] = torch.tensor([edit.get("position_shift", 0) for edit in edits])
        if "token_drop" in kinds:
            out["token_keep"] = torch.ones(rows, width, dtype=torch.bool)
            for r, edit in enumerate(edits):
                out["token_keep"][r, edit.get("token_drop", [])] = False
        if "feature_drop" in kinds:
            out["feature_keep"] = torch.ones(rows, embedding_width, dtype=torch.bool)
            for r, edit in enumerate(edits):
                out["feature_keep"][r, edit.get("feature_drop", [])] = False
        if "element_keep" in kinds:
            out["element_keep"] = torch.ones(rows, width, embedding_width, dtype=torch.bool)
            for r, edit in enumerate(edits):
                if "element_keep" in edit:
                    out["element_keep"][r, : edit["element_keep"].shape[0]] = edit["element_keep"]
        return out


class ConSERT(SentEmbMethod):
    """ConSERT, unsupervised: a one-column corpus (the paper trains on the unlabeled sentences of the STS
    sets, `data.train_file: senteval:sts`), two augmented views, NT-Xent (`losses.nt_xent`); negatives are
    both views of the global batch under DDP.

    Defaults are the reference's best unsupervised BERT-base run (scripts/unsup-consert-base.sh): feature
    cutoff 0.2 and token shuffling, τ 0.1, average pooling of the last layer, no MLP, lr 5e-7; the paper
    names the same pair its best. That run also turns the backbone's dropout off (`--no_dropout`, an
    ablation setting its authors added late; its large run keeps it): `dropout: 0.0` in the configs, the
    checkpoint's own by default (a family without a known dropout field, DistilBERT, refuses a value).
    The defaults are the paper's where it says; the reference's published rows also score the test with
    the last two layers' average (`test_pooler: avg_top2`, its `eval.py --last2avg`), which the seed-row
    configs set (docs/methods.md).

    Args:
        augmentations: the two views' augmentations (`none`, `shuffle`, `token_cutoff`, `feature_cutoff`,
            `span_cutoff`, `dropout`, `adversarial`; at most one `adversarial`).
        token_cutoff_rate: 0.1, the reference scripts' (sup-consert-joint); feature_cutoff_rate: 0.2, its
            best pair's; span_cutoff_rate, dropout_rate: 0.1 (no reference script sets them).
        span_cutoff: `erase` (the paper's description of cutoff) or `keep` (the reference), see above.
        dropout_draw: `bernoulli` (paper) or `exact` (reference), see above.
        adversarial_norm: ε of the adversarial perturbation, per token (the reference's `--noise_norm`
            default, 1.0).
        loss_weight: a factor on the loss; the paper's loss is the mean over the 2N anchors (1.0); the
            reference's scripts train on 0.15 × the sum of both directions' means, i.e. 0.3 (under Adam it
            changes only how large ε is against the gradient).
        pooler, mlp, temperature, lr: `SentEmbMethod`'s, with ConSERT's defaults.
        test_pooler: the pooler outside a fit (test, `encode`, `sentemb evaluate --ckpt`, exports), where
            training and the fit's validation, which selects the checkpoint, pool with `pooler`, as the
            reference (its dev evaluator reads the training model's mean pooling); null = `pooler`.
        **kwargs: see `SentEmbMethod`.
    """

    collator_class = ConSERTViews

    def __init__(
        self,
        backbone: str,
        augmentations: Sequence[Augmentation] = ("feature_cutoff", "shuffle"),
        token_cutoff_rate: float = 0.1,
        feature_cutoff_rate: float = 0.2,
        span_cutoff_rate: float = 0.1,
        span_cutoff: Literal["erase", "keep"] = "erase",
        dropout_rate: float = 0.1,
        dropout_draw: Literal["bernoulli", "exact"] = "bernoulli",
        adversarial_norm: float = 1.0,
        loss_weight: float = 1.0,
        pooler: Pooler | None = "avg",
        mlp: MlpMode = "none",
        temperature: float = 0.1,
        lr: float = 5e-7,
        test_pooler: Pooler | None = None,
        **kwargs: Any,
    ) -> None:
        if test_pooler is not None and (test_pooler not in POOLERS or test_pooler == "mask"):
            raise SentEmbUserError(f"model.init_args.test_pooler: {test_pooler!r} is no plain pooler; choose one of "
                                   f"{', '.join(p for p in POOLERS if p != 'mask')}")
        rates = {"token_cutoff_rate": token_cutoff_rate, "feature_cutoff_rate": feature_cutoff_rate,
                 "span_cutoff_rate": span_cutoff_rate, "dropout_rate": dropout_rate}
        check_augmentations(augmentations, kwargs.get("grad_cache_chunk", 0), span_cutoff, dropout_draw, rates)
        super().__init__(backbone, pooler=pooler, mlp=mlp, temperature=temperature, lr=lr, **kwargs)
        self.encoder.pooler = self.test_pooler  # outside a fit

    @property
    def test_pooler(self) -> str:
        return self.hparams.get("test_pooler") or self.hparams.pooler

    def on_fit_start(self) -> None:
        """A fit trains and validates with `pooler`; test, `encode` and exports use `test_pooler`."""
        self.encoder.pooler = self.hparams.pooler
        super().on_fit_start()

    def on_fit_end(self) -> None:
        self.encoder.pooler = self.test_pooler

    def build_encoder(self) -> AugmentedEncoder:
        hp = self.hparams
        return AugmentedEncoder(hp.backbone, hp.pooler, with_mlm_head=hp.mlm_weight > 0,
                                shuffles="shuffle" in hp.augmentations)

    def embedding_loss(
        self, embeddings: Tensor, batch: dict[str, Any], drop: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        view_a, view_b = embeddings.unflatten(0, (2, -1))
        return self.hparams.loss_weight * self.contrastive_loss(view_a, view_b, drop), {}

    def contrastive_loss(self, view_a: Tensor, view_b: Tensor, drop: Tensor | None = None) -> Tensor:
        """NT-Xent between this process's rows of the two views, negatives from the global batch."""
        labels = local_labels(view_a.size(0), view_a.device)
        return nt_xent(view_a, view_b, gather_with_grad(view_a), gather_with_grad(view_b), labels,
                       self.hparams.temperature, drop)

    def training_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """One forward of both views; with an adversarial view, three (`adversarial_loss`)."""
        if "adversarial" in self.hparams.augmentations:
            return self.adversarial_loss(batch)
        return super().training_loss(batch)

    def adversarial_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """The other view and a clean copy of the adversarial one in one forward, recording the embedding
        output; the loss between them (with a guide model's mask, which the second loss reuses); its
        gradient with respect to the clean copy's embedding output (every process's anchors' terms, through
        the gathers' backward); the adversarial rows: that output plus the FGV step, forwarded again; the
        loss between the other view and them."""
        features = batch["features"]
        rows = features["input_ids"].size(0) // 2
        adversarial = list(self.hparams.augmentations).index("adversarial")
        span = slice(adversarial * rows, (adversarial + 1) * rows)
        with self.encoder.recording() as recorded:
            embeddings = self.embed(features)
        guided = self.guide_drop(embeddings, batch)
        attack_loss, _ = self.sentence_loss(embeddings, batch, guided)
        (gradient,) = torch.autograd.grad(attack_loss, recorded[0], retain_graph=True)
        clean = recorded[0][span]
        replaced = {**rows_of(features, span, self.encoder.combine_keys),
                    "embedding_replacement": clean + fgv_perturbation(gradient[span], self.hparams.adversarial_norm)}
        views = list(embeddings.unflatten(0, (2, -1)))
        views[adversarial] = self.embed(replaced)
        # a guide model judges the texts, the same for both losses (embedded once); `self` judges the new rows
        reuse = self.guide is not None and not self.guide.is_self
        return self.sentence_loss(torch.cat(views), batch, guided if reuse else None)


def check_augmentations(augmentations: Sequence[str], grad_cache_chunk: int, span_cutoff: str, dropout_draw: str,
                        rates: dict[str, float]) -> None:
    """One line for a setting ConSERT cannot train with."""
    option = "model.init_args.augmentations"
    unknown = [a for a in augmentations if a not in AUGMENTATIONS]
    if len(augmentations) != 2 or unknown:
        raise SentEmbUserError(f"{option}: give two (one per view) of {', '.join(AUGMENTATIONS)}; got "
                               f"{list(augmentations)}")
    if list(augmentations).count("adversarial") > 1:
        raise SentEmbUserError(f"{option}: one view may be adversarial, its attack reads the other; got both")
    if "adversarial" in augmentations and grad_cache_chunk:
        raise SentEmbUserError(f"{option}: adversarial needs the whole batch's gradient inside the step, which "
                               "model.init_args.grad_cache_chunk computes only chunk by chunk; set grad_cache_chunk 0 "
                               "or choose another augmentation")
    for name, value in rates.items():
        if not 0 <= value < 1:
            raise SentEmbUserError(f"model.init_args.{name} must be in [0, 1), got {value}")
    if span_cutoff not in ("erase", "keep") or dropout_draw not in ("bernoulli", "exact"):
        raise SentEmbUserError("model.init_args.span_cutoff must be erase or keep and dropout_draw bernoulli or exact; "
                               f"got {span_cutoff!r}, {dropout_draw!r}")
