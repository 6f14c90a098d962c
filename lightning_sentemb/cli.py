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
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path

from .errors import SentEmbUserError

USAGE = """usage: sentemb SUBCOMMAND [options]      (`lightning` is the same command)

Training (LightningCLI: -c CONFIG.yaml, any key overridable as --model.init_args.lr 1e-5):
  fit         train a method; best.ckpt by STS-B dev under <default_root_dir>/checkpoints
  validate    STS dev sets of a checkpoint (--ckpt_path best|last|FILE)
  test        the 7-task STS table of a checkpoint (--ckpt_path best|last|FILE)
  predict     LightningCLI's predict loop

Tools:
  evaluate    STS, transfer, few-shot, clustering, analysis of checkpoints / HF folders / pkg:MODULE
  export      checkpoint -> folder that AutoModel and SentenceTransformer both load
  data        download the data sets, or check what a data directory holds
  sweep       run a W&B sweep file locally and offline (needs the `sweep` extra)
  reproduce   one fit per seed, mean ± std and best of N (extra fit arguments after `--`)

`sentemb SUBCOMMAND --help` describes each. SENTEMB_DEBUG=1 shows tracebacks of user errors.
"""


TRUST_HELP = ("load the checkpoint with the full pickle loader, which can run code stored in the file: "
              "only for checkpoints you wrote or trust (default: tensors and plain values only)")


def evaluate_main(args: list[str]) -> None:
    from .atomic_io import atomic_write_bytes
    from .evaluation.report import encode_results, model_labels, write_report
    from .evaluation.sts import format_table
    from .evaluation.suite import EVALUATORS, evaluate_suite, parse_evaluators
    from .loading import load_method
    from .loggers import silence_known_noise

    parser = argparse.ArgumentParser(prog="sentemb evaluate", description="Evaluate checkpoints or HF model folders.")
    parser.add_argument("--model", required=True, nargs="+", help="checkpoint (.ckpt), HF folder, hub name or pkg:MODULE")
    parser.add_argument("--name", nargs="+", help="one label per --model for tables and figures "
                        "(default: run folder + file stem, e.g. simcse/best)")
    parser.add_argument("--pooler", choices=["cls", "cls_before_pooler", "avg", "avg_first_last", "avg_top2"],
                        help="pooling for HF folders (checkpoints keep their own); default cls_before_pooler")
    parser.add_argument("--tasks", default="sts", help=f"comma-separated evaluators: {','.join(EVALUATORS)}")
    parser.add_argument("--data-dir", default=None, help="data directory (default $SENTEMB_DATA, else ./data)")
    parser.add_argument("--output", default=None,
                        help="FILE.json: the results as JSON; a folder: results.json + report.md + figures/. "
                             "Written after each evaluator, so a later failure keeps what finished")
    parser.add_argument("--aggregation", default="all", choices=["all", "wmean", "mean"], help="STS12–16 aggregation")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "32"])
    parser.add_argument("--device", default=None, help="cuda when available, else cpu")
    parser.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    options = parser.parse_args(args)
    silence_known_noise()
    try:
        evaluators = parse_evaluators(options.tasks)
    except ValueError as error:
        parser.error(str(error))
    report_dir = Path(options.output) if options.output and not options.output.endswith(".json") else None
    results_file = None if options.output is None else report_dir / "results.json" if report_dir else Path(options.output)
    if results_file is not None:
        check_writable(results_file, "--output")
    device = options.device or ("cuda" if _cuda() else "cpu")
    results: dict[str, dict] = {}

    def save(label: str, partial: dict[str, dict]) -> None:
        """Keep every finished evaluator on disk: a later failure must not discard it."""
        results[label] = partial
        if results_file is not None:
            atomic_write_bytes(results_file, encode_results(results[label] if len(options.model) == 1 else results))

    for model, label in zip(options.model, model_labels(options.model, options.name)):
        method = load_method(model, options.pooler, trust_checkpoint=options.trust_checkpoint,
                             eval_precision=options.precision).to(device)
        evaluate_suite(
            functools.partial(method.encode, batch_size=options.batch_size), evaluators, options.data_dir,
            (report_dir or Path(".")) / "figures", name=label, aggregation=options.aggregation,
            on_result=lambda partial, label=label: save(label, partial),
        )
    if "sts" in evaluators:
        print(format_table({model: r["sts"] for model, r in results.items()}))
    if report_dir is not None:
        written = write_report(results, report_dir)
        print(f"report: {written['markdown']}")
    elif results_file is not None:
        print(f"results: {results_file}")


