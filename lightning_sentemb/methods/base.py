"""The shared LightningModule: what a sentence-embedding method is. A method subclasses `SentEmbMethod`
and contributes only what differs: `build_encoder` (input format), `collator_class` (the views of a
training example), `embedding_loss` (the loss from the batch's embeddings). The rest is composed from
one module per concern, whose functions are the hooks here: `building` (backbone weights, LoRA, memory
switches), `steps` (a batch's loss, training step, seeding, optimizer), `grad_cache`, `matryoshka`,
`encoding` (`embed`, `encode`), `validation` (STS and other evaluators in a run), `checkpoint_state`.
Exports read a method through `export.protocol.ExportableMethod` (`export_format` picks the writer)."""

from __future__ import annotations

import inspect
import os
from typing import Any, Literal

from lightning.pytorch import LightningModule
from torch import Tensor, nn

from .. import grad_cache, matryoshka
from ..backbones import family_of
from ..encoders.echo import EchoEncoder
from ..encoders.lora import LoraSettings
from ..encoders.memory import BackboneDtype
from ..encoders.plain import POOLERS, Encoder
from ..encoders.pretrained import load_config
from . import checkpoint_state, encoding, steps, validation
from .building import (
    AttnImplementation,
    build_encoder_for,
    build_method,
    check_options,
    configure_backbone,
    resolve_attention,
)
from .checkpoint_state import backbone_identity, unpacked_numel
from .collator import Collator
from .guide import Guide, GuideOption

__all__ = ["SentEmbMethod", "backbone_identity", "build_method", "unpacked_numel"]

MlpMode = Literal["none", "train", "always"]
Pooler = Literal[POOLERS]  # the values of POOLERS: the CLI refuses any other with the list


