"""`sentemb` (alias `lightning`): LightningCLI for fit/validate/test plus evaluate/export/data.

    sentemb fit -c experiments/simcse.yaml
    sentemb test -c experiments/simcse.yaml --ckpt_path best
    sentemb evaluate --model out/simcse/checkpoints/best.ckpt --tasks sts
    sentemb export out/simcse/checkpoints/best.ckpt exported/
    sentemb data download --to data/      |   sentemb data check --data-dir ../shared/data
    sentemb sweep experiments/sweeps/demo.yaml --runs 4        (W&B sweep file, run locally offline)
    sentemb reproduce --method simcse --seeds 5                (mean ± std and best of N on 7 STS tasks)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def evaluate_main(args: list[str]) -> None:
    from .atomic_io import atomic_write_json
    from .evaluation.report import model_labels, write_report
    from .evaluation.sts import format_table
    from .evaluation.suite import EVALUATORS, evaluate_suite, parse_evaluators
    from .loading import load_method

    parser = argparse.ArgumentParser(prog="sentemb evaluate", description="Evaluate checkpoints or HF model folders.")
    parser.add_argument("--model", required=True, nargs="+", help="checkpoint (.ckpt), HF folder, hub name or pkg:MODULE")
    parser.add_argument("--name", nargs="+", help="one label per --model for tables and figures "
                        "(default: run folder + file stem, e.g. simcse/best)")
    parser.add_argument("--pooler", choices=["cls", "cls_before_pooler", "avg", "avg_first_last", "avg_top2"],
                        help="pooling for HF folders (checkpoints keep their own); default cls_before_pooler")
    parser.add_argument("--tasks", default="sts", help=f"comma-separated evaluators: {','.join(EVALUATORS)}")
    parser.add_argument("--data-dir", default=None, help="data directory (default $SENTEMB_DATA, else ./data)")
    parser.add_argument("--output", default=None,
                        help="FILE.json: the results as JSON; a folder: results.json + report.md + figures/")
    parser.add_argument("--aggregation", default="all", choices=["all", "wmean", "mean"], help="STS12–16 aggregation")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "32"])
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu")
    options = parser.parse_args(args)
    try:
        evaluators = parse_evaluators(options.tasks)
    except ValueError as error:
        parser.error(str(error))
    report_dir = Path(options.output) if options.output and not options.output.endswith(".json") else None
    results = {}
    for model, label in zip(options.model, model_labels(options.model, options.name)):
        method = load_method(model, options.pooler, eval_precision=options.precision).to(options.device)
        results[label] = evaluate_suite(
            lambda sentences: method.encode(sentences, batch_size=options.batch_size), evaluators, options.data_dir,
            (report_dir or Path(".")) / "figures", name=label, aggregation=options.aggregation,
        )
    if "sts" in evaluators:
        print(format_table({model: r["sts"] for model, r in results.items()}))
    if report_dir is not None:
        written = write_report(results, report_dir)
        print(f"report: {written['markdown']}")
    elif options.output:
        atomic_write_json(Path(options.output), next(iter(results.values())) if len(results) == 1 else results)


def export_main(args: list[str]) -> None:
    from .export import export
    from .loading import load_method

    parser = argparse.ArgumentParser(prog="sentemb export", description="Checkpoint → HF + sentence-transformers folder.")
    parser.add_argument("checkpoint")
    parser.add_argument("out_dir")
    options = parser.parse_args(args)
    folder = export(load_method(options.checkpoint), options.out_dir)
    print(f"exported to {folder} (AutoModel.from_pretrained and SentenceTransformer both load it)")


def data_main(args: list[str]) -> None:
    from .data.download import check_data_dir, download

    parser = argparse.ArgumentParser(prog="sentemb data")
    sub = parser.add_subparsers(dest="action", required=True)
    fetch = sub.add_parser("download", help="fetch SentEval + SimCSE corpora from their canonical sources")
    fetch.add_argument("--to", required=True, help="target data directory")
    fetch.add_argument("--what", default="senteval,wiki1m,nli", help="comma-separated: senteval,wiki1m,nli")
    check = sub.add_parser("check", help="list which data files a directory (an existing mirror) provides")
    check.add_argument("--data-dir", default=None)
    options = parser.parse_args(args)
    if options.action == "download":
        download(options.to, options.what.split(","))
    else:
        missing = check_data_dir(options.data_dir)
        sys.exit(1 if missing else 0)


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


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if args and args[0] in TOOLS:
        TOOLS[args[0]](args[1:])
    else:
        from .lightning_cli import lightning_main

        lightning_main(None if argv is None else args)


if __name__ == "__main__":
    main()
