"""`make gpu-check` (gpucheck/gpu_check.py and its gpu_*.py modules): one line and exit 2 without CUDA; its
development mode (`--device cpu --smoke`) runs every part end to end on tiny models and writes the whole
report; the dropout checks fail a kernel that forgets the 1 / (1 − p) rescale; the sync recorder names the
line of each host sync; every method has a training path."""

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
SCRIPT = REPO / "gpucheck" / "gpu_check.py"
# the constants, read without importing the script (its imports put gpucheck/ and benchmarks/ on sys.path)
NAMES = ("PARTS", "BUDGET_S", "REPORT_RESERVE_S", "TARGETS")
CONSTANTS = {node.targets[0].id: ast.literal_eval(node.value)
             for path in (SCRIPT, REPO / "gpucheck" / "gpu_check_throughput.py")
             for node in ast.parse(path.read_text()).body
             if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) in NAMES}


@pytest.fixture
def check_modules(monkeypatch) -> None:
    """gpucheck/ and benchmarks/ importable, as the script makes them for its own modules."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.syspath_prepend(str(REPO / "gpucheck"))


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
def test_smoke_mode_runs_every_part_and_writes_the_report(tmp_path, check_modules):
    from gpu_check_paths import PATHS

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
    assert len(kernel_rows) == 24 and {row["result"].split(":")[0].split(" (")[0] for row in kernel_rows} == {"pass",
                                                                                                              "skipped"}
    assert all(row["result"] == "pass" for row in kernel_rows if row["kernel"] == "aligned")
    dropout = [row for row in kernel_rows if "dropout" in row["case"] and row["result"].startswith("pass")]
    assert [row["kernel"] for row in dropout] == ["varlen"] * 3 + ["nested"] * 2 + ["aligned"] * 3
    # on the CPU varlen's exact comparison runs through the stand-in of the flash op, the others by their rescale
    assert all("stand-in" in row["result"] and row["dropped share"] > 0 for row in dropout[:3])
    assert all(abs(row["mean output on values 1"] - 1) < row["its tolerance"] < 0.05 for row in dropout[3:])
    steps = parts["bf16_steps"]["rows"]
    assert "deliberate .item()" in steps[0]["path"] and steps[0]["result"].startswith("skipped")  # no CUDA
    assert [row["path"] for row in steps[1:]] == [path.name for path in PATHS]
    assert all(row["result"].startswith("pass") for row in steps[1:]), steps
    assert "aligned" in steps[1]["kernels"] and "mlm_loss" in steps[3]["logged"]
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
    for heading in ("## Environment", "## Attention kernels", "## CUDA tests", "## Every training path",
                    "## Equivalence",
                    "## Throughput: SimCSE", "## Throughput: PromptEOL", "## Throughput: ClusterNS", "## DDP",
                    "## Throughput: 4-bit", "## Skipped"):
        assert heading in markdown


# ----- the dropout checks of the kernels part ------------------------------------------------------------
LENGTHS = [1, 3, 6]
DROPOUT_CASE = "GQA 14/2, causal, dropout 0.1"


def sentences_of(packed, lengths: list[int]) -> list:
    """Each sentence's rows of packed (tokens, heads, d) as (1, heads, length, d)."""
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [packed[start:start + length].transpose(0, 1)[None] for start, length in zip(starts, lengths, strict=True)]


def test_the_reference_under_a_dropout_mask_is_torchs_own_attention_with_that_mask(check_modules) -> None:
    """gpu-check's fp32 reference (packed sentences, grouped-query heads, causal) equals torch's math
    attention handed the same dropout mask, sentence by sentence, to 1e-6."""
    import torch
    from gpu_attention import reference

    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(10, heads, 8, generator=generator, dtype=torch.float64) for heads in (4, 2, 2))
    keep = [torch.rand(4, n, n, generator=generator) >= 0.3 for n in LENGTHS]
    ours = reference(query, key, value, LENGTHS, True, None, None, 8**-0.5, keep, 0.3)
    for q, k, v, kept, mine in zip(*(sentences_of(t, LENGTHS) for t in (query, key, value)), keep,
                                   sentences_of(ours, LENGTHS), strict=True):
        theirs = torch.ops.aten._scaled_dot_product_attention_math(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), dropout_p=0.3, is_causal=True,
            dropout_mask=kept[None], scale=8**-0.5)[0]
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=1e-6)


def forgets_the_rescale(op):
    """A flash op that drops as `op` does but leaves out the 1 / (1 − p) of the kept probabilities."""

    def forgetful(*args, **kwargs):
        out, *rest = op(*args, **kwargs)
        return (out * (1 - args[7]), *rest)

    return forgetful


