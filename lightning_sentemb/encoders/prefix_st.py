"""sentence-transformers input module of a DCPCSE export: the frozen backbone, loaded from its name
or path, whose layers attend to the trained deep prefix.

An export folder holds only `prefix_config.json` (backbone reference + prefix shape), the prefix
weights and the pooling modules, never the backbone. Load it with
`SentenceTransformer(folder, trust_remote_code=True)`: since sentence-transformers 6.0 a module
class outside its own namespace is imported only with that flag, local folders included, and
`lightning_sentemb` must be installed (the class is imported from it, not from the folder).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from safetensors.torch import load_file, save_file
from sentence_transformers.base.modules.input_module import InputModule
from torch import Tensor
from transformers import AutoModel, AutoTokenizer

from .plain import resolve_model_path
from .prefix import PositionOffset, PrefixedBackbone, PrefixEncoder

__all__ = ["PrefixedTransformer"]


class PrefixedTransformer(InputModule):
    """Tokenizer + `PrefixedBackbone`; outputs `token_embeddings` (and `all_layer_embeddings` when
    `output_hidden_states`) over the sentence tokens only, so the standard Pooling modules follow.

    Args:
        backbone: hub name, folder or `pkg:MODULE` of the frozen model the prefix was trained on.
        prefix_len, projection, projection_hidden_size, position_offset: as in `PrefixedBackbone`.
        max_seq_length: truncation in tokens, special tokens included.
        output_hidden_states: also return every layer (for WeightedLayerPooling).
    """

    config_file_name = "prefix_config.json"
    weights_file_name = "prefix_encoder.safetensors"
    config_keys: ClassVar[list[str]] = [
        "backbone", "prefix_len", "projection", "projection_hidden_size", "position_offset", "max_seq_length",
        "output_hidden_states",
    ]
    save_in_root = True

    def __init__(
        self,
        backbone: str,
        prefix_len: int,
        max_seq_length: int,
        projection: bool = False,
        projection_hidden_size: int = 512,
        position_offset: PositionOffset = "shifted",
        output_hidden_states: bool = False,
    ) -> None:
        super().__init__()
        path = resolve_model_path(backbone)
        self.backbone = backbone
        self.prefix_len = prefix_len
        self.max_seq_length = max_seq_length
        self.projection = projection
        self.projection_hidden_size = projection_hidden_size
        self.position_offset = position_offset
        self.output_hidden_states = output_hidden_states
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.prefixed = PrefixedBackbone(
            AutoModel.from_pretrained(path), prefix_len, projection, projection_hidden_size,
            position_offset=position_offset,
        )

    def preprocess(self, inputs: Sequence[str], prompt: str | None = None, **kwargs: Any) -> dict[str, Tensor]:
        texts = self._prepend_prompt(list(inputs), prompt) if prompt else list(inputs)
        return self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_seq_length, return_tensors="pt")

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        outputs = self.prefixed(
            features["input_ids"], features["attention_mask"], output_hidden_states=self.output_hidden_states
        )
        features["token_embeddings"] = outputs.last_hidden_state
        if self.output_hidden_states:
            features["all_layer_embeddings"] = outputs.hidden_states
        return features

    def get_embedding_dimension(self) -> int:
        return self.prefixed.backbone.config.hidden_size

    @classmethod
    def write(cls, folder: Path, config: dict[str, Any], prefix_encoder: PrefixEncoder) -> None:
        """The module's files, from a config (`config_keys`) and a trained prefix."""
        if set(config) != set(cls.config_keys):
            raise ValueError(f"config keys {sorted(config)} differ from {sorted(cls.config_keys)}")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / cls.config_file_name).write_text(json.dumps(config, indent=2) + "\n")
        weights = {name: tensor.detach().contiguous() for name, tensor in prefix_encoder.state_dict().items()}
        save_file(weights, str(folder / cls.weights_file_name))

    def save(self, output_path: str, *args: Any, **kwargs: Any) -> None:
        self.write(Path(output_path), self.get_config_dict(), self.prefixed.prefix_encoder)

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
    ) -> PrefixedTransformer:
        where = {"subfolder": subfolder, "token": token, "cache_folder": cache_folder, "revision": revision,
                 "local_files_only": local_files_only}
        module = cls(**cls.load_config(model_name_or_path, **where))
        weights = cls.load_file_path(model_name_or_path, cls.weights_file_name, **where)
        if weights is None:
            raise FileNotFoundError(f"{model_name_or_path}: {cls.weights_file_name} is missing")
        module.prefixed.prefix_encoder.load_state_dict(load_file(weights))
        return module
