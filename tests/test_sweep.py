"""W&B sweep files: valid for `wandb sweep`, their `${args}` accepted by the CLI, and run locally
offline by `sentemb sweep` with W&B's open-source engine (which must leave numpy 2 in place)."""

import json
from importlib.metadata import requires, version
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

from lightning_sentemb.cli import main
from lightning_sentemb.lightning_cli import SELECTION_METRIC
from lightning_sentemb.sweep import SweepTracker, fit_arguments, load_sweep

REPO = Path(__file__).resolve().parents[1]
SWEEPS = sorted((REPO / "experiments" / "sweeps").glob("*.yaml"))


def tiny_overrides(backbone: str, data: Path, root: Path) -> list[str]:
    """Appended to a demo-config fit: a tiny model on the miniature data dir, quietly, on CPU."""
    return [f"--model.backbone={backbone}", f"--data.data_dir={data}", f"--data.cache_dir={root / 'cache'}",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false", "--trainer.accelerator=cpu",
            "--trainer.log_every_n_steps=1"]


def test_sweeps_engine_installs_beside_numpy_2():
    import sweeps  # noqa: F401  (the import is the test: the engine loads with numpy 2 and pydantic 2)

    assert int(np.__version__.split(".")[0]) >= 2
    assert version("sweeps") == "0.2.0"  # 0.3.0 requires numpy<2
    assert not [r for r in requires("sweeps") if r.startswith("numpy") and "<" in r]


def test_engine_proposes_grid_random_and_bayes_runs_under_numpy_2():
    from sweeps import RunState, SweepRun, next_run

    space = {"a": {"values": [1, 2]}, "lr": {"distribution": "log_uniform_values", "min": 1e-5, "max": 1e-3}}
    metric = {"name": "m", "goal": "maximize"}
    grid = {"method": "grid", "metric": metric, "parameters": {"a": space["a"]}}
    assert next_run(grid, [SweepRun(config={"a": {"value": 1}})]).config == {"a": {"value": 2}}
    for method in ("random", "bayes"):
        config = {"method": method, "metric": metric, "parameters": space}
        # pydantic 2 ignores the engine's field-name population: histories go in by alias
        runs = [SweepRun(name=str(i), state=RunState.finished,
                         config={"a": {"value": 1}, "lr": {"value": 10 ** -(3 + i)}},
                         sampledHistory=[{"m": float(i)}], summaryMetrics={"m": float(i)}) for i in range(3)]
        assert runs[0].history == [{"m": 0.0}]
        proposal = next_run(config, runs)
        assert 1e-5 <= proposal.config["lr"]["value"] <= 1e-3 and proposal.config["a"]["value"] in (1, 2)


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_sweep_file_is_a_wandb_sweep_over_an_experiment(path):
    sweep = load_sweep(path)  # W&B's schema
    assert sweep["metric"] == {"name": SELECTION_METRIC, "goal": "maximize"}
    command = sweep["command"]
    assert command[:4] == ["${env}", "sentemb", "fit", "-c"] and command[-1] == "${args}"
    assert (REPO / command[4]).is_file() and all("." in key for key in sweep["parameters"])


def corner_values(spec: dict) -> list:
    """The first and last value of a parameter (a grid's corners; a distribution's bounds)."""
    if "values" in spec:
        return [spec["values"][0], spec["values"][-1]]
    if "value" in spec:
        return [spec["value"]] * 2
    return [spec["min"], spec["max"]]


def lookup(config: dict, dotted: str):
    for part in dotted.split("."):
        config = config[part]
    return config


@pytest.mark.parametrize("corner", [0, 1], ids=["first", "last"])
@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_swept_args_are_flags_the_cli_accepts(path, corner, capsys):
    """`${args}` expanded by wandb's agent code, parsed by the CLI: every value lands on its key."""
    sweep = load_sweep(path)
    params = {key: corner_values(spec)[corner] for key, spec in sweep["parameters"].items()}
    with pytest.raises(SystemExit) as exited:
        main([*fit_arguments(sweep, params), "--print_config"])
    assert exited.value.code in (None, 0)
    config = yaml.safe_load(capsys.readouterr().out)
    for key, value in params.items():
        assert lookup(config, key) == pytest.approx(value), key


def test_the_best_command_gives_each_key_once_with_the_value_that_wins():
    from lightning_sentemb.sweep import without_repeated_keys

    argv = ["fit", "-c", "a.yaml", "--trainer.max_steps=30", "--model.init_args.lr=0.001", "-c", "b.yaml",
            "--trainer.max_steps", "10", "--model.lr=0.002", "--overwrite", "true"]
    assert without_repeated_keys(argv) == ["fit", "-c", "a.yaml", "-c", "b.yaml", "--trainer.max_steps", "10",
                                           "--model.lr=0.002", "--overwrite", "true"]


