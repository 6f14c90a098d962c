"""`sentemb reproduce`: one fit per seed, each best checkpoint tested, mean ± std and best of N."""

import json

import pytest

from lightning_sentemb.cli import main, parse_seeds
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.reproduce import config_files, format_report, summarize
from tests.test_sweep import tiny_overrides

TASKS = ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness", "avg"]


def test_seeds_are_a_count_or_a_list():
    assert parse_seeds("3") == [0, 1, 2]
    assert parse_seeds("7,42") == [7, 42]


def test_method_names_its_experiment_file_and_c_files_follow():
    assert config_files("simcse", ["experiments/trainer/a100.yaml"]) == [
        "experiments/simcse.yaml", "experiments/trainer/a100.yaml"]
    with pytest.raises(SentEmbUserError, match="methods in experiments/"):
        config_files("no_such_method", [])
    with pytest.raises(SentEmbUserError, match="--method M"):
        config_files(None, [])


def test_summary_is_mean_sample_std_and_best_avg():
    results = {0: {"STS12": 70.0, "avg": 75.0}, 1: {"STS12": 72.0, "avg": 77.0}, 2: {"STS12": 74.0, "avg": 76.0}}
    summary = summarize(results)
    assert summary["mean"] == {"STS12": 72.0, "avg": 76.0}
    assert summary["std"] == pytest.approx({"STS12": 2.0, "avg": 1.0})
    assert summary["best_seed"] == 1
    report = format_report("simcse", results)
    assert "| simcse mean ± std | 72.00 ± 2.00 | 76.00 ± 1.00 |" in report
    assert "| simcse best of 3 (seed 1) | 72.00 | 77.00 |" in report


@pytest.mark.slow  # ~20 s alone on 2 free cores
def test_reproduce_two_seeds_prints_the_table_beside_the_paper(tiny_bert, sts_fixture, tmp_path, capsys):
    root = tmp_path / "repro"
    main(["reproduce", "-c", "experiments/demo/simcse.yaml", "--seeds", "2", "--paper", "simcse", "--root", str(root), "--",
          *tiny_overrides(tiny_bert, sts_fixture, tmp_path), "--trainer.max_steps=4", "--trainer.val_check_interval=2", "--model.lr=1e-2"])
    out = capsys.readouterr().out
    assert "Test metric" not in out and out.count("| model | STS12") == 2 + 1  # each seed's table, then the summary
    assert f"{root}: " in out and " MB on disk (best.ckpt of each seed; last.ckpt removed)" in out
    for row in ("simcse seed 0", "simcse seed 1", "simcse mean ± std", "simcse best of 2 (seed "):
        assert f"| {row}" in out
    for column in ("STS12", "STS13", "STS14", "STS15", "STS16", "STS-B", "SICK-R", "Avg."):
        assert column in out
    saved = json.loads((root / "reproduce.json").read_text())
    assert list(saved["seeds"]) == ["0", "1"] and list(saved["mean"]) == TASKS
    # the published row beside the reproduced one, task by task, with the differences
    paper = saved["paper"]
    assert paper["paper"] == "simcse" and list(paper["tasks"]) == TASKS
    stsb = paper["tasks"]["STSBenchmark"]
    assert stsb["paper"] == 76.85 and stsb["mean"] == pytest.approx(saved["mean"]["STSBenchmark"])
    assert stsb["mean_minus_paper"] == pytest.approx(saved["mean"]["STSBenchmark"] - 76.85)
    row = f"| STS-B | 76.85 | {stsb['mean']:.2f} ± {stsb['std']:.2f} | {stsb['mean_minus_paper']:+.2f} |"
    assert row in out
    assert "Paper: simcse, unsup-SimCSE-BERT-base" in out and "Avg.: reproduced mean" in out
    assert not paper["within_spread"]  # four steps of a tiny random model are far from 76.25
    markdown = (root / "reproduce.md").read_text()
    assert row in markdown and "| simcse mean ± std |" in markdown
    assert saved["seeds"]["0"] != saved["seeds"]["1"]  # the seed changes the run
    for seed in (0, 1):
        run = root / f"seed-{seed}"
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.ckpt"]  # one lean best per run
        assert f"seed_everything: {seed}" in (run / "lightning_logs" / "version_0" / "config.yaml").read_text()
