"""`sentemb evaluate`: every evaluator on checkpoints, HF folders or `pkg:MODULE`, with results written
after each evaluator (a later failure or Ctrl-C keeps what finished), and a report folder on request."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..data.instructions import E5_FORMAT
from ..data.paths import DATA_DIR_HELP
from ..errors import SentEmbUserError
from ..evaluation import EVALUATORS, WHITEN_PER_TASK
from . import TRUST_HELP, ArgumentParser

if TYPE_CHECKING:
    from ..evaluation.suite import SuitePlan
    from ..loading import Embedder


def evaluate_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="sentemb evaluate", description="Evaluate checkpoints or HF model folders.")
    parser.add_argument("--model", required=True, nargs="+",
                        help="checkpoint (.ckpt), HF folder, hub name or pkg:MODULE")
    parser.add_argument("--name", nargs="+", help="one label per --model for tables and figures "
                        "(default: run folder + file stem, e.g. simcse/best)")
    parser.add_argument("--pooler", choices=["cls", "cls_before_pooler", "last", "avg", "avg_first_last",
                                             "avg_emb_last", "avg_top2", "echo_mean", "echo_last"],
                        help="pooling for HF folders (checkpoints keep their own, a sentence-transformers folder or "
                             "export its modules.json's unless this is given); default cls_before_pooler on encoders, "
                             "last on decoder LLMs, echo_mean with --template. avg_first_last averages the first "
                             "transformer layer and the last, avg_emb_last the embedding output and the last")
    parser.add_argument("--template", default=None,
                        help="for HF folders: echo (echo embeddings: the sentence twice, pooled over the second copy), "
                             "or echo wording with [X] twice")
    parser.add_argument("--tasks", default=None, help=f"comma-separated evaluators: {','.join(EVALUATORS)} "
                        "(default sts, none when --mteb is given)")
    parser.add_argument("--mteb", default=None, metavar="TASKS",
                        help="MTEB tasks (STSBenchmark,STS12) or a benchmark name (\"MTEB(eng, v2)\"), run by the "
                             "`mteb` package on the same encoding; mteb's main score per task (×100) in the results")
    parser.add_argument("--mteb-prompts", default=None, metavar="FILE",
                        help="yaml/json {mteb key: text before the texts} (keys: task name, task type, query, "
                             "document, TASK-query), over the model's own prompts (docs/mixtures.md)")
    parser.add_argument("--mteb-instructions", nargs="?", const=E5_FORMAT, default=None, metavar="FORMAT",
                        help="before queries (not documents), each MTEB task's own instruction in FORMAT, with "
                             "{instruction} (default E5's 'Instruct: {instruction}\\nQuery: '), where no prompt "
                             "applies")
    parser.add_argument("--data-dir", default=None, help=DATA_DIR_HELP)
    parser.add_argument("--output", default=None,
                        help="FILE.json: the results as JSON; a folder: results.json + report.md + figures/. "
                             "Written after each evaluator, so a later failure keeps what finished")
    parser.add_argument("--max-examples", type=int, default=None, metavar="N",
                        help="a quick look: every task (each STS set, transfer split, clustering set) capped at "
                             "about N examples drawn at random (at least 20 per class); the results say so and are "
                             "not the papers' numbers")
    parser.add_argument("--aggregation", default="all", choices=["all", "wmean", "mean"], help="STS12–16 aggregation")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--precision", default="auto", choices=["auto", "bf16", "32"])
    parser.add_argument("--device", default=None, help="cuda when available, else cpu")
    parser.add_argument("--trust-checkpoint", action="store_true", help=TRUST_HELP)
    parser.add_argument("--dims", type=parse_dims, default=None,
                        help="comma-separated sizes, e.g. 64,256: also score the Matryoshka truncations (the first d "
                             "dimensions, re-normalized), one row each (`MODEL @d`); the model is encoded once")
    parser.add_argument("--whiten", default=None, metavar="SOURCE",
                        help="BERT-whitening (Su et al., 2021): also score each model whitened, one more row "
                             "(`MODEL whitened (SOURCE)`), μ and W fitted on SOURCE: target (the reference's "
                             "setting: each STS task on the pairs of all its splits, train + dev + test for STS-B and "
                             "SICK-R), task (each STS task on its own test sentences), nli "
                             "(corpora/nli_for_simcse.csv of the data directory) or a corpus file (one sentence a "
                             "line, or an NLI csv)")
    parser.add_argument("--whiten-dim", type=int, default=None, metavar="K",
                        help="keep K whitened dimensions (the paper's 256 or 384; default: every direction the "
                             "fit's embeddings span, all unless the model leaves some constant)")
    return parser


def parse_dims(text: str) -> list[int]:
    try:
        return [int(d) for d in text.split(",") if d.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--dims takes comma-separated sizes such as 64,256; got {text!r}") from None


def evaluate(options: argparse.Namespace) -> None:
    from ..evaluation import parse_evaluators

    evaluators = parse_evaluators(options.tasks or ("" if options.mteb else "sts"))  # a typo costs no seconds
    if options.max_examples is not None and options.max_examples < 1:
        raise SentEmbUserError(f"--max-examples {options.max_examples}: give a positive number of examples")
    check_whitening_options(options, evaluators)

    from ..atomic_io import atomic_write_bytes
    from ..evaluation.report import encode_results, model_labels, write_report
    from ..evaluation.sts import format_table
    from ..evaluation.suite import SuitePlan, evaluate_suite
    from ..loading import Embedder, load_embedder
    from ..loggers import silence_known_noise
    from ..matryoshka import check_dims, memoized, truncated

    silence_known_noise()
    report_dir = Path(options.output) if options.output and not options.output.endswith(".json") else None
    results_file = (None if options.output is None else report_dir / "results.json" if report_dir
                    else Path(options.output))
    if results_file is not None:
        check_writable(results_file, "--output")
    plan = SuitePlan.load(evaluators, options.data_dir, options.max_examples)  # missing data: before any model loads
    mteb_tasks = mteb_plan(options.mteb)
    whitening_sentences = None
    if options.whiten is not None and options.whiten not in WHITEN_PER_TASK:
        from ..evaluation.whitening import source_sentences

        whitening_sentences = source_sentences(options.whiten, options.data_dir)
    if evaluators:
        print(plan.describe() + f"\n  for {len(options.model)} model(s)", flush=True)
    device = options.device or ("cuda" if _cuda() else "cpu")
    results: dict[str, dict] = {}

    def save(label: str, partial: dict[str, dict]) -> None:
        """Keep every finished task on disk: a later failure or a Ctrl-C must not discard it."""
        results[label] = dict(partial)
        if results_file is not None:
            one_model = len(options.model) == 1 and not options.dims and not options.whiten
            atomic_write_bytes(results_file, encode_results(results[label] if one_model else results))

    try:
        labels = model_labels(options.model, options.name)
        for index, (model, label) in enumerate(zip(options.model, labels, strict=True)):
            template = {} if options.template is None else {"template": options.template}
            embedder = load_embedder(model, options.pooler, device, options.batch_size, options.trust_checkpoint,
                                     options.precision, **template)
            encode = embedder.encode
            if index == 0 and evaluators:
                print(encoding_estimate(encode, plan, options.batch_size, len(options.model)), flush=True)
            if options.dims or options.whiten:  # every variant reads the one encoding of each sentence
                encode = memoized(encode)
            # (row name, embedder, plan, what the results record of the variant)
            variants = [(label, Embedder(encode, embedder.size, embedder.prompts), plan, {})]
            if options.whiten:
                variants.append(whitened_variant(label, encode, embedder, plan, options, whitening_sentences))
            if options.dims:
                check_dims(options.dims, embedder.size, "--dims")
                variants += [(f"{label} @{dim}", Embedder(truncated(encode, dim), dim, embedder.prompts), plan,
                              {"dim": dim})
                             for dim in options.dims]
            for name, served, variant_plan, marks in variants:
                suite_results = evaluate_suite(
                    served.encode, variant_plan, options.data_dir,
                    (report_dir or Path(".")) / "figures", name=name, aggregation=options.aggregation,
                    on_result=lambda partial, name=name, marks=marks: save(name, {**partial, **marks}),
                )
                suite_results.update(marks)
                if mteb_tasks:
                    run_mteb(served, name, mteb_tasks, options,
                             lambda scores, name=name, done=suite_results: save(name, {**done, "mteb": scores}))
    except KeyboardInterrupt:
        finished = [f"{label}: {', '.join(finished_tasks(partial)) or 'nothing'}" for label, partial in results.items()]
        kept = f"{results_file} keeps the finished tasks ({'; '.join(finished) or 'none'})" if results_file else \
            "nothing kept (no --output)"
        print(f"\nsentemb evaluate: interrupted; {kept}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    if "sts" in evaluators:
        print(format_table({model: r["sts"] for model, r in results.items()}))
    if mteb_tasks:
        print(format_table({model: r["mteb"] for model, r in results.items()}))
    if options.max_examples:
        print(f"every task capped at {options.max_examples:,} examples (--max-examples): a quick look, not the papers' "
              "numbers")
    if report_dir is not None:
        written = write_report(results, report_dir)
        print(f"report: {written['markdown']}")
    elif results_file is not None:
        print(f"results: {results_file}")


def check_whitening_options(options: argparse.Namespace, evaluators: list[str]) -> None:
    """`--whiten` and `--whiten-dim` that cannot work: one line, before any data or model loads."""
    if options.whiten_dim is not None and not options.whiten:
        raise SentEmbUserError("--whiten-dim applies to a whitening: add --whiten target|task|nli|FILE")
    if options.whiten and options.dims:
        raise SentEmbUserError("--whiten with --dims: the whitened dimensions are chosen by --whiten-dim K (the "
                               "paper's 256 or 384), not truncated; drop --dims")
    if options.whiten in WHITEN_PER_TASK and (options.mteb or set(evaluators) - {"sts"}):
        raise SentEmbUserError(f"--whiten {options.whiten} fits each STS task on its own sentences; for transfer, "
                               "clustering, analysis or --mteb fit once on a corpus: --whiten nli or --whiten FILE")


def whitened_variant(label: str, encode: Callable, embedder: Embedder, plan: SuitePlan, options: argparse.Namespace,
                     sentences: list[str] | None) -> tuple[str, Embedder, SuitePlan, dict]:
    """The whitened row of a model: (name, embedder, plan, results marks), fitted on the source's sentences
    now (their own encoding, not kept), or per STS task (`--whiten target|task`)."""
    from dataclasses import replace

    from ..evaluation.suite import capped
    from ..evaluation.whitening import (
        check_whiten_dim,
        fit_whitening,
        own_sentences,
        per_task_whitened,
        target_sentences,
        whitened,
    )
    from ..loading import Embedder

    dim = options.whiten_dim
    if dim is not None:
        check_whiten_dim(dim, embedder.size)
    name = f"{label} whitened ({Path(options.whiten).name}{'' if dim is None else f', {dim}d'})"
    if sentences is None:  # per task: the fewest sentences checked first (task), the splits read first (target)
        fewest = min(len(set(task.first + task.second)) for task in plan.sts)
        if options.whiten == "task" and dim is not None and fewest <= dim:
            raise SentEmbUserError(f"--whiten task: a task has {fewest} distinct sentences for {dim} "
                                   "whitened dimensions; whitening needs more sentences than dimensions: set "
                                   f"--whiten-dim below {fewest}, leave it out, or fit on more sentences (--whiten "
                                   "target|nli|FILE)")
        fit_sentences = (target_sentences(plan.sts, options.data_dir, lambda split: capped(split, plan.max_examples))
                         if options.whiten == "target" else own_sentences)
        served = Embedder(per_task_whitened(encode, fit_sentences, dim, options.whiten), dim or embedder.size,
                          embedder.prompts)
        return name, served, replace(plan, sts_per_task=True), {"whitened": {"source": options.whiten, "dim": dim}}
    embeddings = embedder.encode(sentences, label=f"{label} · whitening: {len(sentences):,} sentences")
    whitening = fit_whitening(embeddings, dim, options.whiten)
    k = whitening.kernel.shape[1]
    marks = {"whitened": {"source": options.whiten, "dim": k}}
    return name, Embedder(whitened(encode, whitening), k, embedder.prompts), plan, marks


def mteb_plan(spec: str | None) -> list:
    """The MTEB tasks named by --mteb, their data loaded before any model (one line when missing)."""
    if not spec:
        return []
    from ..evaluation.mteb import load_task_data, mteb_tasks

    tasks = mteb_tasks(spec)
    load_task_data(tasks)
    print(f"mteb: {len(tasks)} task(s): {', '.join(t.metadata.name for t in tasks)}", flush=True)
    return tasks


def run_mteb(embedder: object, name: str, tasks: list, options: argparse.Namespace, on_result: Callable) -> None:
    """mteb on `tasks`, with the prompts of --mteb-prompts and --mteb-instructions."""
    from ..evaluation.mteb import MTEBModel, evaluate_mteb, read_prompts

    prompts = read_prompts(options.mteb_prompts) if options.mteb_prompts else None
    model = MTEBModel(embedder, name, prompts, options.mteb_instructions)
    evaluate_mteb(model, tasks, options.batch_size, on_result)


def encoding_estimate(encode: Callable[..., object], plan: SuitePlan, batch_size: int, models: int) -> str:
    """The time of the plan's encoding, from the speed of two batches of its sentences drawn at random
    (encoded once more, for the measure); the classifiers and K-means runs come on top."""
    import random
    import time

    planned = plan.sentences()
    every = [sentence for sentences in planned.values() for sentence in sentences]
    sample = random.Random(0).sample(every, min(len(every), 2 * batch_size))
    start = time.perf_counter()
    encode(sample, show_progress=False)
    rate = len(sample) / max(time.perf_counter() - start, 1e-9)
    per_model = len(every) / rate
    return (f"estimate: {len(every):,} sentences at {rate:,.0f}/s (measured on {len(sample)}): encoding takes about "
            f"{_duration(per_model)} per model, {_duration(per_model * models)} in all"
            + ("; the transfer classifiers and K-means runs add to it"
               if {"transfer", "cluster"} & set(planned) else ""))


def _duration(seconds: float) -> str:
    return (f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min" if seconds < 5400
            else f"{seconds / 3600:.1f} h")


def finished_tasks(results: dict) -> list[str]:
    """`sts`, `transfer/MR`, …: what a results dict holds."""
    names = []
    for key, value in results.items():
        if key in ("transfer", "clustering"):
            names += [f"{key}/{task}" for task in value]
        elif isinstance(value, dict):
            names.append(key)
    return names


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


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()
