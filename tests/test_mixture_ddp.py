"""A mixture under 2 gloo processes: every global batch (both ranks) comes from one dataset, the ranks' rows
distinct, and a fit killed with -9 mid-mixture (on forked ranks, tests/launch.py) resumes under torchrun, as
users type it, from its step checkpoint bit for bit (the mixture's position is the checkpoint's data state)."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch import Callback
from transformers import AutoTokenizer

from tests.launch import fork_ranks, run_commands, torchrun
from tests.test_mixture import sentence
from tests.test_resume import read_losses, trained_state

STEPS, KILL_AT = 7, 3  # 4 + 2 global batches of 4 an epoch: the resume crosses an epoch


class RecordDatasets(Callback):
    """Appends each step's dataset and rows (token ids of the anchors) to `<path>.rank<r>`, a JSON line a step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        features, views = batch["features"], batch["num_views"]
        anchors = zip(features["input_ids"].chunk(views)[0], features["attention_mask"].chunk(views)[0], strict=True)
        rows = [ids[mask.bool()].tolist() for ids, mask in anchors]
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as file:
            file.write(json.dumps([trainer.global_step, [batch["dataset"].name, rows]]) + "\n")


class KillAt(Callback):
    """SIGKILL to rank 0 once `step` optimizer steps are done (the step checkpoint of the step before is on disk)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step and trainer.is_global_zero:
            os.kill(os.getpid(), signal.SIGKILL)


def command(folder: Path, root: Path, backbone: str, data: Path, *callbacks: dict) -> list[str]:
    datasets = {"big": {"path": str(folder / "big.csv")}, "small": {"path": str(folder / "small.csv"), "weight": 2}}
    config = root.parent / f"{root.name}-{len(callbacks)}-callbacks.yaml"
    config.write_text(json.dumps({"trainer": {"callbacks": [
        {"class_path": "tests.test_resume.RecordLosses", "init_args": {"path": str(root) + ".losses"}},
        {"class_path": "tests.test_mixture_ddp.RecordDatasets", "init_args": {"path": str(root) + ".rows"}},
        {"class_path": "lightning_sentemb.callbacks.step_checkpoints.StepCheckpoints",
         "init_args": {"every_n_train_steps": 2}},
        *callbacks]}}))
    return ["fit", "--model", "lightning_sentemb.methods.SimCSE", "--model.backbone", backbone, "--model.pooler", "cls",
            "--seed_everything", "7", "--data.data_dir", str(data), "--data.datasets", json.dumps(datasets),
            "--data.mixture_sampling", "temperature", "--data.batch_size", "2", "--data.cache_dir", str(folder / "c"),
            "--data.val_tasks", "[STSBenchmark-dev]", "--trainer.default_root_dir", str(root),
            "--trainer.max_steps", str(STEPS), "--trainer.val_check_interval", "5",
            "--trainer.check_val_every_n_epoch", "null", "--trainer.enable_progress_bar", "false",
            "--trainer.enable_model_summary", "false", "--trainer.accelerator", "cpu", "--trainer.logger", "false",
            "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.precision", "32-true",
            "-c", str(config)]


@pytest.mark.slow
def test_torchrun_mixture_batches_are_one_dataset_and_resume_bit_exact_after_kill_9(tiny_bert, sts_fixture, tmp_path):
    for name, size in (("big", 16), ("small", 8)):
        (tmp_path / f"{name}.csv").write_text("sent0,sent1\n" + "".join(
            f"{sentence(i)} {name},{sentence(i, ' too')}\n" for i in range(size)))
    kill = {"class_path": "tests.test_mixture_ddp.KillAt", "init_args": {"step": KILL_AT}}
    with pytest.raises(mp.ProcessExitedException, match="process 0 terminated with signal SIGKILL"):
        fork_ranks(run_commands, [command(tmp_path, tmp_path / "reference", tiny_bert, sts_fixture),
                                  command(tmp_path, tmp_path / "run", tiny_bert, sts_fixture, kill)])
    assert (tmp_path / "reference" / "checkpoints" / "last.ckpt").exists()
    assert not (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()  # no clean stop: only step=2.ckpt
    step_checkpoint = tmp_path / "run" / "checkpoints" / "step=2.ckpt"
    resumed = torchrun([str(Path(sys.executable).with_name("sentemb")),
                        *command(tmp_path, tmp_path / "run", tiny_bert, sts_fixture), "--ckpt_path",
                        str(step_checkpoint)], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = read_losses(tmp_path / "reference.losses")
    assert sorted(expected) == list(range(1, STEPS + 1))
    assert read_losses(tmp_path / "run.losses") == expected  # float equality: bit for bit
    state, reference = trained_state(tmp_path / "run"), trained_state(tmp_path / "reference")
    assert all(torch.equal(state[k], reference[k]) for k in reference)
    tokenizer = AutoTokenizer.from_pretrained(tiny_bert)
    anchors = {name: {tuple(tokenizer(f"{sentence(i)} {name}")["input_ids"]) for i in range(size)}
               for name, size in (("big", 16), ("small", 8))}
    ranks = [read_losses(Path(f"{tmp_path / 'reference.rows'}.rank{r}")) for r in range(2)]
    names = []
    for step in range(STEPS):  # both ranks' rows: distinct anchors of the one dataset the step names
        (name, rows0), (other, rows1) = ranks[0][step], ranks[1][step]
        rows = set(map(tuple, rows0 + rows1))
        assert name == other and len(rows) == 4 and rows <= anchors[name], step
        names.append(name)
    # temperature 0.5, weights 1 : 2: 1 x √4 : 2 x √2 of 6 batches = 2.49 : 3.51 -> 2 and 4 an epoch, then one more
    assert names.count("small") in (4, 5)
    # the resumed steps (2 to 6, under torchrun) drew on each rank the rows of the reference's
    resumed = [read_losses(Path(f"{tmp_path / 'run.rows'}.rank{r}")) for r in range(2)]
    assert resumed == ranks
