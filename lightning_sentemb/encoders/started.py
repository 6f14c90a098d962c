"""A module started once from data (a flow's actnorms, K-means centroids), whose `initialized` flag the
training step branches on without reading the device."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["StartedOnce"]


class StartedOnce(nn.Module):
    """`initialized`, a buffer (checkpoints carry it; `.to` moves it), and `is_initialized`, its host copy:
    set by `mark_initialized` and read back once on every `load_state_dict` (of this module or any module
    holding it), so a step reads no device value to know whether the start ran."""

    initialized: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("initialized", torch.tensor(False))
        self._initialized = False
        self.register_load_state_dict_post_hook(StartedOnce._read_host_view)

    @staticmethod
    def _read_host_view(module: StartedOnce, incompatible_keys: Any) -> None:
        module._initialized = bool(module.initialized)  # one host read per checkpoint load

    @property
    def is_initialized(self) -> bool:
        """Whether the start ran (the host's copy: no device sync)."""
        return self._initialized

    def mark_initialized(self) -> None:
        """The start ran: the buffer and its host copy."""
        self.initialized.fill_(True)
        self._initialized = True