def test_fit_arguments_keep_overrides_last_and_refuse_swept_ones():
    sweep = load_sweep(REPO / "experiments" / "sweeps" / "demo.yaml")
    argv = fit_arguments(sweep, {"model.init_args.lr": 1e-5, "data.batch_size": 32}, ["--trainer.max_steps=3"])
    assert argv[:3] == ["fit", "-c", "experiments/demo/simcse.yaml"]
    assert "--model.init_args.lr=1e-05" in argv and "--data.batch_size=32" in argv
    assert argv[-1] == "--trainer.max_steps=3"
    with pytest.raises(ValueError, match="model.lr"):
        fit_arguments(sweep, {"model.init_args.lr": 1e-5}, ["--model.lr=1e-3"])
    with pytest.raises(ValueError, match="sentemb fit"):
        fit_arguments({**sweep, "command": ["${env}", "python", "train.py", "${args}"]}, {})


def test_hyperband_stops_a_run_that_trails_the_earlier_ones():
    from sweeps import RunState, SweepRun

    sweep = load_sweep(REPO / "experiments" / "sweeps" / "demo.yaml")
    earlier = [SweepRun(name=f"r{i}", state=RunState.finished,
                        sampledHistory=[{SELECTION_METRIC: v} for v in (60, 70, 75)])
               for i in range(3)]

    def validate(run, value):
        trainer = SimpleNamespace(sanity_checking=False, should_stop=False,
                                  callback_metrics={SELECTION_METRIC: torch.tensor(value)})
        SweepTracker(sweep, run, earlier).on_validation_end(trainer, None)
        return trainer.should_stop

    good, bad = (SweepRun(name=n, state=RunState.running) for n in ("good", "bad"))
    assert not validate(good, 65.0) and not validate(good, 80.0)
    assert not validate(bad, 20.0)  # Hyperband judges from the 2nd validation on (min_iter 1)
    assert validate(bad, 25.0) and bad.stopped
    assert [row[SELECTION_METRIC] for row in bad.history] == [20.0, 25.0]


def test_runs_started_by_wandb_agent_log_online(monkeypatch):
    """`wandb agent` sets WANDB_SWEEP_ID; an offline run would never report to the sweep."""
    from lightning_sentemb.loggers import wandb_configured

    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_SWEEP_ID"):
        monkeypatch.delenv(name, raising=False)
    assert not wandb_configured()
    monkeypatch.setenv("WANDB_SWEEP_ID", "abc123")
    assert wandb_configured()

@pytest.mark.slow  # ~20 s alone on 2 free cores
def test_demo_sweep_runs_offline_end_to_end(tiny_bert, sts_fixture, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    root = tmp_path / "sweep"
    main(["sweep", "experiments/sweeps/demo.yaml", "--runs", "4", "--root", str(root), "--",
          *tiny_overrides(tiny_bert, sts_fixture, tmp_path), "--trainer.max_steps=6", "--trainer.val_check_interval=2"])
    out = capsys.readouterr().out
    assert "| run | " in out and "\nbest: run-" in out
    best_command = out.split("\nbest: run-")[1].splitlines()[1]
    assert best_command.count("--trainer.max_steps") == 1 and "--trainer.max_steps=6" in best_command
    assert " MB on disk (best.ckpt of each finished run; last.ckpt removed)" in out
    summary = json.loads((root / "summary.json").read_text())
    runs = summary["runs"]
    assert [r["name"] for r in runs] == ["run-000", "run-001", "run-002", "run-003"]
    assert len({r["params"]["model.init_args.lr"] for r in runs}) == 4  # bayes proposed four points
    for run in runs:
        assert run["state"] in ("finished", "stopped early")
        # 6 steps, a validation every 2; Hyperband may stop a run at its 2nd or 3rd validation
        assert len(run["history"]) == 3 if run["state"] == "finished" else len(run["history"]) in (2, 3)
        assert run["best"] == max(run["history"])
        folder = root / run["name"]
        assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["best.ckpt"]  # one lean best per run
        assert SELECTION_METRIC in (folder / "lightning_logs" / "version_0" / "metrics.csv").read_text()
        saved = yaml.safe_load((folder / "lightning_logs" / "version_0" / "config.yaml").read_text())
        assert saved["model"]["init_args"]["lr"] == pytest.approx(run["params"]["model.init_args.lr"])
        assert saved["data"]["batch_size"] == run["params"]["data.batch_size"]
        assert len(list((folder / "wandb").glob("offline-run-*"))) == 1  # each run its own offline W&B run
    assert summary["best"] == max(runs, key=lambda r: r["best"])["name"]