class SentEmbMethod(LightningModule):
    """Base of every method.

    Args:
        backbone: Hugging Face hub name, local folder or `pkg:MODULE`: a BERT-family, ModernBERT or
            decoder-LLM checkpoint (`lightning_sentemb.backbones`; pairs that cannot work are refused
            with one line).
        pooler: cls | cls_before_pooler | last | avg | avg_first_last | avg_emb_last | avg_top2 (template
            methods: mask); None = the family's default, cls for encoders and last for decoders.
        dropout: every dropout probability of the backbone's config (None = the checkpoint's). Decoder
            LLMs and ModernBERT ship with 0, which makes unsupervised SimCSE's two views identical.
        matryoshka_dims: Matryoshka training (e.g. [768, 512, 256, 128, 64]): the method's loss on the first
            d dimensions of every embedding, re-normalized, summed over d with `matryoshka_weights`
            (default 1 each, as sentence-transformers' MatryoshkaLoss; `matryoshka.matryoshka_loss`).
        matryoshka_weights: one weight per entry of `matryoshka_dims`.
        matryoshka_eval_dim: validation (the STS-B dev score that selects `best.ckpt`) on the first this many
            dimensions; None = all. Test and `encode` keep all (`sentemb evaluate --dims` scores truncations).
        mlp: Linear+Tanh projection over the pooled vector: "train" (SimCSE unsupervised: used in
            training, dropped at evaluation), "always" (supervised SimCSE), or "none".
        temperature: τ of the contrastive softmax.
        lr, weight_decay, warmup_steps: AdamW with linear warm-up then linear decay to 0.
        mlm_weight: weight of the masked-LM auxiliary loss (0 disables it; SimCSE uses 0.1).
        mlm_probability: fraction of tokens masked for the auxiliary loss.
        eval_max_length: truncation at evaluation; None = the model's maximum (SimCSE's
            evaluation does not truncate; the 32-token limit is for training only).
        eval_batch_size: sentences per forward in `encode` (under `sentemb fit`, set by `data.eval_batch_size`).
        eval_precision: autocast during `encode`: "auto" (bf16/fp16 on GPU, fp32 on CPU), "bf16", or "32".
        sts_aggregation: how STS12–16 subsets combine: "all" (SentEval/SimCSE), "wmean", "mean".
        grad_cache_chunk: rows per chunk for gradient caching (0 = off): the global batch's exact loss
            and gradient with the activation memory of this many rows, so a paper's batch fits a small
            GPU (`grad_cache`; `accumulate_grad_batches` is refused, `gradient_clip_val` applies).
        attn_implementation: the attention path. null = padding-free (`encoders.packed`: the backbone's
            own forward on the real tokens only, same results; unsupported backbones fall back to the
            padded one with a logged reason); padded = transformers' padded forward with the kernel it
            picks; sdpa | eager | flash_attention_2 | flex_attention = with that kernel (DCPCSE: no
            other kernel than sdpa).
        padding_free: deprecated alias (said once): false = `attn_implementation: padded`.
        compile_layers: `torch.compile` each backbone layer (dynamic shapes: no recompile per batch
            length), packed or padded. Off by default: compiling costs minutes and pays only on long runs.
        lora: LoRA adapters through peft, `{r, alpha, dropout, target_modules}` (`encoders.lora.LoraSettings`;
            default PromptEOL's r 64, alpha 16, dropout 0.05, all-linear); null = off. The backbone is
            frozen: the adapters and the method's own heads train.
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
        guide: a false-negative filter: `{model: M, pooler: null, margin: 0.0, margin_strategy: absolute}`
            (M any model `sentemb evaluate` reads, frozen: GISTEmbed's rule, negatives the guide scores above
            the anchor's positive less the margin leave the denominator) or `self` (Qwen3-Embedding's: the
            model's own detached similarities, above the positive + 0.1); a candidate whose text is the
            positive's leaves too (`drop_duplicates`). See `methods.guide` and docs/negatives.md; null = off.
        pool_instruction: whether a query's instruction (a mixture dataset's, `data.datasets`) is pooled
            with its text by the mean poolers; false (LLM2Vec's, NV-Embed's) averages the text only
            (`encoders.instruction`). cls and last read one token either way.
        prompts: name -> the text written before a query (formatted: `Instruct: ...\nQuery: `), what the
            export carries (`config_sentence_transformers.json`) and `sentemb evaluate --mteb` offers mteb;
            `sentemb fit` fills it from the instructions of `data.datasets`. docs/mixtures.md.
    """

    manual_gradient_clip: tuple[float | None, str | None] = (None, None)
    export_format = "plain"  # the export's writer (`export.write_method_folder`)

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
        padding_free: bool | None = None,
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
        guide: GuideOption = None,
        pool_instruction: bool = False,
        prompts: dict[str, str] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        resolve_attention(self)
        self._run_seed: int | None = None
        self.guide = Guide.from_option(guide)
        self.family = family_of(load_config(backbone))
        self.apply_family_defaults()
        self.encoder = build_encoder_for(self)
        self.backbone_frozen = lora is not None or not any(p.requires_grad for p in self.encoder.backbone.parameters())
        check_options(self)
        self.backbone_adapted = False  # its weights load in `configure_model` (`building`)
        self.encoder.configure_speed(self.hparams.attn_implementation is None, compile_layers)
        self.backbone_identity = backbone_identity(backbone)
        hidden = self.encoder.hidden_size
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) if mlp != "none" else None
        matryoshka.check_settings(matryoshka_dims, matryoshka_weights, matryoshka_eval_dim, self.output_size)
        self.sts_metrics = validation.sts_metrics(sts_aggregation)
        self._collator: Collator | None = None

    configure_model = configure_backbone

    def cpu(self) -> SentEmbMethod:
        """Lightning's teardown before `configure_model` (a skeleton backbone): nothing has left the CPU."""
        return self if self.encoder.weights_deferred else super().cpu()

    # ----- what a method provides -------------------------------------------------------
    def apply_family_defaults(self) -> None:
        """Fill the hyper-parameters whose default depends on `self.family` (checkpoints keep the values)."""
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
    guide_candidate_views: int | None = None
    """How many views after the first the loss's denominator reads, those the guide judges (None: all)."""

    mixture_options: frozenset[str] = frozenset()
    """The settings of a mixture's dataset (`data.datasets`) this method applies beyond its rows
    (`check_source`): `instruction`, `in_batch_negatives` (false), `query_max_len`, `doc_max_len`."""

    def embedding_loss(
        self, embeddings: Tensor, batch: dict[str, Any], drop: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss, extra values to log) from the sentence embeddings of a training batch's rows
        (`embed(batch["features"])`, the views in collate's order). `drop` (n, columns): with a guide, the
        columns that leave each anchor's denominator, over the global batch's views 1, 2, ... in order
        (`Guide.drop`); a method that cannot apply it leaves `drop` out of its signature and refuses the
        guide when built."""
        raise NotImplementedError

    def prepare_truncations(self, embeddings: Tensor, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch `embedding_loss` gets at every Matryoshka truncation, with what the method computes
        once from the full embeddings (ClusterNS: the K-means assignment); the batch itself by default."""
        return batch

    def mlm_weight_at(self, step: int) -> float:
        """Weight of the MLM loss at a global step (constant here; DCPCSE decays it)."""
        return self.hparams.mlm_weight

    # ----- embedding --------------------------------------------------------------------
    tokenizer = property(lambda self: self.encoder.tokenizer)
    output_size = property(lambda self: self.encoder.hidden_size, doc="The embedding's dimensions.")

    @property
    def eval_mlp(self) -> nn.Module | None:
        """The MLP kept at evaluation (mlp='always'), or None: what `encode` and the exports apply."""
        return self.mlp if self.hparams.mlp == "always" else None

    @property
    def eval_length(self) -> int:
        """Truncation at evaluation and in exports: `eval_max_length`, else the model's maximum."""
        return self.hparams.eval_max_length or self.encoder.max_length

    embed = encoding.embed
    project = encoding.project
    features_from_ids = encoding.features_from_ids
    sentence_features = encoding.sentence_features
    embed_features = encoding.embed_features
    encode_batch = encoding.encode_batch
    encode = encoding.encode
    encode_across_ranks = encoding.encode_across_ranks
    eval_autocast = encoding.eval_autocast

    # ----- training ---------------------------------------------------------------------
    check_source = steps.check_source

    @property
    def collator(self) -> Collator:
        """What the training DataLoader runs to build batches (in its workers), never the module itself."""
        if self._collator is None:
            self._collator = self.collator_class(self.encoder.format, self.encoder.max_length, self.hparams)
        return self._collator

    collate = property(lambda self: self.collator, doc="`collate(examples)`: a training batch (`collator`'s).")
    collate_generator = property(lambda self: self.collator.generator,
                                 doc="What `collate` draws from (MLM masks, templates); reseeded per batch.")

    @property
    def run_seed(self) -> int:
        """The `seed_everything` seed of the run's data order and draws, kept in checkpoints for resuming."""
        if self._run_seed is None:
            self._run_seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        return self._run_seed

    @property
    def automatic_optimization(self) -> bool:
        """Off with gradient caching, which runs its own backward passes and optimizer step."""
        return not self.hparams.grad_cache_chunk

    guide_drop = steps.guide_drop
    sentence_loss = steps.sentence_loss
    training_loss = steps.training_loss
    step_loss = steps.step_loss
    grad_cache_backward = grad_cache.grad_cache_backward
    training_step = steps.training_step
    on_train_batch_start = steps.seed_batch
    on_fit_start = steps.on_fit_start
    configure_optimizers = steps.configure_optimizers
    configure_callbacks = steps.check_trainer_options
    on_before_optimizer_step = steps.clip_cached_gradients

    # ----- validation and test ------------------------------------------------------------
    validation_step = validation.validation_step
    test_step = validation.test_step
    on_validation_epoch_end = validation.on_validation_epoch_end
    on_test_epoch_end = validation.on_test_epoch_end

    # ----- checkpoints and exports ----------------------------------------------------------
    trainable_state_keys = checkpoint_state.trainable_state_keys
    on_save_checkpoint = checkpoint_state.on_save_checkpoint
    on_load_checkpoint = checkpoint_state.on_load_checkpoint
    load_state_dict = checkpoint_state.load_state_dict
    check_state_keys = checkpoint_state.check_state_keys

    def own_hyperparameters(self) -> dict[str, Any]:
        """The method's own hyperparameters, those the shared base does not take (model cards list them)."""
        shared = inspect.signature(SentEmbMethod.__init__).parameters
        return {k: v for k, v in self.hparams.items() if k not in shared and not k.startswith("_")}
