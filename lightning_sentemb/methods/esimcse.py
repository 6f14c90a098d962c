"""ESimCSE (Wu et al., COLING 2022, "ESimCSE: Enhanced Sample Building Method for Contrastive Learning of
Unsupervised Sentence Embedding"; reference caskcsg/sentemb, ESimCSE/): SimCSE whose positive is the
sentence with some of its tokens repeated (so the two views differ in length), plus momentum contrast:
the embeddings a momentum encoder gave the last batches' sentences, kept in a queue, are extra negatives.

Where the paper and the reference code differ (both supported, the paper's the default):

- how many tokens repeat (`dup_rule`): the paper (§3.1, "word repetition") draws dup_len uniformly from
  {0, …, max(2, ⌊dup_rate·N⌋)} over the N tokens of the sentence and the positions uniformly among them;
  the reference (train.py, dup_type "bpe") draws from {0, …, min(10, ⌊dup_rate·L⌋) − 1} where L counts the
  special tokens too, nothing when ⌊dup_rate·L⌋ is 0 (its word variant: from {0, …, min(10, W,
  max(2, ⌊dup_rate·W⌋)) − 1} among the W words but the last);
- what repeats (`dup_unit`): sub-word tokens (the paper, and the reference's "bpe" run), or words (the
  reference's dup_type "word": the sentence is decoded, split on spaces, and re-tokenized with its words
  repeated; the reference splits the raw text, which the decoded text matches up to the tokenizer's
  normalization, e.g. lower case);
- the reference repeats once per example at preprocessing; here the repetitions are drawn at every step
  by the collator (`collate_generator`, seeded per batch: reproducible, repeated after a resume).

Both lengthen the truncated sentence (the repeated row may exceed `max_seq_len` by the repeated tokens,
as in the reference's "bpe" run; its "word" run truncates after repeating).

The momentum encoder's start (`momentum_init`): a copy of the encoder (MoCo's, the default: the paper is
silent), or, as the reference, a fresh initialization of the architecture (its `BertForCL.__init__` copies
the encoder before the pretrained weights load, then `init_weights()` re-initializes the copy, and loading
leaves it random: the checkpoint has no `momentum_model.*` keys), so the first queues hold the embeddings
of a mostly random encoder until θm ← m·θm + (1 − m)·θ has moved it (0.995^1000 ≈ 0.7 % left after 1,000
steps).

Momentum contrast as the reference runs it (the paper is silent on these): the momentum encoder averages
the encoder's trained tensors only (the MLP over it is the trained one, as the reference applies its
`mlp` to the momentum outputs); at step t it moves toward the weights the step's loss was computed with
(before the optimizer step), then embeds the step's *anchors* (the unrepeated sentences) with dropout off;
they join the queue after the loss, so step t's loss sees the queue of steps < t. The queue starts empty
and fills (the first step's loss is SimCSE's); the reference empties it at every epoch (it trains one),
here it persists. Under DDP every rank pushes the global batch's keys, in the examples' order (k processes
train as one); `grad_cache_chunk` chunks the momentum forward too, and the queue is a constant of the step.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from lightning.pytorch import Callback
from torch import Tensor

from ..distributed import gather_strided_rows, gather_with_grad, local_labels, world
from ..errors import SentEmbUserError, check_choice
from ..fsdp import is_sharded
from ..grad_cache import chunk_spans, rows_of
from ..losses.info_nce import info_nce
from .base import SentEmbMethod
from .collator import Collator
from .momentum import EmbeddingQueue, MomentumEncoder, MomentumInit

DupRule = Literal["paper", "reference"]
DupUnit = Literal["subword", "word"]
REFERENCE_MAX_REPEATS = 10  # the reference's cap on the repeated tokens (words) of a sentence


def repeated_positions(length: int, dup_rate: float, rule: DupRule, unit: DupUnit, num_special: int,
                       generator: torch.Generator) -> list[int]:
    """The positions (sorted) among a sentence's `length` tokens (or words) that repeat: how many, as
    `rule` draws it (see the module's docstring), then which, uniformly without replacement.
    `num_special`: the special tokens around the sentence (the reference's sub-word count includes them)."""
    if dup_rate <= 0 or length == 0:
        return []
    candidates = length
    if rule == "paper":
        count = int(torch.randint(max(2, int(dup_rate * length)) + 1, (1,), generator=generator))
    else:
        if unit == "subword":
            high = min(REFERENCE_MAX_REPEATS, int(dup_rate * (length + num_special)))
        else:
            high, candidates = min(REFERENCE_MAX_REPEATS, length, max(2, int(dup_rate * length))), length - 1
        count = int(torch.randint(high, (1,), generator=generator)) if high > 0 else 0
    count = min(count, candidates)
    return sorted(torch.randperm(candidates, generator=generator)[:count].tolist())


def repeat_at(items: list[Any], positions: list[int]) -> list[Any]:
    """`items` with each item at `positions` written twice in a row (the paper's x⁺ = {x1, x1, x2, …})."""
    chosen = set(positions)
    return [item for i, item in enumerate(items) for _ in range(2 if i in chosen else 1)]


class ESimCSEViews(Collator):
    """The sentence (view 0, the anchor) and the sentence with repeated tokens or words (view 1, the
    positive); other columns of the corpus are ignored."""

    def repeated(self, sentences: list[list[int]]) -> list[list[int]]:
        hp, draw = self.hparams, self.generator
        if hp.dup_unit == "subword":
            return [repeat_at(ids, repeated_positions(len(ids), hp.dup_rate, hp.dup_rule, "subword",
                                                      self.format.num_special_tokens, draw)) for ids in sentences]
        tokenizer = self.format.tokenizer
        texts = tokenizer.batch_decode(sentences, skip_special_tokens=True, clean_up_tokenization_spaces=True)
        rows, redo = list(sentences), {}
        for i, text in enumerate(texts):
            words = text.split(" ")
            positions = repeated_positions(len(words), hp.dup_rate, hp.dup_rule, "word", 0, draw)
            if positions:
                redo[i] = " ".join(repeat_at(words, positions))
        if redo:
            for i, ids in zip(redo, tokenizer(list(redo.values()), add_special_tokens=False)["input_ids"], strict=True):
                rows[i] = ids
        return rows

    def __call__(self, examples: list[dict[str, list[int]]]) -> dict[str, Any]:
        sentences = [example["sent0"] for example in examples]
        rows = sentences + self.repeated(sentences)
        batch = {"features": self.format.build(rows, max_length=None), "num_views": 2}
        return self.add_guide_texts(self.add_mlm_inputs(batch), rows)


class ESimCSE(SentEmbMethod):
    """ESimCSE on a one-sentence-a-line corpus: word repetition for the positive, momentum contrast for
    more negatives. Each half can be switched off: `dup_rate` 0 (the positive is the sentence again,
    SimCSE's dropout view) and `queue_size` 0, or `queue_batches` 0 with `queue_size` null (no momentum
    encoder, no queue). The defaults are the paper's; the code behind the published rows differs in
    `dup_rule` (reference) and `momentum_init` (fresh), which the seed-row configs set (docs/methods.md).

    Args:
        dup_rate: the maximal repetition rate (paper: 0.32 for BERT; the reference's run.sh: 0.3 for
            RoBERTa-base, 0.28 for RoBERTa-large); 0 = no repetition.
        dup_rule: "paper" or "reference": how the number of repeated tokens is drawn (module docstring).
        dup_unit: "subword" (paper) or "word" (the reference's dup_type word).
        momentum: m of the momentum encoder's update θm ← m·θm + (1 − m)·θ (paper: 0.995).
        queue_batches: the queue's size as a multiple of the global batch (paper: 2.5, the reference's
            neg_size 160 at batch 64); used when `queue_size` is null.
        queue_size: the queue's size in embeddings (the reference's neg_size), or null.
        momentum_init: the momentum encoder's start: "copy" of the encoder, or "fresh" (the reference's
            re-initialized copy; see the module docstring).
        **kwargs: see `SentEmbMethod`.
    """

    collator_class = ESimCSEViews

    def __init__(self, backbone: str, dup_rate: float = 0.32, dup_rule: DupRule = "paper",
                 dup_unit: DupUnit = "subword", momentum: float = 0.995, queue_batches: float = 2.5,
                 queue_size: int | None = None, momentum_init: MomentumInit = "copy", **kwargs: Any) -> None:
        check_choice("model.init_args.dup_rule", dup_rule, DupRule)
        check_choice("model.init_args.momentum_init", momentum_init, MomentumInit)
        check_choice("model.init_args.dup_unit", dup_unit, DupUnit)
        if not 0 <= dup_rate < 1 or not 0 <= momentum < 1 or queue_batches < 0 or (queue_size or 0) < 0:
            raise SentEmbUserError("model.init_args: ESimCSE takes 0 <= dup_rate < 1, 0 <= momentum < 1 and a "
                                   f"queue_batches / queue_size >= 0; got dup_rate {dup_rate}, momentum {momentum}, "
                                   f"queue_batches {queue_batches}, queue_size {queue_size}")
        super().__init__(backbone, **kwargs)
        momentum_contrast = bool(queue_size) if queue_size is not None else queue_batches > 0
        self.queue = EmbeddingQueue(self.output_size) if momentum_contrast else None
        self.momentum_encoder: MomentumEncoder | None = None  # built once the weights are loaded

    def configure_model(self) -> None:
        """The backbone's weights (`configure_backbone`), then the momentum encoder from them."""
        super().configure_model()
        if self.queue is not None and self.momentum_encoder is None:
            self.momentum_encoder = MomentumEncoder(self.encoder, self.hparams.momentum, self.hparams.momentum_init)

    def configure_callbacks(self) -> list[Callback]:
        """Refuses FSDP: the momentum forward swaps whole tensors into the encoder, which a sharded one lacks."""
        trainer = self._trainer
        if self.queue is not None and trainer is not None and is_sharded(trainer.strategy):
            raise SentEmbUserError("model.init_args.queue_batches: ESimCSE's momentum encoder needs the whole weights "
                                   "on every rank, which FSDP (trainer.strategy) shards; train with DDP, or without "
                                   "momentum contrast (queue_batches 0)")
        return super().configure_callbacks()

    def queue_capacity(self, local_batch: int) -> int:
        hp = self.hparams
        return hp.queue_size if hp.queue_size is not None else round(hp.queue_batches * local_batch * world()[1])

    def embedding_loss(
        self, embeddings: Tensor, batch: dict[str, Any], drop: Tensor | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """InfoNCE of each anchor against the global batch's positives and the queue's filled rows (the paper's
        loss)."""
        anchors, positives = embeddings.unflatten(0, (2, -1))
        positives = gather_with_grad(positives)
        labels = local_labels(anchors.size(0), anchors.device)
        if self.queue is None:
            return info_nce(anchors, positives, labels, self.hparams.temperature, drop=drop), {}
        queue = self.queue
        queue.allocate(self.queue_capacity(anchors.size(0)), "model.init_args.queue_batches / queue_size")
        keys = queue.embeddings[:, : anchors.size(-1)]  # all of it unless Matryoshka truncates
        dtype = torch.promote_types(positives.dtype, keys.dtype)
        candidates = torch.cat([positives.to(dtype), keys.to(dtype)])
        if drop is None:
            drop = torch.zeros(anchors.size(0), positives.size(0), dtype=torch.bool, device=anchors.device)
        drop = torch.cat([drop, ~queue.valid()[None].expand(anchors.size(0), -1)], dim=1)  # the unfilled rows
        return info_nce(anchors, candidates, labels, self.hparams.temperature, drop=drop), {}

    def sentence_loss(self, embeddings: Tensor, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss (every truncation, with gradient caching too: computed once a step), then, in training,
        the momentum step: the queue the loss read is that of the steps before."""
        result = super().sentence_loss(embeddings, batch)
        if self.training and self.queue is not None:
            self.advance_momentum(batch)
        return result

    @torch.no_grad()
    def advance_momentum(self, batch: dict[str, Any]) -> None:
        """Move the momentum encoder toward the current weights, embed the batch's anchors with it (in
        `grad_cache_chunk` chunks when caching) through the trained MLP, and push the global batch's keys."""
        if self.momentum_encoder is None:
            raise RuntimeError(f"{type(self).__name__}: no weights yet; build it with build_method(cls, ...)")
        self.momentum_encoder.update_(self.encoder)
        features, combine = batch["features"], self.encoder.combine_keys
        local_batch = features["input_ids"].size(0) // batch["num_views"]
        anchors = rows_of(features, slice(0, local_batch), combine)
        chunk = self.hparams.grad_cache_chunk or local_batch
        keys = torch.cat([self.momentum_encoder(self.encoder, rows_of(anchors, span, combine))
                          for span in chunk_spans(local_batch, chunk)])
        keys = self.project(keys)
        # the global batch's keys in its examples' order, as one process pushes them: rank r holds every
        # world-size-th example from r (`data.loader.rank_rows`)
        size = world()[1]
        self.queue.push(keys if size == 1 else gather_strided_rows(keys, size * local_batch))
