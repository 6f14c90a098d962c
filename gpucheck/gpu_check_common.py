"""What every part of `make gpu-check` (`gpucheck/gpu_check.py`) reads: the sizes, the context of a part
(device, model folders, sentences), a part's result from its rows, and the helpers the Trainer-driven parts
share. Imports nothing heavy at module level: the parent process answers "no CUDA" after importing torch
alone."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def build_method(*args: Any, **kwargs: Any) -> Any:
    """`lightning_sentemb.methods.building.build_method`, imported when a part first builds a method."""
    from lightning_sentemb.methods.building import build_method as build

    return build(*args, **kwargs)


@dataclass(frozen=True)
class Sizes:
    batch: int  # throughput
    check_batch: int  # equivalence
    path_batch: int  # the bf16 steps of the training paths
    path_steps: int  # their steps (the last two under sync debug)
    chunk: int  # gradient-cache rows per chunk
    steps: int  # timed steps
    warmup: int
    profiled: int  # profiled steps after them
    ddp_batch: int  # per rank
    lora_r: int


FULL = Sizes(batch=64, check_batch=32, path_batch=32, path_steps=4, chunk=16, steps=20, warmup=5, profiled=3,
             ddp_batch=16, lora_r=64)
SMOKE = Sizes(batch=8, check_batch=8, path_batch=4, path_steps=2, chunk=4, steps=1, warmup=1, profiled=1, ddp_batch=4,
              lora_r=8)


class PartSkipped(Exception):
    """The part cannot run here; the message says why."""


def outcome(rows: list[dict[str, Any]], notes: list[str] | None = None) -> dict[str, Any]:
    """A part's result from its rows: failed when a row's `result` starts with "fail"."""
    failed = sum(str(row.get("result", "")).startswith("fail") for row in rows)
    notes = list(notes or []) + ([f"{failed} of {len(rows)} rows failed"] if failed else [])
    return {"status": "fail" if failed else "pass", "rows": rows, "notes": notes}


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def partial_path(results: Path, part: str) -> Path:
    """Where a part keeps the rows it finished, for the report when it is killed at its time limit."""
    return results / f"{part}.partial.json"


class Context:
    """What every part reads: device, sizes, the model folders, the sentences."""

    def __init__(self, options: argparse.Namespace, part: str) -> None:
        import torch
        from gpu import BF16_PEAK_TFLOPS
        from random_models import synthetic_sentences

        self.part = part
        self.device = torch.device("cuda", 0) if options.device == "cuda" else torch.device("cpu")
        self.smoke = options.smoke
        self.sizes = SMOKE if options.smoke else FULL
        self.models = Path(options.models)
        self.bert, self.decoder = str(self.models / "bert"), str(self.models / "qwen2")
        self.sentences = synthetic_sentences(4 * self.sizes.batch)
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "CPU"
        self.peak_tflops = next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
        self.results = Path(options.results)

    def need_models(self) -> None:
        for folder in (self.bert, self.decoder):
            if not (Path(folder) / "config.json").is_file():
                raise PartSkipped("the models part did not build the models (see its row)")

    def lora(self, dropout: float) -> dict[str, Any]:
        return {"r": self.sizes.lora_r, "alpha": 16, "dropout": dropout, "target_modules": "all-linear"}

    def mfu(self, flops: float, seconds: float) -> float:
        return flops / seconds / (self.peak_tflops * 1e12) if self.peak_tflops else float("nan")

    def keep_rows(self, rows: list[dict[str, Any]]) -> None:
        """Write the rows finished so far: a part killed at its limit still reports them."""
        from lightning_sentemb.atomic_io import atomic_write_json

        atomic_write_json(partial_path(self.results, self.part), {"rows": rows})

    def free(self) -> None:
        """Give the memory of the previous configuration back before the next one is built."""
        import gc

        import torch

        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)


def kernels_text(ran: dict[str, int]) -> str:
    return ", ".join(f"{kernel} ×{calls}" for kernel, calls in sorted(ran.items())) or "none (padded forward)"


def trainer_options(ctx: Context, folder: str, steps: int) -> dict[str, Any]:
    """A bare bf16-mixed Trainer: no logger, checkpoint, progress bar or validation."""
    return {"accelerator": ctx.device.type, "precision": "bf16-mixed", "max_steps": steps, "logger": False,
            "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False,
            "limit_val_batches": 0, "num_sanity_val_steps": 0, "log_every_n_steps": 1, "default_root_dir": folder}


def training_examples(method, sentences: list[str], count: int, kind: str = "unsup") -> list[dict[str, list[int]]]:
    """`count` tokenized examples cycling over `sentences`, cut to 32 tokens with the special ones, as the
    DataModule's `max_seq_len 32` cuts them. `kind`: "unsup" (one sentence a line, `sent0`; with its
    negation where the method reads one, SNCSE), "nli" (SimCSE's NLI triplets: `sent0`, its positive `sent1`
    and its hard negative `hard_neg`, here the next two sentences) or "pairs" (SBERT's labelled pairs: each
    sentence and the next, labels cycling over the three classes)."""
    from lightning_sentemb.data.negation import NEGATION_COLUMN, lexicon_tokens, negate

    budget = 32 - method.encoder.format.num_special_tokens

    def tokenized(texts: list[str]) -> list[list[int]]:
        return [row[:budget] for row in method.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    ids = tokenized(sentences)
    if kind == "unsup":
        if NEGATION_COLUMN in method.collator.required_columns:
            negations = tokenized([negate(lexicon_tokens(sentence)).text for sentence in sentences])
            return [{"sent0": ids[i % len(ids)], NEGATION_COLUMN: negations[i % len(ids)]} for i in range(count)]
        return [{"sent0": ids[i % len(ids)]} for i in range(count)]
    if kind == "nli":
        return [{"sent0": ids[i % len(ids)], "sent1": ids[(i + 1) % len(ids)], "hard_neg": ids[(i + 2) % len(ids)]}
                for i in range(count)]
    if kind == "pairs":
        return [{"premise": ids[i % len(ids)], "hypothesis": ids[(i + 1) % len(ids)], "label": i % 3}
                for i in range(count)]
    raise ValueError(f"unknown batch kind {kind!r}: unsup, nli or pairs")
