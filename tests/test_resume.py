"""Every fit leaves a usable, resumable result: last.ckpt and best.ckpt, end-of-fit validation, exact
mid-epoch resume after SIGTERM (bit for bit, per method, with and without DataLoader workers, under
2-process DDP), no stale checkpoints, the divergence guard."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.lightning_cli import lightning_main

REPO = Path(__file__).resolve().parents[1]
MAX_STEPS, KILL_AT = 7, 3  # 20 sentences / batch 4 = 5 batches an epoch: the resume crosses an epoch

METHODS = {
    "simcse": ["--model", "lightning_sentemb.methods.SimCSE", "--model.pooler", "cls"],
    "promptbert": ["--model", "lightning_sentemb.methods.PromptBERT"],
    "conpvp": ["--model", "lightning_sentemb.methods.ConPVP", "--model.prompt_length", "2"],
    "dcpcse": ["--model", "lightning_sentemb.methods.DCPCSE", "--model.prefix_len", "2", "--model.mlm_weight", "0.1",
               "--model.lr", "1e-2"],
    "clusterns": ["--model", "lightning_sentemb.methods.ClusterNS", "--model.num_clusters", "2", "--model.sigma", "1.0"],
}


class RecordLosses(Callback):
    """Appends (global step, training loss) of rank 0 to a JSON-lines file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            with open(self.path, "a") as file:
                file.write(json.dumps([trainer.global_step, float(outputs["loss"])]) + "\n")


class TerminateAt(Callback):
    """Sends SIGTERM to this process once `step` optimizer steps are done (as a pre-emption would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    words = ["cats", "dogs", "birds", "fish", "kids"]
    path.write_text("".join(f"sentence {i} is about {words[i % 5]} and {words[i * 3 % 5]} .\n" for i in range(20)))
    return path


def run_args(method: str, backbone: str, data: Path, corpus: Path, root: Path, workers: int, *extra: str) -> list[str]:
    return [
        *METHODS[method], "--model.backbone", backbone, "--seed_everything", "7",
        "--data.data_dir", str(data), "--data.train_file", str(corpus), "--data.batch_size", "4",
        "--data.num_workers", str(workers), "--data.cache_dir", str(root.parent / "cache"),
        "--data.val_tasks", "[STSBenchmark-dev]", "--trainer.default_root_dir", str(root),
        "--trainer.max_steps", str(MAX_STEPS), "--trainer.val_check_interval", "5",
        "--trainer.check_val_every_n_epoch", "null", "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
        *extra,
    ]


def fit(args: list[str], losses: Path, *callbacks: Callback) -> None:
    lightning_main(["fit", *args], callbacks=[RecordLosses(str(losses)), *callbacks])


def read_losses(path: Path) -> dict[int, float]:
    return dict(json.loads(line) for line in path.read_text().splitlines())


def trained_state(root: Path) -> dict[str, torch.Tensor]:
    return torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_bert, sts_fixture, corpus, tmp_path_factory):
    """The reference run of each method (no workers), computed once."""
    cache = {}

    def reference(method: str) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
        if method not in cache:
            root = tmp_path_factory.mktemp(f"{method}-reference")
            fit(run_args(method, tiny_bert, sts_fixture, corpus, root, 0), root / "losses.jsonl")
            cache[method] = read_losses(root / "losses.jsonl"), trained_state(root)
        return cache[method]

    return reference


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("method", list(METHODS))
def test_resume_after_sigterm_is_bit_exact(method, workers, uninterrupted, tiny_bert, sts_fixture, corpus, tmp_path):
    expected_losses, expected_state = uninterrupted(method)
    root = tmp_path / "run"
    args = run_args(method, tiny_bert, sts_fixture, corpus, root, workers)
    with pytest.raises(SystemExit) as stopped:
        fit(args, tmp_path / "losses.jsonl", TerminateAt(KILL_AT))
    assert stopped.value.code == 143
    saved = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)
    assert saved["global_step"] == KILL_AT
    if method == "clusterns":
        assert bool(saved["state_dict"]["cluster_state.initialized"])  # the resume carries live centroids
    fit([*args, "--ckpt_path", "last"], tmp_path / "losses.jsonl")
    assert read_losses(tmp_path / "losses.jsonl") == expected_losses  # float equality: bit for bit
    assert sorted(expected_losses) == list(range(1, MAX_STEPS + 1))
    state = trained_state(root)
    assert state.keys() == expected_state.keys()
    assert all(torch.equal(state[k], expected_state[k]) for k in state)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["simcse", "clusterns"])
def test_two_process_ddp_resume_is_bit_exact(method, tiny_bert, sts_fixture, corpus, tmp_path):
    """The same under 2-process CPU DDP (gloo): SIGTERM on rank 0 stops both ranks at one step."""

    def launch(root: Path, losses: Path, *extra: str) -> subprocess.CompletedProcess:
        callbacks = [{"class_path": "tests.test_resume.RecordLosses", "init_args": {"path": str(losses)}}]
        callbacks += [{"class_path": "tests.test_resume.TerminateAt", "init_args": {"step": KILL_AT}}] if extra == ("kill",) else []
        config = root.parent / f"{root.name}-callbacks.yaml"
        config.write_text(json.dumps({"trainer": {"callbacks": callbacks}}))
        args = run_args(method, tiny_bert, sts_fixture, corpus, root, 0, "--data.batch_size", "2",
                        "--trainer.strategy", "ddp", "--trainer.devices", "2", "-c", str(config),
                        *(a for a in extra if a != "kill"))
        return subprocess.run([sys.executable, "-m", "lightning_sentemb.cli", "fit", *args], cwd=REPO, timeout=600,
                              env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True, text=True)

    reference = launch(tmp_path / "reference", tmp_path / "reference.jsonl")
    assert reference.returncode == 0, reference.stderr[-3000:]
    stopped = launch(tmp_path / "run", tmp_path / "run.jsonl", "kill")
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    resumed = launch(tmp_path / "run", tmp_path / "run.jsonl", "--ckpt_path", "last")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_losses(tmp_path / "run.jsonl") == read_losses(tmp_path / "reference.jsonl")
    state, expected = trained_state(tmp_path / "run"), trained_state(tmp_path / "reference")
    assert all(torch.equal(state[k], expected[k]) for k in expected)
