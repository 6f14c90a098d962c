"""How a method embeds: `embed` (features to sentence vectors, the training MLP where it applies), and
for raw sentences `encode` (one process) and `encode_across_ranks` (every rank of the process group),
under the evaluation autocast. Every evaluator, export check and
callback goes through these; `SentEmbMethod` exposes them as its methods."""

from __future__ import annotations

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from ..console import progress_bar
from ..distributed import gather_strided_rows, world
from ..encoders.instruction import instructed_features
from ..encoders.memory import DTYPES
from ..errors import SentEmbUserError
from ..fsdp import grad_free
from ..precision import autocast_for


def embed(method: LightningModule, features: dict[str, Tensor]) -> Tensor:
    """Sentence vectors; the MLP applies in training, and at evaluation only with mlp='always'."""
    if method.encoder.weights_deferred:  # built with `cls(...)` alone: one line instead of a meta-device error
        raise RuntimeError(f"{type(method).__name__}: no weights yet; build it with build_method(cls, ...)")
    return method.project(method.encoder(features))


def project(method: LightningModule, pooled: Tensor) -> Tensor:
    """The MLP over pooled sentence vectors where it applies (see `embed`)."""
    mlp = method.mlp if method.training else method.eval_mlp
    return mlp(pooled) if mlp is not None else pooled


def features_from_ids(method: LightningModule, sentence_ids: list[list[int]]) -> dict[str, Tensor]:
    """Evaluation inputs (method's format, evaluation truncation) from token ids."""
    return method.encoder.format.build(sentence_ids, method.eval_length)


def sentence_features(method: LightningModule, sentences: list[str]) -> dict[str, Tensor]:
    """Model inputs for raw sentences at evaluation (the method's `features_from_ids`)."""
    return method.features_from_ids(method.encoder.format.sentence_ids(sentences))


def prompted_features(method: LightningModule, sentence_ids: list[list[int]],
                      prompt_ids: list[int]) -> dict[str, Tensor]:
    """Evaluation inputs of queries with a prompt (an instruction, formatted) before them, pooled as in
    training (`pool_instruction`, `encoders.instruction`); a method without instructions refuses it."""
    if "instruction" not in method.mixture_options or method.hparams.get("template") is not None:
        raise SentEmbUserError(f"a prompt (instruction) before the sentences: {type(method).__name__} "
                               f"{'with a template ' if method.hparams.get('template') else ''}takes none; "
                               "encode without prompts")
    return instructed_features(method.encoder.format, sentence_ids, [], prompt_ids, method.hparams.pool_instruction,
                               method.eval_length, option="eval_max_length")


def embed_features(method: LightningModule, features: dict[str, Tensor]) -> Tensor:
    """`embed` of evaluation inputs, moved to the method's device."""
    return method.embed({k: v.to(method.device, non_blocking=True) for k, v in features.items()})


def encode_batch(method: LightningModule, sentences: list[str]) -> Tensor:
    """Embeddings of one batch of raw sentences, as the module is (no mode switch, no autocast)."""
    return method.embed_features(method.sentence_features(sentences))


def eval_autocast(method: LightningModule) -> torch.autocast:
    """`eval_precision`'s autocast; with a bf16/fp16 backbone, autocast to its dtype (its fp32 heads
    need it)."""
    dtype = DTYPES[method.hparams.backbone_dtype]
    if dtype != torch.float32:
        return torch.autocast(method.device.type, dtype=dtype)
    return autocast_for(method.device, method.hparams.eval_precision)


def encode(
    method: LightningModule, sentences: list[str], batch_size: int | None = None, show_progress: bool | None = None,
    label: str = "encode", prompt: str | None = None,
) -> Tensor:
    """(n, hidden) float32 embeddings on CPU, in the input order; `label` names the progress bar
    (evaluators pass the task running); `prompt`: text written before every sentence, tokenized apart
    as training tokenizes an instruction (`prompted_features`), e.g. `Instruct: ...\nQuery: `.

    Tokenized once, sorted by length so each batch pads little; evaluation mode, no gradient (inference mode,
    or `no_grad` where FSDP2 shards the module: `fsdp.grad_free`), autocast per `eval_precision`. Every evaluator
    calls this.
    """
    with grad_free(method):
        return _encode(method, sentences, batch_size or method.hparams.eval_batch_size, show_progress, label, prompt)


def _encode(method: LightningModule, sentences: list[str], batch_size: int, show_progress: bool | None,
            label: str, prompt: str | None = None) -> Tensor:
    if not sentences:  # a rank's empty share in `encode_across_ranks`
        return torch.empty(0, method.output_size, dtype=torch.float32)
    was_training = method.training
    method.eval()
    sentence_ids = method.encoder.format.sentence_ids(sentences)
    prompt_ids = method.encoder.format.sentence_ids([prompt])[0] if prompt else None
    order = np.argsort([len(ids) for ids in sentence_ids], kind="stable")[::-1]
    show = len(sentences) > 10 * batch_size if show_progress is None else show_progress
    # rows in `order`, copied batch by batch without waiting for the device (pinned memory on a GPU)
    in_order = torch.empty(len(sentences), method.output_size, dtype=torch.float32,
                           pin_memory=method.device.type == "cuda")
    with method.eval_autocast():
        for start in progress_bar(range(0, len(sentences), batch_size), desc=label, disable=not show):
            rows = order[start : start + batch_size]
            batch_ids = [sentence_ids[i] for i in rows]
            features = (method.features_from_ids(batch_ids) if prompt_ids is None
                        else prompted_features(method, batch_ids, prompt_ids))
            in_order[start : start + len(rows)].copy_(method.embed_features(features).float(), non_blocking=True)
    if method.device.type == "cuda":
        torch.cuda.current_stream(method.device).synchronize()  # the one wait: every copy has landed
    method.train(was_training)
    out = torch.empty_like(in_order, pin_memory=False)
    out[torch.from_numpy(order.copy())] = in_order
    return out


def encode_across_ranks(
    method: LightningModule, sentences: list[str], batch_size: int | None = None, show_progress: bool | None = None,
    label: str = "encode",
) -> Tensor:
    """`encode` with the work shared by every rank of the process group: each encodes every
    world_size-th sentence and all get the whole (n, hidden) matrix, in the input order. Every rank
    must call it with the same sentences. One process: exactly `encode`."""
    rank, world_size = world()
    if world_size == 1:
        return method.encode(sentences, batch_size, show_progress, label)
    # equal shares (the short ones end with a repeat, dropped by the gather): every rank runs as many
    # forwards, each a collective under FSDP
    share = sentences[rank::world_size]
    share += sentences[: -(-len(sentences) // world_size) - len(share)]
    share = method.encode(share, batch_size, show_progress if rank == 0 else False, label)
    return gather_strided_rows(share.to(method.device), len(sentences)).cpu()
