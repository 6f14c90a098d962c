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
    with pytest.raises(SentEmbUserError, match=r"--method no_such_method: no experiments/no_such_method.yaml \(the"):
        config_files("no_such_method", [])
    with pytest.raises(SentEmbUserError, match="-c: no such config: experiments/nope.yaml$"):
        config_files("simcse", ["experiments/nope.yaml"])
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
def test_reproduce_two_seeds_prints_the_table_beside_the_paper(tiny_bert, sts_fixture, tmp_path, capsys, monkeypatch):
    """With `--mteb-sts`, on an mteb task built on the fixture's STS-B test file in place of the hub's seven:
    each seed's MTEB score is its tested checkpoint's, so it equals SentEval's STS-B of that seed."""
    from lightning_sentemb.data.senteval import load_sts_task
    from tests.evaluation.test_mteb import local_sts_task

    stsb = load_sts_task("STSBenchmark", sts_fixture)
    monkeypatch.setattr("lightning_sentemb.evaluation.mteb.named_tasks",
                        lambda names: [local_sts_task("STSBenchmark", stsb.first, stsb.second, stsb.gold)])
    root = tmp_path / "repro"
    main(["reproduce", "-c", "experiments/demo/simcse.yaml", "--seeds", "2", "--paper", "simcse", "--root", str(root),
          "--mteb-sts", "--",
          *tiny_overrides(tiny_bert, sts_fixture, tmp_path), "--trainer.max_steps=4", "--trainer.val_check_interval=2",
          "--model.lr=1e-2"])
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
    for seed in ("0", "1"):
        senteval = saved["seeds"][seed]["STSBenchmark"]
        assert saved["mteb"]["seeds"][seed]["STSBenchmark"] == pytest.approx(senteval, abs=0.01)
    assert saved["mteb"]["best_seed"] == saved["best_seed"] and "| simcse mteb mean ± std |" in out
    assert "| STS-B | " in markdown.split("MTEB's STS tasks")[1]
    for seed in (0, 1):
        run = root / f"seed-{seed}"
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["best.ckpt"]  # one lean best per run
        assert f"seed_everything: {seed}" in (run / "lightning_logs" / "version_0" / "config.yaml").read_text()


def test_report_puts_mteb_beside_senteval_with_senteval_best_seed(tmp_path, capsys):
    """`--mteb-sts`'s part of the report: MTEB's per-seed table, whose best row is the checkpoint that
    SentEval's Avg. picked (seed 1 here, though seed 0 has MTEB's better Avg.), and the two side by side."""
    from lightning_sentemb.reproduce import report

    results = {0: {"STS12": 70.0, "SICKRelatedness": 80.0, "avg": 75.0},
               1: {"STS12": 72.0, "SICKRelatedness": 82.0, "avg": 77.0}}
    mteb = {0: {"STS12": 71.0, "SICK-R": 79.0, "avg": 75.0}, 1: {"STS12": 73.0, "SICK-R": 77.0, "avg": 74.0}}
    report("simcse", results, tmp_path, mteb_results=mteb)
    out = capsys.readouterr().out
    assert "| simcse mteb best of 2 (seed 1) | 73.00 | 77.00 | 74.00 |" in out
    assert "| simcse mteb mean ± std | 72.00 ± 1.41 | 78.00 ± 1.41 | 74.50 ± 0.71 |" in out
    for row in ("| STS12 | 71.00 ± 1.41 | 72.00 ± 1.41 | +1.00 |", "| SICK-R | 81.00 ± 1.41 | 78.00 ± 1.41 | -3.00 |",
                "| Avg. | 76.00 ± 1.41 | 74.50 ± 0.71 | -1.50 |"):
        assert row in out and row in (tmp_path / "reproduce.md").read_text()
    saved = json.loads((tmp_path / "reproduce.json").read_text())
    assert saved["best_seed"] == saved["mteb"]["best_seed"] == 1
    assert saved["mteb"]["seeds"]["0"] == mteb[0] and saved["mteb"]["mean"]["SICK-R"] == 78.0


