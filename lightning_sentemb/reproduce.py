"""`sentemb reproduce`: one fit per seed, each best checkpoint tested on the 7 STS tasks.

    sentemb reproduce --method simcse --seeds 5
    sentemb reproduce -c experiments/demo/simcse.yaml --seeds 0,1,2 -- --trainer.max_steps=50

Prints every seed's row, mean ± std per task (ConPVP's Table 4 reports ablations so) and the best
of N (the seed with the best test Avg., as the seed papers' main tables report it). Each seed gets
`--seed_everything=SEED` and its own `--trainer.default_root_dir` under `--root`; arguments after
`--` are appended to every fit (a trainer preset, a smaller model). The fits run in this process
one after another, so under DDP every rank runs the same loop in step.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from lightning.pytorch.utilities import rank_zero_only

from .atomic_io import atomic_write_json
from .console import disk_usage_line
from .errors import SentEmbUserError
from .lightning_cli import keep_best_only, lightning_main
from .evaluation.sts import format_table

EXPERIMENTS = Path("experiments")


def config_files(method: str | None, configs: Sequence[str]) -> list[str]:
    """`--method M` is `experiments/M.yaml`; `-c` files follow it (later files win)."""
    files = ([str(EXPERIMENTS / f"{method}.yaml")] if method else []) + list(configs)
    if not files:
        raise SentEmbUserError("sentemb reproduce: name the experiment: --method M (experiments/M.yaml) or -c FILE")
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        available = ", ".join(sorted(p.stem for p in EXPERIMENTS.glob("*.yaml")))
        raise SentEmbUserError(f"sentemb reproduce: no such config: {', '.join(missing)} "
                               f"(methods in {EXPERIMENTS}/: {available})")
    return files


def run_seeds(files: Sequence[str], seeds: Sequence[int], root: Path, overrides: Sequence[str] = ()) -> dict[int, dict[str, float]]:
    """{seed: {task: Spearman ×100, ..., 'avg': mean}} of each seed's best checkpoint on the test tasks."""
    import wandb

    results = {}
    for seed in seeds:
        argv = ["fit", *(arg for f in files for arg in ("-c", f)), *overrides,
                f"--seed_everything={seed}", f"--trainer.default_root_dir={root / f'seed-{seed}'}"]
        try:
            cli = lightning_main(argv)
            cli.trainer.test(cli.model, datamodule=cli.datamodule, ckpt_path=cli.run_checkpoint.best_model_path,
                             verbose=False)  # the method prints its one STS table
            results[seed] = dict(cli.model.test_results)
            keep_best_only(cli)
        finally:
            wandb.finish()  # the next seed's WandbLogger must start its own W&B run
    return results


def summarize(results: dict[int, dict[str, float]]) -> dict[str, dict[str, float] | int]:
    """Mean and sample standard deviation (ddof=1) per task, and the seed with the best Avg."""
    tasks = list(next(iter(results.values())))
    table = np.array([[scores[t] for t in tasks] for scores in results.values()])
    std = table.std(axis=0, ddof=1) if len(table) > 1 else np.zeros(len(tasks))
    best_seed = max(results, key=lambda seed: results[seed]["avg"])
    return {"mean": dict(zip(tasks, table.mean(axis=0).tolist())), "std": dict(zip(tasks, std.tolist())),
            "best_seed": best_seed}


def format_report(name: str, results: dict[int, dict[str, float]]) -> str:
    """Markdown: one row per seed, then mean ± std, then the best of N."""
    summary = summarize(results)
    rows = {f"{name} seed {seed}": scores for seed, scores in results.items()}
    rows[f"{name} best of {len(results)} (seed {summary['best_seed']})"] = results[summary["best_seed"]]
    mean, std = summary["mean"], summary["std"]
    spread = f"| {name} mean ± std | " + " | ".join(f"{mean[t]:.2f} ± {std[t]:.2f}" for t in mean) + " |"
    return format_table(rows) + "\n" + spread


@rank_zero_only
def report(name: str, results: dict[int, dict[str, float]], root: Path) -> None:
    """Print the table; write `root/reproduce.json`."""
    print(f"\n{name}: {len(results)} seeds, best checkpoint (STS-B dev) of each, tested on the STS tasks")
    print(format_report(name, results))
    content = {"seeds": {str(seed): scores for seed, scores in results.items()}, **summarize(results)}
    atomic_write_json(root / "reproduce.json", content)
    print(disk_usage_line(root, "best.ckpt of each seed; last.ckpt removed"))


def reproduce_command(options: argparse.Namespace, overrides: list[str]) -> None:
    """`sentemb reproduce (--method M | -c FILE ...) --seeds N [--root DIR] [-- fit overrides]` (parsed by `cli`)."""
    # every run's arguments are passed to LightningCLI on purpose, beside this command's own sys.argv
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    files = config_files(options.method, options.config)
    name = options.method or Path(files[0]).stem
    root = Path(options.root or Path("out") / "reproduce" / name)
    report(name, run_seeds(files, options.seeds, root, overrides), root)
