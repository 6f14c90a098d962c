"""JSON + Markdown report of several models side by side, laid out like the papers' tables.

``results`` maps a model name to the outputs of the evaluation functions, under these keys
(each optional; any other key is kept in the JSON only)::

    "transfer":        evaluate_transfer(...)        -> ConPVP Table 5 / ClusterNS Table 8, few-shot
    "clustering":      evaluate_clustering(...)      -> ConPVP Table 6 / ClusterNS Tables 5-6
    "analysis":        analyze_sts_pairs(...)        -> alignment/uniformity, cosine buckets, t-SNE
    "frequent_tokens": frequent_token_removal(...)   -> ConPVP Fig. 5

Every file is written to a temporary name in its directory and renamed into place, so an
interrupted run never leaves a half-written report behind.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..atomic_io import atomic_write_bytes
from ..errors import SentEmbUserError
from .figures import alignment_uniformity_figure, few_shot_figure, frequent_tokens_figure, place_figure, safe_filename
from .sts import format_table

__all__ = ["encode_results", "model_labels", "write_report"]

# (result key, column header) in the papers' order.
TRANSFER_COLUMNS: tuple[tuple[str, str], ...] = (
    ("MR", "MR"),
    ("CR", "CR"),
    ("SUBJ", "SUBJ"),
    ("MPQA", "MPQA"),
    ("SST2", "SST"),
    ("TREC", "TREC"),
    ("MRPC", "MRPC"),
)
SHORT_TEXT_COLUMNS: tuple[tuple[str, str], ...] = (
    ("AgNews", "AG"),
    ("Biomedical", "Bio"),
    ("GoogleNews-S", "G-S"),
    ("GoogleNews-T", "G-T"),
    ("GoogleNews-TS", "G-TS"),
    ("SearchSnippets", "SS"),
    ("StackOverflow", "SO"),
    ("Tweet", "Tweet"),
)
OTHER_CLUSTERING_COLUMNS: tuple[tuple[str, str], ...] = (("DBpedia", "DBpedia"), ("AgNewsFull", "AG News full"))
MISSING = "–"


def encode_results(results: dict) -> bytes:
    """The results as `results.json` holds them (numpy values as plain numbers)."""
    return json.dumps(results, indent=2, default=_json_default).encode("utf-8")


def _json_default(value: object) -> object:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise TypeError(f"report results contain a {type(value).__name__}, which JSON cannot store: {value!r}")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _score_table(
    results: dict[str, dict],
    section: str,
    columns: Sequence[tuple[str, str]],
    cell: Callable[[dict], float | str],
    digits: int = 2,
    average: bool = True,
) -> str:
    """Models as rows, tasks as columns; Avg. only for models that have every column."""
    header = ["Model", *(title for _, title in columns)] + (["Avg."] if average else [])
    rows = []
    for model, result in results.items():
        tasks = result.get(section, {})
        values = [cell(tasks[key]) if key in tasks else None for key, _ in columns]
        row = [model] + [MISSING if v is None else v if isinstance(v, str) else f"{v:.{digits}f}" for v in values]
        if average:
            numbers = [v for v in values if isinstance(v, float | int)]
            row.append(f"{np.mean(numbers):.{digits}f}" if len(numbers) == len(columns) else MISSING)
        rows.append(row)
    return _table(header, rows)


def _present(results: dict[str, dict], section: str, columns: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The columns some model has results for."""
    return [(key, title) for key, title in columns if any(key in r.get(section, {}) for r in results.values())]


def model_labels(models: Sequence[str], names: Sequence[str] | None = None) -> list[str]:
    """One unique, readable label per model for tables, figure titles and file names: the given
    `names`, else the run folder and stem of each model (`out/simcse/checkpoints/best.ckpt` →
    `simcse/best`, a hub name as it is), with more parent folders where two would read alike."""
    if names:
        if len(names) != len(models) or not _distinct(names):
            raise SentEmbUserError(f"--name needs one distinct name per --model ({len(models)}); got {list(names)}")
        return list(names)
    parts = [[p for p in Path(m[: -len(".ckpt")] if m.endswith(".ckpt") else m).parts if p not in ("/", "checkpoints")]
             for m in models]
    depth = [min(2, len(p)) for p in parts]
    while True:
        labels = ["/".join(p[len(p) - d :]) for p, d in zip(parts, depth, strict=True)]
        files = [safe_filename(label) for label in labels]
        clashing = [i for i, file in enumerate(files) if files.count(file) > 1]
        growing = [i for i in clashing if depth[i] < len(parts[i])]
        if not growing:
            break
        for i in growing:
            depth[i] += 1
    if clashing:
        raise SentEmbUserError(f"--model {' '.join(models)} read alike as {labels}; name each with --name")
    return labels


