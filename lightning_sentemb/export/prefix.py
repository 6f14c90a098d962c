"""sentence-transformers input module of a DCPCSE export: the frozen backbone, loaded from its name
or path, whose layers attend to the trained deep prefix.

An export folder holds only `prefix_config.json` (backbone reference + prefix shape), the prefix
weights and the pooling modules, never the backbone. Load it with
`SentenceTransformer(folder, trust_remote_code=True)` (see `st_module`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor
from transformers import AutoModel, AutoTokenizer

from ..encoders.lora import has_lora, save_backbone
from ..encoders.plain import LAYER_POOLERS
from ..encoders.prefix import PositionOffset, PrefixedBackbone
from ..encoders.pretrained import load_pretrained
from .plain import write_pooling_modules
from .st_module import SentEmbSTModule

if TYPE_CHECKING:
    from .protocol import ExportableMethod

__all__ = ["SAME_FOLDER", "PrefixedTransformer", "write_prefix_export"]

# `backbone` of an export that holds its backbone itself (DCPCSE with LoRA: merged, or a peft adapter)
SAME_FOLDER = "."


class PrefixedTransformer(SentEmbSTModule):
    """Tokenizer + `PrefixedBackbone`; outputs `token_embeddings` (and `all_layer_embeddings` when
    `output_hidden_states`) over the sentence tokens only, so the standard Pooling modules follow.

    Args:
        backbone: hub name, folder or `pkg:MODULE` of the frozen model the prefix was trained on;
            `SAME_FOLDER` in a saved config: the export folder itself.
        prefix_len, projection, projection_hidden_size, position_offset: as in `PrefixedBackbone`.
        max_seq_length: truncation in tokens, special tokens included.
        output_hidden_states: also return every layer (for WeightedLayerPooling).
        eval_precision: the method's, the autocast of the forward (`SentEmbSTModule`); its outputs are fp32,
            so the pooling modules after it run as they would without.
    """

    config_file_name = "prefix_config.json"
    weights_file_name = "prefix_encoder.safetensors"
    config_keys: ClassVar[list[str]] = [
        "backbone", "prefix_len", "projection", "projection_hidden_size", "position_offset", "max_seq_length",
        "output_hidden_states", "eval_precision",
    ]

    def __init__(
        self,
        backbone: str,
        prefix_len: int,
        max_seq_length: int,
        projection: bool = False,
        projection_hidden_size: int = 512,
        position_offset: PositionOffset = "shifted",
        output_hidden_states: bool = False,
        eval_precision: str = "auto",
    ) -> None:
        super().__init__()
        self.eval_precision = eval_precision
        self.backbone = backbone
        self.prefix_len = prefix_len
        self.max_seq_length = max_seq_length
        self.projection = projection
        self.projection_hidden_size = projection_hidden_size
        self.position_offset = position_offset
        self.output_hidden_states = output_hidden_states
        self.tokenizer = load_pretrained(AutoTokenizer, backbone)
        self.prefixed = PrefixedBackbone(
            load_pretrained(AutoModel, backbone), prefix_len, projection, projection_hidden_size,
            position_offset=position_offset,
        )
        self.prefixed.family.prepare_tokenizer(self.tokenizer)

    def preprocess(self, inputs: Sequence[str], prompt: str | None = None, **kwargs: Any) -> dict[str, Tensor]:
        texts = self._prepend_prompt(list(inputs), prompt) if prompt else list(inputs)
        return self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_seq_length, return_tensors="pt")

    def forward(self, features: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
        with self.autocast(features):
            outputs = self.prefixed(
                features["input_ids"], features["attention_mask"], output_hidden_states=self.output_hidden_states
            )
        features["token_embeddings"] = outputs.last_hidden_state.float()
        if self.output_hidden_states:
            features["all_layer_embeddings"] = tuple(states.float() for states in outputs.hidden_states)
        return features

    def get_embedding_dimension(self) -> int:
        return self.prefixed.backbone.config.hidden_size

    def own_weights(self) -> dict[str, Tensor]:
        """The trained prefix (the backbone is referenced by name, never copied)."""
        return prefix_weights(self.prefixed)

    def load_own_weights(self, weights: dict[str, Tensor]) -> None:
        self.prefixed.prefix_encoder.load_state_dict(weights)

    @classmethod
    def from_config(cls, config: dict[str, Any], folder: str) -> PrefixedTransformer:
        if config["backbone"] == SAME_FOLDER:
            config = {**config, "backbone": folder}
        return cls(**config)


def prefix_weights(prefixed: PrefixedBackbone) -> dict[str, Tensor]:
    """What `PrefixedTransformer` saves of a prefixed backbone."""
    return {name: tensor.detach().contiguous() for name, tensor in prefixed.prefix_encoder.state_dict().items()}


def write_prefix_export(method: ExportableMethod, folder: Path, adapter_only: bool = False) -> None:
    """DCPCSE's folder: `PrefixedTransformer` (prefix weights + backbone reference, no backbone weights),
    then the pooling stack. Load with `trust_remote_code=True`. With LoRA the backbone is in the folder
    (merged, or `adapter_only` as peft's adapter) and the reference is the folder itself."""
    hp = method.hparams
    reference = backbone_reference(hp.backbone)
    if adapter_only or has_lora(method.encoder.backbone):
        save_backbone(method.encoder.backbone, folder, adapter_only)
        method.tokenizer.save_pretrained(folder)
        reference = SAME_FOLDER
    config = {
        "backbone": reference,
        "prefix_len": hp.prefix_len,
        "projection": hp.prefix_projection,
        "projection_hidden_size": hp.prefix_hidden_size,
        "position_offset": hp.position_offset,
        "max_seq_length": method.eval_length,
        "output_hidden_states": hp.pooler in LAYER_POOLERS,
        "eval_precision": hp.eval_precision,
    }
    PrefixedTransformer.write_files(folder, config, prefix_weights(method.encoder.prefixed))
    write_pooling_modules(method, folder, [PrefixedTransformer.modules_entry()])


def backbone_reference(name: str) -> str:
    """A local folder as an absolute path (an export must not depend on the working directory);
    hub names and `pkg:` references as they are."""
    path = Path(name)
    return str(path.resolve()) if path.is_dir() else name
