"""`make gpu-check` (benchmarks/gpu_check.py): one line and exit 2 without CUDA; its development mode
(`--device cpu --smoke`) runs every part end to end on tiny models and writes the whole report."""

from __future__ import annotations

import ast
import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import minilm_tokenizer

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
# the script's constants, read without importing it (its imports put benchmarks/ on sys.path)
NAMES = ("PARTS", "BUDGET_S", "REPORT_RESERVE_S", "TARGETS")
CONSTANTS = {node.targets[0].id: ast.literal_eval(node.value) for node in ast.parse(SCRIPT.read_text()).body
             if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in NAMES}


def test_the_part_limits_fit_the_budget() -> None:
    """On a GPU every part can use its whole limit and the report is still written within the budget;
    the parts that prove the GPU path works run before the timings."""
    assert sum(limit for _, limit in CONSTANTS["PARTS"]) + CONSTANTS["REPORT_RESERVE_S"] <= CONSTANTS["BUDGET_S"]
    order = [name for name, _ in CONSTANTS["PARTS"]]
    assert order[0] == "kernels" and order.index("ddp") < order.index("throughput_simcse")


def padded_per_real_token(lengths: list[int], batch: int = 64, batches: int = 400) -> float:
    """Tokens of a padded batch per real token (the longest row over the mean row), averaged over random
    batches of `lengths`."""
    draw = random.Random(0)
    ratios = []
    for _ in range(batches):
        rows = draw.sample(lengths, batch)
        ratios.append(max(rows) * batch / sum(rows))
    return sum(ratios) / batches


def test_the_benchmark_sentences_are_as_padded_as_wiki1m(shared_data, monkeypatch) -> None:
    """gpu-check's bert-base throughput (batch 64, 32 tokens) gains from padding-free what a wiki1m batch
    would: both tokenized alike (all-MiniLM-L6-v2's uncased WordPiece, which has every synthetic word)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from random_models import synthetic_sentences

    tokenizer = minilm_tokenizer()
    wiki = (shared_data / "corpora" / "wiki1m_for_simcse.txt").read_text(encoding="utf8").splitlines()

    def lengths(lines: list[str]) -> list[int]:
        ids = tokenizer([line for line in lines if line.strip()], truncation=True, max_length=32)["input_ids"]
        return [len(row) for row in ids]

    theirs, ours = padded_per_real_token(lengths(wiki)), padded_per_real_token(lengths(synthetic_sentences(4096)))
    assert 1.4 < theirs < 1.55 and abs(ours - theirs) < 0.03, (ours, theirs)


def no_cuda_environment() -> dict[str, str]:
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "WANDB_MODE": "disabled"}


def test_without_cuda_it_says_so_in_one_line_and_exits_2(tmp_path):
    direct = subprocess.run([sys.executable, str(SCRIPT), "--output", str(tmp_path / "report")], cwd=REPO,
                            env=no_cuda_environment(), capture_output=True, text=True, timeout=300)
    assert direct.returncode == 2, direct.stderr[-2000:]
    assert direct.stdout.splitlines() == [direct.stdout.strip()] and "no CUDA device" in direct.stdout
    assert not (tmp_path / "report").exists()
    # through make (which reports any failing recipe as its own exit status 2): the same one line
    made = subprocess.run(["make", "-s", "gpu-check", f"GPU_PYTHON={sys.executable}", f"GPU_KIT={tmp_path / 'no-kit'}"],
                          cwd=REPO, env=no_cuda_environment(), capture_output=True, text=True, timeout=300)
    assert made.returncode == 2 and made.stdout == direct.stdout


@pytest.mark.slow
def test_smoke_mode_runs_every_part_and_writes_the_report(tmp_path):
    folder = tmp_path / "report"
    done = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--smoke", "--output", str(folder)],
                          cwd=REPO, env=no_cuda_environment(), capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"writing to {folder}" in done.stdout.splitlines()[0]
    report = json.loads((folder / "report.json").read_text())
    parts = report["parts"]
    statuses = {name: part["status"] for name, part in parts.items()}
    assert list(statuses) == [name for name, _ in CONSTANTS["PARTS"]]
    assert statuses == {"kernels": "pass", "cuda_tests": "pass", "models": "pass", "bf16_steps": "pass",
                        "equivalence": "pass",
                        "throughput_simcse": "pass", "throughput_prompteol": "pass", "throughput_decoder_128": "pass",
                        "throughput_clusterns": "pass",
                        "ddp": "pass", "throughput_4bit": "skipped"}
    # the CUDA tests were collected and skipped on this CPU
    assert parts["cuda_tests"]["rows"] and {row["outcome"] for row in parts["cuda_tests"]["rows"]} == {"skipped"}
    kernel_rows = parts["kernels"]["rows"]
    assert len(kernel_rows) == 21 and {row["result"].split(":")[0] for row in kernel_rows} == {"pass", "skipped"}
    assert all(row["result"] == "pass" for row in kernel_rows if row["kernel"] == "aligned")
    assert sum("dropout" in row["case"] and row["result"] == "pass" for row in kernel_rows) == 3  # aligned 2, nested 1
    steps = parts["bf16_steps"]["rows"]
    assert len(steps) == 7 and all(row["result"].startswith("pass") for row in steps)  # 5 + 1 methods, the sync step
    assert "aligned" in steps[0]["kernels"] and "sync debug" in steps[-1]["method"]
    equivalence = parts["equivalence"]["rows"]
    assert {row["precision"] for row in equivalence} == {"bf16", "fp32"}
    nested = [row for row in equivalence if "nested" in row["comparison"] and row["result"] == "pass"]
    assert nested and all(row["kernels"].startswith("nested") for row in nested)
    simcse = parts["throughput_simcse"]["rows"]
    assert len(simcse) == 5 and all(row["sentences/s"] > 0 for row in simcse)
    ours = [row for row in simcse if row["implementation"] == "lightning_sentemb"]
    assert [row["forward"] for row in ours] == ["padding-free", "padded", "padding-free, aligned kernel forced"]
    assert [row["kernels"] for row in ours] == ["aligned", "-", "aligned"]  # the CPU: auto runs aligned
    assert all(re.fullmatch(r"(.+ \d+%; ){3}.+ \d+%", row["largest"]) for row in ours)  # profiled
    long_rows = parts["throughput_decoder_128"]["rows"]
    assert [row["forward"] for row in long_rows] == ["padding-free", "padded (attn_implementation sdpa)"]
    assert long_rows[0]["× padded SDPA"] > 0
    for part, target in CONSTANTS["TARGETS"].items():  # judged, whatever the CPU's numbers
        assert re.fullmatch(rf"target ≥ {target}× over transformers' padded SDPA: (PASS|MISS) \(\d+\.\d\d×\)",
                            parts[part]["notes"][0])
    phases = [row.get("clustering started") for row in parts["throughput_clusterns"]["rows"]]
    assert phases == [None, False, True]
    assert [row["rank"] for row in parts["ddp"]["rows"]] == [0, 1]
    assert "bitsandbytes" in parts["throughput_4bit"]["notes"][0]
    markdown = (folder / "report.md").read_text()
    for heading in ("## Environment", "## Attention kernels", "## CUDA tests", "## One bf16-mixed training step",
                    "## Equivalence",
                    "## Throughput: SimCSE", "## Throughput: PromptEOL", "## Throughput: ClusterNS", "## DDP",
                    "## Throughput: 4-bit", "## Skipped"):
        assert heading in markdown
