"""Export of template methods (PromptBERT, ConPVP, SNCSE, SCPCSE) as one sentence-transformers module.

The folder holds the backbone (so `AutoModel.from_pretrained(OUT)` loads it — the template, prompt
vectors and denoising are then up to the caller) and `TemplateSentenceEncoder`, a sentence-transformers
input module that wraps the sentence in the evaluation template, runs the backbone with the prompt
vectors, takes the [MASK] state, denoises it when the method tests denoised, and applies the MLP when
the method keeps it at evaluation (mlp='always'). It reproduces `method.encode`. Load with
`SentenceTransformer(OUT, trust_remote_code=True)` (see `st_module`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor, nn

from ..encoders.lora import is_adapter_folder, save_backbone
from ..encoders.template import TemplateEncoder
from .plain import write_json
from .st_module import SentEmbSTModule

if TYPE_CHECKING:
    from .protocol import ExportableMethod


class TemplateSentenceEncoder(SentEmbSTModule):
    """Template + backbone + [MASK] pooling (+ denoising, + MLP) as a sentence-transformers module.

    Saved in the model's root: the backbone (LoRA adapters merged, or with `adapter_only` peft's adapter
    folder) and tokenizer files, `sentemb_template_config.json` and `sentemb_template.safetensors` (prompt
    vectors and MLP, when there are any).
    """

    config_file_name = "sentemb_template_config.json"
    weights_file_name = "sentemb_template.safetensors"
    config_keys: ClassVar[list[str]] = ["template", "denoise", "max_seq_length", "mlp", "eval_precision", "continuous"]

    def __init__(
        self, encoder: TemplateEncoder, denoise: bool, max_seq_length: int, mlp: nn.Module | None = None,
        adapter_only: bool = False, eval_precision: str = "auto",
    ) -> None:
        super().__init__()
        self.adapter_only = adapter_only
        self.eval_precision = eval_precision
        self.encoder = encoder
        self.tokenizer = encoder.tokenizer
        self.template = encoder.format.templates[0].text
        self.continuous = encoder.format.continuous  # SCPCSE: the template's tokens are prompt vectors
        self.denoise = denoise
        self.max_seq_length = max_seq_length
        self.mlp_layer = mlp

    @property
    def mlp(self) -> bool:
        return self.mlp_layer is not None

    def preprocess(self, inputs: list[str], prompt: str | None = None, **kwargs: Any) -> dict[str, Tensor]:
        if prompt:
            inputs = self._prepend_prompt(inputs, prompt)
        fmt = self.encoder.format
        return fmt.build(fmt.sentence_ids(inputs), self.max_seq_length, denoise=self.denoise)

    def forward(self, features: dict[str, Tensor], **kwargs: Any) -> dict[str, Tensor]:
        with self.autocast(features):
            embeddings = self.encoder(features)
            embeddings = self.mlp_layer(embeddings) if self.mlp_layer is not None else embeddings
        features["sentence_embedding"] = embeddings.float()
        return features

    def get_sentence_embedding_dimension(self) -> int:
        return self.encoder.hidden_size

    def own_weights(self) -> dict[str, Tensor]:
        """Parameters outside the backbone: prompt vectors and MLP."""
        return {
            k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("encoder.backbone.")
        }

    def load_own_weights(self, weights: dict[str, Tensor]) -> None:
        # strict load: the backbone's own (already loaded) entries plus the saved extras
        self.load_state_dict({**self.state_dict(), **weights})

    def save(self, output_path: str, *args: Any, **kwargs: Any) -> None:
        save_backbone(self.encoder.backbone, output_path, self.adapter_only)
        self.tokenizer.save_pretrained(output_path)
        super().save(output_path)

    @classmethod
    def from_config(cls, config: dict[str, Any], folder: str) -> TemplateSentenceEncoder:
        encoder = TemplateEncoder(folder, [config["template"]], continuous=config.get("continuous", False))
        mlp = nn.Sequential(nn.Linear(encoder.hidden_size, encoder.hidden_size), nn.Tanh()) if config["mlp"] else None
        return cls(encoder, config["denoise"], config["max_seq_length"], mlp, adapter_only=is_adapter_folder(folder),
                   eval_precision=config.get("eval_precision", "auto"))  # exports before it was saved: the default


def write_template_export(method: ExportableMethod, folder: Path, adapter_only: bool = False) -> None:
    """The method's evaluation-time embedding (template 0, `denoise_test`, MLP if mlp='always')."""
    module = TemplateSentenceEncoder(method.encoder, method.hparams.denoise_test, method.eval_length, method.eval_mlp,
                                     adapter_only, method.hparams.eval_precision)
    module.save(str(folder))
    write_json(folder / "modules.json", [TemplateSentenceEncoder.modules_entry()])