def _distinct(names: Sequence[str]) -> bool:
    return len({safe_filename(n) for n in names}) == len(names)


def _link(title: str, path: Path, out_dir: Path) -> str:
    return f"![{title}]({path.relative_to(out_dir).as_posix()})"


def _scores_section(results: dict[str, dict], key: str, title: str, caption: str) -> list[str]:
    """One table of `results[model][key]` ({task: score}), models as rows; nothing when no model has it."""
    rows = {model: r[key] for model, r in results.items() if key in r}
    if not rows:
        return []
    return [f"## {title}", "", caption, "", format_table(rows), ""]


def _sts_section(results: dict[str, dict]) -> list[str]:
    return _scores_section(results, "sts", "STS",
                           "Spearman ×100 of cosine similarities; STS12–16 with SentEval's 'all' aggregation.")


def _mteb_section(results: dict[str, dict]) -> list[str]:
    return _scores_section(results, "mteb", "MTEB", "mteb's main score ×100 for each task (`--mteb`; cosine "
                           "Spearman for STS).")


def _transfer_section(results: dict[str, dict], out_dir: Path, written: dict[str, Path]) -> list[str]:
    columns = _present(results, "transfer", TRANSFER_COLUMNS)
    if not columns:
        return []
    lines = [
        "## Transfer tasks",
        "",
        (
            "Accuracy (%) of logistic regression on frozen embeddings, SentEval protocol "
            "(ConPVP Table 5, ClusterNS Table 8); Avg. over all seven tasks."
        ),
        "",
        _score_table(results, "transfer", TRANSFER_COLUMNS, lambda r: r["acc"]),
        "",
    ]
    few_shot = [
        (key, title)
        for key, title in columns
        if any("few_shot" in r.get("transfer", {}).get(key, {}) for r in results.values())
    ]
    if few_shot:
        shots = sorted(
            {
                r["transfer"][key]["few_shot"]["shots"]
                for r in results.values()
                for key, _ in few_shot
                if "few_shot" in r.get("transfer", {}).get(key, {})
            }
        )
        lines += [
            "### Few-shot transfer",
            "",
            (
                f"{'/'.join(map(str, shots))} labelled examples per class, accuracy (%) mean ± std over seeds "
                "(ConPVP Fig. 7)."
            ),
            "",
            _score_table(
                results,
                "transfer",
                few_shot,
                average=False,
                cell=lambda r: (
                    f"{r['few_shot']['mean']:.2f} ± {r['few_shot']['std']:.2f}" if "few_shot" in r else MISSING
                ),
            ),
            "",
        ]
        written["few_shot"] = few_shot_figure(results, few_shot, out_dir / "figures" / "few_shot.png")
        lines += [_link("few-shot accuracy", written["few_shot"], out_dir), ""]
    return lines


def _clustering_section(results: dict[str, dict]) -> list[str]:
    lines = []
    if _present(results, "clustering", SHORT_TEXT_COLUMNS):
        lines += [
            "## Short-text clustering",
            "",
            (
                "K-means with K = number of classes, averaged over runs (ConPVP Table 6, ClusterNS Table 6); "
                "Avg. over all eight data sets."
            ),
            "",
            "Accuracy (%):",
            "",
            _score_table(results, "clustering", SHORT_TEXT_COLUMNS, lambda r: r["acc"]),
            "",
            "NMI:",
            "",
            _score_table(results, "clustering", SHORT_TEXT_COLUMNS, lambda r: r["nmi"], digits=4),
            "",
        ]
    other = _present(results, "clustering", OTHER_CLUSTERING_COLUMNS)
    if other:
        columns = [
            (key, f"{title} {metric.upper()}", metric) for key, title in other for metric in ("acc", "nmi", "ami")
        ]
        rows = []
        for model, result in results.items():
            tasks = result.get("clustering", {})
            rows.append(
                [model]
                + [
                    f"{tasks[key][metric]:.{2 if metric == 'acc' else 4}f}" if key in tasks else MISSING
                    for key, _, metric in columns
                ]
            )
        lines += [
            "### DBpedia and AG News",
            "",
            "K-means as above; ClusterNS Table 5 reports the DBpedia AMI.",
            "",
            _table(["Model", *(title for _, title, _ in columns)], rows),
            "",
        ]
    return lines


