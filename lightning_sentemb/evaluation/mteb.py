"""MTEB (the `mteb` package, 2.x) on any of our models, encoding exactly as `SentEmbMethod.encode` does.

`MTEBModel` is an `mteb` encoder (its `AbsEncoder`: `encode(DataLoader, task_metadata=..., ...)` and
`mteb_model_meta`) around one `Embedder` (`loading.load_embedder`): the method's template and
[MASK] or last-token pooling, denoising, prefix and, with `dim`, its Matryoshka truncation. mteb's
task prompts are not applied: our models embed a sentence one way whatever the task (instruction
models are not among our methods).

    from lightning_sentemb.evaluation.mteb import MTEBModel
    mteb.evaluate(MTEBModel.load("out/promptbert/checkpoints/best.ckpt"), mteb.get_tasks(tasks=["STS12"]))
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import mteb
import numpy as np
import torch
from mteb.abstasks import AbsTask
from mteb.models import ModelMeta
from mteb.models.abs_encoder import AbsEncoder
from mteb.models.model_meta import ScoringFunction

from ..errors import SentEmbUserError
from ..loading import Embedder, load_embedder
from ..matryoshka import check_dims, truncated


class MTEBModel(AbsEncoder):
    """An `mteb.evaluate`-able encoder over `embedder`; cosine similarity, as every evaluator of ours."""

    def __init__(self, embedder: Embedder, name: str = "model") -> None:
        self.embedder = embedder
        self.name = name
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
        return self.embedder.encode(sentences, batch_size=kwargs.get("batch_size"), label=label).numpy()


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
