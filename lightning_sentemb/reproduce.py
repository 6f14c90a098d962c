"""`sentemb reproduce`: one fit per seed, each best checkpoint tested on the 7 STS tasks.

    sentemb reproduce --method simcse --seeds 5
    sentemb reproduce -c experiments/demo/simcse.yaml --seeds 0,1,2 -- --trainer.max_steps=50

Prints every seed's row, mean ± std per task (ConPVP's Table 4 reports ablations so) and the best
of N (the seed with the best test Avg., as the seed papers' main tables report it), then the
published row (`papers.py`: the config's own, or `--paper NAME`) beside them task by task, with the
differences and whether the average falls within the paper's spread (only for a run of the paper's
seven tasks: another set's average is not the paper's), and every row that reads the same runs
(`PaperRow.runs_of`: ConPVP's own best of 4 beside the released SimCSE). The same tables go to
`ROOT/reproduce.md`, the numbers to `ROOT/reproduce.json`. Each seed gets
`--seed_everything=SEED` and its own `--trainer.default_root_dir` under `--root`; arguments after
`--` are appended to every fit (a trainer preset, a smaller model). The fits run in this process
one after another, so under DDP every rank runs the same loop in step.

`--mteb-sts` also scores each best checkpoint on MTEB's seven STS tasks (the `mteb` package, through
`evaluation.mteb.MTEBModel`) right after its test, and adds their table and a task-by-task comparison
with SentEval's to the same report. Their data is loaded before the first fit: offline and uncached,
the command stops there in one line naming the task.
"""

from __future__ import annotations

import argparse
import difflib
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_only

from .atomic_io import atomic_write_json, atomic_write_text
from .console import disk_usage_line
from .data.senteval import SHORT_NAMES
from .errors import SentEmbUserError
from .evaluation.sts import format_table
from .lightning_cli import keep_best_only, lightning_main
from .papers import PAPERS, RUNS, TASKS, PaperRow, paper_for_config
from .seed_tables import spread_of, task_mismatch

EXPERIMENTS = Path("experiments")
# MTEB's names of SentEval's seven STS tasks, in the papers' order (`papers.TASKS`)
MTEB_STS = {"STS12": "STS12", "STS13": "STS13", "STS14": "STS14", "STS15": "STS15", "STS16": "STS16",
            "STSBenchmark": "STSBenchmark", "SICK-R": "SICKRelatedness"}


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """"; did you mean A, B?" with the names closest to a mistyped `name` (`--method`, `--paper`), or ""."""
    close = difflib.get_close_matches(name, list(known), n=3)
    return f"; did you mean {', '.join(close)}?" if close else ""


def config_files(method: str | None, configs: Sequence[str]) -> list[str]:
    """`--method M` is `experiments/M.yaml`; `-c` files follow it (later files win)."""
    if method and not (EXPERIMENTS / f"{method}.yaml").is_file():
        methods = (path.relative_to(EXPERIMENTS).with_suffix("").as_posix() for path in EXPERIMENTS.rglob("*.yaml"))
        raise SentEmbUserError(f"sentemb reproduce --method {method}: no {EXPERIMENTS}/{method}.yaml"
                               f"{did_you_mean(method, sorted(methods))} (the methods are {EXPERIMENTS}/*.yaml)")
    files = ([str(EXPERIMENTS / f"{method}.yaml")] if method else []) + list(configs)
    if not files:
        raise SentEmbUserError("sentemb reproduce: name the experiment: --method M (experiments/M.yaml) or -c FILE")
    missing = [f for f in files if not Path(f).is_file()]
    if missing:
        raise SentEmbUserError(f"sentemb reproduce -c: no such config: {', '.join(missing)}")
    return files


def mteb_sts_tasks() -> list:
    """MTEB's STS tasks with their data in memory, before any fit: uncached offline data is one line."""
    from .evaluation.mteb import load_task_data, named_tasks

    tasks = named_tasks(list(MTEB_STS))
    load_task_data(tasks, "--mteb-sts")
    return tasks


