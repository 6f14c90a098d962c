"""World-size invariance: k processes equal 1 process with the same global batch.

`sentemb fit` on 2 CPU processes (gloo, `strategy: ddp`, batch 4 each) and on 1 process (batch 8),
dropout 0, fp32, 3 steps at the default lr 3e-5: each step trains on the same 8 examples, and the
checkpointed state after the last step is the same (every weight; ClusterNS's centroids, which start at
step 1 with σ 1.0; LoRA's adapters) within 1e-6. AdamW's first steps move every trained weight by about
the lr whatever its gradient's size, so a gradient of another direction shows 30x above that; sums
taken in another order differ by rounding, which AdamW's normalization lifts to ~1e-7 on weights whose
true gradient is 0 (attention key biases). The in-batch negatives are the global
batch (`distributed.gather_with_grad`), the batch sampler gives rank r every world-size-th example of
one permutation, and DDP averages the ranks' gradients: the single-process gradient.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback

from lightning_sentemb.lightning_cli import lightning_main
from tests.launch import fork_ranks, run_commands
from tests.test_resume import read_losses, run_args, trained_state

STEPS, GLOBAL_BATCH = 3, 8
# Averaged tokens: the random tiny BERT's [CLS] vectors are nearly one (1 - cos < 1e-5), where the loss's
# gradient is mostly rounding (an AdamW step then goes either way) and a sample's two centroid similarities
# differ by ~1e-7; averaged, the sentences are apart (1 - cos ~ 0.05, centroid gaps > 1e-3).
COMMON = ["--model.dropout", "0", "--trainer.max_steps", str(STEPS)]
# Plain SimCSE runs inside each case: ClusterNS's step is SimCSE's plus the centroids, LoRA is SimCSE's,
# and caching runs DCLR, SimCSE's views and encoder with noise negatives and its own similarities weighing
# the in-batch ones (the noise drawn alike and moved against the gathered anchors on every rank), so the
# cached step of k processes equals 1 process's for it too (a case of its own cost two more interpreters
# per rank and found nothing these miss; SimCSE's cached DDP step: tests/test_grad_cache.py).
CASES = {
    "clusterns": ("clusterns", []),
    # three views (the negations: `data.negate`), the BML of each rank's own rows (λ 1: it weighs) beside the
    # gathered InfoNCE. In fp64: the tiny BERT's [MASK] states of different sentences are nearly one (1 - cos
    # ~ 1e-6), so in fp32 their gradients are mostly rounding, which AdamW lifts to the lr's size
    "sncse": ("sncse", ["--model.bml_weight", "1.0", "--trainer.precision", "64-true"]),
    "dclr-gradcache": ("dclr", ["--model.grad_cache_chunk", "3"]),
    "simcse-lora": ("simcse", ["--model.lora", "{r: 4, alpha: 8, dropout: 0.0, target_modules: all-linear}"]),
    # the attack's gradient takes every process's loss terms (through the gathers' backward); no drawn
    # augmentation beside it: a batch's draws are seeded by rank (as dropout's), not by example
    "consert-adversarial": ("consert", ["--model.augmentations", "[none, adversarial]", "--model.lr", "3e-5"]),
    # each rank pushes the global batch's keys; the partners are one draw (repetitions are drawn per rank
    # as dropout is: off here, as dropout)
    "esimcse": ("esimcse", ["--model.dup_rate", "0"]),
    "mixcse": ("mixcse", []),
}


class RecordRows(Callback):
    """Appends each step's training rows (token ids without padding) to `<path>.rank<r>`, one JSON line a step."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        features = batch["features"]
        pairs = zip(features["input_ids"], features["attention_mask"], strict=True)
        rows = [ids[mask.bool()].tolist() for ids, mask in pairs]
        with open(f"{self.path}.rank{trainer.global_rank}", "a") as file:
            file.write(json.dumps([trainer.global_step, rows]) + "\n")


def rows_per_step(path: Path, ranks: int) -> dict[int, list]:
    """{step: the sorted rows of every rank}."""
    steps: dict[int, list] = {}
    for rank in range(ranks):
        for step, rows in read_losses(Path(f"{path}.rank{rank}")).items():
            steps.setdefault(step, []).extend(rows)
    return {step: sorted(rows) for step, rows in steps.items()}


def case_args(case: str, backbone: str, data: Path, corpus_file: Path, folder: Path, processes: int) -> list[str]:
    """`sentemb fit` arguments of CASES[case] on `processes` processes (global batch GLOBAL_BATCH), recording
    its rows under `folder`."""
    method, extra = CASES[case]
    root, rows = folder / f"{case}-{processes}-processes", folder / f"{case}-rows-{processes}"
    callbacks = folder / f"{case}-{processes}-callbacks.yaml"
    callbacks.write_text(json.dumps({"trainer": {"callbacks": [
        {"class_path": "tests.test_world_size.RecordRows", "init_args": {"path": str(rows)}}]}}))
    pooler = "mask" if method == "sncse" else "avg"
    return ["fit", *run_args(method, backbone, data, corpus_file, root, 0, *COMMON, "--model.pooler", pooler, *extra,
                             "-c", str(callbacks), "--data.batch_size", str(GLOBAL_BATCH // processes),
                             *(["--trainer.strategy", "ddp", "--trainer.devices", "2"] if processes == 2 else []))]


@pytest.fixture(scope="module")
def two_process_runs(tiny_bert, sts_fixture, corpus, tmp_path_factory) -> Path:
    """The folder where every case ran on 2 processes."""
    folder = tmp_path_factory.mktemp("two-processes")
    # one pair of forked ranks for every case (tests/launch.py)
    fork_ranks(run_commands, [case_args(case, tiny_bert, sts_fixture, corpus, folder, 2) for case in CASES])
    return folder


@pytest.mark.slow
def test_two_processes_equal_one_with_the_same_global_batch(tiny_bert, sts_fixture, corpus, two_process_runs,
                                                            tmp_path):
    """Every case in one test: its 2-process runs share one launch, which a test a case would repeat on
    each xdist worker that got one of them."""
    for case in CASES:
        lightning_main(case_args(case, tiny_bert, sts_fixture, corpus, tmp_path, 1))  # the reference, in process
        runs = {processes: (rows_per_step(folder / f"{case}-rows-{processes}", processes),
                            trained_state(folder / f"{case}-{processes}-processes"))
                for processes, folder in ((1, tmp_path), (2, two_process_runs))}
        (rows_1, state_1), (rows_2, state_2) = runs[1], runs[2]
        assert sorted(rows_1) == list(range(STEPS)) and rows_2 == rows_1, case  # the same examples at every step
        assert len(rows_1[0]) == (3 if case == "sncse" else 2) * GLOBAL_BATCH, case  # the views of each example
        assert state_2.keys() == state_1.keys(), case
        if case == "clusterns":
            assert bool(state_1["cluster_state.initialized"]) and int(state_1["cluster_state.num_updates"]) == STEPS - 1
        for name, tensor in state_1.items():
            if tensor.is_floating_point():
                torch.testing.assert_close(state_2[name], tensor, atol=1e-6, rtol=0,
                                           msg=lambda m, name=name, case=case: f"{case}, {name}: {m}")
            else:
                assert torch.equal(state_2[name], tensor), (case, name)
