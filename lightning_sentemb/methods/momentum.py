"""Momentum contrast's state (He et al., 2020, MoCo; in sentence embeddings ESimCSE, Wu et al., 2022): a
momentum encoder, the exponential moving average of what trains in an encoder, and a queue of its past
embeddings as extra negatives. Both are method state: buffers, so checkpoints, resumes and device moves
carry them, and outside the encoder, so exports leave them out."""

from __future__ import annotations

import copy
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ..encoders.plain import Encoder
from ..errors import SentEmbUserError

MomentumInit = Literal["copy", "fresh"]


def buffer_name(parameter: str) -> str:
    """A parameter's name as one buffer name (buffer names hold no dots)."""
    return parameter.replace(".", "__")


class MomentumEncoder(nn.Module):
    """θm ← m·θm + (1 − m)·θ over the encoder's trainable tensors only, run through the encoder itself.

    The frozen weights (LoRA's base, a frozen backbone) are shared, not copied: `forward` calls the
    encoder with the averaged tensors in place of the trained ones (`torch.func.functional_call`), so
    under LoRA the momentum copy is the adapters' average alone; a full fine-tune averages, and so holds,
    the whole backbone. Built after the backbone's weights load (`configure_model`), from its current
    values: θm starts as θ (`start` "copy", MoCo's), or as a fresh initialization of the backbone's
    architecture (`start` "fresh", ESimCSE's reference: `BertForCL.__init__` copies the encoder before
    the pretrained weights load and `init_weights()` then re-initializes the copy, which loading leaves
    random since the checkpoint has no `momentum_model.*` keys).
    """

    def __init__(self, encoder: Encoder, momentum: float, start: MomentumInit = "copy") -> None:
        super().__init__()
        self.momentum = momentum
        self.names = [name for name, p in encoder.named_parameters() if p.requires_grad]
        if not self.names:
            raise SentEmbUserError("model.init_args.queue_batches: nothing in the encoder trains, so its momentum "
                                   "encoder would be the encoder itself; set queue_batches 0 or train the encoder")
        trained = dict(encoder.named_parameters())
        for name in self.names:
            self.register_buffer(buffer_name(name), trained[name].detach().clone())
        if start == "fresh":
            self.initialize_fresh(encoder)

    @torch.no_grad()
    def initialize_fresh(self, encoder: Encoder) -> None:
        """Each averaged tensor as the backbone's own `_init_weights` initializes its module (BERT's: normal
        weights of std `initializer_range`, zero biases, LayerNorm 1 and 0), from torch's global generator
        (seeded by `seed_everything`). A copy of each owning module is initialized, the encoder is untouched."""
        init_weights = encoder.backbone._init_weights
        for owner in dict.fromkeys(name.rpartition(".")[0] for name in self.names):
            fresh = copy.deepcopy(encoder.get_submodule(owner))
            for tensor in fresh.parameters(recurse=False):
                tensor.__dict__.pop("_is_hf_initialized", None)  # transformers skips the tensors it loaded
            init_weights(fresh)
            for local, tensor in fresh.named_parameters(recurse=False):
                name = f"{owner}.{local}" if owner else local
                if name in self.names:
                    getattr(self, buffer_name(name)).copy_(tensor)

    def averages(self) -> list[Tensor]:
        return [getattr(self, buffer_name(name)) for name in self.names]

    @torch.no_grad()
    def update_(self, encoder: Encoder) -> None:
        """One momentum step toward the encoder's current tensors (one fused kernel, no host read)."""
        trained = dict(encoder.named_parameters())
        torch._foreach_lerp_(self.averages(), [trained[name].detach() for name in self.names], 1.0 - self.momentum)

    @torch.no_grad()
    def forward(self, encoder: Encoder, features: dict[str, Tensor]) -> Tensor:
        """The encoder's pooled rows with the averaged tensors, dropout off (evaluation mode, as the paper and
        the reference run it), the encoder's mode restored afterwards."""
        was_training = encoder.training
        encoder.eval()
        try:
            return functional_call(encoder, dict(zip(self.names, self.averages(), strict=True)), (features,))
        finally:
            encoder.train(was_training)


class EmbeddingQueue(nn.Module):
    """The last `capacity` embeddings pushed, oldest first, and how many of its rows are filled (the queue
    starts empty and fills as the reference's does; `valid` marks the filled rows on the device, so the
    loss masks the rest without a host read). Its capacity is set at the first training step
    (`allocate`); a checkpoint brings its own (`_load_from_state_dict`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("embeddings", torch.zeros(0, dim))
        self.register_buffer("filled", torch.zeros((), dtype=torch.long))

    @property
    def capacity(self) -> int:
        return self.embeddings.size(0)

    def allocate(self, capacity: int, option: str) -> None:
        """Empty rows for `capacity` embeddings; a queue that already has another capacity (a resumed run
        whose batch changed) is one line naming `option`."""
        if capacity == self.capacity:
            return
        if self.capacity:
            raise SentEmbUserError(f"{option}: the checkpoint's queue holds {self.capacity} embeddings, this run's "
                                   f"would hold {capacity} (another batch size or world size?); resume with the "
                                   "settings it was trained with")
        self.embeddings = self.embeddings.new_zeros(capacity, self.embeddings.size(1))

    def valid(self) -> Tensor:
        """(capacity,) bool: the filled rows (the last `filled` ones)."""
        return torch.arange(self.capacity, device=self.filled.device) >= self.capacity - self.filled

    @torch.no_grad()
    def push(self, keys: Tensor) -> None:
        """Append `keys` (in fp32) and keep the newest `capacity` rows. The queue is a new tensor: a loss
        that read the previous one keeps it."""
        keys = keys.detach().to(self.embeddings.dtype)[-self.capacity :]
        self.embeddings = torch.cat([self.embeddings, keys])[-self.capacity :]
        self.filled = (self.filled + keys.size(0)).clamp(max=self.capacity)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        saved = state_dict.get(prefix + "embeddings")
        if saved is not None and saved.shape != self.embeddings.shape:
            self.embeddings = self.embeddings.new_zeros(saved.shape)
        super()._load_from_state_dict(state_dict, prefix, *args)
