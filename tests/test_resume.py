"""Every fit leaves a usable, resumable result: last.ckpt and best.ckpt, end-of-fit validation, exact
mid-epoch resume after SIGTERM (bit for bit, per method, with and without DataLoader workers, under
2-process DDP under torchrun), no stale checkpoints (the divergence guard: tests/test_training_guard.py)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from lightning_sentemb.callbacks.checkpointing import AtomicCheckpointIO
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.lightning_cli import lightning_main
from lightning_sentemb.methods.building import build_method
from tests.launch import fork_ranks, run_commands, torchrun

MAX_STEPS, KILL_AT = 7, 3  # 20 sentences / batch 4 = 5 batches an epoch: the resume crosses an epoch

METHODS = {
    "simcse": ["--model", "lightning_sentemb.methods.SimCSE", "--model.pooler", "cls"],
    "promptbert": ["--model", "lightning_sentemb.methods.PromptBERT"],
    "conpvp": ["--model", "lightning_sentemb.methods.ConPVP", "--model.prompt_length", "2"],
    "dcpcse": ["--model", "lightning_sentemb.methods.DCPCSE", "--model.prefix_len", "2", "--model.mlm_weight", "0.1",
               "--model.lr", "1e-2"],
    "clusterns": ["--model", "lightning_sentemb.methods.ClusterNS", "--model.num_clusters", "2",
                  "--model.sigma", "1.0"],
    # the collator's draws (element dropout masks, permutations) repeat after the resume
    "consert": ["--model", "lightning_sentemb.methods.ConSERT", "--model.augmentations", "[dropout, shuffle]",
                "--model.lr", "1e-4"],
    "sncse": ["--model", "lightning_sentemb.methods.SNCSE", "--data.negate", "lexicon"],
    "flow": ["--model", "lightning_sentemb.methods.BERTFlow", "--model.flow_levels", "2", "--model.flow_depth", "2"],
    # noise negatives drawn per batch, its own similarities weighing the in-batch ones
    "dclr": ["--model", "lightning_sentemb.methods.DCLR", "--model.guide", "self", "--model.phi", "0.95"],
    # the momentum encoder and its queue (2.5 batches: full from step 3, the kill); MixCSE's partners, drawn
    # from the run seed and the step
    "esimcse": ["--model", "lightning_sentemb.methods.ESimCSE", "--model.pooler", "cls"],
    "mixcse": ["--model", "lightning_sentemb.methods.MixCSE", "--model.pooler", "cls", "--model.num_mixed", "2"],
    # a trainable prompt on a frozen backbone (the gradient through its lookup: tests/test_scpcse.py)
    "scpcse": ["--model", "lightning_sentemb.methods.SCPCSE", "--model.lr", "1e-2"],
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
    """Sends SIGTERM (as a pre-emption would) or SIGINT (Ctrl-C) to this process once `step`
    optimizer steps are done."""

    def __init__(self, step: int, signum: int = int(signal.SIGTERM)) -> None:
        self.step = step
        self.signum = signum

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            os.kill(os.getpid(), self.signum)


def run_args(method: str, backbone: str, data: Path, corpus: Path, root: Path, workers: int, *extra: str) -> list[str]:
    return [
        *METHODS[method], "--model.backbone", backbone, "--seed_everything", "7",
        "--data.data_dir", str(data), "--data.train_file", str(corpus), "--data.batch_size", "4",
        "--data.num_workers", str(workers), "--data.persistent_workers", "true",  # as the GPU presets (unused at 0)
        "--data.cache_dir", str(root.parent / "cache"),
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


# each method stopped with num_workers 0 and resumed with 2 (the reference has none); the methods whose
# collate draws random numbers (ConPVP's templates, DCPCSE's MLM masks) also stopped with 2 and resumed
# with 0, so both settings are checked against the reference, before and after a resume
@pytest.mark.parametrize(("method", "workers", "resume_workers"),
                         [*((method, 0, 2) for method in ("simcse", "promptbert", "conpvp", "dcpcse", "clusterns",
                                                           "consert", "flow", "dclr", "esimcse", "mixcse",
                                                           "scpcse")),
                          *(pytest.param(method, 2, 0, marks=pytest.mark.slow) for method in ("conpvp", "dcpcse"))])
def test_resume_after_sigterm_is_bit_exact(method, workers, resume_workers, uninterrupted, tiny_bert, sts_fixture,
                                           corpus, tmp_path):
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
    if method == "flow":  # the flow started from the first batch, and is not started again on resume
        assert bool(saved["state_dict"]["flow.initialized"])
    if method == "esimcse":
        assert int(saved["state_dict"]["queue.filled"]) == 10  # and a full queue
    fit([*args, "--data.num_workers", str(resume_workers), "--ckpt_path", "last"], tmp_path / "losses.jsonl")
    assert read_losses(tmp_path / "losses.jsonl") == expected_losses  # float equality: bit for bit
    assert sorted(expected_losses) == list(range(1, MAX_STEPS + 1))
    state = trained_state(root)
    assert state.keys() == expected_state.keys()
    assert all(torch.equal(state[k], expected_state[k]) for k in state)


@pytest.mark.slow
def test_torchrun_resume_is_bit_exact(tiny_bert, sts_fixture, corpus, tmp_path, capfd):
    """The same under 2-process CPU DDP (gloo) started by torchrun, with the multinode preset: SIGTERM on rank 0
    stops both ranks at one step, and `sentemb fit --ckpt_path last` under a new torchrun resumes it (rank 0's
    decision through the store torchrun's agent serves on MASTER_PORT). ClusterNS: its step is SimCSE's plus the
    centroids rank 0 broadcasts: each rank's centroid state at the end, uninterrupted and resumed, is the same.
    The reference and the stopped run on one pair of forked ranks (tests/launch.py), the resume as users type it."""

    def command(root: Path, losses: Path, *extra: str) -> list[str]:
        kill = extra == ("kill",)
        callbacks = [{"class_path": "tests.test_resume.RecordLosses", "init_args": {"path": str(losses)}},
                     {"class_path": "tests.test_clusterns_method.DumpCentroids"}]
        callbacks += [{"class_path": "tests.test_resume.TerminateAt", "init_args": {"step": KILL_AT}}] if kill else []
        config = root.parent / f"{root.name}{'-kill' if kill else ''}-callbacks.yaml"
        config.write_text(json.dumps({"trainer": {"callbacks": callbacks}}))
        return ["fit", "-c", "experiments/trainer/multinode.yaml",
                *run_args("clusterns", tiny_bert, sts_fixture, corpus, root, 0, "--data.batch_size", "2",
                          "--trainer.devices", "2", "--trainer.num_nodes", "1", "--trainer.precision", "32-true",
                          "--data.pin_memory", "false", "-c", str(config), *(() if kill else extra))]

    capfd.readouterr()
    fork_ranks(run_commands, [command(tmp_path / "reference", tmp_path / "reference.jsonl"),
                              command(tmp_path / "run", tmp_path / "run.jsonl", "kill")])
    said = capfd.readouterr().out  # the forked ranks' output
    assert said.count("launch: command 1 stopped by SIGTERM") == 2, said[-3000:]  # by both ranks
    # under DDP the ranks agree to stop at the next decision point: here the validation of step 5
    assert checkpoint_step(tmp_path / "run" / "checkpoints" / "last.ckpt") == 5
    resumed = torchrun([str(Path(sys.executable).with_name("sentemb")),
                        *command(tmp_path / "run", tmp_path / "run.jsonl", "--ckpt_path", "last")], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert read_losses(tmp_path / "run.jsonl") == read_losses(tmp_path / "reference.jsonl")
    assert sorted(read_losses(tmp_path / "reference.jsonl")) == list(range(1, MAX_STEPS + 1))
    state, expected = trained_state(tmp_path / "run"), trained_state(tmp_path / "reference")
    assert all(torch.equal(state[k], expected[k]) for k in expected)
    centroids = [torch.load(tmp_path / run / f"rank{rank}.pt") for run in ("reference", "run") for rank in (0, 1)]
    first = centroids[0]
    assert bool(first["initialized"]) and int(first["num_updates"]) > 0 and first["centroids"].any()
    for other in centroids[1:]:  # both ranks, with and without the resume
        assert other.keys() == centroids[0].keys()
        assert all(torch.equal(other[key], centroids[0][key]) for key in other)


def short_fit_args(backbone: str, data: Path, root: Path, *extra: str) -> list[str]:
    from tests.test_end_to_end import fit_args

    return [*fit_args(backbone, data, root), "--data.val_tasks", "[STSBenchmark-dev]", "--trainer.enable_model_summary",
            "false", *extra]


def checkpoint_step(path: Path) -> int:
    return torch.load(path, weights_only=False)["global_step"]


def test_fit_shorter_than_the_validation_interval_leaves_checkpoints_and_metrics(tiny_bert, sts_fixture, tmp_path):
    lightning_main(["fit", *short_fit_args(tiny_bert, sts_fixture, tmp_path, "--trainer.max_steps", "3",
                                           "--trainer.val_check_interval", "30")])
    assert checkpoint_step(tmp_path / "checkpoints" / "best.ckpt") == 3
    assert checkpoint_step(tmp_path / "checkpoints" / "last.ckpt") == 3
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "val/STSBenchmark-dev" in metrics


def test_best_checkpoint_is_lean_and_serves_test_evaluate_and_export(tiny_bert, sts_fixture, tmp_path, capsys):
    """best.ckpt leaves out the optimizer state (AdamW's two moments per weight): under half of last.ckpt
    for a full fine-tune; what test, evaluate, export and the model card read is in it; a fit cannot
    resume from it."""
    from lightning_sentemb.cli import main

    args = short_fit_args(tiny_bert, sts_fixture, tmp_path, "--trainer.max_steps", "3")
    lightning_main(["fit", *args])
    best, last = tmp_path / "checkpoints" / "best.ckpt", tmp_path / "checkpoints" / "last.ckpt"
    assert best.stat().st_size < last.stat().st_size / 2
    lean, full = torch.load(best, weights_only=False), torch.load(last, weights_only=False)
    assert "optimizer_states" not in lean and "lr_schedulers" not in lean and "optimizer_states" in full
    assert lean["state_dict"].keys() == full["state_dict"].keys() and "callbacks" in lean

    cli = lightning_main(["test", *args, "--ckpt_path", "best"])
    assert cli.trainer.ckpt_path == str(best) and set(cli.model.test_results) >= {"STSBenchmark", "avg"}
    main(["evaluate", "--model", str(best), "--data-dir", str(sts_fixture), "--output", str(tmp_path / "scores.json")])
    main(["export", str(best), str(tmp_path / "export")])
    card = (tmp_path / "export" / "README.md").read_text()
    assert "STS-B dev (Spearman ×100), the score this checkpoint was selected by" in card
    capsys.readouterr()
    with pytest.raises(SentEmbUserError, match=r"without the optimizer state .* --ckpt_path last"):
        lightning_main(["fit", *args, "--ckpt_path", str(best)])


class LastCheckpointSteps(Callback):
    """{global step: step held by last.ckpt} before each training step (all saves of the previous
    step done)."""

    def __init__(self) -> None:
        self.seen: dict[int, int | None] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        path = Path(trainer.checkpoint_callback.dirpath) / "last.ckpt"
        self.seen[trainer.global_step] = checkpoint_step(path) if path.exists() else None


def test_last_checkpoint_follows_the_run_when_the_best_does_not_improve(tiny_bert, sts_fixture, tmp_path):
    """lr 0: STS-B dev never improves after the first validation, last.ckpt still moves on
    (Lightning's `save_last` rewrote it only with a new best)."""
    steps = LastCheckpointSteps()
    lightning_main(["fit", *short_fit_args(tiny_bert, sts_fixture, tmp_path, "--model.lr", "0", "--trainer.max_steps",
                                           "5", "--trainer.val_check_interval", "2",
                                           "--checkpoint.every_n_train_steps", "3")], callbacks=[steps])
    # validation at steps 2 and 4 (and after the last step, 5), every 3 steps, the end
    assert steps.seen == {0: None, 1: None, 2: 2, 3: 3, 4: 4}
    assert checkpoint_step(tmp_path / "checkpoints" / "last.ckpt") == 5
    assert checkpoint_step(tmp_path / "checkpoints" / "best.ckpt") == 2


def test_ctrl_c_stops_after_the_step_and_saves_last(tiny_bert, sts_fixture, tmp_path):
    args = short_fit_args(tiny_bert, sts_fixture, tmp_path, "--trainer.max_steps", "6")
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as stopped:
        lightning_main(["fit", *args], callbacks=[TerminateAt(2, signal.SIGINT)])
    assert stopped.value.code == 143
    assert checkpoint_step(tmp_path / "checkpoints" / "last.ckpt") == 2
    assert signal.getsignal(signal.SIGINT) is handler  # the Ctrl-C handler is restored


def test_a_new_fit_refuses_an_earlier_runs_checkpoints(tiny_bert, sts_fixture, tmp_path):
    args = short_fit_args(tiny_bert, sts_fixture, tmp_path, "--trainer.max_steps", "2")
    lightning_main(["fit", *args])
    before = (tmp_path / "checkpoints" / "best.ckpt").stat().st_mtime_ns
    with pytest.raises(SentEmbUserError, match="resume it with --ckpt_path last.*--overwrite true"):
        lightning_main(["fit", *args])
    assert (tmp_path / "checkpoints" / "best.ckpt").stat().st_mtime_ns == before
    (tmp_path / "checkpoints" / "old-run.ckpt").write_bytes(b"stale")
    lightning_main(["fit", *args, "--overwrite", "true", "--trainer.max_steps", "1"])
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.ckpt")) == ["best.ckpt", "last.ckpt"]
    assert checkpoint_step(tmp_path / "checkpoints" / "last.ckpt") == 1


def test_ckpt_path_last_in_a_new_process(tiny_bert, sts_fixture, tmp_path):
    args = short_fit_args(tiny_bert, sts_fixture, tmp_path, "--trainer.max_steps", "2")
    with pytest.raises(SentEmbUserError, match="last.ckpt does not exist"):
        lightning_main(["validate", *args, "--ckpt_path", "last"])
    lightning_main(["fit", *args, "--ckpt_path", "last"])  # nothing to resume yet: starts from step 0
    cli = lightning_main(["validate", *args, "--ckpt_path", "last"])
    assert cli.trainer.ckpt_path == str(tmp_path / "checkpoints" / "last.ckpt")
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    lightning_main(["fit", *args, "--trainer.max_steps", "3", "--ckpt_path", "last"])  # continues to step 3
    assert checkpoint_step(tmp_path / "checkpoints" / "last.ckpt") == 3


def test_collate_draws_differ_across_workers_and_repeat_after_a_resume(tiny_bert):
    """The same sentence everywhere: only the MLM masks can tell batches apart."""
    from lightning_sentemb.data.loader import ResumableBatchSampler, TrainLoader
    from lightning_sentemb.methods import SimCSE

    method = build_method(SimCSE, tiny_bert, mlm_weight=0.1)
    ids = method.tokenizer("a sentence long enough to get some of its many tokens masked", add_special_tokens=False)
    dataset = [{"sent0": ids["input_ids"]}] * 24

    def masked(workers: int, resume_at: int = 0) -> list[torch.Tensor]:
        sampler = ResumableBatchSampler(len(dataset), 4, seed=5)
        sampler.resume(resume_at)
        return [batch["mlm"]["input_ids"] for batch in TrainLoader(dataset, sampler, method.collator, workers)]

    with_workers = masked(2)
    assert len(with_workers) == 6
    assert not torch.equal(with_workers[0], with_workers[1])  # batches 0 and 1: workers 0 and 1
    assert all(torch.equal(a, b) for a, b in zip(masked(0), with_workers, strict=False))
    assert all(torch.equal(a, b) for a, b in zip(masked(2, resume_at=4), with_workers[4:], strict=False))
    assert len(masked(0, resume_at=4)) == 2


def test_checkpoint_writes_are_atomic(tmp_path, monkeypatch):
    """A write that dies half-way leaves the previous checkpoint and no temporary file."""
    io = AtomicCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 1}, path)

    def killed_midway(obj, file):
        file.write(b"half a checkpoint")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        io.save_checkpoint({"global_step": 2}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=False) == {"global_step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