class MTEBAfterTest(Callback):
    """mteb's scores (`evaluation.mteb.evaluate_mteb`) of the model that `trainer.test` has just scored,
    in `on_test_end`: the best checkpoint's weights are loaded and still on the trainer's devices
    (Lightning moves them to the CPU at teardown), and every rank encodes its share
    (`encode_across_ranks`), as the test's own STS evaluation does."""

    def __init__(self, tasks: list, name: str) -> None:
        self.tasks, self.name = tasks, name
        self.scores: dict[str, float] = {}

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        from .evaluation.mteb import MTEBModel, evaluate_mteb
        from .loading import Embedder

        model = MTEBModel(Embedder(pl_module.encode_across_ranks, pl_module.output_size), self.name)
        self.scores = evaluate_mteb(model, self.tasks, pl_module.hparams.eval_batch_size)


def run_seeds(files: Sequence[str], seeds: Sequence[int], root: Path, overrides: Sequence[str] = (),
              mteb_tasks: list | None = None) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]]]:
    """{seed: {task: Spearman ×100, ..., 'avg': mean}} of each seed's best checkpoint on the test tasks;
    and with `mteb_tasks`, {seed: {mteb task: main score ×100, ..., 'avg'}} of the same checkpoint."""
    import wandb

    results, mteb_results = {}, {}
    for seed in seeds:
        argv = ["fit", *(arg for f in files for arg in ("-c", f)), *overrides,
                f"--seed_everything={seed}", f"--trainer.default_root_dir={root / f'seed-{seed}'}"]
        try:
            cli = lightning_main(argv)
            after_test = MTEBAfterTest(mteb_tasks, f"seed-{seed}") if mteb_tasks else None
            if after_test is not None:
                cli.trainer.callbacks.append(after_test)
            cli.trainer.test(cli.model, datamodule=cli.datamodule, ckpt_path=cli.run_checkpoint.best_model_path,
                             verbose=False)  # the method prints its one STS table
            results[seed] = dict(cli.model.test_results)
            if after_test is not None:
                mteb_results[seed] = after_test.scores
            keep_best_only(cli)
        finally:
            wandb.finish()  # the next seed's WandbLogger must start its own W&B run
    return results, mteb_results


def summarize(results: dict[int, dict[str, float]], best_seed: int | None = None) -> dict[str, dict[str, float] | int]:
    """Mean and sample standard deviation (ddof=1) per task, and the seed with the best Avg (or
    `best_seed`: MTEB's table names the checkpoint that SentEval's picked). A run of one test task has no
    'avg' (`methods.validation.log_sts`): its seeds are ranked on that task."""
    tasks = list(next(iter(results.values())))
    table = np.array([[scores[t] for t in tasks] for scores in results.values()])
    std = table.std(axis=0, ddof=1) if len(table) > 1 else np.zeros(len(tasks))
    if best_seed is None:
        best_seed = max(results, key=lambda seed: headline(results[seed]))
    return {"mean": dict(zip(tasks, table.mean(axis=0).tolist(), strict=True)),
            "std": dict(zip(tasks, std.tolist(), strict=True)), "best_seed": best_seed}


def headline(scores: dict[str, float]) -> float:
    """The score a seed is ranked by: its 'avg', or a single task's own score."""
    return scores["avg"] if "avg" in scores else float(np.mean(list(scores.values())))


def format_report(name: str, results: dict[int, dict[str, float]], best_seed: int | None = None) -> str:
    """Markdown: one row per seed, then mean ± std, then the best of N (see `summarize`)."""
    summary = summarize(results, best_seed)
    rows = {f"{name} seed {seed}": scores for seed, scores in results.items()}
    rows[f"{name} best of {len(results)} (seed {summary['best_seed']})"] = results[summary["best_seed"]]
    mean, std = summary["mean"], summary["std"]
    spread = f"| {name} mean ± std | " + " | ".join(f"{mean[t]:.2f} ± {std[t]:.2f}" for t in mean) + " |"
    return format_table(rows) + "\n" + spread


