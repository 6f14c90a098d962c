"""FSDP2 (`trainer.strategy: fsdp_layers`) on 2 CPU processes (gloo): it trains as DDP does (fp32, dropout
0: the same weights after 3 steps, stopped by SIGTERM and resumed after step 2, to 1e-9, ClusterNS's centroids
and LoRA's adapters included, and so the same embeddings), runs the preset's user command with evaluators
in bf16, and `--ckpt_path last` follows rank 0 where the ranks see different files (processes srun starts;
an elastic restart never reads the previous attempt's answer). Sharded validation and `encode` run without
inference mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_sentemb.distributed import decided_by_rank_zero
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.lightning_cli import resolve_last
from lightning_sentemb.loading import load_method
from tests.conftest import write_sts_fixture
from tests.evaluation.conftest import write_clustering_fixture
from tests.launch import fork_ranks, free_port, run_commands
from tests.test_resume import run_args, trained_state

REPO = Path(__file__).resolve().parents[1]
SENTENCES = ["a man plays guitar .", "the cat sleeps on the sofa", "kids play football", "birds"]
LORA = "{r: 4, alpha: 8, dropout: 0.0, target_modules: all-linear}"
# ClusterNS from its global initialization (every rank encodes through the sharded model), with LoRA adapters:
# one case holds both (centroids and adapters), three fits where a case each took six
CASES = {"clusterns-lora": ("clusterns", ["--model.global_init_samples", "8", "--model.lora", LORA])}


def fit(args: list[str]) -> None:
    done = subprocess.run([sys.executable, "-m", "lightning_sentemb.cli", "fit", *args], cwd=REPO, timeout=600,
                          env={**os.environ, "WANDB_MODE": "disabled"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
def test_fsdp_trains_resumes_and_embeds_as_ddp(tiny_bert, sts_fixture, corpus, tmp_path, capfd):
    """Each case: 3 steps under DDP; under FSDP 2 steps, stopped by SIGTERM (a decision every step) and
    resumed. The weights (centroids and adapters included) and the embeddings are DDP's, to rounding. One pair
    of forked ranks (tests/launch.py) runs the three fits (Lightning's relaunch: the preset's test below)."""
    kill = tmp_path / "kill.yaml"
    kill.write_text(json.dumps({"trainer": {"callbacks": [
        {"class_path": "tests.test_resume.TerminateAt", "init_args": {"step": 2}}]}}))

    def command(case: str, strategy: str, *extra: str) -> list[str]:
        method, case_args = CASES[case]
        return ["fit", *run_args(method, tiny_bert, sts_fixture, corpus, tmp_path / f"{case}-{strategy}", 0,
                                 "--model.dropout", "0", "--model.pooler", "avg", "--trainer.devices", "2",
                                 "--trainer.precision", "32-true", "--trainer.max_steps", "3",
                                 "--trainer.log_every_n_steps", "1", "--trainer.strategy", strategy,
                                 *case_args, *extra)]

    commands = [command(case, "ddp") for case in CASES]
    for case in CASES:
        commands += [command(case, "fsdp_layers", "-c", str(kill)), command(case, "fsdp_layers", "--ckpt_path", "last")]
    capfd.readouterr()
    fork_ranks(run_commands, commands)
    said = capfd.readouterr().out  # the forked ranks' output
    assert [line for line in said.splitlines() if line.startswith("launch:")] == [  # said by both ranks
        "launch: command 1 stopped by SIGTERM"] * 2, said[-3000:]
    for case in CASES:
        ddp, fsdp = tmp_path / f"{case}-ddp", tmp_path / f"{case}-fsdp_layers"
        reference, sharded = trained_state(ddp), trained_state(fsdp)
        assert sharded.keys() == reference.keys()  # clean names: no FSDP prefix; LoRA: the adapters and heads only
        assert any("lora_B" in name for name in sharded) and not any("base_layer" in name for name in sharded)
        assert sharded["cluster_state.centroids"].dtype == torch.float32
        assert int(sharded["cluster_state.num_updates"]) == 3  # the global initialization, then steps 1 and 2
        # FSDP's reduce-scatter sums as DDP's all-reduce does here (equal without a resume); the resumed
        # optimizer differs from DDP's by rounding (~1e-11)
        for name, tensor in reference.items():
            if tensor.is_floating_point():
                torch.testing.assert_close(sharded[name], tensor, atol=1e-9, rtol=0,
                                           msg=lambda m, case=case, name=name: f"{case} {name}: {m}")
            else:
                assert torch.equal(sharded[name], tensor), name
        embeddings = [load_method(str(root / "checkpoints" / "last.ckpt")).encode(SENTENCES) for root in (ddp, fsdp)]
        torch.testing.assert_close(embeddings[1], embeddings[0], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_the_fsdp_preset_runs_the_demo_on_two_cpu_processes(tiny_bert, corpus, tmp_path):
    """The documented command, on the tiny model and data: bf16-mixed, validation with an extra evaluator
    (every rank encodes through the sharded model: clustering, whose scoring is cheap; transfer's 10 x 10
    folds cost a minute here, and its scoring across ranks is `test_distributed_eval.py`'s); ClusterNS's
    centroids stay fp32 and move by γ 1e-3, below bf16's resolution."""
    root, data = tmp_path / "run", write_clustering_fixture(write_sts_fixture(tmp_path / "data"))
    fit(["-c", "experiments/demo/simcse.yaml", "-c", "experiments/trainer/fsdp.yaml", "--trainer.accelerator", "cpu",
         "--trainer.devices", "2", "--model", "lightning_sentemb.methods.ClusterNS", "--model.backbone", tiny_bert,
         "--model.num_clusters", "2", "--model.sigma", "1.0", "--model.gamma", "1e-3", "--model.lr", "1e-3",
         "--data.data_dir", str(data), "--data.train_file", str(corpus), "--data.batch_size", "4",
         "--data.num_workers", "0", "--data.pin_memory", "false", "--data.cache_dir", str(tmp_path / "cache"),
         "--data.val_tasks", "[STSBenchmark-dev]", "--data.val_evaluators", "[cluster]",
         "--trainer.max_steps", "3", "--trainer.val_check_interval", "2", "--trainer.default_root_dir", str(root),
         "--trainer.enable_progress_bar", "false", "--trainer.logger", "false"])
    best = torch.load(root / "checkpoints" / "best.ckpt", weights_only=False)
    last = torch.load(root / "checkpoints" / "last.ckpt", weights_only=False)
    assert best["global_step"] == 2 and last["global_step"] == 3
    before, after = best["state_dict"]["cluster_state.centroids"], last["state_dict"]["cluster_state.centroids"]
    assert after.dtype == torch.float32 and 0 < (after - before).abs().max() < 1e-2


def test_ckpt_path_last_follows_rank_zero(tmp_path):
    """Where rank 0 sees last.ckpt and another rank does not (or the reverse), both take rank 0's answer."""
    folder = tmp_path / "checkpoints"
    callback = SimpleNamespace(dirpath=str(folder), last_path=folder / "last.ckpt")
    rank_zero_saw = {}

    def rank_zero(seen: str) -> str:
        return rank_zero_saw["answer"]

    rank_zero_saw["answer"] = "last"  # this rank sees nothing at all
    assert resolve_last("fit", callback, rank_zero) == str(callback.last_path)
    folder.mkdir()
    callback.last_path.write_bytes(b"")
    rank_zero_saw["answer"] = "none"  # this rank sees last.ckpt, rank 0 does not
    assert resolve_last("fit", callback, rank_zero) is None
    rank_zero_saw["answer"] = "missing"
    with pytest.raises(SentEmbUserError, match="--ckpt_path last: .* does not exist"):
        resolve_last("test", callback, rank_zero)
    assert resolve_last("fit", callback, lambda seen: seen) == str(callback.last_path)  # one process


def srun_environment(rank: int, port: int) -> dict[str, str]:
    """What srun sets for task `rank` of 2 on one node (job 77, step 3), and the address the job script exports."""
    return {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank),
            "SLURM_NODEID": "0", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "3", "SLURM_JOB_NAME": "test",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def srun_worker(rank: int, port: int, out: str) -> None:
    """A process as srun starts it (no agent, no process group yet): rank 0's decision through the store rank 0
    serves, then the process group on the same port, which joins that server."""
    os.environ.update(srun_environment(rank, port))
    decision = decided_by_rank_zero("last" if rank == 0 else "none")
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=2)
    ranks = torch.tensor([rank])
    dist.all_reduce(ranks)
    Path(f"{out}.{rank}").write_text(f"{decision} {int(ranks)}")
    dist.destroy_process_group()


