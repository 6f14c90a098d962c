"""Evaluation shared by the ranks: `encode` copies to the host without a wait per batch, every rank
encodes a share (`encode_across_ranks`), validation with extra evaluators scores the same with 2
gloo processes as with 1, and one rank's scoring error is raised on every rank."""

from __future__ import annotations

import csv
import re
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_sentemb.distributed import gather_strided_rows
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.evaluation.across_ranks import assign_tasks
from lightning_sentemb.lightning_cli import lightning_main
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.simcse import SimCSE
from tests.conftest import write_sts_fixture
from tests.evaluation.conftest import write_clustering_fixture, write_transfer_fixture
from tests.launch import fork_ranks

SENTENCES = ["a man plays guitar .", "the cat sleeps on the sofa all day long", "kids play football",
             "birds", "a woman is slicing an onion in the kitchen", "two dogs run"]


def per_batch_reference(method: SimCSE, sentences: list[str], batch_size: int) -> torch.Tensor:
    """What `encode` computed before: batches longest first, each copied to the host on its own."""
    method.eval()
    ids = method.encoder.format.sentence_ids(sentences)
    order = np.argsort([len(i) for i in ids], kind="stable")[::-1]
    out = torch.empty(len(sentences), method.output_size)
    with torch.inference_mode():
        for start in range(0, len(sentences), batch_size):
            rows = order[start : start + batch_size]
            features = method.features_from_ids([ids[i] for i in rows])
            out[torch.as_tensor(rows.copy())] = method.embed_features(features).cpu()
    return out


def test_encode_equals_the_per_batch_copy(tiny_bert):
    method = build_method(SimCSE, tiny_bert, pooler="cls", mlp="none")
    encoded = method.encode(SENTENCES, batch_size=4)
    assert encoded.dtype == torch.float32 and encoded.device.type == "cpu" and not encoded.is_pinned()
    assert torch.equal(encoded, per_batch_reference(method, SENTENCES, 4))
    assert method.encode([]).shape == (0, method.output_size)


def gather_worker(rank: int, init_file: str, backbone: str, out_file: str) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool (it hangs), as DataLoader workers
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    rows = {total: gather_strided_rows(torch.arange(total * 3.0).view(total, 3)[rank::2], total)
            for total in (1, 4, 5)}  # one rank empty, equal shares, unequal shares
    method = build_method(SimCSE, backbone, pooler="cls", mlp="none")
    encoded = method.encode_across_ranks(SENTENCES, batch_size=2)
    torch.save({"rows": rows, "encoded": encoded}, f"{out_file}.{rank}")
    dist.destroy_process_group()


def test_ranks_share_encoding_and_all_get_every_row_in_order(tiny_bert, tmp_path):
    # fork: the ranks start with this process's imports (spawn re-imports torch and transformers in each)
    mp.start_processes(gather_worker, args=(str(tmp_path / "init"), tiny_bert, str(tmp_path / "out")), nprocs=2,
                       join=True, start_method="fork")
    single = build_method(SimCSE, tiny_bert, pooler="cls", mlp="none")
    assert torch.equal(single.encode_across_ranks(SENTENCES, batch_size=2), single.encode(SENTENCES, batch_size=2))
    for rank in (0, 1):
        result = torch.load(tmp_path / f"out.{rank}")
        for total, rows in result["rows"].items():
            assert torch.equal(rows, torch.arange(total * 3.0).view(total, 3))
        torch.testing.assert_close(result["encoded"], single.encode(SENTENCES, batch_size=2), atol=1e-5, rtol=1e-5)


def failing_worker(rank: int, init_file: str, data_dir: str, out_file: str) -> None:
    """Clustering split across 2 ranks, rank 1's faiss K-means raising: every rank raises, naming rank 1 (the
    process group times out in 30 s, where a rank left waiting in the gather would show)."""
    from lightning_sentemb.evaluation import clustering
    from lightning_sentemb.evaluation.across_ranks import evaluate_across_ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    if rank == 1:
        def broken(*args, **kwargs):
            raise ValueError("faiss broke")

        clustering.kmeans_assign = broken

    def encode(sentences: list[str], label: str = "") -> torch.Tensor:
        return torch.tensor([[len(s), s.count("a"), 1.0] for s in sentences])

    try:
        evaluate_across_ranks(encode, ["cluster"], data_dir, Path(out_file).parent, name="SimCSE")
        Path(f"{out_file}.{rank}").write_text("no error")
    except Exception as error:
        Path(f"{out_file}.{rank}").write_text(f"{type(error).__name__}: {error} (cause: {error.__cause__!r})")
    dist.destroy_process_group()


def test_a_ranks_scoring_error_is_raised_on_every_rank(evaluation_data, tmp_path):
    mp.start_processes(failing_worker, args=(str(tmp_path / "init"), str(evaluation_data), str(tmp_path / "out")),
                       nprocs=2, join=True, start_method="fork")
    said = [(tmp_path / f"out.{rank}").read_text() for rank in (0, 1)]
    for text in said:
        assert re.match(r"RuntimeError: rank 1 failed scoring cluster/\S+(, cluster/\S+)* of the SimCSE evaluation: "
                        r"ValueError: faiss broke \(cause: ", text), text
    assert said[0].endswith("(cause: None)") and said[1].endswith("(cause: ValueError('faiss broke'))")


@pytest.fixture(scope="module")
def evaluation_data(tmp_path_factory) -> Path:
    root = write_sts_fixture(tmp_path_factory.mktemp("data"))
    write_transfer_fixture(root)
    return write_clustering_fixture(root)