def paper_row(name: str | None, files: Sequence[str]) -> PaperRow | None:
    """`--paper NAME`'s row, else the published row of the first config when it is a paper config
    under `experiments/`, else None."""
    if name is not None:
        if name not in PAPERS:
            raise SentEmbUserError(f"sentemb reproduce --paper {name}: no such published row"
                                   f"{did_you_mean(name, PAPERS)} (`sentemb reproduce --list-papers` lists them)")
        return PAPERS[name]
    try:
        config = Path(files[0]).resolve().relative_to(EXPERIMENTS.resolve())
    except ValueError:
        return None
    return paper_for_config(str(config.with_suffix("")))


def compare_to_paper(row: PaperRow, results: dict[int, dict[str, float]]) -> dict:
    """Per task: the paper's score, the reproduced mean ± std and best of N, the differences
    (reproduced − paper); and whether the average is within the paper's spread. A run that tested other
    tasks than the paper's seven is compared task by task only: its average is of another set (None,
    and `tested` says which). A best-of-seeds row is compared with the best of its N (the first N seeds
    where more were run, `PaperRow.compared_seeds`), any other with the mean."""
    summary = summarize(results)
    compared = row.compared_seeds(list(results))
    best = results[max(compared, key=lambda seed: headline(results[seed]))]
    mismatch = task_mismatch(summary["mean"])
    tasks = [t for t in TASKS if t in summary["mean"] and (t != "avg" or mismatch is None)]
    spread, spread_basis = spread_of(row)
    statistic = "best" if row.best_of_seeds else "mean"
    reproduced = best if row.best_of_seeds else summary["mean"]
    return {
        "paper": row.name, "source": row.source, "statistic": row.statistic, "compared": statistic,
        "best_of": len(compared),
        "tasks": {t: {"paper": row.scores[t], "mean": summary["mean"][t], "std": summary["std"][t], "best": best[t],
                      "mean_minus_paper": summary["mean"][t] - row.scores[t],
                      "best_minus_paper": best[t] - row.scores[t]}
                  for t in tasks},
        "tested": mismatch, "spread": spread, "spread_basis": spread_basis,
        "within_spread": None if mismatch else bool(abs(reproduced["avg"] - row.scores["avg"]) <= spread),
    }


def format_comparison(row: PaperRow, comparison: dict, seeds: int) -> str:
    """Markdown: a line naming the row, one table row per task, and the verdict on the average."""
    lines = [f"Paper: {row.name}, {row.model} ({row.backbone}), {row.statistic}; {row.source}", "",
             f"| task | paper | reproduced mean ± std ({seeds} seeds) | Δ mean | best of {comparison['best_of']} "
             "| Δ best |",
             "|---|---|---|---|---|---|"]
    for task, c in comparison["tasks"].items():
        paper = f"{c['paper']:.2f}" + (f" ± {row.std[task]:.2f}" if row.std else "")
        lines.append(f"| {SHORT_NAMES.get(task, task)} | {paper} | {c['mean']:.2f} ± {c['std']:.2f} | "
                     f"{c['mean_minus_paper']:+.2f} | {c['best']:.2f} | {c['best_minus_paper']:+.2f} |")
    if comparison["within_spread"] is None:
        return "\n".join([*lines, "", f"Avg.: not compared: the run tested {comparison['tested']}, not the "
                                       "paper's seven."])
    avg = comparison["tasks"]["avg"]
    reproduced = avg["best"] if comparison["compared"] == "best" else avg["mean"]
    where = "within" if comparison["within_spread"] else "outside"
    lines += ["", f"Avg.: reproduced {comparison['compared']} {reproduced:.2f} is {where} the paper's "
                  f"{avg['paper']:.2f} ± {comparison['spread']:.2f} ({comparison['spread_basis']})."]
    return "\n".join(lines)


