"""Gradient caching (Gao et al., 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup"): the exact gradient of an in-batch contrastive loss over a global batch with the
activation memory of one chunk of rows: `grad_cache_backward` (a method's `grad_cache_backward`),
with its two pieces, the rows of a chunk and the random state that replays its dropout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from .encoders.plain import Encoder
from .losses.mlm import token_prediction_loss


class CachedMethod(Protocol):
    """What gradient caching reads of a method (`methods.SentEmbMethod` provides it): a protocol, as the
    methods import this module."""

    encoder: Encoder
    hparams: Any
    device: torch.device
    global_step: int

    def sentence_loss(self, embeddings: Tensor, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]: ...

    def project(self, embeddings: Tensor) -> Tensor: ...

    def mlm_weight_at(self, step: int) -> float: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


def chunk_spans(num_rows: int, chunk: int) -> list[slice]:
    """Consecutive row ranges of at most `chunk` rows covering `num_rows`."""
    return [slice(start, min(start + chunk, num_rows)) for start in range(0, num_rows, chunk)]


def rows_of(features: dict[str, Tensor], span: slice, batch_keys: tuple[str, ...]) -> dict[str, Tensor]:
    """The features of the rows in `span`; keys in `batch_keys` describe the whole batch and are left out."""
    return {key: value[span] for key, value in features.items() if key not in batch_keys}


@dataclass(frozen=True)
class RngState:
    """The CPU generator's state and, on a GPU, that device's: what dropout draws from."""

    cpu: Tensor
    cuda: Tensor | None
    device: torch.device

    @classmethod
    def capture(cls, device: torch.device) -> RngState:
        cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), cuda, device)

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Draw from this state inside the block; the generators continue afterwards as if the
        block had not run (the second forward must not shift later random draws)."""
        devices = [self.device] if self.cuda is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def grad_cache_backward(
    method: CachedMethod,
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
    encoder, features, chunk = method.encoder, batch["features"], method.hparams.grad_cache_chunk
    spans = chunk_spans(features["input_ids"].size(0), chunk)
    rng_states, rows = [], []
    with torch.no_grad():
        for span in spans:
            rng_states.append(RngState.capture(method.device))
            rows.append(encoder(rows_of(features, span, encoder.combine_keys)))
    cached = torch.cat(rows)
    cached = cached.to(torch.promote_types(cached.dtype, torch.float32)).requires_grad_()
    loss, logs = method.sentence_loss(method.project(encoder.combine_rows(cached, features)), batch)
    (row_grads,) = torch.autograd.grad(loss, cached, retain_graph=True)
    with no_sync():
        for span, rng_state in zip(spans, rng_states, strict=True):
            with rng_state.replay():
                rows_with_graph = encoder(rows_of(features, span, encoder.combine_keys))
            backward((rows_with_graph.to(row_grads.dtype) * row_grads[span]).sum())
        if "mlm" in batch:
            mlm, weight = batch["mlm"], method.mlm_weight_at(method.global_step)
            logs["mlm_loss"] = loss.new_zeros(())
            for span in chunk_spans(mlm["input_ids"].size(0), chunk):
                rows_in_span = rows_of(mlm, span, ())
                part = token_prediction_loss(encoder, rows_in_span, rows_in_span["predicted"], "sum")
                part = part / mlm["predicted"].count
                backward(weight * part)
                logs["mlm_loss"] += part.detach()
            loss = loss + weight * logs["mlm_loss"]
    trainable = [p for p in method.parameters() if p.requires_grad]
    backward(loss + sum(p.sum() * 0 for p in trainable))
    return loss.detach(), logs
