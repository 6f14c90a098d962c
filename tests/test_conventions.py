"""What a researcher expects of the conventions (issue 20): one-line config errors, presets that
compose, model cards, a resume that looks exact, fast help (readable figures:
tests/evaluation/test_eval_figures.py)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Callback

from lightning_sentemb.cli import main
from lightning_sentemb.lightning_cli import end_of_fit, lightning_main
from lightning_sentemb.methods.building import build_method
from tests.test_first_hour import error_line
from tests.test_resume import KILL_AT, MAX_STEPS, TerminateAt, run_args

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "experiments" / "demo" / "simcse.yaml"


# ----- one-line config errors ---------------------------------------------------------------------
def edited_demo(tmp_path: Path, old: str, new: str) -> str:
    """The demo config with one text edit (a typo, a bad value), as a user would make it."""
    text = DEMO.read_text()
    assert old in text
    path = tmp_path / "config.yaml"
    path.write_text(text.replace(old, new))
    return str(path)


@pytest.mark.parametrize(("old", "new", "expected"), [
    ("temperature:", "temprature:", "model.init_args.temprature: SimCSE has no such argument; "
                                    "did you mean `temperature`?"),
    ("  max_steps:", "  max_step:", "unknown key `trainer.max_step` (in {config}); did you mean `trainer.max_steps`?"),
    ("trainer:", "tranier:", "unknown key `tranier.max_steps` (in {config}); did you mean `trainer.max_steps`?"),
    ("pooler: avg", "pooler: mean", "model.init_args.pooler: 'mean' is not allowed; choose one of cls, "
                                    "cls_before_pooler, last, avg, avg_first_last, avg_emb_last, avg_top2, mask, "
                                    "echo_mean, echo_last"),
    ("mlp: none", "mlp: never", "model.init_args.mlp: 'never' is not allowed; choose one of none, train, always"),
    ("temperature: 0.05", "temperature: hot", "model.init_args.temperature: expected a float, got 'hot'"),
    ("SimCSE", "SimCSF", "model: no class named 'SimCSF'; did you mean `SimCSE`?"),
    ("eval_batch_size: 256", "eval_batch_size: 256\n  val_evaluators: [transfer, clusters]",
     "data.val_evaluators: unknown evaluator(s) clusters; choose from sts, transfer, fewshot, cluster, analysis"),
])
def test_a_config_mistake_is_one_line_naming_the_key_and_the_fix(old, new, expected, tmp_path, capsys):
    config = edited_demo(tmp_path, old, new)
    assert error_line(capsys, "fit", "-c", config) == f"sentemb: error: {expected.format(config=config)}"


def test_an_unknown_key_on_the_command_line_gets_the_closest_one(capsys):
    line = error_line(capsys, "fit", "-c", str(DEMO), "--model.init_args.temprature", "0.1")
    assert line == ("sentemb: error: model.init_args.temprature: SimCSE has no such argument; "
                    "did you mean `temperature`?")
    line = error_line(capsys, "fit", "-c", str(DEMO), "--data.batch_sise", "8")
    assert line == ("sentemb: error: unknown key `data.batch_sise` (on the command line); "
                    "did you mean `data.batch_size`?")
    # a prefix of a real key is a mistake too, not an abbreviation that silently trains
    line = error_line(capsys, "fit", "-c", str(DEMO), "--trainer.max_step", "3")
    assert line == ("sentemb: error: unknown key `trainer.max_step` (on the command line); "
                    "did you mean `trainer.max_steps`?")


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "disabled", **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environment, cwd=REPO,
                          timeout=300)


IMPORTS_AFTER = """
import sys
from lightning_sentemb.cli import main
try:
    main({args!r})
except SystemExit as stop:
    print("exit", stop.code)