def _analysis_section(results: dict[str, dict], out_dir: Path, written: dict[str, Path]) -> list[str]:
    analysed = {model: r["analysis"] for model, r in results.items() if "analysis" in r}
    if not analysed:
        return []
    lines = [
        "## Alignment and uniformity",
        "",
        (
            "Wang & Isola metrics on STS pairs, positives = gold score above the threshold (ClusterNS Fig. 6); "
            "lower is better."
        ),
        "",
        _table(
            ["Model", "alignment", "uniformity", "positive pairs", "sentences"],
            [
                [
                    model,
                    f"{a['alignment']:.4f}",
                    f"{a['uniformity']:.4f}",
                    str(a["n_positive_pairs"]),
                    str(a["n_sentences"]),
                ]
                for model, a in analysed.items()
            ],
        ),
        "",
    ]
    written["alignment_uniformity"] = alignment_uniformity_figure(
        results, out_dir / "figures" / "alignment_uniformity.png"
    )
    lines += [_link("alignment and uniformity", written["alignment_uniformity"], out_dir), ""]
    ranges = [bucket["range"] for bucket in next(iter(analysed.values()))["cosine_buckets"]]
    lines += [
        "## Predicted cosine per gold-score bucket",
        "",
        "Mean predicted cosine (ConPVP Fig. 4).",
        "",
        _table(
            ["Model", *ranges],
            [
                [model, *(f"{b['mean']:.4f}" if b["n"] else MISSING for b in a["cosine_buckets"])]
                for model, a in analysed.items()
            ],
        ),
        "",
    ]
    kinds = list(dict.fromkeys(kind for a in analysed.values() for kind in a.get("figures", {})))
    if kinds:
        rows = []
        for model, analysis in analysed.items():
            row = [model]
            for kind in kinds:
                if kind not in analysis.get("figures", {}):
                    row.append(MISSING)
                    continue
                key = f"{safe_filename(model)}_{kind}"
                written[key] = place_figure(analysis["figures"][kind], out_dir / "figures", key)
                row.append(_link(f"{model} {kind}", written[key], out_dir))
            rows.append(row)
        lines += [
            "Per-model figures (ConPVP Figs. 4 and 6):",
            "",
            _table(["Model", *(kind.replace("_", " ") for kind in kinds)], rows),
            "",
        ]
    return lines


def _frequent_tokens_section(results: dict[str, dict], out_dir: Path, written: dict[str, Path]) -> list[str]:
    removal = {
        model: dict(zip(r["frequent_tokens"]["ks"], r["frequent_tokens"]["scores"], strict=True))
        for model, r in results.items()
        if "frequent_tokens" in r
    }
    if not removal:
        return []
    ks = sorted({k for scores in removal.values() for k in scores})
    rows = [[model, *(f"{scores[k]:.2f}" if k in scores else MISSING for k in ks)] for model, scores in removal.items()]
    written["frequent_tokens"] = frequent_tokens_figure(results, out_dir / "figures" / "frequent_tokens.png")
    return [
        "## Removing the most frequent tokens",
        "",
        (
            "Average Spearman ×100 over the seven STS tasks with the k most frequent tokens removed from the "
            "text (ConPVP Fig. 5)."
        ),
        "",
        _table(["Model", *(f"k={k}" for k in ks)], rows),
        "",
        _link("frequent-token removal", written["frequent_tokens"], out_dir),
        "",
    ]


def write_report(results: dict[str, dict], out_dir: str | os.PathLike) -> dict[str, Path]:
    """Write ``results.json``, ``report.md`` and ``figures/*.png`` into ``out_dir``; return their paths."""
    if not results:
        raise ValueError("write_report needs results for at least one model")
    if not _distinct(list(results)):
        raise ValueError(f"model names {list(results)} clash as file names; name each model distinctly")
    results_json = encode_results(results)  # fail before writing
    out_dir = Path(out_dir)
    written: dict[str, Path] = {}
    lines = ["# Evaluation report", "", f"Models: {', '.join(results)}.", ""]
    capped = sorted({r["max_examples"] for r in results.values() if r.get("max_examples")})
    if capped:
        lines += [f"**A quick look**: every task capped at {', '.join(map(str, capped))} examples drawn at random "
                  "(`--max-examples`); these are not the papers' numbers.", ""]
    lines += _sts_section(results)
    lines += _mteb_section(results)
    lines += _transfer_section(results, out_dir, written)
    lines += _clustering_section(results)
    lines += _analysis_section(results, out_dir, written)
    lines += _frequent_tokens_section(results, out_dir, written)
    written["json"] = atomic_write_bytes(out_dir / "results.json", results_json)
    written["markdown"] = atomic_write_bytes(out_dir / "report.md", "\n".join(lines).encode("utf-8"))
    return written
