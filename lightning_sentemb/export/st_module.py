"""One base for our modules inside a sentence-transformers folder (DCPCSE's prefix, the prompt
methods' template encoder): where their files live and how sentence-transformers loads them.

The module sits in the folder's root (`save_in_root`) as a config file (`config_keys`) and one
safetensors file of the weights that are ours (never a backbone's). sentence-transformers 6 imports
a module class outside its own namespace only with `trust_remote_code=True` (it then falls back to
a plain import, so `lightning_sentemb` must be installed): load with
`SentenceTransformer(OUT, trust_remote_code=True)`. modules.json names the class by its import
path, so a class that moves keeps an alias at its old path (old exports still load).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from safetensors.torch import load_file, save_file
from sentence_transformers.base.modules.input_module import InputModule
from torch import Tensor

from ..precision import autocast_for
from .plain import write_json

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["SentEmbSTModule"]


class SentEmbSTModule(InputModule):
    """Subclasses set `config_file_name`, `weights_file_name` and `config_keys`, and say how to build
    themselves from the saved config (`from_config`) and which weights are theirs (`own_weights`,
    `load_own_weights`)."""

    save_in_root = True
    weights_file_name: ClassVar[str]
    # the exported method's `eval_precision`, saved with the config: `forward`'s autocast (`autocast`), so the
    # export encodes as the method's `encode` does (`loading.load_embedder` sets the one asked for instead)
    eval_precision: str = "auto"

    def autocast(self, features: dict[str, Tensor]) -> torch.autocast:
        """`eval_precision`'s autocast on the inputs' device (`precision.autocast_for`, as `encode`'s)."""
        return autocast_for(features["input_ids"].device, self.eval_precision)

    @classmethod
    def from_config(cls, config: dict[str, Any], folder: str) -> Self:
        """The module from its saved config; `folder` is the local copy of the export."""
        raise NotImplementedError

    def own_weights(self) -> dict[str, Tensor]:
        """The tensors saved in `weights_file_name` (contiguous, detached)."""
        raise NotImplementedError

    def load_own_weights(self, weights: dict[str, Tensor]) -> None:
        raise NotImplementedError

    @classmethod
    def modules_entry(cls) -> dict[str, Any]:
        """This module as the first entry of modules.json."""
        return {"idx": 0, "name": "0", "path": "", "type": f"{cls.__module__}.{cls.__qualname__}"}

    @classmethod
    def write_files(cls, folder: Path, config: dict[str, Any], weights: dict[str, Tensor]) -> None:
        """The module's files from a config and its weights: what `save` writes, and what an export
        writes without building the module (DCPCSE would otherwise load its backbone again)."""
        if set(config) != set(cls.config_keys):
            raise ValueError(f"config keys {sorted(config)} differ from {sorted(cls.config_keys)}")
        write_json(folder / cls.config_file_name, config)
        if weights:
            save_file(weights, str(folder / cls.weights_file_name))

    def save(self, output_path: str, *args: Any, **kwargs: Any) -> None:
        self.write_files(Path(output_path), self.get_config_dict(), self.own_weights())

    @classmethod
    def load(
        cls,
        model_name_or_path: str,
        subfolder: str = "",
        token: bool | str | None = None,
        cache_folder: str | None = None,
        revision: str | None = None,
        local_files_only: bool = False,
        **kwargs: Any,
    ) -> Self:
        where = {"subfolder": subfolder, "token": token, "cache_folder": cache_folder, "revision": revision,
                 "local_files_only": local_files_only}
        config = cls.load_config(model_name_or_path, **where)
        module = cls.from_config(config, cls.load_dir_path(model_name_or_path, **where))
        if module.own_weights():
            weights = cls.load_file_path(model_name_or_path, cls.weights_file_name, **where)
            if weights is None:
                raise FileNotFoundError(f"{model_name_or_path}: {cls.weights_file_name} is missing")
            module.load_own_weights(load_file(weights))
        return module
