"""`sentemb` (alias `lightning`): LightningCLI for fit/validate/test/predict plus evaluate/export/data/sweep/reproduce.

    sentemb fit -c experiments/simcse.yaml
    sentemb test -c experiments/simcse.yaml --ckpt_path best
    sentemb evaluate --model out/simcse/checkpoints/best.ckpt --tasks sts
    sentemb export out/simcse/checkpoints/best.ckpt exported/
    sentemb data download --to data/      |   sentemb data check --data-dir ../shared/data
    sentemb sweep experiments/sweeps/demo.yaml --runs 4        (W&B sweep file, run locally offline)
    sentemb reproduce --method simcse --seeds 5                (mean ± std and best of N on 7 STS tasks)

Errors that are the user's to fix (`SentEmbUserError`) print as one line `sentemb: error: ...` and
exit 2; `SENTEMB_DEBUG=1` shows the traceback instead.

This module imports nothing heavy at the top: every command line is parsed, and every `--help`
printed, before torch is imported. `sentemb fit|validate|test|predict --help` is LightningCLI's,
built from the classes' signatures (torch, Lightning and transformers imported, ~6 s of CPU); its
text is kept under the cache folder and printed from there until the installed packages or this
package's files change.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import hashlib
import importlib.metadata
import io
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from .commands import TRUST_HELP, ArgumentParser
from .commands.evaluate import evaluate, evaluate_parser
from .commands.mine import add_mine_parser
from .commands.negate import add_negate_parser, negate_command
from .data.paths import DATA_DIR_HELP, default_cache_dir
from .errors import SentEmbUserError
from .evaluation import WHITEN_PER_TASK

USAGE = """usage: sentemb SUBCOMMAND [options]      (`lightning` is the same command)

Training (LightningCLI: -c CONFIG.yaml, any key overridable as --model.init_args.lr 1e-5):
  fit         train a method; best.ckpt by STS-B dev under <default_root_dir>/checkpoints
  validate    STS dev sets of a checkpoint (--ckpt_path best|last|FILE)
  test        the 7-task STS table of a checkpoint (--ckpt_path best|last|FILE)
  predict     LightningCLI's predict loop

Tools:
  evaluate    STS, transfer, few-shot, clustering, analysis, BERT-whitening of checkpoints / HF folders / pkg:MODULE
  export      checkpoint -> folder that AutoModel and SentenceTransformer both load, with a model card
  data        download the data sets, check what a data directory holds, mine hard negatives, negate sentences
  sweep       run a W&B sweep file locally and offline (needs the `sweep` extra)
  reproduce   one fit per seed, mean ± std and best of N (extra fit arguments after `--`), a seed paper's table

