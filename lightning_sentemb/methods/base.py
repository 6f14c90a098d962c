"""The shared LightningModule: optimizer and schedule, MLM auxiliary loss, encode, STS validation,
LoRA and the memory switches, checkpoints.

A method subclasses `SentEmbMethod` and contributes only what makes it different:
`build_encoder` (input format), `collator_class` (the views of a training example) and `embedding_loss`
(the loss from the batch's sentence embeddings). The base embeds the batch, in one forward or, with
`grad_cache_chunk`, chunk by chunk with gradient caching, and with `matryoshka_dims` sums the method's
loss over truncations of the embeddings (`sentence_loss`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from transformers import get_linear_schedule_with_warmup
from transformers.utils import cached_file

from ..backbones import UnsupportedBackbone, family_of, with_dropout
from ..console import progress_bar
from ..data.datamodule import batch_seed
from ..data.senteval import DEV_TASKS, STS_SUBSETS, STS_TASKS
from ..distributed import gather_strided_rows, world
from ..encoders.echo import EchoEncoder
from ..encoders.lora import LoraSettings, add_lora, peft_base_reference
from ..encoders.memory import DTYPES, BackboneDtype, enable_gradient_checkpointing, from_pretrained_options
from ..encoders.plain import POOLERS, Encoder, backbone_loading
from ..encoders.pretrained import load_config, resolve_model_path
from ..evaluation.sts import StsSpearman, format_table
from ..evaluation.suite import evaluate_suite, headline_scores
from ..errors import SentEmbUserError
from ..export import write_plain_export
from ..grad_cache import RngState, chunk_spans, rows_of
from ..losses.mlm import mlm_loss
from ..matryoshka import check_dims, truncate
from .collator import Collator

MlpMode = Literal["none", "train", "always"]
Pooler = Literal[POOLERS]  # the values of POOLERS: the CLI refuses any other with the list
AttnImplementation = Literal["sdpa", "eager", "flash_attention_2", "flex_attention"]


_WEIGHTS_IN_CONFIGURE_MODEL: ContextVar[bool] = ContextVar("weights_in_configure_model", default=False)


@contextmanager
def backbone_weights_in_configure_model() -> Iterator[None]:
    """Methods built inside leave their backbone's weights to `configure_model`, which the trainer calls
    once it knows the rank's device: each rank then reads them once, onto its own device, in the dtype it
    trains in, instead of all of them in fp32 on the host in `__init__`. Until then the backbone is a
    skeleton on the meta device (tokenizer, config and everything else are built as usual). Outside
    (tests, `sentemb evaluate`, `load_from_checkpoint`, exports) `__init__` loads them on the CPU."""
    token = _WEIGHTS_IN_CONFIGURE_MODEL.set(True)
    try:
        yield
    finally:
        _WEIGHTS_IN_CONFIGURE_MODEL.reset(token)


def autocast_for(device: torch.device, precision: str) -> torch.autocast:
    """bf16 autocast on GPUs that support it (fp16 on older ones); on CPU only when asked."""
    if device.type == "cuda" and precision == "auto":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.autocast("cuda", dtype=dtype)
    enabled = precision == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


class SentEmbMethod(LightningModule):
    """Base of every method.

    Args:
        backbone: Hugging Face hub name, local folder or `pkg:MODULE`: a BERT-family, ModernBERT or
            decoder-LLM checkpoint (`lightning_sentemb.backbones`; pairs that cannot work are refused
            with one line).
        pooler: cls | cls_before_pooler | last | avg | avg_first_last | avg_top2 (template methods:
            mask); None = the family's default, cls for encoders and last for decoders.
        dropout: every dropout probability of the backbone's config (None = the checkpoint's). Decoder
            LLMs and ModernBERT ship with 0, which makes unsupervised SimCSE's two views identical.
        matryoshka_dims: Matryoshka training (e.g. [768, 512, 256, 128, 64]): the method's own loss on
            the first d dimensions of every embedding of the batch, re-normalized, for each d, summed
            with `matryoshka_weights` (default 1 each, as sentence-transformers' MatryoshkaLoss). None
            = the plain loss. See `sentence_loss`.
        matryoshka_weights: one weight per entry of `matryoshka_dims`.
        matryoshka_eval_dim: validation (the STS-B dev score that selects `best.ckpt`) on the first
            this many dimensions; None = all. Test and `encode` keep every dimension
            (`sentemb evaluate --dims` scores truncations).
        mlp: Linear+Tanh projection over the pooled vector: "train" (SimCSE unsupervised: used in
            training, dropped at evaluation), "always" (supervised SimCSE), or "none".
        temperature: τ of the contrastive softmax.
        lr, weight_decay, warmup_steps: AdamW with linear warm-up then linear decay to 0.
        mlm_weight: weight of the masked-LM auxiliary loss (0 disables it; SimCSE uses 0.1).
        mlm_probability: fraction of tokens masked for the auxiliary loss.
        eval_max_length: truncation at evaluation; None = the model's maximum (SimCSE's
            evaluation does not truncate; the 32-token limit is for training only).
        eval_batch_size: sentences per forward in `encode` (under `sentemb fit`, set by `data.eval_batch_size`).
        eval_precision: autocast during `encode`: "auto" (bf16/fp16 on GPU, fp32 on CPU),
            "bf16", or "32".
        sts_aggregation: how STS12–16 subsets combine: "all" (SentEval/SimCSE), "wmean", "mean".
        grad_cache_chunk: rows per chunk for gradient caching (0 = off): the global batch's loss
            and exact gradient with the activation memory of this many rows, so a paper's batch
            (its number of negatives) fits a small GPU. Training then uses manual optimization:
            `trainer.gradient_clip_val` applies as usual (`on_before_optimizer_step`),
            `accumulate_grad_batches` is refused. See `grad_cache_backward`.
        padding_free: run the encoder without computing on padding (`encoders.packed`: the backbone's
            own forward on the real tokens, same results); false = the backbone's own padded forward
            (as `attn_implementation: sdpa`). Unsupported backbones fall back with a logged reason.
        attn_implementation: null = padding-free wherever the backbone supports it (`padding_free`);
            sdpa | eager | flash_attention_2 | flex_attention = transformers' own padded forward with
            that attention kernel (the baseline of the GPU benchmark; DCPCSE: null or sdpa).
        compile_layers: `torch.compile` each backbone layer (dynamic shapes: no recompile per batch
            length), packed or padded. Off by default: compiling costs minutes and pays only on long runs.
        lora: LoRA adapters through peft, `{r, alpha, dropout, target_modules}` (see
            `encoders.lora.LoraSettings`; missing keys take the PromptEOL reference's r 64, alpha 16,
            dropout 0.05, all-linear); null = off. The backbone is frozen: only the adapters and the
            method's own heads (MLP, prompt vectors, prefix, MLM head transform, centroids) train.
        gradient_checkpointing: recompute each backbone layer in backward instead of keeping its
            activations (padded and padding-free forwards; same loss and gradients).
        backbone_dtype: fp32 | bf16 | fp16, the dtype of the backbone's frozen weights (a frozen backbone
            only: LoRA or DCPCSE); what trains stays fp32. Training then needs
            `trainer.precision: bf16-mixed` / `16-mixed`, and evaluation autocasts to it.
        bidirectional: a decoder's causal masking off, every token sees the whole sentence (LLM2Vec;
            `Encoder.set_bidirectional`); refused on encoders.
        template: `echo` (echo embeddings: the sentence twice, pooled over the second copy with pooler
            echo_mean, the default then, or echo_last; `encoders.echo`), or echo wording of your own with
            [X] twice; null = the sentence alone. Methods with their own input format refuse it.
        load_in_4bit: the backbone's linear layers in 4 bits (QLoRA; NF4, bitsandbytes, the `qlora`
            extra), frozen backbones on a CUDA GPU only. Exports load the base unquantized.

    Checkpoints of a frozen backbone (LoRA, DCPCSE) hold only what trains plus the state outside the
    encoder: `backbone` names the rest, rebuilt at load and checked against the identity stored with it
    (name and config.json hash).
    """

    # the trainer's (gradient_clip_val, gradient_clip_algorithm) under gradient caching (`configure_callbacks`)
    manual_gradient_clip: tuple[float | None, str | None] = (None, None)

    def __init__(
        self,
        backbone: str,
        pooler: Pooler | None = None,
        mlp: MlpMode = "train",
        temperature: float = 0.05,
        lr: float = 3e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        mlm_weight: float = 0.0,
        mlm_probability: float = 0.15,
        eval_max_length: int | None = None,
        eval_batch_size: int = 128,
        eval_precision: Literal["auto", "bf16", "32"] = "auto",
        sts_aggregation: Literal["all", "wmean", "mean"] = "all",
        grad_cache_chunk: int = 0,
        padding_free: bool = True,
        attn_implementation: AttnImplementation | None = None,
        compile_layers: bool = False,
        lora: LoraSettings | None = None,
        gradient_checkpointing: bool = False,
        backbone_dtype: BackboneDtype = "fp32",
        load_in_4bit: bool = False,
        dropout: float | None = None,
        matryoshka_dims: list[int] | None = None,
        matryoshka_weights: list[float] | None = None,
        matryoshka_eval_dim: int | None = None,
        bidirectional: bool = False,
        template: str | None = None,
    ) -> None:
        super().__init__()
        if grad_cache_chunk < 0:
            raise SentEmbUserError(f"model.init_args.grad_cache_chunk must be >= 0 (0 = off), got {grad_cache_chunk}")
        self.save_hyperparameters()
        self._run_seed: int | None = None
        self.family = family_of(load_config(backbone))
        self.apply_family_defaults()
        options = with_dropout(from_pretrained_options(backbone_dtype, load_in_4bit), self.family, dropout)
        if attn_implementation is not None:
            if attn_implementation not in AttnImplementation.__args__:
                raise SentEmbUserError(f"model.init_args.attn_implementation must be null or one of "
                                       f"{', '.join(AttnImplementation.__args__)}, got {attn_implementation!r}")
            options["attn_implementation"] = attn_implementation
        try:
            with backbone_loading(defer_weights=_WEIGHTS_IN_CONFIGURE_MODEL.get(), **options):
                self.encoder = self.build_encoder()
                if bidirectional:
                    self.encoder.set_bidirectional()
                if template is not None and not self.encoder.reads_echo:
                    raise SentEmbUserError(f"model.init_args.template: {type(self).__name__} builds its own input format")
        except UnsupportedBackbone as refusal:
            raise UnsupportedBackbone(f"{type(self).__name__} on {backbone} ({self.family.model_type}): {refusal}") from None
        self.backbone_frozen = lora is not None or not any(p.requires_grad for p in self.encoder.backbone.parameters())
        if not self.backbone_frozen and (backbone_dtype != "fp32" or load_in_4bit):
            option = "load_in_4bit" if load_in_4bit else f"backbone_dtype {backbone_dtype}"
            raise SentEmbUserError(
                f"model.init_args.{option} stores the backbone's weights in low precision, which suits a frozen "
                "backbone only: set model.init_args.lora (or, for full fine-tuning, keep backbone_dtype fp32 and "
                "use trainer.precision bf16-mixed)"
            )
        self.backbone_adapted = False
        if not self.encoder.weights_deferred:
            self.configure_model()  # LoRA and the rest now, on the weights just loaded
        self.encoder.configure_speed(padding_free, compile_layers)
        self.backbone_identity = backbone_identity(backbone)
        hidden = self.encoder.hidden_size
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) if mlp != "none" else None
        self.check_matryoshka(matryoshka_dims, matryoshka_weights, matryoshka_eval_dim)
        self.sts_metrics = nn.ModuleDict(
            {
                task.replace(".", "_"): StsSpearman(STS_SUBSETS.get(task, (task,)), sts_aggregation)
                for task in STS_TASKS + DEV_TASKS
            }
        )
        self._collator: Collator | None = None

    def configure_model(self) -> None:
        """Lightning's hook (also FSDP's) before the strategy wraps the module; it runs at every stage and
        once here. A backbone deferred to it (`backbone_weights_in_configure_model`: the `sentemb` CLI
        builds methods so) loads now, straight from the checkpoint files onto this rank's device
        (`weights_device`) in `backbone_dtype`; then, once, LoRA adapters, fp32 for what trains, and
        gradient checkpointing."""
        if self.backbone_adapted:
            return
        hp = self.hparams
        if self.encoder.weights_deferred:
            options = from_pretrained_options(hp.backbone_dtype, hp.load_in_4bit, self.weights_device())
            if hp.attn_implementation is not None:
                options["attn_implementation"] = hp.attn_implementation
            self.encoder.load_backbone(**with_dropout(options, self.family, hp.dropout))
        backbone = self.encoder.backbone
        if hp.lora is not None:
            # the adapters' initial values from the run's seed alone: Lightning reseeds before this hook under
            # DDP, not on one device, and k processes must start as 1 does
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.run_seed)
                add_lora(backbone, hp.lora, peft_base_reference(hp.backbone), self.encoder.family.unread_modules(backbone))
        for parameter in self.encoder.parameters():  # adapters and heads of a low-precision backbone
            if parameter.requires_grad and parameter.dtype != torch.float32:
                parameter.data = parameter.data.float()
        if hp.gradient_checkpointing:
            enable_gradient_checkpointing(backbone)
        self.backbone_adapted = True

    def cpu(self) -> SentEmbMethod:
        """Lightning's teardown moves the module to the CPU, also when a run stopped before `configure_model`
        (a data error in `prepare_data`): a backbone still a skeleton on the meta device has nothing to move
        (which would fail), and the rest has not left the CPU yet (the strategy moves it after the hook)."""
        if self.encoder.weights_deferred:
            return self
        return super().cpu()

    def weights_device(self) -> torch.device | None:
        """Where the backbone's weights load: the trainer's root device, which Lightning numbers by its
        local rank (torchrun, SLURM and Lightning's own launcher alike). None (the CPU; 4-bit: the current
        GPU) outside a trainer, and under FSDP, which shards the module from host memory as it wraps it."""
        trainer = self._trainer
        if trainer is None or isinstance(trainer.strategy, FSDPStrategy):
            return None
        return trainer.strategy.root_device

    def check_matryoshka(self, dims: list[int] | None, weights: list[float] | None, eval_dim: int | None) -> None:
        """One line for Matryoshka settings that cannot apply to this embedding size."""
        size = self.output_size
        if dims is not None:
            check_dims(dims, size, "model.init_args.matryoshka_dims")
        if weights is not None and (dims is None or len(weights) != len(dims)):
            raise SentEmbUserError(
                f"model.init_args.matryoshka_weights {weights}: give one weight per entry of "
                f"model.init_args.matryoshka_dims ({dims})"
            )
        if eval_dim is not None:
            check_dims([eval_dim], size, "model.init_args.matryoshka_eval_dim")

    @property
    def automatic_optimization(self) -> bool:
        """Off with gradient caching, which runs its own backward passes and optimizer step."""
        return not self.hparams.grad_cache_chunk

    # ----- what a method provides -------------------------------------------------------
    def apply_family_defaults(self) -> None:
        """Fill the hyper-parameters left at None whose default depends on the backbone family
        (`self.family`), before the encoder is built; the resolved values are what checkpoints keep."""
        if self.hparams.pooler is None:
            self.hparams.pooler = "echo_mean" if self.hparams.get("template") else self.family.default_pooler

    def build_encoder(self) -> Encoder:
        """The backbone with this method's input format; plain `[CLS] s [SEP]` by default."""
        if self.hparams.template is not None:
            return EchoEncoder(self.hparams.backbone, self.hparams.pooler, self.hparams.template,
                               with_mlm_head=self.hparams.mlm_weight > 0)
        return Encoder(self.hparams.backbone, self.hparams.pooler, with_mlm_head=self.hparams.mlm_weight > 0)

    collator_class: type[Collator] = Collator
    """The method's training views (`collator`)."""

    def embedding_loss(self, embeddings: Tensor, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss, extra values to log) from the sentence embeddings of a training batch's rows
        (`embed(batch["features"])`, the views in collate's order)."""
        raise NotImplementedError

    def prepare_truncations(self, embeddings: Tensor, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch `embedding_loss` gets at every Matryoshka truncation, with what the method computes
        once from the full embeddings (ClusterNS: the K-means assignment); the batch itself by default."""
        return batch

    # ----- shared -----------------------------------------------------------------------
    def sentence_loss(self, embeddings: Tensor, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """The method's `embedding_loss`; with `matryoshka_dims`, Σ_d w_d · embedding_loss(truncation to
        d), each truncation the first d dimensions of every row re-normalized (`matryoshka.truncate`),
        so what the method builds from rows (views, prototypes, template-denoised vectors: the bias is
        subtracted at full size, which truncation commutes with) is truncated alike. The logged values
        are the method's at the first listed size, plus each truncation's loss."""
        dims = self.hparams.matryoshka_dims
        if not dims:
            return self.embedding_loss(embeddings, batch)
        weights = self.hparams.matryoshka_weights or [1.0] * len(dims)
        batch = self.prepare_truncations(embeddings, batch)
        total, logs = 0.0, {}
        for dim, weight in zip(dims, weights, strict=True):
            loss, values = self.embedding_loss(truncate(embeddings, dim), batch)
            if dim == dims[0]:
                logs.update(values)
            logs[f"matryoshka/loss_{dim}"] = loss.detach()
            total = total + weight * loss
        return total, logs

    @property
    def tokenizer(self):
        return self.encoder.tokenizer

    @property
    def eval_mlp(self) -> nn.Module | None:
        """The MLP kept at evaluation (mlp='always'), or None: what `encode` and the exports apply."""
        return self.mlp if self.hparams.mlp == "always" else None

    def embed(self, features: dict[str, Tensor]) -> Tensor:
        """Sentence vectors; the MLP applies in training, and at evaluation only with mlp='always'."""
        return self.project(self.encoder(features))

    def project(self, pooled: Tensor) -> Tensor:
        """The MLP over pooled sentence vectors where it applies (see `embed`)."""
        mlp = self.mlp if self.training else self.eval_mlp
        return mlp(pooled) if mlp is not None else pooled

    def training_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss, extra values to log) of one training batch embedded in one forward pass."""
        return self.sentence_loss(self.embed(batch["features"]), batch)

    @property
    def collator(self) -> Collator:
        """What the training DataLoader runs to build batches (in its workers): a `collator_class` over
        the encoder's input format and the hyper-parameters, never the module itself (see `Collator`)."""
        if self._collator is None:
            self._collator = self.collator_class(self.encoder.format, self.encoder.max_length, self.hparams)
        return self._collator

    def collate(self, examples: list[dict[str, list[int]]]) -> dict[str, Any]:
        """Training batch from tokenized examples (`collator`'s)."""
        return self.collator(examples)

    @property
    def collate_generator(self) -> torch.Generator:
        """What `collate` draws from (MLM masks, templates); the training loader reseeds it per batch."""
        return self.collator.generator

    def mlm_weight_at(self, step: int) -> float:
        """Weight of the MLM loss at a global step (constant here; DCPCSE decays it)."""
        return self.hparams.mlm_weight

    @property
    def run_seed(self) -> int:
        """Seed of the run's data order, collate draws and per-step RNG: the `seed_everything` seed,
        kept in checkpoints so a resumed run continues the same streams whatever its own seed."""
        if self._run_seed is None:
            self._run_seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        return self._run_seed

    def on_fit_start(self) -> None:
        """Log how much trains. Under DDP, no broadcast of the buffers before every forward, a
        collective per step for nothing: every rank holds the same buffers by construction (the
        backbone's constant position ids; ClusterNS's centroids, updated from the all-gathered batch
        and re-broadcast from rank 0 by its K-means callback at log steps)."""
        rank_zero_info(f"{type(self).__name__}: {self.trainable_summary()}")
        model = self.trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            model.forward_sync_buffers = False  # torch >= 2.13
            model.broadcast_buffers = False  # its name before

    def on_train_batch_start(self, batch: dict[str, Any], batch_idx: int) -> None:
        """Seed torch (CPU and CUDA), numpy and random from (run seed, rank, epoch, batch): dropout,
        SimCSE's augmentation, then depends only on where the run is, so a resumed run draws what
        the uninterrupted one drew, and ranks draw differently."""
        seed = batch_seed(self.run_seed, self.global_rank, self.current_epoch, batch_idx)
        torch.manual_seed(seed)
        np.random.seed(seed % 2**32)
        random.seed(seed)

    def step_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """The training objective of one batch in one forward: the method's loss plus the
        weighted MLM loss when enabled."""
        loss, logs = self.training_loss(batch)
        if "mlm" in batch:
            mlm = batch["mlm"]
            logits = self.encoder.mlm_logits(mlm["input_ids"], mlm["attention_mask"], mlm["layout"])
            logs["mlm_loss"] = mlm_loss(logits, mlm["labels"])
            loss = loss + self.mlm_weight_at(self.global_step) * logs["mlm_loss"]
        return loss, logs

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        if self.hparams.grad_cache_chunk:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            no_sync = getattr(self.trainer.strategy, "block_backward_sync", nullcontext)  # DDP-like strategies
            loss, logs = self.grad_cache_backward(batch, self.manual_backward, no_sync)
            optimizer.step()
            self.lr_schedulers().step()
        else:
            loss, logs = self.step_loss(batch)
        # collate may give "batch_size" when its features hold extra rows (e.g. template-bias rows)
        batch_size = batch.get("batch_size") or batch["features"]["input_ids"].size(0) // batch["num_views"]
        # not prog_bar: Lightning would read it back every step; `SentEmbProgressBar` shows it at log steps
        self.log("train/loss", loss, batch_size=batch_size)
        self.log_dict({f"train/{k}": v for k, v in logs.items()}, batch_size=batch_size)
        return loss

    def grad_cache_backward(
        self,
        batch: dict[str, Any],
        backward: Callable[[Tensor], None] = Tensor.backward,
        no_sync: Callable[[], AbstractContextManager] = nullcontext,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Accumulate the gradient of the batch's loss into `.grad` chunk by chunk (gradient
        caching); returns the detached loss and the logs, as `training_loss` (+ MLM) would.

        1. Embed the rows (sentence rows, then any template-bias rows) `grad_cache_chunk` at a time
           without a graph, keeping each chunk's random state.
        2. The method's loss on all of them (the rows are combined — denoising, MLP — and scored
           exactly as in one forward, ClusterNS's callback included); its gradient w.r.t. the
           rows is cached (fp32).
        3. Each chunk again, with a graph, under the random state of its first forward (same
           dropout masks), back-propagating its cached gradient; then the MLM loss chunk by chunk
           (a sum over rows: no cache needed).
        4. One more backward through the loss's graph (the MLP) plus a zero touching every
           trainable parameter: the only one outside `no_sync`, so DDP reduces the accumulated
           gradients once per step, all parameters included.

        `backward` is the trainer's (`manual_backward`: loss scaling) and `no_sync` its
        `block_backward_sync`; the defaults serve a single process without a trainer.
        """
        features, chunk = batch["features"], self.hparams.grad_cache_chunk
        batch_keys = self.encoder.combine_keys
        spans = chunk_spans(features["input_ids"].size(0), chunk)
        rng_states, rows = [], []
        with torch.no_grad():
            for span in spans:
                rng_states.append(RngState.capture(self.device))
                rows.append(self.encoder(rows_of(features, span, batch_keys)))
        cached = torch.cat(rows)
        cached = cached.to(torch.promote_types(cached.dtype, torch.float32)).requires_grad_()
        loss, logs = self.sentence_loss(self.project(self.encoder.combine_rows(cached, features)), batch)
        (row_grads,) = torch.autograd.grad(loss, cached, retain_graph=True)
        with no_sync():
            for span, rng_state in zip(spans, rng_states, strict=True):
                with rng_state.replay():
                    rows_with_graph = self.encoder(rows_of(features, span, batch_keys))
                backward((rows_with_graph.to(row_grads.dtype) * row_grads[span]).sum())
            if "mlm" in batch:
                mlm, weight = batch["mlm"], self.mlm_weight_at(self.global_step)
                predicted = (mlm["labels"] != -100).sum()
                logs["mlm_loss"] = loss.new_zeros(())
                for span in chunk_spans(mlm["input_ids"].size(0), chunk):
                    logits = self.encoder.mlm_logits(mlm["input_ids"][span], mlm["attention_mask"][span], mlm["layout"][span])
                    part = mlm_loss(logits, mlm["labels"][span], reduction="sum") / predicted
                    backward(weight * part)
                    logs["mlm_loss"] += part.detach()
                loss = loss + weight * logs["mlm_loss"]
        trainable = [p for p in self.parameters() if p.requires_grad]
        backward(loss + sum(p.sum() * 0 for p in trainable))
        return loss.detach(), logs

    def trainable_summary(self) -> str:
        """How many parameters train, of how many (4-bit weights counted unpacked)."""
        sizes = {id(p): (unpacked_numel(p), p.requires_grad) for p in self.parameters()}.values()
        total = sum(n for n, _ in sizes)
        trainable = sum(n for n, grad in sizes if grad)
        return f"{trainable:,} trainable parameters of {total:,} ({100 * trainable / total:.3g}%)"

    def configure_callbacks(self) -> list:
        """No callbacks of its own (ClusterNS adds K-means); refuses trainer options that gradient
        caching or a low-precision backbone cannot honour, before Lightning's own, less specific, check, and
        what is refused under FSDP: gradient caching (several forward and backward passes of the backbone
        within one step, which its DDP path keeps out of the reduction with `no_sync`; under FSDP's
        gather and reshard per layer this is unverified without a GPU, so refused rather than risked) and
        4-bit weights (bitsandbytes' packed tensors do not shard)."""
        trainer = self._trainer
        fitting = trainer is not None and trainer.state.fn == "fit"
        dtype = self.hparams.backbone_dtype
        if dtype != "fp32" and fitting and not str(trainer.precision).endswith("-mixed"):
            raise SentEmbUserError(
                f"model.init_args.backbone_dtype {dtype} keeps the frozen weights in {dtype} and what trains in fp32, "
                f"which run together under mixed precision: set trainer.precision {'bf16' if dtype == 'bf16' else '16'}"
                f"-mixed (got {trainer.precision})"
            )
        if fitting and isinstance(trainer.strategy, FSDPStrategy):
            for option in ("grad_cache_chunk", "load_in_4bit"):
                if self.hparams[option]:
                    raise SentEmbUserError(
                        f"model.init_args.{option} is not supported under FSDP (trainer.strategy), which shards a "
                        "backbone that trains whole; train with DDP (docs/training.md: what each strategy supports)"
                    )
        if self.hparams.grad_cache_chunk and fitting:
            # Lightning refuses gradient_clip_val under manual optimization; the method clips itself
            # (`on_before_optimizer_step`), so it takes the setting over before Lightning's check.
            self.manual_gradient_clip = (trainer.gradient_clip_val, trainer.gradient_clip_algorithm)
            trainer.gradient_clip_val = None
            if trainer.accumulate_grad_batches != 1:
                raise SentEmbUserError(
                    f"trainer.accumulate_grad_batches={trainer.accumulate_grad_batches} with "
                    "model.init_args.grad_cache_chunk > 0: accumulation does not add negatives; raise "
                    "data.batch_size instead (caching keeps its memory to one chunk)"
                )
        return []

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Gradient caching steps the optimizer itself, where Lightning does not clip: the trainer's
        `gradient_clip_val` / `gradient_clip_algorithm` apply here, where automatic optimization clips
        (after DDP's gradient all-reduce and fp16's unscaling, before the step)."""
        clip_val, algorithm = self.manual_gradient_clip
        if clip_val:
            self.clip_gradients(optimizer, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        # fused: one kernel for all parameters, no per-tensor launches (CPU and CUDA alike)
        optimizer = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, fused=True)
        total = self.trainer.estimated_stepping_batches
        total = int(total) if math.isfinite(total) else 10**9
        schedule = get_linear_schedule_with_warmup(optimizer, self.hparams.warmup_steps, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ----- encoding ---------------------------------------------------------------------
    def sentence_features(self, sentences: list[str]) -> dict[str, Tensor]:
        """Model inputs for raw sentences at evaluation (method's format, evaluation truncation)."""
        return self.features_from_ids(self.encoder.format.sentence_ids(sentences))

    @property
    def eval_length(self) -> int:
        """Truncation at evaluation and in exports: `eval_max_length`, else the model's maximum."""
        return self.hparams.eval_max_length or self.encoder.max_length

    def features_from_ids(self, sentence_ids: list[list[int]]) -> dict[str, Tensor]:
        return self.encoder.format.build(sentence_ids, self.eval_length)

    def encode_batch(self, sentences: list[str]) -> Tensor:
        return self.embed_features(self.sentence_features(sentences))

    def embed_features(self, features: dict[str, Tensor]) -> Tensor:
        return self.embed({k: v.to(self.device, non_blocking=True) for k, v in features.items()})

    @torch.inference_mode()
    def encode(
        self, sentences: list[str], batch_size: int | None = None, show_progress: bool | None = None,
        label: str = "encode",
    ) -> Tensor:
        """(n, hidden) float32 embeddings on CPU, in the input order; `label` names the progress bar
        (evaluators pass the task running).

        Tokenized once, sorted by length so each batch pads little; evaluation mode, no gradient,
        autocast per `eval_precision`. Every evaluator calls this.
        """
        batch_size = batch_size or self.hparams.eval_batch_size
        if not sentences:  # a rank's empty share in `encode_across_ranks`
            return torch.empty(0, self.output_size, dtype=torch.float32)
        was_training = self.training
        self.eval()
        sentence_ids = self.encoder.format.sentence_ids(sentences)
        order = np.argsort([len(ids) for ids in sentence_ids], kind="stable")[::-1]
        show = len(sentences) > 10 * batch_size if show_progress is None else show_progress
        # rows in `order`, copied batch by batch without waiting for the device (pinned memory on a GPU)
        in_order = torch.empty(len(sentences), self.output_size, dtype=torch.float32,
                               pin_memory=self.device.type == "cuda")
        with self.eval_autocast():
            for start in progress_bar(range(0, len(sentences), batch_size), desc=label, disable=not show):
                rows = order[start : start + batch_size]
                features = self.features_from_ids([sentence_ids[i] for i in rows])
                in_order[start : start + len(rows)].copy_(self.embed_features(features).float(), non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the one wait: every copy has landed
        self.train(was_training)
        out = torch.empty_like(in_order, pin_memory=False)
        out[torch.from_numpy(order.copy())] = in_order
        return out

    def encode_across_ranks(
        self, sentences: list[str], batch_size: int | None = None, show_progress: bool | None = None,
        label: str = "encode",
    ) -> Tensor:
        """`encode` with the work shared by every rank of the process group: each encodes every
        world_size-th sentence and all get the whole (n, hidden) matrix, in the input order. Every rank
        must call it with the same sentences. One process: exactly `encode`."""
        rank, world_size = world()
        if world_size == 1:
            return self.encode(sentences, batch_size, show_progress, label)
        share = self.encode(sentences[rank::world_size], batch_size, show_progress if rank == 0 else False, label)
        return gather_strided_rows(share.to(self.device), len(sentences)).cpu()

    def eval_autocast(self) -> torch.autocast:
        """`eval_precision`'s autocast; with a bf16/fp16 backbone, autocast to its dtype (its fp32 heads
        need it)."""
        dtype = DTYPES[self.hparams.backbone_dtype]
        if dtype != torch.float32:
            return torch.autocast(self.device.type, dtype=dtype)
        return autocast_for(self.device, self.hparams.eval_precision)

    @property
    def output_size(self) -> int:
        return self.encoder.hidden_size

    # ----- STS validation and test --------------------------------------------------------
    def _sts_step(self, batch: dict[str, Any], dim: int | None = None) -> None:
        """Cosines of a batch of STS pairs into the task's metric; on the first `dim` dimensions when given."""
        n = len(batch["first"])
        embeddings = self.encode_batch(batch["first"] + batch["second"])
        if dim is not None:
            embeddings = truncate(embeddings, dim)
        cosines = torch.nn.functional.cosine_similarity(embeddings[:n].float(), embeddings[n:].float(), dim=-1)
        self.sts_metrics[batch["task"].replace(".", "_")].update(batch["index"], cosines, batch["gold"], batch["subset"])

    def _log_sts(self, stage: str, tasks: list[str]) -> dict[str, float]:
        scores = {}
        for task in tasks:
            metric = self.sts_metrics[task.replace(".", "_")]
            scores[task] = float(metric.compute())
            metric.reset()
        if len(scores) > 1:
            scores["avg"] = float(np.mean(list(scores.values())))
        self.log_dict({f"{stage}/{k}": v for k, v in scores.items()}, sync_dist=False)
        return scores

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._sts_step(batch, self.hparams.matryoshka_eval_dim)

    def test_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._sts_step(batch)

    def _stage_tasks(self, stage: str) -> list[str]:
        datamodule = self.trainer.datamodule
        return list(datamodule.val_tasks if stage == "val" else datamodule.test_tasks)

    def _run_extra_evaluators(self, stage: str) -> None:
        """Evaluators beyond STS named by the DataModule (`val_evaluators` / `test_evaluators`), on every
        rank: each encodes its share of the sentences (`encode_across_ranks`), and every rank scores the
        gathered embeddings itself, so no rank waits on another's long work (a collective pending through
        minutes of scoring could outlast the process group's timeout). The scoring is deterministic and
        its inputs identical on every rank: so are the results, which rank 0 logs (and plots)."""
        datamodule = self.trainer.datamodule
        names = list(getattr(datamodule, f"{stage}_evaluators", ()))
        if not names:
            return
        figures = Path(self.trainer.default_root_dir) / "figures" / f"{stage}-step{self.global_step}"
        with nullcontext(figures) if self.trainer.is_global_zero else tempfile.TemporaryDirectory() as figure_dir:
            results = evaluate_suite(self.encode_across_ranks, names, datamodule.data_dir, figure_dir,
                                     name=type(self).__name__)
        metrics = {f"{stage}/{k}": v for k, v in headline_scores(results).items()}
        if self.trainer.is_global_zero:
            for logger in self.loggers:
                logger.log_metrics(metrics, step=self.global_step)

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._log_sts("val", self._stage_tasks("val"))
            self._run_extra_evaluators("val")
        else:
            for metric in self.sts_metrics.values():
                metric.reset()

    def on_test_epoch_end(self) -> None:
        self.test_results = self._log_sts("test", self._stage_tasks("test"))
        self._run_extra_evaluators("test")
        if self.trainer.is_global_zero:
            print("\n" + format_table({type(self).__name__: self.test_results}), flush=True)

    # ----- checkpoints ----------------------------------------------------------------------
    def trainable_state_keys(self) -> set[str]:
        """state_dict names of what a checkpoint of a frozen backbone keeps: the trainable tensors (every
        name of a shared one) and the state outside the encoder (e.g. ClusterNS's centroids)."""
        trainable = {name for name, p in self.named_parameters(remove_duplicate=False) if p.requires_grad}
        return trainable | {name for name in self.state_dict() if not name.startswith("encoder.")}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the method class (so `sentemb evaluate/export` rebuild it from the file alone) and the
        backbone's identity; drop a frozen backbone (hyper-parameter `backbone` names it)."""
        checkpoint["sentemb_method"] = f"{type(self).__module__}.{type(self).__qualname__}"
        checkpoint["sentemb_run_seed"] = self.run_seed
        checkpoint["sentemb_backbone"] = self.backbone_identity
        if self.backbone_frozen:
            keep = self.trainable_state_keys()
            checkpoint["state_dict"] = {name: t for name, t in checkpoint["state_dict"].items() if name in keep}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A resumed run keeps the seed of the run it continues. A checkpoint of a frozen backbone needs the
        very base it was trained on: a different config.json is one line."""
        self._run_seed = checkpoint.get("sentemb_run_seed", self._run_seed)
        saved = checkpoint.get("sentemb_backbone")
        if self.backbone_frozen and saved and saved["config_sha256"] != self.backbone_identity["config_sha256"]:
            raise SentEmbUserError(
                f"the checkpoint holds adapters/prefixes trained on backbone {saved['name']!r} (config "
                f"{str(saved['config_sha256'])[:12]}), but model.init_args.backbone {self.hparams.backbone!r} is a "
                f"different model (config {str(self.backbone_identity['config_sha256'])[:12]}); point it to the model "
                "the checkpoint was trained on"
            )

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False):
        """A frozen backbone's checkpoint holds exactly `trainable_state_keys`: those are loaded (strictly:
        a missing or unknown name is an error) and the frozen weights stay as loaded from `backbone`."""
        if not (self.backbone_frozen and strict):
            return super().load_state_dict(state_dict, strict=strict, assign=assign)
        missing = sorted(self.trainable_state_keys() - state_dict.keys())
        unexpected = sorted(state_dict.keys() - self.state_dict().keys())
        if missing or unexpected:
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self).__name__}: Missing key(s) {missing}; "
                               f"unexpected key(s) {unexpected}")
        return super().load_state_dict(state_dict, strict=False, assign=assign)

    def write_export(self, folder: Path, adapter_only: bool = False) -> None:
        """Write this method as a HF + sentence-transformers folder (prompt formats override); LoRA
        adapters merged into the backbone, or with `adapter_only` as peft's adapter folder."""
        write_plain_export(self, folder, adapter_only)


def backbone_identity(name: str) -> dict[str, str | None]:
    """The backbone as a checkpoint remembers it: its name and the SHA-256 of its config.json (parsed,
    without the keys saving rewrites), None where it has none (an adapter folder)."""
    path = cached_file(resolve_model_path(name), "config.json", _raise_exceptions_for_missing_entries=False)
    digest = None
    if path is not None:
        config = json.loads(Path(path).read_text())
        for key in ("_name_or_path", "transformers_version"):
            config.pop(key, None)
        digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return {"name": name, "config_sha256": digest}


def unpacked_numel(parameter: Tensor) -> int:
    """Elements of a parameter; bitsandbytes' 4-bit weights pack two in a byte (their quant state keeps
    the shape)."""
    quant_state = getattr(parameter, "quant_state", None)
    return math.prod(quant_state.shape) if quant_state is not None else parameter.numel()
