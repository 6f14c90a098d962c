"""MTEB (the `mteb` package, 2.x) on any of our models, encoding exactly as `SentEmbMethod.encode` does.

`MTEBModel` is an `mteb` encoder (its `AbsEncoder`: `encode(DataLoader, task_metadata=..., ...)` and
`mteb_model_meta`) around one `Embedder` (`loading.load_embedder`): the method's template and
[MASK] or last-token pooling, denoising, prefix and, with `dim`, its Matryoshka truncation.

Prompts (instruction models, docs/mixtures.md): the text before a query comes, first, from `prompts`,
keyed as mteb keys a model's prompts (task name, task type, `query` / `document`, `{task}-query`): the
model's own (a checkpoint's `prompts`, an export's `config_sentence_transformers.json`; keys mteb does
not know, such as a training dataset's name, are left out) updated by `sentemb evaluate --mteb-prompts
FILE`; else, with `instruction_format`, the task's own instruction in mteb's metadata written in that
format (E5's), before queries and the texts of symmetric tasks (no prompt type), never documents;
else nothing, as before. The instruction is pooled as the model trained (`pool_instruction`).

    from lightning_sentemb.evaluation.mteb import MTEBModel
    mteb.evaluate(MTEBModel.load("out/promptbert/checkpoints/best.ckpt"), mteb.get_tasks(tasks=["STS12"]))
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import mteb
import numpy as np
import torch
from mteb.abstasks import AbsTask
from mteb.models import ModelMeta
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ScoringFunction
from mteb.types import PromptType

from ..data.instructions import instruction_prefix
from ..errors import SentEmbUserError
from ..loading import Embedder, load_embedder
from ..matryoshka import check_dims, truncated


class MTEBModel(AbsEncoder):
    """An `mteb.evaluate`-able encoder over `embedder`; cosine similarity, as every evaluator of ours."""

    def __init__(self, embedder: Embedder, name: str = "model", prompts: dict[str, str] | None = None,
                 instruction_format: str | None = None) -> None:
        self.embedder = embedder
        self.name = name
        self.model_prompts = {**mteb_keyed(embedder.prompts), **(prompts or {})}
        self.instruction_format = instruction_format
        self.mteb_model_meta = ModelMeta.create_empty(overwrites={
            "name": name if "/" in name else f"lightning_sentemb/{name}", "revision": "local",
            "embed_dim": embedder.size, "similarity_fn_name": ScoringFunction.COSINE,
            "modalities": ["text"], "framework": ["PyTorch"],
        })

    @classmethod
    def load(cls, path_or_name: str, pooler: str | None = None, dim: int | None = None, name: str | None = None,
             **options: Any) -> MTEBModel:
        """A checkpoint, export, HF folder, hub name or `pkg:MODULE`, as `sentemb evaluate --model`
        loads it (`options`: `device`, `batch_size`, `trust_checkpoint`, `eval_precision`); `dim`
        serves the first `dim` dimensions, re-normalized."""
        embedder = load_embedder(path_or_name, pooler, **options)
        if dim is not None:
            check_dims([dim], embedder.size, "dim")
            embedder = Embedder(truncated(embedder.encode, dim), dim)
        return cls(embedder, name or str(path_or_name))

    def encode(self, inputs: torch.utils.data.DataLoader, *, task_metadata: Any, hf_split: str, hf_subset: str,
               prompt_type: Any = None, **kwargs: Any) -> np.ndarray:
        """Every text of `inputs` in one `encode` call, so our length-sorted batching runs as in training."""
        sentences = [text for batch in inputs for text in batch["text"]]
        label = f"{self.name} · mteb: {task_metadata.name}"
        prompt = self.prompt_for(task_metadata, prompt_type)
        return self.embedder.encode(sentences, batch_size=kwargs.get("batch_size"), label=label,
                                    **({"prompt": prompt} if prompt else {})).numpy()

    def prompt_for(self, task_metadata: Any, prompt_type: PromptType | None) -> str | None:
        """The text before this task's texts of `prompt_type` (see the module's docstring), or None."""
        name = self.get_prompt_name(task_metadata, prompt_type)
        if name is not None:
            return self.model_prompts[name] or None
        if self.instruction_format is None or prompt_type == PromptType.document:
            return None
        instruction = self.get_instruction(task_metadata, prompt_type)
        if not isinstance(instruction, str):  # a task with query/document instructions, asked for neither
            return None
        return instruction_prefix(instruction, self.instruction_format, "--instruction-format") or None


def mteb_keyed(prompts: dict[str, str]) -> dict[str, str]:
    """The prompts whose keys mteb reads (a model's own may be named after its training datasets), quietly."""
    logger = logging.getLogger("mteb.models.abs_encoder")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            checked = AbsEncoder.validate_task_to_prompt_name(prompts, raise_for_invalid_keys=False)
    finally:
        logger.setLevel(level)
    return (checked[0] if checked else None) or {}


def read_prompts(path: str, option: str = "--mteb-prompts") -> dict[str, str]:
    """A yaml or json file of prompts, `{key: text before the texts}` keyed as mteb keys a model's
    prompts (`STS12: "Instruct: ...\nQuery: "`, `Retrieval-query: ...`, `query: ...`); one line if it is
    not such a mapping."""
    import yaml

    try:
        prompts = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as error:
        raise SentEmbUserError(f"{option} {path}: cannot read it ({error})") from None
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise SentEmbUserError(f"{option} {path}: give a mapping of mteb keys (task name, task type, query, "
                               "document) to the text put before the texts, e.g. STS12: \"Instruct: ...\\nQuery: \"")
    _, unknown = MTEBModel.validate_task_to_prompt_name(prompts, raise_for_invalid_keys=False) or (None, set())
    if unknown:
        raise SentEmbUserError(f"{option} {path}: {sorted(unknown)[0]}")
    return prompts


def mteb_tasks(spec: str) -> list[AbsTask]:
    """`"STSBenchmark,STS12"` or a benchmark name (`"MTEB(eng, v2)"`) → mteb's tasks; an unknown
    name is one line with mteb's suggestion."""
    spec = spec.strip()
    with contextlib.suppress(KeyError):
        return list(mteb.get_benchmark(spec).tasks)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    if not names:
        raise SentEmbUserError("--mteb: give task names (STSBenchmark,STS12) or a benchmark name (\"MTEB(eng, v2)\")")
    return named_tasks(names)


def named_tasks(names: list[str]) -> list[AbsTask]:
    """mteb's tasks of these names (no benchmark lookup: mteb builds its benchmark registry, seconds, on
    the first); an unknown name is one line with mteb's suggestion."""
    tasks = []
    for name in names:
        try:
            tasks.append(mteb.get_task(name))
        except KeyError as error:
            raise SentEmbUserError(f"--mteb: {str(error).strip(chr(34))} (neither a task nor a benchmark; "
                                   "mteb.get_tasks() and mteb.get_benchmarks() list them)") from None
    return tasks


def load_task_data(tasks: Iterable[AbsTask], option: str = "--mteb") -> None:
    """Every task's data in memory before any model loads (mteb then keeps it for every model).
    Data neither cached nor reachable (offline, `HF_HUB_OFFLINE=1`) is one line naming `option` and
    the task."""
    for task in tasks:
        for part in getattr(task.metadata, "tasks", None) or [task]:  # an aggregate task loads its parts
            try:
                part.load_data()
            except OSError as error:  # datasets' ConnectionError and FileNotFoundError, the hub's errors
                dataset = part.metadata.dataset.get("path", "its dataset")
                raise SentEmbUserError(
                    f"{option} {task.metadata.name}: its data ({dataset}) is not in the Hugging Face cache and "
                    f"the hub cannot be reached ({type(error).__name__}); fetch it once online: python -c "
                    f"\"import mteb; mteb.get_task('{part.metadata.name}').load_data()\"") from None


def evaluate_mteb(model: MTEBModel, tasks: list[AbsTask], batch_size: int = 128,
                  on_result: Callable[[dict[str, float]], None] | None = None) -> dict[str, float]:
    """{task: mteb's main score ×100 (mean over its evaluation splits and subsets), ..., 'avg'}.
    mteb's result cache is off: a checkpoint rewritten under the same name must not read old scores."""
    scores: dict[str, float] = {}
    for task in tasks:
        result = mteb.evaluate(model, task, cache=None, encode_kwargs={"batch_size": batch_size},
                               show_progress_bar=False)
        for task_result in result.task_results:
            scores[task_result.task_name] = 100 * float(task_result.get_score())
        if on_result is not None:
            on_result({**scores, "avg": float(np.mean(list(scores.values())))})
    scores["avg"] = float(np.mean(list(scores.values())))
    return scores
