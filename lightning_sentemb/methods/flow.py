"""BERT-flow (Li et al., EMNLP 2020): a Glow (`encoders.glow`) fitted by maximum likelihood on a frozen
backbone's pooled embeddings; the flow's latent is the sentence embedding.

Reference (github.com/bohanli/BERT-flow, `run_siamese.py` with `--flow=1 --flow_loss=1
--num_examples=0`) details, and the choices made here:

- Frozen backbone: no gradient reaches it (it runs without autograd). It stays in train mode, as the
  reference's estimator runs BERT with `is_training=True` while the flow fits: its dropout applies to
  the embeddings the flow learns from (the paper is silent; `dropout: 0.0` turns it off). The
  reference's zero-loss BERT optimizer still decays BERT's weights by 0.01·lr a step; ours stay fixed.
- Pooling: `avg_first_last`, what the reference's `avg-last-2` computes (its loop reads
  `all_encoder_layers[-0]`, the first layer, and `[-1]`); its config default `avg` is `pooler: avg`.
- Flow: the reference's `config_l3_d3_w32` (3 levels of 3 steps, coupling width 32, additive coupling,
  reversed channels), `flow_*` options for the others, Glow's LU mixing and affine coupling included.
- Objective: the mean negative log-likelihood in bits per dimension, −log p(x) / (d·ln 2), as the
  reference's; it sums the losses of the two sentences of a pair, here every sentence is a row.
- Data-dependent start: the actnorms are set from the first training batch (the global batch under
  DDP, gathered, so k processes start as one; the reference runs its init op on its first batch). A
  pooled dimension constant over that batch stops the run in one line (`start_flow`).
- Optimizer: the reference's flow optimizer is AdamW at a constant 1e-3 (weight decay 0.01, no
  warm-up, no decay), gradients clipped to norm 1 (`trainer.gradient_clip_val: 1.0` in the
  configs); `lr_schedule: linear` takes the shared warm-up and linear decay instead. It has no bias
  correction and ε 1e-6 where torch's AdamW has both and ε 1e-8.
- Training data: any corpus; both sentences of a labelled NLI pair (`corpora/allnli_pairs.csv`: SNLI +
  MNLI, labels unused, the paper's "NLI" setting, read as the reference reads its pairs) or every column
  of SimCSE's NLI csv are sentences, and a file of the target task's sentences is its "target" setting.

What trains is the flow alone: LoRA, an MLP, the MLM loss, Matryoshka, a guide, an echo template,
gradient caching (the loss is per sentence: accumulation is exact) and FSDP are refused in one line.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor
from transformers import PreTrainedModel

from ..data.corpus import nli_columns
from ..data.nli_pairs import LABELLED_COLUMNS
from ..distributed import gather_with_grad
from ..encoders.glow import Coupling, Glow, Mixing
from ..encoders.plain import Encoder
from ..errors import SentEmbUserError
from ..fsdp import is_sharded
from . import steps
from .base import MlpMode, Pooler, SentEmbMethod
from .collator import Collator


class FrozenEncoder(Encoder):
    """`Encoder` whose backbone never trains (skeleton and loaded weights alike)."""

    def set_backbone(self, model: PreTrainedModel) -> None:
        super().set_backbone(model.requires_grad_(False))


class FlowSentences(Collator):
    """Every sentence of the batch is a row: the corpus line, both sentences of a labelled NLI pair (the
    reference's pairs: a batch of 32 pairs is 64 sentences), or each column of SimCSE's NLI csv."""

    corpus_hint = ("one sentence a line (.txt), labelled NLI pairs (premise,hypothesis,label) or a csv with sent0 "
                   "(SimCSE's NLI columns too)")

    def check_columns(self, columns: list[str], source: str) -> None:
        if LABELLED_COLUMNS[0] not in columns:
            super().check_columns(columns, source)

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, Any]:
        first = examples[0]
        columns = (list(LABELLED_COLUMNS[:2]) if LABELLED_COLUMNS[0] in first else
                   nli_columns(first) if "sent1" in first else ["sent0"])
        rows = [example[column] for column in columns for example in examples]
        return {"features": self.format.build(rows, max_length=None), "num_views": len(columns)}


class BERTFlow(SentEmbMethod):
    """A normalizing flow on the pooled embeddings of a frozen backbone (see the module docstring). The
    defaults are the reference's (the paper gives no training settings); the configs list what differs.

    Args:
        flow_levels, flow_depth, flow_coupling_width: the Glow's shape (reference: 3, 3, 32).
        flow_coupling: "additive" (reference) or "affine" (Glow's).
        flow_mixing: "reverse" (reference: fixed reversed channels) or "lu" (Glow's invertible 1×1).
        lr_schedule: "constant" (reference) or "linear" (the shared warm-up and linear decay).
        pooler: default avg_first_last (the reference's `avg-last-2`).
        lr, weight_decay: the reference's flow optimizer, 1e-3 and 0.01.
        **kwargs: see `SentEmbMethod`.
    """

    collator_class = FlowSentences
    export_format = "flow"  # `export.flow`: the plain export plus the flow after the pooling

    def __init__(
        self,
        backbone: str,
        flow_levels: int = 3,
        flow_depth: int = 3,
        flow_coupling_width: int = 32,
        flow_coupling: Coupling = "additive",
        flow_mixing: Mixing = "reverse",
        lr_schedule: Literal["constant", "linear"] = "constant",
        pooler: Pooler | None = "avg_first_last",
        mlp: MlpMode = "none",
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        **kwargs: Any,
    ) -> None:
        super().__init__(backbone, pooler=pooler, mlp=mlp, lr=lr, weight_decay=weight_decay, **kwargs)
        refused = next((option for option, value in (
            ("mlp", mlp != "none"), ("lora", self.hparams.lora is not None), ("mlm_weight", self.hparams.mlm_weight),
            ("matryoshka_dims", self.hparams.matryoshka_dims), ("guide", self.hparams.guide is not None),
            ("grad_cache_chunk", self.hparams.grad_cache_chunk), ("template", self.hparams.template is not None))
            if value), None)
        if refused is not None:
            raise SentEmbUserError(f"model.init_args.{refused}: BERTFlow trains its flow alone, by maximum likelihood "
                                   "on the frozen backbone's pooled embeddings; remove the option (gradient caching: "
                                   "the loss is per sentence, so trainer.accumulate_grad_batches is exact)")
        self.flow = Glow(self.encoder.hidden_size, flow_levels, flow_depth, flow_coupling_width, flow_coupling,
                         flow_mixing)

    def build_encoder(self) -> Encoder:
        return FrozenEncoder(self.hparams.backbone, self.hparams.pooler)

    def project(self, pooled: Tensor) -> Tensor:
        """The flow's latent, in fp32 whatever the autocast."""
        with torch.autocast(pooled.device.type, enabled=False):
            return self.flow(pooled.float())[0]

    def training_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """−log p(x) / (d·ln 2), the mean over the batch's sentences; the first batch starts the flow."""
        with torch.no_grad():
            pooled = self.encoder(batch["features"]).float()
        if not self.flow.is_initialized:  # the host's copy: no device read a step
            self.start_flow(gather_with_grad(pooled))
        with torch.autocast(pooled.device.type, enabled=False):
            log_likelihood = self.flow(pooled)[1]
        return -log_likelihood.mean() / (pooled.shape[-1] * math.log(2)), {}

    def start_flow(self, pooled: Tensor) -> None:
        """The data-dependent start on the (global) first batch, after one check, read on the host once: a
        dimension that batch leaves constant (spread under the actnorm's ε, 1e-6; e.g. three of
        all-MiniLM-L6-v2's under `avg`) has no maximum of the likelihood, and the actnorms' 1e6 scales
        compound over the steps until every gradient but that dimension's is clipped away."""
        spread = (pooled - pooled.mean(0)).pow(2).mean(0).sqrt()
        constant = int((spread < 1e-6).sum())
        if constant:
            raise SentEmbUserError(
                f"BERTFlow: {constant} of the {pooled.shape[1]} pooled dimensions of {self.hparams.backbone} "
                f"(pooler {self.hparams.pooler}) are constant over the first batch, where a flow's likelihood has "
                "no maximum; choose another model.init_args.pooler (avg_first_last mixes in the first layer)"
            )
        self.flow.initialize_(pooled)

    def configure_optimizers(self) -> dict[str, Any]:
        configured = steps.configure_optimizers(self)
        return configured if self.hparams.lr_schedule == "linear" else {"optimizer": configured["optimizer"]}

    def configure_callbacks(self) -> list:
        trainer = self._trainer
        if trainer is not None and trainer.state.fn == "fit" and is_sharded(trainer.strategy):
            raise SentEmbUserError("trainer.strategy: BERTFlow trains a small flow on a frozen backbone, which FSDP "
                                   "has nothing to shard of; train with DDP")
        return steps.check_trainer_options(self)