`sentemb SUBCOMMAND --help` describes each. SENTEMB_DEBUG=1 shows tracebacks of user errors.
"""

LIGHTNING_SUBCOMMANDS = ("fit", "validate", "test", "predict")
HELP_FLAGS = ("-h", "--help")
# ----- export ------------------------------------------------------------------------------------
def export_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="sentemb export", description="Checkpoint → HF + sentence-transformers folder "
                            "with a model card (README.md).")
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir", help="a new or empty folder")
    parser.add_argument("--results", default=None,
                        help="`sentemb evaluate --output` of this checkpoint (results.json, or its folder): its "
                             "scores go into the model card")
    parser.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    parser.add_argument("--adapter-only", action="store_true",
                        help="LoRA checkpoints: write peft's adapter folder (naming the base model) plus the pooling/"
                             "template config, instead of the backbone with the adapters merged (the default)")
    parser.add_argument("--pooler", default=None, choices=["cls", "cls_before_pooler", "last", "avg", "avg_first_last",
                                                           "avg_emb_last", "avg_top2"],
                        help="for a Hugging Face folder (checkpoints keep their own): its pooling, as in "
                             "`sentemb evaluate`")
    parser.add_argument("--whiten", default=None, metavar="SOURCE",
                        help="append BERT-whitening (Su et al., 2021) after the pooling, as sentence-transformers' "
                             "Dense module, μ and W fitted on SOURCE: nli (corpora/nli_for_simcse.csv of the data "
                             "directory) or a corpus file (one sentence a line, or an NLI csv)")
    parser.add_argument("--whiten-dim", type=int, default=None, metavar="K",
                        help="keep K whitened dimensions (the paper's 256 or 384; default: all)")
    parser.add_argument("--data-dir", default=None, help=DATA_DIR_HELP + " (for --whiten nli)")
    return parser


def export(options: argparse.Namespace) -> None:
    from .export import check_export_folder
    from .export import export as write_export
    from .export.model_card import read_results, run_facts
    from .loading import load_method
    from .loggers import silence_known_noise

    silence_known_noise()
    check_export_folder(options.out_dir)
    results = read_results(options.results) if options.results else None
    sentences = whitening_sentences(options)  # a missing source: before the model loads
    # the base loads unquantized: a QLoRA run's adapters merge into (or ride on) the full-precision base
    method = load_method(options.checkpoint, options.pooler, trust_checkpoint=options.trust_checkpoint,
                         load_in_4bit=False)
    facts = run_facts(options.checkpoint, options.trust_checkpoint) if options.checkpoint.endswith(".ckpt") else None
    whitening = None
    if sentences is not None:
        from .evaluation.whitening import check_whiten_dim, fit_whitening

        check_whiten_dim(options.whiten_dim, method.output_size)  # before minutes of encoding
        embeddings = method.encode(sentences, label=f"whitening: {len(sentences):,} sentences")
        whitening = options.whiten, fit_whitening(embeddings, options.whiten_dim, options.whiten)
    folder = write_export(method, options.out_dir, facts, results, adapter_only=options.adapter_only,
                          whitening=whitening)
    print(f"exported to {folder} (AutoModel.from_pretrained and SentenceTransformer both load it; "
          f"model card: {folder / 'README.md'})")


def whitening_sentences(options: argparse.Namespace) -> list[str] | None:
    """The sentences `sentemb export --whiten` fits on, or None without it."""
    if options.whiten is None:
        if options.whiten_dim is not None:
            raise SentEmbUserError("--whiten-dim applies to a whitening: add --whiten nli|FILE")
        return None
    if options.whiten in WHITEN_PER_TASK:
        raise SentEmbUserError(f"sentemb export --whiten {options.whiten}: an export serves every task, so it is "
                               f"whitened once: --whiten nli or --whiten FILE (`sentemb evaluate --whiten "
                               f"{options.whiten}` scores each task's own)")
    from .evaluation.whitening import source_sentences

    return source_sentences(options.whiten, options.data_dir)


# ----- data --------------------------------------------------------------------------------------
def data_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="sentemb data")
    sub = parser.add_subparsers(dest="action", required=True)
    fetch = sub.add_parser("download", help="fetch SentEval + SimCSE corpora from their canonical sources")
    fetch.add_argument("--to", required=True, help="target data directory")
    fetch.add_argument("--what", default="senteval,wiki1m,nli",
                       help="comma-separated: senteval,wiki1m,nli,allnli (allnli: SNLI+MNLI with labels, for SBERT)")
    check = sub.add_parser("check", help="report, per evaluator and corpus, what a data directory holds",
                           description="Reports every group; the exit status is 1 only when a group named "
                                       "by --require is incomplete.")
    check.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    check.add_argument("--require", default="sts",
                       help="comma-separated groups that must be complete for exit status 0: "
                            "sts,transfer,cluster,wiki1m,nli,allnli or all (default sts: what every fit needs)")
    add_mine_parser(sub)
    add_negate_parser(sub)
    return parser


def data(options: argparse.Namespace) -> None:
    from .data.download import CHECK_GROUPS, check_data_dir, download

    if options.action == "mine":
        from .mining import mine_command

        mine_command(options)
        return
    if options.action == "negate":
        negate_command(options)
        return
    if options.action == "download":
        download(options.to, options.what.split(","))
        return
    required = CHECK_GROUPS if options.require == "all" else [g for g in options.require.split(",") if g]
    incomplete = check_data_dir(options.data_dir, required)
    if incomplete:
        print(f"incomplete: {', '.join(incomplete)} (required by --require {options.require})")
    sys.exit(1 if incomplete else 0)


# ----- sweep, reproduce (arguments after `--` go to every fit) ------------------------------------
def sweep_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="sentemb sweep", description="Run a W&B sweep file locally, offline.",
        usage="sentemb sweep SWEEP_FILE [--runs N] [--root DIR] [--method M] [--seed S] [-- FIT ARGS ...]",
        epilog="Arguments after `--` are appended to every run's `sentemb fit` "
               "(e.g. -- -c experiments/trainer/a100.yaml).",
    )
    parser.add_argument("sweep_file", help="W&B sweep YAML (experiments/sweeps/*.yaml)")
    parser.add_argument("--runs", type=int, default=None, help="number of runs (default: every grid point)")
    parser.add_argument("--root", default=None, help="output folder (default out/sweeps/<file stem>)")
    parser.add_argument("--method", choices=["grid", "random", "bayes"], help="replace the file's search method")
    parser.add_argument("--seed", type=int, default=0, help="seed of the engine's random proposals")
    return parser


def sweep(options: argparse.Namespace, fit_args: list[str]) -> None:
    from .sweep import sweep_command

    sweep_command(options, fit_args)


def parse_seeds(text: str) -> list[int]:
    """`5` means seeds 0–4; `1,7,42` names them."""
    if "," in text:
        return [int(seed) for seed in text.split(",")]
    count = int(text)
    if count < 1:
        raise argparse.ArgumentTypeError("--seeds needs at least one seed")
    return list(range(count))


def reproduce_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="sentemb reproduce", description="Fit once per seed, test, aggregate.",
        usage="sentemb reproduce (--method M | -c FILE ...) [--seeds N|a,b,c] [--paper NAME] [--mteb-sts] [--root DIR] "
              "[-- FIT ARGS ...]  |  sentemb reproduce --list-papers  |  sentemb reproduce --table PAPER [--runs DIR]",
        epilog="Arguments after `--` are appended to every seed's `sentemb fit` "
               "(e.g. -- -c experiments/trainer/a100.yaml or -- --trainer.max_steps=50).",
    )
    parser.add_argument("--list-papers", action="store_true", help="print the published rows and their sources")
    parser.add_argument("--table", choices=["conpvp", "dcpcse", "clusterns"],
                        help="print that seed paper's main STS table in its order, with our mean ± std beside each "
                             "row where a reproduce run is under --runs, else the command that reproduces it")
    parser.add_argument("--runs", default="out/reproduce", help="where --table looks for the runs "
                        "(RUNS/<config>/reproduce.json, the default --root of each run; default out/reproduce)")
    parser.add_argument("--paper", default=None, help="the published row to compare with (default: the config's "
                        "own, for the paper configs of experiments/; --list-papers names them)")
    parser.add_argument("--method", help="runs experiments/METHOD.yaml")
    parser.add_argument("-c", "--config", action="append", default=[], help="config file(s), after --method's")
    parser.add_argument("--seeds", type=parse_seeds, default=parse_seeds("5"), help="N (seeds 0..N-1) or a,b,c")
    parser.add_argument("--mteb-sts", action="store_true", help="also score each best checkpoint on MTEB's seven STS "
                        "tasks (the mteb package; data from the Hugging Face cache or hub) beside SentEval's table")
    parser.add_argument("--root", default=None, help="output folder (default out/reproduce/<name>)")
    return parser


def reproduce(options: argparse.Namespace, fit_args: list[str]) -> None:
    if options.table or options.list_papers:  # printed from the rows alone: no torch, under a second
        from .seed_tables import format_papers, format_seed_table

        print(format_seed_table(options.table, Path(options.runs)) if options.table else format_papers())
        return
    from .reproduce import reproduce_command

    reproduce_command(options, fit_args)


# name: (parser, run, whether arguments after `--` go to every fit)
TOOLS: dict[str, tuple[Callable[[], ArgumentParser], Callable[..., None], bool]] = {
    "evaluate": (evaluate_parser, evaluate, False),
    "export": (export_parser, export, False),
    "data": (data_parser, data, False),
    "sweep": (sweep_parser, sweep, True),
    "reproduce": (reproduce_parser, reproduce, True),
}


def run_tool(name: str, args: list[str]) -> None:
    """Parse first (`--help` and bad arguments end here, before any heavy import), then run."""
    build_parser, run_command, takes_fit_args = TOOLS[name]
    fit_args: list[str] = []
    if takes_fit_args and "--" in args:
        args, fit_args = args[: args.index("--")], args[args.index("--") + 1 :]
    options = build_parser().parse_args(args)
    if takes_fit_args:
        run_command(options, fit_args)
    else:
        run_command(options)


# ----- the LightningCLI subcommands --------------------------------------------------------------
def check_config_files(args: list[str]) -> None:
    """A missing `-c` file: one line naming it (and a close name beside it), before the seconds of
    imports LightningCLI needs."""
    from .config_errors import config_files_in

    for file in config_files_in(args):
        path = Path(file)
        if path.is_file():
            continue
        siblings = [str(p) for p in path.parent.glob("*.y*ml")] if path.parent.is_dir() else []
        close = difflib.get_close_matches(str(path), siblings, n=1)
        raise SentEmbUserError(f"config file {file} does not exist" + (f"; did you mean {close[0]}?" if close else ""))


def lightning_help(subcommand: str) -> None:
    """LightningCLI's `--help` of `subcommand`, from the cache when it is there (see the module
    docstring), else built and cached."""
    path = help_cache_path(subcommand)
    if path.is_file():
        text = path.read_text()
    else:
        from .atomic_io import atomic_write_text
        from .lightning_cli import lightning_main

        output = io.StringIO()
        status: int | str | None = 0
        with contextlib.redirect_stdout(output), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="LightningCLI's args parameter")  # these args are sys.argv's
            try:
                lightning_main([subcommand, "--help"])
            except SystemExit as done:
                status = done.code
        text = output.getvalue()
        if status not in (0, None):  # a failed help is shown, never cached
            print(text, end="")
            raise SystemExit(status)
        with contextlib.suppress(OSError):  # an unwritable cache only costs the next --help its seconds
            atomic_write_text(path, text)
    print(text, end="")


def help_cache_path(subcommand: str) -> Path:
    """The cached help of `subcommand`, keyed by what its text depends on: Python and the packages
    that build it, this package's files, and the terminal width."""
    package = Path(__file__).parent
    key = hashlib.sha256()
    key.update(f"{sys.version} {shutil.get_terminal_size().columns}".encode())
    for name in ("lightning", "jsonargparse", "torch", "transformers"):
        key.update(f"{name}={importlib.metadata.version(name)}".encode())
    for file in sorted(package.rglob("*.py")):
        stat = file.stat()
        key.update(f"{file.relative_to(package)} {stat.st_mtime_ns} {stat.st_size}".encode())
    return default_cache_dir() / "help" / f"{subcommand}-{key.hexdigest()[:16]}.txt"


