"""Export of BERT-flow (`methods.flow.BERTFlow`): the plain export (backbone, pooling) with the flow
after the pooling as `FlowHead`, our sentence-transformers module: `SentenceTransformer(OUT,
trust_remote_code=True)` serves the flow's latent, as `method.encode` does."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from sentence_transformers.base.modules.module import Module
from torch import Tensor

from ..encoders.glow import Coupling, Glow, Mixing
from .plain import append_module, write_plain_export

if TYPE_CHECKING:
    from typing_extensions import Self

    from .protocol import ExportableMethod


class FlowHead(Module):
    """A Glow (`encoders.glow`) over `sentence_embedding`, in fp32: the latent replaces it."""

    config_keys = ["dim", "levels", "depth", "coupling_width", "coupling", "mixing"]

    def __init__(self, dim: int, levels: int = 3, depth: int = 3, coupling_width: int = 32,
                 coupling: Coupling = "additive", mixing: Mixing = "reverse") -> None:
        super().__init__()
        self.dim, self.levels, self.depth, self.coupling_width = dim, levels, depth, coupling_width
        self.coupling, self.mixing = coupling, mixing
        self.glow = Glow(dim, levels, depth, coupling_width, coupling, mixing)

    def forward(self, features: dict[str, Tensor], **kwargs: Any) -> dict[str, Tensor]:
        pooled = features["sentence_embedding"]
        with torch.autocast(pooled.device.type, enabled=False):
            features["sentence_embedding"] = self.glow(pooled.float())[0]
        return features

    def get_embedding_dimension(self) -> int:
        return self.dim

    def save(self, output_path: str, *args: Any, safe_serialization: bool = True, **kwargs: Any) -> None:
        self.save_config(output_path)
        self.save_torch_weights(output_path, safe_serialization=safe_serialization)

    @classmethod
    def load(cls, model_name_or_path: str, subfolder: str = "", token: bool | str | None = None,
             cache_folder: str | None = None, revision: str | None = None, local_files_only: bool = False,
             **kwargs: Any) -> Self:
        where = {"subfolder": subfolder, "token": token, "cache_folder": cache_folder, "revision": revision,
                 "local_files_only": local_files_only}
        module = cls(**cls.load_config(model_name_or_path, **where))
        cls.load_torch_weights(model_name_or_path, **where, model=module)
        return module


def write_flow_export(method: ExportableMethod, folder: Path, adapter_only: bool = False) -> None:
    """The plain export, then the method's flow (`method.flow`) after its pooling."""
    write_plain_export(method, folder, adapter_only)
    hp = method.hparams
    head = FlowHead(method.output_size, hp.flow_levels, hp.flow_depth, hp.flow_coupling_width, hp.flow_coupling,
                    hp.flow_mixing)
    head.glow.load_state_dict(method.flow.state_dict())
    append_module(folder, "FlowHead", head)
