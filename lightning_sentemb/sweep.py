"""`sentemb sweep`: run a W&B sweep file locally and offline with W&B's open-source engine.

    sentemb sweep experiments/sweeps/demo.yaml --runs 4
    sentemb sweep experiments/sweeps/simcse.yaml -- -c experiments/trainer/a100.yaml

The file is the one `wandb sweep` takes. Its `command` (`${env} sentemb fit -c EXPERIMENT ... ${args}`)
runs in this process with `${args}` expanded by wandb's own agent code, so what runs here runs
unchanged under `wandb agent`. The engine (`sweeps` 0.2.0, the `sweep` extra: grid, random,
bayes, hyperband early termination) proposes each run from the results so far; each run gets its
own `--trainer.default_root_dir` (checkpoint, CSV metrics, offline W&B run) under `--root`.
Extra arguments after `--` are appended to every run's command line (a trainer preset, a
smaller model); they may not name a swept parameter.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import shlex
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import yaml
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only

from .atomic_io import atomic_write_json
from .console import disk_usage_line
from .errors import SentEmbUserError
from .lightning_cli import keep_best_only, lightning_main

if TYPE_CHECKING:
    from sweeps import SweepRun


def load_sweep(path: str | Path) -> dict[str, Any]:
    """The sweep file, validated against W&B's sweep schema (defaults filled in)."""
    from sweeps import SweepConfig

    return dict(SweepConfig(yaml.safe_load(Path(path).read_text())))


def swept_flags(params: dict[str, Any]) -> list[str]:
    """`${args}` for these parameter values, exactly as `wandb agent` expands it (`--key=value`)."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args

    return create_sweep_command_args({"args": {key: {"value": value} for key, value in params.items()}})["args"]


def fit_arguments(sweep: dict[str, Any], params: dict[str, Any], overrides: Sequence[str] = ()) -> list[str]:
    """The `sentemb fit ...` arguments of the sweep's `command` for `params`, then `overrides`.

    Only the shape this project's sweep files use is accepted (`${env}`, the program, `fit`, fixed
    arguments, `${args}`), so a file that would run something else under `wandb agent` fails here.
    """
    command = [str(token) for token in sweep.get("command", []) if token != "${env}"]
    if command[:2] not in (["sentemb", "fit"], ["lightning", "fit"]) or "${args}" not in command:
        raise ValueError(f"sweep command must be `${{env}} sentemb fit ... ${{args}}`, got {command}")
    clashes = sorted(_normalized(params) & _normalized(_flag_keys(overrides)))
    if clashes:
        raise ValueError(f"overrides name swept parameter(s) {', '.join(clashes)}: the sweep would not search them")
    at = command.index("${args}")
    return [*command[1:at], *swept_flags(params), *command[at + 1 :], *overrides]


def without_repeated_keys(arguments: Sequence[str]) -> list[str]:
    """`arguments` with every option given twice (`--trainer.max_steps=30` in the sweep file, then
    `--trainer.max_steps=10` after `--`) kept only where it is given last, the value that wins;
    `-c` files are all kept."""
    groups: list[tuple[str | None, list[str]]] = []
    i = 0
    while i < len(arguments):
        token = arguments[i]
        takes_value = token.startswith("--") and "=" not in token and i + 1 < len(arguments) \
            and not arguments[i + 1].startswith("--")
        key = token[2:].split("=", 1)[0] if token.startswith("--") and token != "--config" else None
        groups.append((None if key is None else next(iter(_normalized([key]))),
                       list(arguments[i : i + (2 if takes_value else 1)])))
        i += 2 if takes_value else 1
    last = {key: index for index, (key, _) in enumerate(groups) if key is not None}
    return [token for index, (key, tokens) in enumerate(groups) if key is None or last[key] == index
            for token in tokens]


def _flag_keys(arguments: Sequence[str]) -> list[str]:
    return [a[2:].split("=", 1)[0] for a in arguments if a.startswith("--")]


def _normalized(keys: Sequence[str] | dict[str, Any]) -> set[str]:
    """`model.init_args.lr` and `model.lr` name the same option."""
    return {key.replace(".init_args.", ".") for key in keys}


def _plain(value: Any) -> Any:
    """The engine proposes numpy scalars; JSON and the summary want Python numbers."""
    return value.item() if isinstance(value, np.generic) else value


class SweepTracker(Callback):
    """Feeds every validation's metric to the engine's run and applies its early termination.

    W&B's hyperband compares the n-th logged value of the metric across runs; here the n-th value
    is the n-th validation, as it is in the W&B run's history. A run told to stop ends its fit
    (`trainer.should_stop`), keeping its best checkpoint, where the agent would kill the process.
    """

    def __init__(self, sweep: dict[str, Any], run: SweepRun, earlier: list[SweepRun]) -> None:
        self.sweep = sweep
        self.run = run
        self.earlier = earlier
        self.metric = sweep["metric"]["name"]

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        value = trainer.callback_metrics.get(self.metric)
        if trainer.sanity_checking or value is None:
            return
        self.run.history.append({self.metric: float(value)})
        if "early_terminate" in self.sweep:
            from sweeps import stop_runs

            if any(r.name == self.run.name for r in stop_runs(self.sweep, [*self.earlier, self.run])):
                self.run.stopped = True
                trainer.should_stop = True


@dataclass
class LocalRun:
    """One sweep run: the engine's record plus where its outputs are."""

    run: SweepRun
    params: dict[str, Any]
    argv: list[str]
    state: str = "running"  # finished | stopped early | failed
    log_dir: str | None = None

    def best(self, goal: str) -> float | None:
        values = [value for row in self.run.history for value in row.values()]
        if not values:
            return None
        return max(values) if goal == "maximize" else min(values)