def test_processes_srun_starts_take_rank_zeros_decision(tmp_path):
    mp.start_processes(srun_worker, args=(free_port(), str(tmp_path / "out")), nprocs=2, join=True,
                       start_method="fork")
    assert [(tmp_path / f"out.{rank}").read_text() for rank in (0, 1)] == ["last 1", "last 1"]


class SlowDeletes:
    """A prefix store whose deletions take 0.3 s each (the window in which a rank that asks again could once read
    the previous decision)."""

    def __init__(self, prefix_store: type, prefix: str, store: dist.Store) -> None:
        self.store = prefix_store(prefix, store)

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def delete_key(self, key: str) -> bool:
        time.sleep(0.3)
        return self.store.delete_key(key)


def restarted_worker(rank: int, port: int, out: str) -> None:
    """Two attempts of one torchrun run against the agent's store (served by the test, as torchrun's agent serves
    it, and outliving the attempts): rank 0 sees no checkpoint in the first and last.ckpt in the second, where
    it decides late."""
    os.environ.update({"TORCHELASTIC_RUN_ID": "run", "TORCHELASTIC_USE_AGENT_STORE": "True", "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    if rank == 0:  # rank 0 cleans the first attempt's keys up slowly: rank 1 asks again before it is done
        dist.PrefixStore = partial(SlowDeletes, dist.PrefixStore)
    first = decided_by_rank_zero("none", timeout=timedelta(seconds=30))
    if rank == 0:
        time.sleep(0.5)  # rank 1 asks first: it must wait for this attempt's answer, not take the first's
    second = decided_by_rank_zero("last" if rank == 0 else "none", timeout=timedelta(seconds=30))
    Path(f"{out}.{rank}").write_text(f"{first} {second}")


def test_an_elastic_restart_never_reads_the_previous_attempts_decision(tmp_path):
    port = free_port()
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    mp.start_processes(restarted_worker, args=(port, str(tmp_path / "out")), nprocs=2, join=True, start_method="fork")
    assert [(tmp_path / f"out.{rank}").read_text() for rank in (0, 1)] == ["none last", "none last"]
    del agent


def test_a_rank_that_waits_in_vain_says_for_what(monkeypatch):
    """Rank 1 of 2 with no rank 0 anywhere: the error names the rank, the store and the run."""
    for key, value in srun_environment(1, free_port()).items():
        monkeypatch.setenv(key, value)
    with pytest.raises(TimeoutError, match=r"--ckpt_path last: rank 1 of 2, waiting up to 0:00:00.300000 for rank "
                                           r"0's decision and its clean-up through the store at 127.0.0.1:\d+ "
                                           r"\(SLURM job 77 step 3\)"):
        decided_by_rank_zero("none", timeout=timedelta(seconds=0.3))


def grad_mode_worker(rank: int, backbone: str, out: str) -> None:
    """`sentemb validate` under fsdp_layers in one CPU process, its loop choosing as on NCCL (Lightning runs any
    gloo process group under no_grad, which hid the GPU's path): whether inference mode is on in the validation
    step and in `encode` there."""
    from lightning import Trainer
    from lightning.pytorch.loops import utilities
    from torch.utils.data import DataLoader

    from lightning_sentemb.fsdp import LayerFSDPStrategy
    from lightning_sentemb.methods.building import build_method
    from lightning_sentemb.methods.simcse import SimCSE

    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool (it hangs), nor may
    os.environ["OMP_NUM_THREADS"] = "1"  # Lightning's strategy raise the thread count again
    utilities._distributed_is_initialized = lambda: False
    method = build_method(SimCSE, backbone, pooler="cls", mlp="none")
    seen, embed = {}, method.embed_features

    def embed_features(features):
        seen["encode"] = torch.is_inference_mode_enabled()
        return embed(features)

    def validation_step(batch, batch_idx):
        seen["validation"] = torch.is_inference_mode_enabled()
        method.encode(SENTENCES[:1])

    method.embed_features, method.validation_step = embed_features, validation_step
    method.on_validation_epoch_end = None
    Trainer(strategy=LayerFSDPStrategy(), accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False).validate(method, DataLoader([0]))
    Path(out).write_text(json.dumps(seen))


def test_sharded_validation_and_encode_run_without_inference_mode(tiny_bert, tmp_path):
    mp.start_processes(grad_mode_worker, args=(tiny_bert, str(tmp_path / "seen.json")), nprocs=1, join=True,
                       start_method="fork")
    assert json.loads((tmp_path / "seen.json").read_text()) == {"validation": False, "encode": False}