def format_mteb_beside(results: dict[int, dict[str, float]], mteb_results: dict[int, dict[str, float]]) -> str:
    """Markdown: per task, SentEval's mean ± std beside MTEB's on the same checkpoints, and MTEB − SentEval."""
    senteval, mteb = summarize(results), summarize(mteb_results)
    lines = ["| task | SentEval mean ± std | MTEB mean ± std | MTEB − SentEval |", "|---|---|---|---|"]
    for theirs, ours in [*MTEB_STS.items(), ("avg", "avg")]:
        if theirs in mteb["mean"] and ours in senteval["mean"]:
            a, b = senteval["mean"][ours], mteb["mean"][theirs]
            lines.append(f"| {SHORT_NAMES.get(ours, ours)} | {a:.2f} ± {senteval['std'][ours]:.2f} | "
                         f"{b:.2f} ± {mteb['std'][theirs]:.2f} | {b - a:+.2f} |")
    return "\n".join(lines)


@rank_zero_only
def report(name: str, results: dict[int, dict[str, float]], root: Path, paper: PaperRow | None = None,
           mteb_results: dict[int, dict[str, float]] | None = None) -> None:
    """Print the tables; write `root/reproduce.md` (the same) and `root/reproduce.json`; with
    `mteb_results`, MTEB's table (its best row: SentEval's best seed) and the two side by side."""
    heading = f"{name}: {len(results)} seeds, best checkpoint (STS-B dev) of each, tested on the STS tasks"
    sections = [heading, format_report(name, results)]
    content = {"seeds": {str(seed): scores for seed, scores in results.items()}, **summarize(results)}
    if paper is not None:
        comparison = compare_to_paper(paper, results)
        sections.append(format_comparison(paper, comparison, len(results)))
        content["paper"] = comparison
        readers = [row for row in PAPERS.values() if row.runs_of is paper and row is not paper]  # see `runs_of`
        content["also"] = {row.name: compare_to_paper(row, results) for row in readers}
        sections += [format_comparison(row, content["also"][row.name], len(results)) for row in readers]
    else:
        sections.append("No published row for this config: `--paper NAME` picks one "
                        "(`sentemb reproduce --list-papers`).")
    if mteb_results:
        best_seed = content["best_seed"]
        sections += ["MTEB's STS tasks on the same checkpoints (the `mteb` package's main score, "
                     "cosine Spearman ×100; its copies of the data, its aggregation):",
                     format_report(f"{name} mteb", mteb_results, best_seed), format_mteb_beside(results, mteb_results)]
        content["mteb"] = {"seeds": {str(seed): scores for seed, scores in mteb_results.items()},
                           **summarize(mteb_results, best_seed)}
    text = "\n\n".join(sections)
    print("\n" + text)
    atomic_write_text(root / "reproduce.md", f"# Reproduce: {name}\n\n{text}\n")
    atomic_write_json(root / "reproduce.json", content)
    print(disk_usage_line(root, "best.ckpt of each seed; last.ckpt removed"))


def reproduce_command(options: argparse.Namespace, overrides: list[str]) -> None:
    """`sentemb reproduce (--method M | -c FILE ...) --seeds N [--paper NAME] [--root DIR] [-- fit overrides]`
    (parsed by `cli`, which prints `--list-papers` and `--table` itself)."""
    # every run's arguments are passed to LightningCLI on purpose, beside this command's own sys.argv
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter")
    files = config_files(options.method, options.config)
    paper = paper_row(options.paper, files)  # a wrong --paper fails before the first fit
    tasks = mteb_sts_tasks() if options.mteb_sts else None  # so does missing MTEB data
    name = options.method or Path(files[0]).stem
    root = Path(options.root or RUNS / name)
    results, mteb_results = run_seeds(files, options.seeds, root, overrides, tasks)
    report(name, results, root, paper, mteb_results)
