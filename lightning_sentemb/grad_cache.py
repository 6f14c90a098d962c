"""Gradient caching (Gao et al., 2021, "Scaling Deep Contrastive Learning Batch Size under Memory
Limited Setup"): the exact gradient of an in-batch contrastive loss over a global batch with the
activation memory of one chunk of rows. `SentEmbMethod.grad_cache_backward` runs the algorithm;
here are its two pieces: the rows of a chunk and the random state that replays its dropout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor


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
