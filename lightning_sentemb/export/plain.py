"""The export of methods whose embedding is the backbone plus a standard pooling: the backbone folder
and sentence-transformers' own Pooling (WeightedLayerPooling, Dense) modules after it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from ..encoders.lora import save_backbone
from ..encoders.plain import FIRST_STATE
from ..errors import SentEmbUserError

if TYPE_CHECKING:
    from .protocol import ExportableMethod

ST_POOLING = {"cls": "cls", "cls_before_pooler": "cls", "last": "lasttoken", "avg": "mean", "avg_first_last": "mean",
              "avg_emb_last": "mean", "avg_top2": "mean"}


def write_json(path: Path, content: dict | list) -> None:
    """One JSON file of the export (the whole folder is staged and renamed, so no atomic write here)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=2) + "\n")


def _layer_weights(method: ExportableMethod) -> tuple[int, list[float]] | None:
    """(first layer, weights) for sentence-transformers' WeightedLayerPooling, or None."""
    if method.encoder.pooler not in FIRST_STATE:
        return None
    layers = method.encoder.backbone.config.num_hidden_layers  # hidden_states has layers + 1 entries
    first = FIRST_STATE[method.encoder.pooler] % (layers + 1)
    return first, [1.0] + [0.0] * (layers - first - 1) + [1.0]


def write_plain_export(method: ExportableMethod, folder: Path, adapter_only: bool = False) -> None:
    """Backbone (LoRA adapters merged, or with `adapter_only` peft's adapter folder), tokenizer and the
    sentence-transformers pooling stack for plain poolers. An adapter folder keeps the base model's
    config, so the per-layer states that WeightedLayerPooling reads are asked for in
    sentence_bert_config.json, and its backbone pooler is the base's (the Dense module applies the MLP)."""
    backbone = method.encoder.backbone
    if method.eval_mlp is not None and getattr(backbone, "pooler", None) is not None:
        backbone.pooler.dense.load_state_dict(method.eval_mlp[0].state_dict())
    output_hidden_states = _layer_weights(method) is not None
    backbone.config.output_hidden_states = output_hidden_states
    save_backbone(backbone, folder, adapter_only)
    method.tokenizer.save_pretrained(folder)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    st_config = {"max_seq_length": method.encoder.max_length, "do_lower_case": False}
    if adapter_only and output_hidden_states:
        st_config["config_kwargs"] = {"output_hidden_states": True}
    write_json(folder / "sentence_bert_config.json", st_config)
    write_pooling_modules(method, folder, modules)


def write_pooling_modules(method: ExportableMethod, folder: Path, modules: list[dict]) -> None:
    """Append the sentence-transformers modules of the method's pooler (WeightedLayerPooling, Pooling,
    and the evaluation-time MLP as Dense) after the token-embedding module(s) in `modules`, then write
    modules.json. Shared by every export whose first module yields sentence-only token embeddings."""
    pooler = method.encoder.pooler  # a method may pool otherwise at test (ConSERT: test_pooler)
    if pooler not in ST_POOLING:
        raise SentEmbUserError(f"{type(method).__name__} with pooler {pooler!r} has no sentence-transformers "
                               "export yet")
    hidden = method.encoder.hidden_size
    layer_weights = _layer_weights(method)
    if layer_weights is not None:
        start, weights = layer_weights
        path = f"{len(modules)}_WeightedLayerPooling"
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": path,
                        "type": "sentence_transformers.models.WeightedLayerPooling"})
        write_json(folder / path / "config.json", {"word_embedding_dimension": hidden, "layer_start": start,
                                                   "num_hidden_layers": start + len(weights) - 1})
        save_file({"layer_weights": torch.tensor(weights)}, str(folder / path / "model.safetensors"))
    path = f"{len(modules)}_Pooling"
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": path,
                    "type": "sentence_transformers.models.Pooling"})
    pooling = {"word_embedding_dimension": hidden, "pooling_mode": ST_POOLING[pooler]}
    if ST_POOLING[pooler] == "mean" and method.hparams.get("prompts") and not method.hparams.get("pool_instruction"):
        pooling["include_prompt"] = False  # the instruction out of the mean, as trained (`encoders.instruction`)
    write_json(folder / path / "config.json", pooling)
    if method.eval_mlp is not None:
        path = f"{len(modules)}_Dense"
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": path,
                        "type": "sentence_transformers.models.Dense"})
        write_json(folder / path / "config.json", {"in_features": hidden, "out_features": hidden, "bias": True,
                                                    "activation_function": "torch.nn.modules.activation.Tanh"})
        linear = method.eval_mlp[0]
        save_file({"linear.weight": linear.weight.detach().contiguous(),
                   "linear.bias": linear.bias.detach().contiguous()}, str(folder / path / "model.safetensors"))
    write_json(folder / "modules.json", modules)


def append_module(folder: Path, kind: str, module: torch.nn.Module) -> None:
    """Save a sentence-transformers `module` in `folder/<index>_<kind>` and append it to modules.json,
    after the pooling (a whitening, BERT-flow's flow)."""
    modules = json.loads((folder / "modules.json").read_text())
    path = f"{len(modules)}_{kind}"
    (folder / path).mkdir()
    module.save(str(folder / path))
    modules.append({"idx": len(modules), "name": str(len(modules)), "path": path, "type": module_path(type(module))})
    write_json(folder / "modules.json", modules)


def module_path(cls: type) -> str:
    """The import path modules.json names `cls` by: sentence-transformers' own modules by their public
    `sentence_transformers.models.<Name>`, which every sentence-transformers since 2 imports (their defining
    module, e.g. `sentence_transformers.base.modules.dense`, is sentence-transformers 6's layout); ours by
    their own."""
    if cls.__module__.split(".")[0] == "sentence_transformers":
        from sentence_transformers import models

        if getattr(models, cls.__name__, None) is not cls:
            raise ValueError(f"{cls.__qualname__} is not in sentence_transformers.models: no public path to write")
        return f"sentence_transformers.models.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"