def test_mteb_after_test_scores_the_module_it_is_given(tiny_bert):
    """The callback that `run_seeds` adds to `trainer.test`: mteb's score of the module's own
    embeddings (`encode_across_ranks`, one process here) equals our Spearman of them."""
    from lightning_sentemb.build import build_method
    from lightning_sentemb.evaluation.sts import pair_cosines, spearman
    from lightning_sentemb.methods import SimCSE
    from lightning_sentemb.reproduce import MTEBAfterTest
    from tests.evaluation.test_mteb import local_sts_task

    first = ["a man plays the guitar .", "a woman is slicing an onion .", "the cat sleeps on the mat .",
             "two dogs run in a park ."]
    second = ["a man is playing music .", "someone cuts a vegetable .", "a cat is asleep .", "the market fell ."]
    gold = [4.5, 3.8, 4.0, 0.2]
    method = build_method(SimCSE, tiny_bert, pooler="avg")
    callback = MTEBAfterTest([local_sts_task("Pairs", first, second, gold)], "seed-0")
    callback.on_test_end(None, method)
    expected = 100 * spearman(pair_cosines(method.encode(first), method.encode(second)), gold)
    assert callback.scores == pytest.approx({"Pairs": expected, "avg": expected}, abs=1e-6)


def test_mteb_sts_without_its_data_stops_in_one_line_before_any_fit(monkeypatch, capsys):
    pytest.importorskip("mteb")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("lightning_sentemb.reproduce.lightning_main", lambda argv: pytest.fail("a fit started"))
    with pytest.raises(SystemExit) as exit_:
        main(["reproduce", "-c", "experiments/demo/simcse.yaml", "--seeds", "1", "--mteb-sts"])
    err = capsys.readouterr().err.strip()
    if exit_.value.code is None:
        pytest.skip("STS12's data is in this machine's Hugging Face cache")
    assert exit_.value.code == 2 and "\n" not in err
    assert err.startswith("sentemb: error: --mteb-sts STS12: its data (mteb/sts12-sts) is not in the Hugging Face "
                          "cache")
    assert err.endswith("fetch it once online: python -c \"import mteb; mteb.get_task('STS12').load_data()\"")


@pytest.mark.slow  # a 2-step fit, as the test above
def test_a_single_test_task_writes_its_mean_and_std(tiny_bert, sts_fixture, tmp_path, capsys):
    """One test task has no 'avg' (nothing to average): the run still ends in `reproduce.json`, the mean ±
    std of that task, and the published row is compared on that task alone (issue 46: KeyError 'avg')."""
    root = tmp_path / "repro"
    main(["reproduce", "-c", "experiments/demo/simcse.yaml", "--seeds", "1", "--paper", "simcse", "--root", str(root),
          "--", *tiny_overrides(tiny_bert, sts_fixture, tmp_path), "--trainer.max_steps=2",
          "--trainer.val_check_interval=2", "--data.test_tasks=[STSBenchmark]"])
    saved = json.loads((root / "reproduce.json").read_text())
    stsb = saved["seeds"]["0"]["STSBenchmark"]
    assert list(saved["seeds"]["0"]) == ["STSBenchmark"] and saved["best_seed"] == 0
    assert saved["mean"] == {"STSBenchmark": stsb} and saved["std"] == {"STSBenchmark": 0.0}
    assert list(saved["paper"]["tasks"]) == ["STSBenchmark"] and saved["paper"]["within_spread"] is None
    assert "Avg.: not compared: the run tested 1/7 tasks (STS-B), not the paper's seven." in capsys.readouterr().out


def test_report_of_one_task_over_seeds_is_its_mean_and_sample_std(tmp_path):
    from lightning_sentemb.reproduce import report

    report("simcse", {0: {"STSBenchmark": 70.0}, 1: {"STSBenchmark": 72.0}, 2: {"STSBenchmark": 71.0}}, tmp_path)
    saved = json.loads((tmp_path / "reproduce.json").read_text())
    assert saved["mean"] == {"STSBenchmark": 71.0} and saved["std"] == pytest.approx({"STSBenchmark": 1.0})
    assert saved["best_seed"] == 1
    assert "| simcse best of 3 (seed 1) | 72.00 |" in (tmp_path / "reproduce.md").read_text()