def check_writable(path: Path, option: str) -> None:
    """Fail before minutes of work when `path` cannot be written (creating its folder if needed)."""
    import tempfile

    if path.is_dir():
        raise SentEmbUserError(f"{option} {path} is a folder; give a file name")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path.parent):
            pass
    except OSError as error:
        raise SentEmbUserError(f"{option} {path}: cannot write there ({error.strerror or error}); "
                               "choose a writable path") from error


def export_main(args: list[str]) -> None:
    from .export import check_export_folder, export
    from .loading import load_method
    from .loggers import silence_known_noise

    parser = argparse.ArgumentParser(prog="sentemb export", description="Checkpoint → HF + sentence-transformers folder.")
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    parser.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    parser.add_argument("--adapter-only", action="store_true",
                        help="LoRA checkpoints: write peft's adapter folder (naming the base model) plus the pooling/"
                             "template config, instead of the backbone with the adapters merged (the default)")
    options = parser.parse_args(args)
    silence_known_noise()
    check_export_folder(options.out_dir)
    # the base loads unquantized: a QLoRA run's adapters merge into (or ride on) the full-precision base
    method = load_method(options.checkpoint, trust_checkpoint=options.trust_checkpoint, load_in_4bit=False)
    folder = export(method, options.out_dir, options.adapter_only)
    print(f"exported to {folder} (AutoModel.from_pretrained and SentenceTransformer both load it)")


def data_main(args: list[str]) -> None:
    from .data.download import CHECK_GROUPS, check_data_dir, download

    parser = argparse.ArgumentParser(prog="sentemb data")
    sub = parser.add_subparsers(dest="action", required=True)
    fetch = sub.add_parser("download", help="fetch SentEval + SimCSE corpora from their canonical sources")
    fetch.add_argument("--to", required=True, help="target data directory")
    fetch.add_argument("--what", default="senteval,wiki1m,nli", help="comma-separated: senteval,wiki1m,nli")
    check = sub.add_parser("check", help="report, per evaluator and corpus, what a data directory holds",
                           description="Reports every group; the exit status is 1 only when a group named "
                                       "by --require is incomplete.")
    check.add_argument("--data-dir", default=None, help="data directory (default $SENTEMB_DATA, else ./data)")
    check.add_argument("--require", default="sts",
                       help="comma-separated groups that must be complete for exit status 0: "
                            "sts,transfer,cluster,wiki1m,nli or all (default sts: what every fit needs)")
    options = parser.parse_args(args)
    if options.action == "download":
        download(options.to, options.what.split(","))
    else:
        required = CHECK_GROUPS if options.require == "all" else [g for g in options.require.split(",") if g]
        incomplete = check_data_dir(options.data_dir, required)
        if incomplete:
            print(f"incomplete: {', '.join(incomplete)} (required by --require {options.require})")
        sys.exit(1 if incomplete else 0)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def sweep_main(args: list[str]) -> None:
    from .sweep import sweep_main as run

    run(args)


def reproduce_main(args: list[str]) -> None:
    from .reproduce import reproduce_main as run

    run(args)


TOOLS = {"evaluate": evaluate_main, "export": export_main, "data": data_main, "sweep": sweep_main,
         "reproduce": reproduce_main}


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
    if args[0] in ("-h", "--help"):
        print(USAGE, end="")  # before any heavy import: `sentemb --help` stays instant
    elif args[0] in TOOLS:
        TOOLS[args[0]](args[1:])
    else:
        from .lightning_cli import lightning_main

        lightning_main(None if from_sys_argv else args)


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
