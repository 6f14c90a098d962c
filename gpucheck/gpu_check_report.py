"""gpu-check's report: `report.md` and `report.json` from the parts' results, the environment and what this
check cannot run on one machine."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from gpu_attention import DRAWS, RESCALE_DRAWS, SMOKE_DRAWS, SMOKE_RESCALE_DRAWS, TOLERANCE
from gpu_check_equivalence import TOLERANCES

TITLES = {
    "kernels": "Attention kernels, forced, against fp32 attention per sentence",
    "cuda_tests": "CUDA tests (`pytest -m cuda`)",
    "models": "Models (random weights, built here)",
    "bf16_steps": "Every training path in Trainer.fit, bf16-mixed, the last two steps under sync debug",
    "equivalence": "Equivalence of the fast paths on this device",
    "throughput_simcse": "Throughput: SimCSE on bert-base",
    "throughput_prompteol": "Throughput: PromptEOL with LoRA on the Qwen2-0.5B-shaped decoder",
    "throughput_decoder_128": "Throughput: padding-free against transformers' padded SDPA, Qwen2-0.5B-shaped, "
                              "length 128",
    "throughput_clusterns": "Throughput: ClusterNS before and after clustering starts (Lightning Trainer)",
    "ddp": "DDP: 2 processes on the one GPU (gloo)",
    "throughput_4bit": "Throughput: 4-bit (QLoRA) PromptEOL on the decoder",
}
DESCRIPTIONS = {
    "kernels": "Each packed-attention kernel forced on bf16 packed rows of 1 to 128 tokens (the smoke run: 1 to 16), "
               "forward and backward (a fixed random cotangent), against fp32 attention sentence by sentence: "
               "relative error of the output and of the largest of the query / key / value (/ prefix) gradients, "
               f"tolerance {TOLERANCE:g}. With attention dropout 0.1: one draw must differ from the reference and the "
               "same seed must draw the same output. `varlen` (aten's flash op): its call replayed with "
               "`return_debug_mask=True` gives the mask it drew; output and gradients against the reference under "
               f"that mask and the 1/(1-p) rescale, tolerance {TOLERANCE:g}, the replay's output the kernel's, the "
               "`dropped share` p within 5 standard deviations. `aligned` and `nested` cannot return their mask: "
               f"`mean output on values 1` over {RESCALE_DRAWS} draws (the smoke run: {SMOKE_RESCALE_DRAWS}) must be 1 "
               f"within `its tolerance` (without the rescale it is 1 - p), and the mean of {DRAWS} draws "
               f"({SMOKE_DRAWS}) the reference within {TOLERANCE:g} plus three times its noise. In the smoke run "
               "varlen's dropout rows use a CPU stand-in of the flash op "
               "(they check the comparison, not a kernel). A kernel this device or torch cannot run is skipped "
               "with the reason.",
    "equivalence": "Loss and gradient of one batch, dropout 0, the fast path against the plain one "
                   "(same weights). Tolerances (relative): "
                   + "; ".join(f"{p}: loss {t['loss']:g}, gradient {t['gradient']:g}" for p, t in TOLERANCES.items())
                   + ". fp32 runs with TF32 off. `kernels`: the packed-attention calls per kernel in the fast run "
                     "(`auto` picks varlen for bf16 without dropout on sm80+; nested is forced in its own rows). "
                     "varlen (flash) takes fp16/bf16 only, so no fp32 row runs it; the fp32 rows run aligned "
                     "(auto) and nested (forced: memory-efficient kernel on CUDA, math on CPU).",
    "throughput_simcse": "Hand-written step loops (forward of both views, loss, backward, fused AdamW, bf16 "
                         "autocast), median step after warm-up. MFU: useful FLOPs (6·N per real token plus "
                         "attention over real tokens) against the GPU's dense bf16 peak. `ours ×`: our "
                         "padding-free sentences/s over the row's. The `aligned` row forces the kernel `auto` "
                         "ran with attention dropout before `varlen` took it (the flash op with dropout). Our rows "
                         "name the kernels that ran, and 3 more steps under torch.profiler give `GPU busy` (kernel "
                         "time over wall time: well below 1, the host does not keep the GPU fed) and the "
                         "`largest` kernels' shares.",
    "throughput_prompteol": "PromptBERT with the PromptEOL templates on the decoder, LoRA r 64 / alpha 16 / "
                            "dropout 0.05 on every linear layer (experiments/llm/prompteol_unsup.yaml). MFU counts "
                            "4·N per token for the frozen base.",
    "throughput_decoder_128": "SimCSE (`last` pooling, full fine-tuning) on the decoder, sentences of up to 128 "
                              "tokens: our padding-free forward against `attn_implementation: sdpa` (transformers' "
                              "own padded forward with SDPA), same hand loop. Issue 25's target: ≥ 1.5×.",
    "throughput_clusterns": "Median step in `Trainer.fit` (bf16-mixed), K-means callback included. Before: σ −1, "
                            "the criterion never holds (plain InfoNCE and the σ test every step); after: σ 1, "
                            "clustering starts at the first step.",
    "bf16_steps": "Every training path of `gpucheck/gpu_check_paths.py` (a row each: the method, its options, "
                  "the batch kind and the model), batch 32, 4 steps of `Trainer.fit` (bf16-mixed, fused AdamW, the "
                  "method's `training_step` with its logging and its callbacks: what `sentemb fit` runs). Checked: "
                  "loss and trainable weights finite, the trainable tensors updated, the logs an option must write "
                  "(`mlm_loss`, the guide's `masked_fraction`), clustering running in the last step. Steps 3 and 4 "
                  "run under `torch.cuda.set_sync_debug_mode`, each from its `on_train_batch_start` (the batch on "
                  "the device) to its last `on_train_batch_end`: step 3 under \"warn\", every synchronizing call "
                  "listed with the line that made it (and the line of ours that led there); step 4 under "
                  "\"error\", which raises at the first (the verdict, even where code silences warnings). A sync "
                  "in either fails the row. The first row checks that both modes catch a deliberate `.item()`. "
                  "`kernels`: the packed-attention calls per kernel in the 4 steps.",
    "ddp": "`DDPStrategy(parallel_devices=[device, device], process_group_backend='gloo')`, SimCSE on bert-base, "
           "2 steps of 16 sentences per rank; the ranks' weights compared by a (sum, norm) per parameter.",
}


def environment(device: str) -> list[dict[str, str]]:
    """The device and the versions of what the parts import (or why it is missing)."""
    from importlib import metadata

    import torch

    rows = [{"what": "device", "value": torch.cuda.get_device_name(0) if device == "cuda" else "CPU"},
            {"what": "torch / CUDA", "value": f"{torch.__version__} / {torch.version.cuda}"},
            {"what": "bf16 supported", "value": str(device == "cuda" and torch.cuda.is_bf16_supported())},
            {"what": "python", "value": sys.version.split()[0]}]
    for package in ("lightning", "transformers", "peft", "accelerate", "sentence-transformers", "datasets",
                    "faiss-cpu", "faiss-gpu-cu12", "bitsandbytes", "wandb"):
        try:
            version = metadata.version(package)
        except metadata.PackageNotFoundError:
            version = "not installed"
        rows.append({"what": package, "value": version})
    return rows


def never_run(device: str, env: list[dict[str, str]]) -> list[dict[str, str]]:
    """What this check cannot exercise on one machine, with the reason."""
    versions = {row["what"]: row["value"] for row in env}
    rows = [{"what": "NCCL DDP across GPUs, multi-node (SLURM)", "why": "one GPU: DDP runs 2 ranks on it with gloo"},
            {"what": "FSDP", "why": "one GPU: sharding a model over one device exercises nothing"},
            {"what": "torch.compile of the padding-free layer (compile_layers)",
             "why": "compiling takes minutes, beyond the 8-minute budget"}]
    if versions.get("wandb") == "not installed":
        rows.append({"what": "wandb logging", "why": "wandb is not installed (WANDB_MODE=disabled)"})
    if versions.get("faiss-gpu-cu12") == "not installed":
        rows.append({"what": "faiss on the GPU", "why": "only a CPU faiss is installed"})
    if device != "cuda":
        rows.append({"what": "everything CUDA-specific", "why": "--device cpu (development mode)"})
    return rows


def format_value(key: str, value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if key == "MFU":
            return f"{value:.1%}"
        if key.endswith("×") or key.startswith("×"):
            return f"{value:.2f}×"
        return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4g}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(format_value(c, c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(format_value(c, row[c]) if c in row else "" for c in columns) + " |" for row in rows]
    return lines


def write_report(folder: Path, header: dict[str, Any], env: list[dict], results: dict[str, dict],
                 skipped: list[dict]) -> Path:
    from lightning_sentemb.atomic_io import atomic_write_json, atomic_write_text

    counts = {status: sum(r["status"] == status for r in results.values()) for status in ("pass", "fail", "skipped")}
    lines = [f"# gpu-check: {header['device']}, {header['started']}", "",
             f"{len(results)} parts: {counts['pass']} passed, {counts['fail']} failed, {counts['skipped']} skipped, "
             f"in {header['seconds']:.0f} s (budget {header['budget_s']:.0f} s). `{header['command']}`", "",
             "| part | status | seconds | note |", "|---|---|---|---|"]
    for name, result in results.items():
        note = "; ".join(result.get("notes", []))
        lines.append(f"| {TITLES[name]} | {result['status']} | {result['seconds']:.0f} "
                     f"| {format_value('note', note)} |")
    lines += ["", "## Environment", "", *markdown_table(env)]
    for name, result in results.items():
        lines += ["", f"## {TITLES[name]}: {result['status']}", ""]
        if name in DESCRIPTIONS:
            lines += [DESCRIPTIONS[name], ""]
        lines += [f"- {note}" for note in result.get("notes", [])]
        if result.get("rows"):
            lines += ["", *markdown_table(result["rows"])] if result.get("notes") else markdown_table(result["rows"])
        lines += ["", f"Log: `{result['log']}`"]
    lines += ["", "## Skipped: what this check cannot run here", "", *markdown_table(skipped), ""]
    report = folder / "report.md"
    atomic_write_text(report, "\n".join(lines))
    atomic_write_json(folder / "report.json", {**header, "environment": env, "parts": results, "skipped": skipped})
    return report