print("torch imported:", "torch" in sys.modules)
"""


def test_a_missing_config_file_is_one_line_before_any_heavy_import():
    result = run_python(IMPORTS_AFTER.format(args=["fit", "-c", "experiments/demo/simcs.yaml"]))
    assert result.stderr.strip() == ("sentemb: error: config file experiments/demo/simcs.yaml does not exist; "
                                     "did you mean experiments/demo/simcse.yaml?")
    assert result.stdout.split("\n")[:2] == ["exit 2", "torch imported: False"]


def test_an_unknown_subcommand_or_tool_option_is_one_line(capsys):
    assert error_line(capsys, "fitt") == "sentemb: error: unknown subcommand 'fitt'; did you mean `fit`? " \
                                         "`sentemb --help` lists them"
    line = error_line(capsys, "evaluate", "--model", "x", "--pooler", "mean")
    assert line.startswith("sentemb: error: sentemb evaluate: argument --pooler: invalid choice: 'mean'")


# ----- fast help ---------------------------------------------------------------------------------
@pytest.mark.parametrize("tool", ["evaluate", "export", "data", "sweep", "reproduce"])
def test_tool_help_does_not_import_torch(tool):
    result = run_python(IMPORTS_AFTER.format(args=[tool, "--help"]))
    assert result.stdout.startswith(f"usage: sentemb {tool}")
    assert result.stdout.splitlines()[-2:] == ["exit 0", "torch imported: False"]


@pytest.mark.slow  # two fresh processes, one of them building Lightning's help; the tools' help: above
def test_lightning_help_is_built_once_then_printed_without_torch(tmp_path):
    first = run_python(IMPORTS_AFTER.format(args=["fit", "--help"]), SENTEMB_CACHE=str(tmp_path))
    assert first.stdout.startswith("usage: sentemb [options] fit [-c CONFIG]")
    assert "--model.help [CLASS_PATH_OR_NAME]" in first.stdout  # LightningCLI's own text
    second = run_python(IMPORTS_AFTER.format(args=["fit", "--help"]), SENTEMB_CACHE=str(tmp_path))
    assert second.stdout.splitlines()[-1] == "torch imported: False"
    assert second.stdout.rsplit("exit", 1)[0] == first.stdout.rsplit("exit", 1)[0]


# ----- resume ------------------------------------------------------------------------------------
class ProgressTotals(Callback):
    """(position in the epoch, the bar's total) after every training batch."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.append((batch_idx + 1, trainer.progress_bar_callback.total_train_batches))


def metrics_rows(root: Path) -> list[dict[str, str]]:
    (version,) = (root / "lightning_logs").iterdir()  # one CSV version for the whole run
    with (version / "metrics.csv").open(newline="") as file:
        return list(csv.DictReader(file))


def without(args: list[str], *options: str) -> list[str]:
    """`args` without the given options and their values."""
    kept = []
    for arg in args:
        if kept and kept[-1] in options:
            kept.pop()
        else:
            kept.append(arg)
    return kept


def test_a_resumed_run_looks_exact(tiny_bert, sts_fixture, corpus, tmp_path, capsys):
    """No resumability warning, one CSV version holding the rows of an uninterrupted run, the
    progress bar's total right in the resumed epoch, and the summary at the end."""
    def args(root: Path) -> list[str]:
        return [*without(run_args("simcse", tiny_bert, sts_fixture, corpus, root, 0), "--trainer.logger",
                         "--trainer.enable_progress_bar"), "--trainer.log_every_n_steps", "1"]

    lightning_main(["fit", *args(tmp_path / "reference")])
    root = tmp_path / "run"
    with pytest.raises(SystemExit):
        lightning_main(["fit", *args(root)], callbacks=[TerminateAt(KILL_AT)])
    totals = ProgressTotals()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = lightning_main(["fit", *args(root), "--ckpt_path", "last"], callbacks=[totals])
    end_of_fit(resumed)  # what `sentemb fit` prints last
    assert not [w for w in caught if "resumable" in str(w.message)]
    # 5 batches an epoch: the resume continues epoch 0 at batch 4, then epoch 1 runs batches 1-2
    assert totals.seen == [(4, 5), (5, 5), (1, 2), (2, 2)]
    # the loss of the step SIGTERM interrupts is never logged (the stop comes before Lightning logs it)
    interrupted_step = {"epoch": "0", "step": str(KILL_AT - 1)}
    expected = [row for row in metrics_rows(tmp_path / "reference")
                if not (row.items() >= interrupted_step.items() and row["train/loss"])]
    assert metrics_rows(root) == expected
    summary = capsys.readouterr().out.split("fit done:")[-1]
    assert f"{MAX_STEPS} steps. Best STS-B dev" in summary
    for path in (root / "checkpoints" / "best.ckpt", root / "checkpoints" / "last.ckpt",
                 root / "lightning_logs" / "version_0" / "metrics.csv"):
        assert str(path) in summary
    assert f"sentemb export {root / 'checkpoints' / 'best.ckpt'} {root / 'export'}" in summary


def test_a_resumed_run_continues_the_same_wandb_run(tmp_path, monkeypatch):
    from lightning_sentemb.loggers import ResumedRun, default_loggers

    monkeypatch.setenv("WANDB_MODE", "offline")
    csv_logger, wandb_logger = default_loggers(str(tmp_path), ResumedRun({"csv": 3, "wandb": "abc123"}, step=5))
    assert csv_logger.version == 3
    assert wandb_logger.version == "abc123" and wandb_logger._wandb_init["resume"] == "allow"
    assert wandb_logger._wandb_init["settings"].silent  # offline: the fit's summary names the run instead


def test_the_fit_summary_names_every_offline_folder_of_a_resumed_wandb_run(tmp_path):
    """W&B writes a resumed run (same id) into a new offline folder: `wandb sync` needs them all."""
    from types import SimpleNamespace

    from lightning.pytorch.loggers import WandbLogger

    from lightning_sentemb.console import fit_summary

    stamps = ("20261125_101010-abc123", "20261125_111111-abc123", "20261125_121212-other")
    folders = [tmp_path / "wandb" / f"offline-run-{stamp}" for stamp in stamps]
    for folder in folders:
        (folder / "files").mkdir(parents=True)
    logger = WandbLogger.__new__(WandbLogger)  # the second process of the run, as W&B leaves it
    logger._experiment = SimpleNamespace(offline=True, dir=str(folders[1] / "files"), id="abc123", _run_id="abc123")
    summary = fit_summary(SimpleNamespace(global_step=5, loggers=[logger]),
                          SimpleNamespace(best_model_path="", best_model_score=None, last_path=tmp_path / "last.ckpt"))
    assert [line.split()[-1] for line in summary.splitlines() if "W&B run" in line] == [str(f) for f in folders[:2]]


def test_a_continued_metrics_file_drops_the_rows_the_resume_trains_again(tmp_path):
    """After a hard kill, metrics.csv may hold rows logged after the last checkpoint: the resumed run
    logs those steps again, so they go (train row of step k+1 is logged as step k, as Lightning does)."""
    from lightning_sentemb.loggers import ContinuedCSVLogger

    version = tmp_path / "lightning_logs" / "version_2"
    version.mkdir(parents=True)
    (version / "metrics.csv").write_text("epoch,step,train/loss\n" + "".join(f"0,{s},{s / 10}\n" for s in range(6)))
    logger = ContinuedCSVLogger(str(tmp_path), version=2, step=3)
    logger.log_metrics({"train/loss": 0.9}, step=3)
    logger.save()
    assert (version / "metrics.csv").read_text().splitlines() == [
        "epoch,step,train/loss", "0,0,0.0", "0,1,0.1", "0,2,0.2", ",3,0.9"]


# ----- callback presets ----------------------------------------------------------------------------
PRESETS = sorted((REPO / "callbacks").glob("*.yaml"))


def test_every_preset_composes_with_the_others(capsys):
    """All presets after one experiment: each keeps its callback (jsonargparse's `callbacks+:`)."""
    with pytest.raises(SystemExit) as stop:
        main(["fit", "-c", str(DEMO), *(arg for preset in PRESETS for arg in ("-c", str(preset))), "--print_config"])
    assert stop.value.code == 0
    config = yaml.safe_load(capsys.readouterr().out)
    names = [callback["class_path"].rsplit(".", 1)[1] for callback in config["trainer"]["callbacks"]]
    assert names == ["DeviceStatsMonitor", "EarlyStopping", "EmbeddingSpaceMonitor", "LearningRateMonitor",
                     "StepCheckpoints"]
    assert config["data"]["val_evaluators"] == ["transfer", "cluster"]
    assert {p.name for p in PRESETS} <= set((REPO / "callbacks" / "README.md").read_text().split("`"))


class Callbacks(Callback):
    def on_fit_start(self, trainer, pl_module) -> None:
        self.names = [type(callback).__name__ for callback in trainer.callbacks]


def test_two_presets_train_together_and_log_what_they_promise(tiny_bert, sts_fixture, tmp_path):
    from lightning_sentemb.data.senteval import load_sts_task
    from lightning_sentemb.evaluation.analysis import alignment_uniformity, encode_pairs
    from lightning_sentemb.loading import load_method
    from tests.test_resume import short_fit_args

    seen = Callbacks()
    lightning_main(["fit", *short_fit_args(tiny_bert, sts_fixture, tmp_path, "--trainer.max_steps", "3"),
                    "-c", str(REPO / "callbacks" / "lr_monitor.yaml"),
                    "-c", str(REPO / "callbacks" / "embedding_space.yaml")], callbacks=[seen])
    assert {"LearningRateMonitor", "EmbeddingSpaceMonitor", "SentEmbCheckpoint", "TrainingGuard"} <= set(seen.names)
    (version,) = (tmp_path / "lightning_logs").iterdir()
    with (version / "metrics.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert any(row.get("lr-AdamW") for row in rows)
    logged = next(row for row in rows if row.get("val/alignment"))
    # the same numbers as the analysis evaluator gives the trained model (last.ckpt: the validated state)
    method = load_method(str(tmp_path / "checkpoints" / "last.ckpt"))
    dev = load_sts_task("STSBenchmark-dev", sts_fixture)
    first, second, distinct = encode_pairs(lambda sentences: method.encode(sentences).numpy(), dev.first, dev.second)
    expected = alignment_uniformity(first, second, dev.gold, distinct)
    assert float(logged["val/alignment"]) == pytest.approx(expected["alignment"], abs=1e-4)
    assert float(logged["val/uniformity"]) == pytest.approx(expected["uniformity"], abs=1e-4)


def test_step_checkpoints_sit_beside_best_and_last_and_never_pass_for_best(tiny_bert, sts_fixture, tmp_path):
    from tests.test_resume import short_fit_args

    args = [*short_fit_args(tiny_bert, sts_fixture, tmp_path, "--trainer.max_steps", "3"),
            "--trainer.callbacks+=lightning_sentemb.callbacks.step_checkpoints.StepCheckpoints",
            "--trainer.callbacks.every_n_train_steps=2"]
    lightning_main(["fit", *args])
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["best.ckpt", "last.ckpt", "step=2.ckpt"]
    # Lightning's `trainer.checkpoint_callback` is now the step callback; `best` still means best.ckpt
    cli = lightning_main(["validate", *args, "--ckpt_path", "best"])
    assert cli.trainer.checkpoint_callback is not cli.run_checkpoint
    assert cli.trainer.ckpt_path == str(folder / "best.ckpt")


# ----- exports -----------------------------------------------------------------------------------
def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("\n---\n", 1)[0].removeprefix("---\n"))


def test_the_model_card_names_the_method_its_scores_and_how_to_load_it(tiny_bert, sts_fixture, tmp_path):
    from tests.test_resume import short_fit_args

    lightning_main(["fit", *short_fit_args(tiny_bert, sts_fixture, tmp_path, "--trainer.max_steps", "3",
                                           "--model.temperature", "0.07")])
    best = tmp_path / "checkpoints" / "best.ckpt"
    main(["evaluate", "--model", str(best), "--data-dir", str(sts_fixture), "--output", str(tmp_path / "scores.json")])
    main(["export", str(best), str(tmp_path / "simcse-tiny"), "--results", str(tmp_path / "scores.json")])
    card = (tmp_path / "simcse-tiny" / "README.md").read_text()
    front = front_matter(card)
    assert front["library_name"] == "sentence-transformers" and front["pipeline_tag"] == "sentence-similarity"
    assert "base_model" not in front  # a local folder, not a hub id
    assert {"simcse", "sentence-transformers"} <= set(front["tags"])
    (entry,) = front["model-index"]
    scores = {(r["dataset"]["name"], r["dataset"]["split"]): r["metrics"][0]["value"] for r in entry["results"]}
    checkpoint = torch.load(best, weights_only=False)
    callback_state = next(iter(checkpoint["callbacks"].values()))
    assert scores.pop(("STS Benchmark (dev)", "validation")) == round(float(callback_state["best_model_score"]), 2)
    evaluated = json.loads((tmp_path / "scores.json").read_text())["sts"]
    assert scores == {(task, "test"): round(value, 2) for task, value in evaluated.items() if task != "avg"}
    for text in ("**SimCSE**", "https://aclanthology.org/2021.emnlp-main.552", "@inproceedings{gao2021simcse",
                 "| temperature | `0.07` |", f"| steps trained | `{checkpoint['global_step']}` |",
                 'SentenceTransformer("simcse-tiny")'):
        assert text in card


def test_a_prompt_method_card_gives_its_template_and_trust_remote_code(tiny_bert, tmp_path):
    from lightning_sentemb.export import export
    from lightning_sentemb.methods import PromptBERT

    card = (export(build_method(PromptBERT, tiny_bert), tmp_path / "pb") / "README.md").read_text()
    assert "model-index" not in front_matter(card)  # no scores known
    assert '- Template: `This sentence : "[X]" means [MASK] .`' in card
    assert 'SentenceTransformer("pb", trust_remote_code=True)' in card
    assert "PromptBERT: Improving BERT Sentence Embeddings with Prompts" in card


def test_export_onto_a_file_is_one_line_and_keeps_the_file(tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("keep me")
    line = error_line(capsys, "export", str(tmp_path / "never_loaded.ckpt"), str(target))
    assert line == f"sentemb: error: export folder {target} is a file; choose a new folder name (the file is kept)"
    assert target.read_text() == "keep me"


# ----- the data directory ----------------------------------------------------------------------------
def test_one_data_directory_rule(tmp_path, monkeypatch):
    """--data-dir, else $SENTEMB_DATA, else ./data if it exists, else ../shared/data (the mirror
    beside the repository), for every command: the configs name none."""
    from lightning_sentemb.data.paths import resolve_data_dir

    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.chdir(repo)
    monkeypatch.delenv("SENTEMB_DATA", raising=False)
    assert resolve_data_dir() == Path("data")  # nothing there: errors name ./data
    (tmp_path / "shared" / "data").mkdir(parents=True)
    assert resolve_data_dir() == Path("../shared/data")
    (repo / "data").mkdir()
    assert resolve_data_dir() == Path("data")
    monkeypatch.setenv("SENTEMB_DATA", str(tmp_path / "elsewhere"))
    assert resolve_data_dir() == tmp_path / "elsewhere"
    assert resolve_data_dir("given") == Path("given")
    configs = [*REPO.glob("experiments/*.yaml"), *REPO.glob("experiments/demo/*.yaml")]
    assert configs and not [c for c in configs if "data_dir" in (yaml.safe_load(c.read_text()).get("data") or {})]


# ----- file size ----------------------------------------------------------------------------------
def test_no_python_file_is_over_400_lines():
    """The house rule (one concept a file): a module that grows past 400 lines is split by concept, in the
    package, the benchmarks, gpu-check and the tests alike."""
    folders = ("lightning_sentemb", "benchmarks", "gpucheck", "tests")
    files = [path for folder in folders for path in (REPO / folder).rglob("*.py")]
    assert len(files) > 100
    long = {str(path.relative_to(REPO)): n for path in files if (n := len(path.read_text().splitlines())) > 400}
    assert not long, f"split these by concept: {long}"


def test_the_shared_method_class_stays_lean():
    """`SentEmbMethod` says what a method is and composes the concern modules (`building`, `steps`,
    `encoding`, `validation`, `checkpoint_state`): under 250 lines of class (the lean-house issue's goal;
    it had grown back to 260), what grows goes into the module of its concern."""
    import inspect

    from lightning_sentemb.methods.base import SentEmbMethod

    lines, _ = inspect.getsourcelines(SentEmbMethod)
    assert len(lines) < 250, f"SentEmbMethod has {len(lines)} lines: move a concern into its module"
