"""Checkpoint → one folder that is both a Hugging Face model and a sentence-transformers model.

`AutoModel.from_pretrained(OUT)` loads the backbone; `SentenceTransformer(OUT)` loads the backbone
plus the method's evaluation-time pooling (modules.json), so both reproduce `method.encode`.
A Linear+Tanh MLP kept at evaluation (mlp='always') is written into the backbone's pooler, so
`--pooler cls` on the exported folder (SimCSE's convention) and the sentence-transformers Dense
module both apply it.

A method names its writer by `export_format` (`protocol.ExportableMethod`; exports never import the
methods): plain poolers with sentence-transformers' own modules (`plain`); methods whose embedding
needs our code with one of our sentence-transformers modules (`SentEmbSTModule` in `st_module`:
`template` for PromptBERT/ConPVP, `prefix` for DCPCSE), loaded with `trust_remote_code=True`. A
method of the user's own may write its folder itself (`write_export(folder, adapter_only)`). Every export
carries a `README.md` model card (`model_card`). A model trained with `matryoshka_dims` records them in
`config_sentence_transformers.json` (`matryoshka_dims`, beside sentence-transformers' own
`similarity_fn_name`); `SentenceTransformer(folder, truncate_dim=d)` serves a truncation. A model trained
with instructions carries them there as its `prompts`, and its mean Pooling leaves the prompt out
(`include_prompt: false`) unless it pooled it (`pool_instruction`), so `encode(q, prompt_name=...)`
embeds a query as training did.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic_io import atomic_directory
from ..errors import SentEmbUserError
from .model_card import RunFacts, is_ours, model_card
from .plain import write_json, write_plain_export, write_pooling_modules

if TYPE_CHECKING:
    from ..evaluation.whitening import Whitening
    from .protocol import ExportableMethod

__all__ = ["ExportFolderNotEmptyError", "check_export_folder", "export", "write_method_folder", "write_plain_export",
           "write_pooling_modules"]


class ExportFolderNotEmptyError(SentEmbUserError, FileExistsError):
    """Never export over another model's files: a mixed folder would load as neither."""


def check_export_folder(out_dir: str | os.PathLike) -> Path:
    """`out_dir` as a Path when an export may go there (absent or empty); `sentemb export` asks
    before loading the checkpoint."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportFolderNotEmptyError(f"export folder {out_dir} is a file; choose a new folder name "
                                        "(the file is kept)")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise ExportFolderNotEmptyError(f"export folder {out_dir} exists and is not empty; "
                                        "choose a new folder or remove it")
    return out_dir


def export(
    method: ExportableMethod,
    out_dir: str | os.PathLike,
    facts: RunFacts | None = None,
    results: dict[str, Any] | None = None,
    adapter_only: bool = False,
    whitening: tuple[str, Whitening] | None = None,
) -> Path:
    """Write the export, with its model card (`model_card`: `facts` of the checkpoint's run and
    `sentemb evaluate` `results` add their scores), into a staging folder beside `out_dir` and
    rename it into place only when complete (a kill leaves no `out_dir`, never a half-written one);
    folder and files get the permissions `cp` would give them under the umask. LoRA adapters are
    merged into the backbone, or with `adapter_only` written as peft's adapter folder (the base model
    named, not copied). `whitening` (its source, its fit) appends BERT-whitening after the pooling
    (`export.whitening`)."""
    out_dir = check_export_folder(out_dir)
    check_exportable(type(method))
    with atomic_directory(out_dir) as staging:
        write = getattr(method, "write_export", None)  # a user's method that writes its own folder
        if write is not None:
            write(staging, adapter_only)
        else:
            write_method_folder(method, staging, adapter_only)
        st_config = sentence_transformers_config(method)
        if st_config:
            write_json(staging / "config_sentence_transformers.json", {"similarity_fn_name": "cosine", **st_config})
        card = model_card(method, staging, out_dir.name, facts, results)
        if whitening is not None:
            from .whitening import append_whitening, whitening_card

            append_whitening(staging, whitening[1])
            card += whitening_card(*whitening)
        (staging / "README.md").write_text(card)
    return out_dir


def sentence_transformers_config(method: ExportableMethod) -> dict[str, Any]:
    """What the export's `config_sentence_transformers.json` records of the method: its Matryoshka sizes,
    and its prompts (`prompts`: name → the text before a query, the instructions it trained with), with
    no default prompt (`default_prompt_name` null: documents are encoded without one, as in training)."""
    config: dict[str, Any] = {}
    if method.hparams.get("matryoshka_dims"):
        config["matryoshka_dims"] = list(method.hparams.matryoshka_dims)
    if method.hparams.get("prompts"):
        config.update(prompts=dict(method.hparams.prompts), default_prompt_name=None)
    return config


def write_method_folder(method: ExportableMethod, folder: Path, adapter_only: bool = False) -> None:
    """The folder of the method's `export_format` (the template and prefix writers import
    sentence-transformers, so they load only when used)."""
    if method.export_format == "template":
        from .template import write_template_export as write
    elif method.export_format == "prefix":
        from .prefix import write_prefix_export as write
    elif method.export_format == "flow":
        from .flow import write_flow_export as write
    elif method.export_format == "plain":
        write = write_plain_export
    else:
        raise ValueError(f"{type(method).__name__}.export_format {method.export_format!r}: not plain, template, prefix "
                         "or flow")
    write(method, folder, adapter_only)


# What decides a method's embedding at inference: an export written for another class reproduces a
# subclass's `encode` only when the subclass changes none of them.
EMBEDDING_HOOKS = ("build_encoder", "embed", "project", "encode", "encode_batch", "embed_features",
                   "sentence_features", "features_from_ids", "eval_mlp", "output_size")


def check_exportable(cls: type) -> None:
    """A method defined outside the package that changes how sentences are embedded (one of
    `EMBEDDING_HOOKS`) below the class whose `export_format` it inherits would be exported as that
    class's embedding: refused in one line (its own `write_export`, even one calling
    `write_method_folder`, or its own `export_format`, vouches for the folder). A method that changes
    only its training (`collate`, `embedding_loss`) exports as its base does, with
    sentence-transformers' and lightning_sentemb's modules only (its own module is not needed)."""
    writer = _defining_class(cls, "write_export") or _defining_class(cls, "export_format")
    below = [c for c in cls.__mro__[: cls.__mro__.index(writer)] if not is_ours(c)]  # ours: export tested
    changed = [hook for hook in EMBEDDING_HOOKS if _defining_class(cls, hook) in below]
    if changed:
        raise SentEmbUserError(
            f"cannot export {cls.__qualname__}: it overrides {', '.join(changed)} (its embedding) and inherits "
            f"its export from {writer.__name__}, which writes the embedding of lightning_sentemb's own methods; "
            "override write_export(folder, adapter_only) so that the folder reproduces its encode (docs/extending.md)"
        )


def _defining_class(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)