def test_the_exact_dropout_check_fails_a_flash_op_that_forgets_the_rescale(check_modules) -> None:
    """varlen's dropout rows (through the CPU stand-in of aten's flash op): its own mask, replayed with
    return_debug_mask, and the reference under it pass the stand-in and fail it without the rescale."""
    import torch
    from gpu_dropout import flash_keep_masks
    from gpu_kernels import check, flash_stand_in

    good = check("varlen", DROPOUT_CASE, torch.device("cpu"), LENGTHS, 8, flash=flash_stand_in)
    assert good["result"] == "pass" and good["forward rel. error"] < 1e-2 and 0 < good["dropped share"] < 0.3
    bad = check("varlen", DROPOUT_CASE, torch.device("cpu"), LENGTHS, 8, draws=2,
                flash=forgets_the_rescale(flash_stand_in))
    assert bad["result"].startswith("fail: beyond tolerance of the reference under the op's own mask; values of 1 "
                                    "gave 0.") and bad["result"].endswith("the 1/(1-p) rescale?"), bad
    assert abs(bad["mean output on values 1"] - 0.9) < 0.03  # the checks without a mask follow, and fail it too
    forward, backward = map(float, bad["own mask: forward, backward rel. error"].split(", "))
    assert 0.08 < forward < 0.12 and 0.08 < backward < 0.12  # p off
    # the op's encoding: a dropped probability has its sign bit set (-0.0 included), from each sentence's corner
    debug = torch.tensor([[[[0.5, -0.25, 7.0], [-0.0, 0.0, 7.0]]], [[[-0.5, 0.1, 7.0], [7.0, 7.0, 7.0]]]])
    keep = flash_keep_masks(debug, [2, 1], [2, 2])
    assert [k.tolist() for k in keep] == [[[[True, False], [False, True]]], [[[False, True]]]]


def test_the_rescale_check_fails_a_kernel_that_forgets_the_rescale(check_modules, monkeypatch) -> None:
    """The aligned kernel (which cannot return its mask): its dropout rescaled on values of 1 passes, and
    fails when dropout forgets 1 / (1 − p)."""
    import torch
    import torch.nn.functional as F
    from gpu_kernels import check

    good = check("aligned", DROPOUT_CASE, torch.device("cpu"), LENGTHS, 8, draws=2)
    assert good["result"] == "pass" and abs(good["mean output on values 1"] - 1) < good["its tolerance"] < 0.05
    dropout = F.dropout
    monkeypatch.setattr(F, "dropout", lambda x, p, *args, **kwargs: dropout(x, p, *args, **kwargs) * (1 - p))
    bad = check("aligned", DROPOUT_CASE, torch.device("cpu"), LENGTHS, 8, draws=2)
    assert "the 1/(1-p) rescale?" in bad["result"] and abs(bad["mean output on values 1"] - 0.9) < 0.03, bad


# ----- the sync recorder and the table of training paths -------------------------------------------------
def test_the_sync_recorder_names_the_line_of_each_sync_and_lets_other_warnings_through(check_modules) -> None:
    """What torch's sync debug mode "warn" raises at each synchronizing call is recorded with its line (and
    the line of the package that led there); other warnings still reach their handler; after `stop` the
    warning is no longer recorded. Mode "error"'s exception names its line too."""
    import warnings

    from gpu_check_sync import SYNC_WARNING, HostSync, SyncRecorder, raised_sync, sync_of

    def synchronizing() -> None:
        raise RuntimeError(SYNC_WARNING)

    try:
        synchronizing()
    except RuntimeError as error:
        raised = raised_sync(error)
    assert raised.site.startswith("tests/test_gpu_check.py:") and raised.site.endswith(" synchronizing")
    assert raised_sync(RuntimeError("another error")) is None

    recorder, shown = SyncRecorder(cuda=False), []
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: shown.append(str(message))
        recorder.start()
        for _ in range(2):
            warnings.warn(f"{SYNC_WARNING} (Triggered internally at CUDAFunctions.h:1.)", stacklevel=1)
        warnings.warn("another warning", stacklevel=1)
        recorder.stop()
        warnings.warn(SYNC_WARNING, stacklevel=1)
    line = recorder.syncs[0].site
    assert len(recorder.syncs) == 2 and line.startswith("tests/test_gpu_check.py:") and line.endswith(
        "test_the_sync_recorder_names_the_line_of_each_sync_and_lets_other_warnings_through")
    assert recorder.summary() == f"{line} ×2" and shown == ["another warning", SYNC_WARNING]
    # a sync made in a library, reached from the package: both lines
    frames = [__import__("traceback").FrameSummary(f"/x/{name}", 3, "f") for name in (
        "lightning_sentemb/methods/steps.py", "site-packages/lightning/pytorch/core/module.py")]
    assert sync_of(frames) == HostSync("lightning/pytorch/core/module.py:3 f", "lightning_sentemb/methods/steps.py:3 f")


def test_every_method_and_option_has_a_training_path(check_modules) -> None:
    """gpu-check's bf16 part trains every method class the package exports, and every option the issue
    lists, on some row (a new method fails here until it has its row)."""
    import inspect

    from gpu_check_paths import PATHS

    from lightning_sentemb import methods
    from lightning_sentemb.methods import SentEmbMethod

    exported = {getattr(methods, name) for name in methods.__all__}
    classes = {c for c in exported if inspect.isclass(c) and issubclass(c, SentEmbMethod) and c is not SentEmbMethod}
    assert classes - {path.method for path in PATHS} == set()
    options = [{**path.kwargs, "batch": path.batch, "model": path.model} for path in PATHS]
    for key, value in [("guide", "self"), ("template", "echo"), ("bidirectional", True), ("batch", "nli"),
                       ("model", "decoder")]:
        assert any(option.get(key) == value for option in options), (key, value)
    for key in ("mlm_weight", "grad_cache_chunk", "lora", "hinge_weight"):
        assert any(option.get(key) for option in options), key
    assert any(isinstance(option.get("guide"), dict) for option in options)  # a guide model
    mlm = [path.method.__name__ for path in PATHS if path.kwargs.get("mlm_weight")]
    assert "DCPCSE" in mlm