def unknown_subcommand(name: str) -> SentEmbUserError:
    known = [*LIGHTNING_SUBCOMMANDS, *TOOLS]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean `{close[0]}`? " if close else ""
    return SentEmbUserError(f"unknown subcommand {name!r}; {hint}`sentemb --help` lists them")


# ----- entry -------------------------------------------------------------------------------------
def user_error(error: BaseException) -> SentEmbUserError | None:
    """The `SentEmbUserError` behind `error`, if any: jsonargparse and Lightning wrap errors raised
    while a class is instantiated, so the whole cause/context chain is searched."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, SentEmbUserError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def run(args: list[str], from_sys_argv: bool = False) -> None:
    """Dispatch one command line (no error handling; `main` adds it)."""
    if not args:
        print(USAGE, end="", file=sys.stderr)
        raise SystemExit(2)
    command, rest = args[0], args[1:]
    if command in HELP_FLAGS:
        print(USAGE, end="")
    elif command in TOOLS:
        run_tool(command, rest)
    elif command in LIGHTNING_SUBCOMMANDS and rest and all(arg in HELP_FLAGS for arg in rest):
        lightning_help(command)
    elif command in LIGHTNING_SUBCOMMANDS or command.startswith("-"):
        check_config_files(rest)
        from .lightning_cli import end_of_fit, lightning_main

        cli = lightning_main(None if from_sys_argv else args)
        if cli.subcommand == "fit":
            end_of_fit(cli)
    else:
        raise unknown_subcommand(command)


def main(argv: list[str] | None = None) -> None:
    """Entry point of `sentemb` / `lightning`: one line and exit status 2 for a user error."""
    try:
        run(sys.argv[1:] if argv is None else list(argv), from_sys_argv=argv is None)
    except Exception as error:  # noqa: BLE001  (re-raised unless it is the user's to fix)
        cause = user_error(error)
        if cause is None or os.environ.get("SENTEMB_DEBUG", "0") not in ("", "0"):
            raise
        message = " ".join(str(cause).split())
        print(f"sentemb: error: {message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