def run_sweep(
    sweep: dict[str, Any], runs: int | None, root: Path, overrides: Sequence[str] = (), seed: int = 0
) -> list[LocalRun]:
    """Propose, run and record up to `runs` runs (a grid: all its points when `runs` is None).

    The engine's random choices (random/bayes proposals) are seeded per run from `seed`, so a
    local sweep is repeatable and every DDP rank proposes the same run.
    """
    import wandb
    from sweeps import RunState, next_run

    if runs is None and sweep["method"] != "grid":
        raise ValueError(f"a {sweep['method']} sweep never ends by itself: pass --runs N")
    goal = sweep["metric"]["goal"]
    done: list[LocalRun] = []
    while runs is None or len(done) < runs:
        random.seed(seed + len(done))
        np.random.seed(seed + len(done))
        run = next_run(sweep, [d.run for d in done])
        if run is None:  # the grid is exhausted
            break
        run.name, run.state = f"run-{len(done):03d}", RunState.running
        params = {key: _plain(spec["value"]) for key, spec in run.config.items()}
        local = LocalRun(run, params,
                         fit_arguments(sweep, params, overrides) + [f"--trainer.default_root_dir={root / run.name}"])
        _say(f"\n=== {run.name}: {' '.join(swept_flags(params))}")
        try:
            cli = lightning_main(local.argv, callbacks=[SweepTracker(sweep, run, [d.run for d in done])])
            local.log_dir = cli.trainer.log_dir
            run.state, local.state = RunState.finished, "stopped early" if run.stopped else "finished"
            keep_best_only(cli)
        except Exception:  # noqa: BLE001  (like `wandb agent`: record the failure, go on with the next run)
            traceback.print_exc()
            run.state, local.state = RunState.failed, "failed"
        finally:
            wandb.finish()  # the next run's WandbLogger must start its own W&B run
        best = local.best(goal)
        if best is not None:
            run.summary_metrics = {sweep["metric"]["name"]: best}
        done.append(local)
    return done


def summary_table(sweep: dict[str, Any], done: list[LocalRun]) -> str:
    """Markdown table: one row per run with its parameters, state and best metric."""
    metric, goal = sweep["metric"]["name"], sweep["metric"]["goal"]
    keys = list(sweep["parameters"])
    lines = [
        "| run | " + " | ".join(keys) + f" | state | validations | best {metric} |",
        "|" + "---|" * (len(keys) + 4),
    ]
    for local in done:
        best = local.best(goal)
        lines.append(
            f"| {local.run.name} | " + " | ".join(f"{local.params[k]:.3g}" if isinstance(local.params[k], float)
                                                  else str(local.params[k]) for k in keys)
            + f" | {local.state} | {len(local.run.history)} | " + ("–" if best is None else f"{best:.2f}") + " |"
        )
    return "\n".join(lines)


def best_run(sweep: dict[str, Any], done: list[LocalRun]) -> LocalRun | None:
    goal = sweep["metric"]["goal"]
    scored = [d for d in done if d.best(goal) is not None]
    if not scored:
        return None
    return (max if goal == "maximize" else min)(scored, key=lambda d: d.best(goal))


@rank_zero_only
def _say(text: str) -> None:
    print(text, flush=True)


@rank_zero_only
def report(sweep: dict[str, Any], done: list[LocalRun], root: Path) -> None:
    """Print the summary and the best run's command line; write `root/summary.json`."""
    metric, goal = sweep["metric"]["name"], sweep["metric"]["goal"]
    best = best_run(sweep, done)
    print("\n" + summary_table(sweep, done))
    if best is not None:
        print(f"\nbest: {best.run.name} ({metric} = {best.best(goal):.2f})")
        print("  " + shlex.join(["sentemb", *without_repeated_keys(best.argv)]))
        print(f"  full config: {best.log_dir}/config.yaml")
    print(disk_usage_line(root, "best.ckpt of each finished run; last.ckpt removed"))
    summary = {
        "metric": metric, "goal": goal, "best": best.run.name if best else None,
        "runs": [
            {"name": d.run.name, "params": d.params, "state": d.state,
             "history": [row[metric] for row in d.run.history], "best": d.best(goal), "argv": d.argv,
             "log_dir": d.log_dir}
            for d in done
        ],
    }
    atomic_write_json(root / "summary.json", summary)


def sweep_command(options: argparse.Namespace, overrides: list[str]) -> None:
    """`sentemb sweep FILE [--runs N] [--root DIR] [--method M] [--seed S] [-- fit overrides]` (parsed by `cli`)."""
    if importlib.util.find_spec("sweeps") is None:
        raise SentEmbUserError("sentemb sweep needs the `sweep` extra (W&B's sweep engine): "
                               "pip install -e '.[sweep]' (or pip install sweeps==0.2.0)")
    # every run's arguments are passed to LightningCLI on purpose, beside this command's own sys.argv
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    # sweeps 0.2.0 declares pydantic-1-style models; pydantic 2 warns about them at import
    warnings.filterwarnings("ignore", message="Valid config keys have changed in V2")
    warnings.filterwarnings("ignore", message="Support for class-based `config` is deprecated")
    sweep = load_sweep(options.sweep_file)
    if options.method:
        sweep["method"] = options.method
    root = Path(options.root or Path("out") / "sweeps" / Path(options.sweep_file).stem)
    done = run_sweep(sweep, options.runs, root, overrides, options.seed)
    report(sweep, done, root)
    if any(d.state == "failed" for d in done):
        raise SystemExit(1)