def validate(backbone: str, data: Path, root: Path, devices: int) -> dict[str, float]:
    """`sentemb validate` of the untrained model on `devices` gloo processes (one: in this process; two: forked
    from it, tests/launch.py); the metrics rank 0 logged."""
    args = ["validate", "--model", "lightning_sentemb.methods.SimCSE", "--model.backbone", backbone,
            "--model.pooler", "cls", "--data.data_dir", str(data), "--data.eval_batch_size", "4",
            "--data.val_tasks", "[STSBenchmark-dev, SICKRelatedness-dev]",
            "--data.val_evaluators", "[transfer, cluster]",
            "--data.cache_dir", str(root / "cache"), "--trainer.default_root_dir", str(root),
            "--trainer.accelerator", "cpu", "--trainer.devices", str(devices), "--trainer.enable_progress_bar", "false",
            *(["--trainer.strategy", "ddp"] if devices > 1 else [])]
    if devices == 1:
        lightning_main(args)
    else:
        fork_ranks(lightning_main, args, processes=devices)
    with open(next(root.glob("lightning_logs/version_*/metrics.csv"))) as file:
        rows = list(csv.DictReader(file))
    return {key: float(value) for row in rows for key, value in row.items() if value and key != "step"}


@pytest.mark.slow
def test_validation_with_extra_evaluators_scores_the_same_on_two_processes(tiny_bert, evaluation_data, tmp_path):
    one = validate(tiny_bert, evaluation_data, tmp_path / "one", 1)
    two = validate(tiny_bert, evaluation_data, tmp_path / "two", 2)
    assert {"val/STSBenchmark-dev", "val/SICKRelatedness-dev", "val/transfer/MR", "val/transfer/MRPC",
            "val/cluster/AgNews/acc", "val/cluster/Tweet/nmi"} <= one.keys()
    assert one.keys() == two.keys()
    for key, value in one.items():
        assert two[key] == pytest.approx(value, abs=1e-3), key


def test_each_rank_scores_its_share_of_the_tasks_largest_first():
    sizes = {"transfer/MR": 100, "transfer/CR": 40, "cluster/AgNews": 70, "cluster/Tweet": 30, "transfer/SUBJ": 10}
    # MR to rank 0 (100), AgNews to 1 (70), CR to 1 (110), Tweet to 0 (130), SUBJ to 1 (120)
    assert assign_tasks(sizes, 2) == [["transfer/MR", "cluster/Tweet"],
                                      ["cluster/AgNews", "transfer/CR", "transfer/SUBJ"]]
    assert assign_tasks(sizes, 1) == [sorted(sizes, key=lambda t: -sizes[t])]
    assert assign_tasks({"cluster/Tweet": 5}, 3) == [["cluster/Tweet"], [], []]  # a rank may score nothing


def test_validation_takes_simcses_five_transfer_folds_and_the_test_sentevals_ten(tiny_bert, evaluation_data, tmp_path,
                                                                                 monkeypatch):
    """`data.val_transfer_kfold` (5 by default, as SimCSE's evaluation during training) reaches the transfer
    cross-validation of validation; the test's stays 10. A plan's folds checked against the task alone."""
    from lightning_sentemb.data.datamodule import SentEmbDataModule
    from lightning_sentemb.data.transfer import load_transfer_task
    from lightning_sentemb.evaluation.suite import SuitePlan, evaluate_suite
    from lightning_sentemb.evaluation.transfer import evaluate_transfer_splits
    from lightning_sentemb.methods import validation

    method = build_method(SimCSE, tiny_bert, pooler="cls", mlp="none")

    def numpy(sentences, label=""):
        return method.encode(list(sentences)).float().numpy()

    # MRPC: a train/test task whose C is picked by k-fold; its accuracy differs between 5 and 10 folds here
    mrpc = load_transfer_task("MRPC", evaluation_data)
    alone = {kfold: evaluate_transfer_splits(numpy, "MRPC", mrpc, kfold=kfold, few_shot=False)["acc"]
             for kfold in (5, 10)}
    assert alone[5] != alone[10]  # so the check below can tell the two apart
    for kfold in (5, 10):
        plan = SuitePlan(["transfer"], transfer={"MRPC": mrpc}, transfer_kfold=kfold)
        assert evaluate_suite(method.encode, plan, figure_dir=tmp_path)["transfer"]["MRPC"]["acc"] == alone[kfold]
    assert SuitePlan(["transfer"]).transfer_kfold == 10

    assert SentEmbDataModule(data_dir=str(evaluation_data)).val_transfer_kfold == 5
    with pytest.raises(SentEmbUserError, match="data.val_transfer_kfold is 1: .* at least 2 folds"):
        SentEmbDataModule(data_dir=str(evaluation_data), val_transfer_kfold=1)
    asked = {}
    monkeypatch.setattr(validation, "evaluate_across_ranks",
                        lambda *args, transfer_kfold, **kwargs: asked.setdefault("kfold", transfer_kfold) and {})
    datamodule = SentEmbDataModule(data_dir=str(evaluation_data), val_evaluators=["transfer"],
                                   test_evaluators=["transfer"], val_transfer_kfold=3)
    trainer = type("Trainer", (), {"datamodule": datamodule, "default_root_dir": str(tmp_path), "is_global_zero": True})
    fake = type("Method", (), {"trainer": trainer, "encode_across_ranks": None, "global_step": 0, "loggers": []})
    for stage, kfold in (("val", 3), ("test", 10)):
        asked.clear()
        validation.run_extra_evaluators(fake, stage)
        assert asked["kfold"] == kfold
