"""`make gpu-check`: what one CUDA GPU proves about this package, within 8 minutes, as a Markdown and
JSON report in a folder it names.

    make gpu-check                       # installs the kit's wheels from $(GPU_KIT) first, when present
    python3 gpucheck/gpu_check.py [--output DIR] [--budget 480]
    python3 gpucheck/gpu_check.py --device cpu --smoke   # development: every part on tiny models, on CPU

It needs no package index, no hub and no data: the models are built here with random weights
(`random_models`), the sentences are synthetic. The parts, in this order, each in its own process
under a time limit (one that fails, crashes or hangs is reported, with the rows it finished, and the others
still run; the limits add up to the 480 s budget and are capped so that the whole run stays within
`--budget` seconds; in `--smoke` the parts but DDP share one process). Each part is a module:

1. Kernels (`gpu_kernels`, `gpu_dropout`): each packed-attention kernel (varlen, nested, aligned) forced on
   bf16 packed rows of 1 to 128 tokens, forward and backward, against fp32 attention per sentence:
   bidirectional, causal, causal + window, GQA (14 / 2 heads), a prefix; with attention dropout, the flash
   op's output and gradients against the same attention under the op's own dropout mask (its
   `return_debug_mask`), and for kernels that cannot return their mask, the 1 / (1 − p) rescale on values
   of 1 and the mean of many draws. A kernel the device cannot run is skipped.
2. Models (`gpu_check_models`): a bert-base (`BertConfig()`) and a Qwen2-0.5B-shaped decoder, random weights.
3. DDP (`gpu_check_ddp`): one 2-process step on the one GPU with gloo (NCCL refuses two ranks on one
   device), through Lightning's DDP strategy: losses finite, both ranks' weights equal after the step.
4. bf16 steps (`gpu_check_steps`): every training path of `gpu_check_paths.PATHS` (each method, MNTP, echo,
   the guide, `bidirectional`, hard negatives, gradient caching, the MLM losses) trained 4 steps in
   `Trainer.fit`, bf16-mixed, as a fit trains it (`training_step`, its logging, the method's callbacks), the
   last two under CUDA's sync debug mode (`gpu_check_sync`: "warn", every host sync with the line that made
   it, then "error").
   A new method is a row in `gpu_check_paths.PATHS`.
5. Equivalence (`gpu_check_equivalence`): the padding-free forward against the padded one (`auto`, and the
   nested kernel forced), and gradient caching against the full batch: loss and gradient of one batch,
   dropout 0, under bf16 autocast and in fp32 (TF32 off), within `TOLERANCES`.
6. Throughput (`gpu_check_throughput`; sentences/s, MFU, peak memory) at batch 64, max length 32: SimCSE on
   bert-base (ours, padding-free and padded; sentence-transformers' MultipleNegativesRankingLoss;
   transformers' own padded forward with SDPA in a hand-written loop; ours with the `aligned` kernel
   forced); the decoder at length 128; PromptEOL with LoRA on the decoder; ClusterNS before and after
   clustering starts, in a Lightning Trainer beside SimCSE. Our hand-loop rows name the kernels that ran
   and profile 3 more steps (how busy the GPU is, its largest kernels). Each target (`TARGETS`: ours over
   transformers' padded SDPA) is judged PASS or MISS with its number.
7. CUDA tests (`gpu_check_models`): `pytest -m cuda` (the tests marked `cuda`), each with its outcome; 4-bit
   PromptEOL when bitsandbytes imports.

What cannot run here is listed as skipped, with the reason (`gpu_check_report`). Without CUDA it prints one
line and exits 2; it exits 1 when a part failed, else 0.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# its own modules, then the benchmarks' random models and timing helpers it borrows
sys.path[:0] = [str(REPO / "gpucheck"), str(REPO / "benchmarks"), str(REPO)]

BUDGET_S = 480  # the default --budget on a GPU
REPORT_RESERVE_S = 5  # kept back from the budget to write the report
# (part, its time limit in seconds on a GPU), in the order they run: what decides whether the GPU path works
# first, the timings after. Their sum stays within BUDGET_S - REPORT_RESERVE_S (tests/test_gpu_check.py).
PARTS = [("kernels", 25), ("models", 35), ("ddp", 45), ("bf16_steps", 80), ("equivalence", 60),
         ("throughput_simcse", 60), ("throughput_decoder_128", 45), ("throughput_prompteol", 40),
         ("throughput_clusterns", 50), ("cuda_tests", 25), ("throughput_4bit", 10)]
# each part's function: (module, name), imported in the child process that runs it
PART_FUNCTIONS = {
    "kernels": ("gpu_kernels", "kernels_part"), "models": ("gpu_check_models", "models"),
    "ddp": ("gpu_check_ddp", "ddp"), "bf16_steps": ("gpu_check_steps", "bf16_steps"),
    "equivalence": ("gpu_check_equivalence", "equivalence"),
    "throughput_simcse": ("gpu_check_throughput", "throughput_simcse"),
    "throughput_decoder_128": ("gpu_check_throughput", "throughput_decoder_128"),
    "throughput_prompteol": ("gpu_check_throughput", "throughput_prompteol"),
    "throughput_clusterns": ("gpu_check_throughput", "throughput_clusterns"),
    "cuda_tests": ("gpu_check_models", "cuda_tests"), "throughput_4bit": ("gpu_check_throughput", "throughput_4bit"),
}
OWN_PROCESS = {"ddp"}  # in --smoke the other parts share one process (DDP relaunches its own command line)
SMOKE_SLOWDOWN = 6  # part limits on a CPU in --smoke mode


def run_child(options: argparse.Namespace) -> None:
    """The parts named by `--part` (comma-separated), in order, each result written as JSON into `--results`
    with its seconds (nothing from a DDP rank other than 0)."""
    from gpu_check_common import Context, PartSkipped, one_line

    from lightning_sentemb.atomic_io import atomic_write_json

    for name in options.part.split(","):
        start = time.perf_counter()
        module, function = PART_FUNCTIONS[name]
        try:
            result = getattr(importlib.import_module(module), function)(Context(options, name))
        except PartSkipped as skip:
            result = {"status": "skipped", "notes": [str(skip)]}
        except Exception as error:
            traceback.print_exc()
            result = {"status": "fail", "notes": [one_line(error)]}
        if result is not None:
            seconds = time.perf_counter() - start
            atomic_write_json(Path(options.results) / f"{name}.json", {**result, "seconds": seconds})


# ----- the parent: runs the parts, writes the report ---------------------------------------------------
def child_environment() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO),
            "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def process_groups(smoke: bool) -> list[list[str]]:
    """Each part in its own process on a GPU (a crash or hang costs one part); in --smoke, all but
    `OWN_PROCESS` share one, so the rehearsal does not pay a start-up per part."""
    names = [name for name, _ in PARTS]
    if not smoke:
        return [[name] for name in names]
    return [[name for name in names if name not in OWN_PROCESS], *([name] for name in names if name in OWN_PROCESS)]


def run_parts(names: list[str], limit: float, options: argparse.Namespace, folder: Path,
              models_folder: Path) -> dict[str, dict]:
    """Run `names` in one child process group, killed (with anything it started) at `limit` seconds."""
    from gpu_check_common import partial_path

    log_path = folder / "logs" / f"{names[0] if len(names) == 1 else 'parts'}.log"
    command = [sys.executable, str(Path(__file__).resolve()), "--part", ",".join(names), "--device", options.device,
               "--models", str(models_folder), "--results", str(folder / "parts")]
    command += ["--smoke"] if options.smoke else []
    start = time.perf_counter()
    with open(log_path, "w", encoding="utf8") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=child_environment(),
                                 cwd=REPO, start_new_session=True)
        try:
            code = child.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            code = None
    seconds = time.perf_counter() - start
    results = {}
    for name in names:
        result_path = folder / "parts" / f"{name}.json"
        if result_path.is_file():
            result = json.loads(result_path.read_text(encoding="utf8"))
        elif code is None:
            partial = partial_path(folder / "parts", name)  # the rows it finished (`Context.keep_rows`)
            rows = json.loads(partial.read_text(encoding="utf8"))["rows"] if partial.is_file() else []
            killed = f"killed at its time limit ({limit:.0f} s) after {len(rows)} rows; see {log_path.name}"
            result = {"status": "fail", "rows": rows, "notes": [killed]}
        else:
            result = {"status": "fail", "notes": [f"exited with code {code} and no result: {last_line(log_path)}"]}
        if len(names) == 1:
            result["seconds"] = seconds  # with the process's start-up
        results[name] = {"seconds": 0.0, **result, "log": str(log_path.relative_to(folder))}
    return results


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text(encoding="utf8", errors="replace").splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", help="report folder (default out/gpu-check/<UTC time>)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds for all the parts (default 480 on a GPU, 1800 with --smoke)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--part", help=argparse.SUPPRESS)  # comma-separated names of PART_FUNCTIONS
    parser.add_argument("--models", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.part:
        run_child(options)
        return
    try:
        import torch
    except ImportError as error:
        print(f"gpu-check: {sys.executable} cannot import torch ({error}); nothing checked")
        raise SystemExit(2) from None
    if options.device == "cuda" and not torch.cuda.is_available():
        print("gpu-check: no CUDA device here (torch.cuda.is_available() is False); run it on a CUDA machine "
              "(docs/gpu-check.md)")
        raise SystemExit(2)
    started = datetime.now(timezone.utc)
    folder = Path(options.output or REPO / "out" / "gpu-check" / started.strftime("%Y%m%d-%H%M%S")).resolve()
    for sub in ("parts", "logs"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    print(f"gpu-check: writing to {folder}", flush=True)
    budget = options.budget or (1800.0 if options.smoke else float(BUDGET_S))
    deadline = time.monotonic() + budget
    from gpu_check_report import environment, never_run, write_report

    env = environment(options.device)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-models-") as models_folder:
        limits = dict(PARTS)
        for names in process_groups(options.smoke):
            limit = sum(limits[name] for name in names) * (SMOKE_SLOWDOWN if options.smoke else 1)
            limit = min(limit, deadline - time.monotonic() - REPORT_RESERVE_S)
            if limit < 10:
                results.update({name: {"status": "skipped", "notes": ["the time budget (--budget) is spent"],
                                       "seconds": 0.0, "log": "-"} for name in names})
            else:
                results.update(run_parts(names, limit, options, folder, Path(models_folder)))
            for name in names:
                print(f"gpu-check: {name}: {results[name]['status']} ({results[name]['seconds']:.0f} s)", flush=True)
        results = {name: results[name] for name, _ in PARTS}  # the report in the parts' order
    header = {"device": env[0]["value"], "started": started.strftime("%Y-%m-%d %H:%M UTC"),
              "seconds": budget - (deadline - time.monotonic()), "budget_s": budget,
              "command": " ".join([Path(sys.executable).name, *sys.argv]), "smoke": options.smoke}
    report = write_report(folder, header, env, results, never_run(options.device, env))
    failed = [name for name, result in results.items() if result["status"] == "fail"]
    print(f"gpu-check: report {report} ({len(failed)} part(s) failed{': ' + ', '.join(failed) if failed else ''})")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
