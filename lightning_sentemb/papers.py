"""The published STS rows of the papers behind the configs in `experiments/`, with their sources.

Every number here was copied from a source named in its row: a seed paper (the text files in
`../shared/papers/`), a reference repository's README, or a paper quoted by another. Tasks are the
seven STS test sets plus their average, Spearman × 100 ("all" aggregation, as every paper here).
A config without a published row has none: `experiments/modernbert_simcse.yaml`,
`clusterns_dcpcse.yaml` and `experiments/llm/*.yaml` (Qwen2-0.5B) are runs no paper reports; the
PromptEOL rows (OPT, LLaMA) are there for `sentemb reproduce --paper NAME`.

`statistic` says what the number is: the best of N seeds, a mean over N seeds (with its std where
the source gives one), one run, or unstated. `spread` is the ± the source gives for the average, or
None; `sentemb reproduce` then uses `DEFAULT_SPREAD` (see `spread_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .data.senteval import STS_TASKS

TASKS = (*STS_TASKS, "avg")
# The spread assumed where a source gives none: the seed-to-seed std of the STS average that the
# sources do report for this family of methods lies between 0.15 (PromptBERT README, BERT-base) and
# 0.88 (ConPVP Table 4, SimCSE RoBERTa-large); half a point sits inside that range.
DEFAULT_SPREAD = 0.5


@dataclass(frozen=True)
class PaperRow:
    """One published row.

    Attributes:
        name: the key for `--paper`.
        model: the model as the source names it.
        backbone: the pretrained model it starts from.
        scores: task -> score for `TASKS` (Spearman × 100).
        source: paper or README, table, as precisely as it can be found again.
        statistic: "best of N seeds", "mean of N seeds", "single run", ... (the source's words).
        std: task -> std where the source prints one per task, else None.
        spread: the ± of the average the source gives (its std, or a std it states in its text),
            else None.
        configs: the configs under `experiments/` (path without `.yaml`) that reproduce this row.
        seed_paper_file: the file of `../shared/papers/` that prints the row (checked by the tests).
    """

    name: str
    model: str
    backbone: str
    scores: dict[str, float]
    source: str
    statistic: str
    std: dict[str, float] | None = None
    spread: float | None = None
    configs: tuple[str, ...] = ()
    seed_paper_file: str | None = None

    @property
    def best_of_seeds(self) -> bool:
        return self.statistic.startswith("best of")


def _row(values: str) -> dict[str, float]:
    numbers = [float(v) for v in values.split()]
    if len(numbers) != len(TASKS):
        raise ValueError(f"a paper row needs {len(TASKS)} numbers, got {values!r}")
    return dict(zip(TASKS, numbers))


SIMCSE_TABLE = "Gao et al. (2021), SimCSE, main STS results, as quoted (‡) in DCPCSE Table 1 (Jiang & Wang, 2022)"

PAPERS: dict[str, PaperRow] = {
    row.name: row
    for row in (
        PaperRow(
            "simcse", "unsup-SimCSE-BERT-base", "bert-base-uncased",
            _row("68.40 82.41 74.38 80.91 78.56 76.85 72.23 76.25"),
            f"{SIMCSE_TABLE}; the avg also in princeton-nlp/SimCSE README, Model List",
            "unstated (the released checkpoint scores it)", configs=("simcse",),
            seed_paper_file="dcpcse_jiang2022.txt",
        ),
        PaperRow(
            "simcse_sup", "sup-SimCSE-BERT-base", "bert-base-uncased",
            _row("75.30 84.67 80.19 85.40 80.82 84.25 80.39 81.57"),
            f"{SIMCSE_TABLE}; the avg also in princeton-nlp/SimCSE README, Model List",
            "unstated (the released checkpoint scores it)", configs=("simcse_sup",),
            seed_paper_file="dcpcse_jiang2022.txt",
        ),
        PaperRow(
            "promptbert", "unsupervised PromptBERT", "bert-base-uncased",
            _row("71.56 84.58 76.98 84.47 80.60 81.60 69.87 78.54"),
            "kongds/Prompt-BERT README, Results on STS Tasks (Jiang et al., 2022); the means also in ConPVP "
            "Table 3 and ClusterNS Table 1",
            "mean ± std over random seeds (the README does not say how many)",
            std=_row("0.18 0.22 0.26 0.24 0.21 0.22 0.40 0.15"), spread=0.15, configs=("promptbert",),
            seed_paper_file="conpvp_zeng2022.txt",
        ),
        PaperRow(
            "promptbert_sup", "supervised PromptBERT", "bert-base-uncased",
            _row("75.48 85.59 80.57 85.99 81.08 84.56 80.52 81.97"),
            "kongds/Prompt-BERT README, Results on STS Tasks (Jiang et al., 2022)",
            "unstated (the released checkpoint)", configs=("promptbert_sup",),
        ),
        PaperRow(
            "conpvp", "ConPVP BERT-base", "bert-base-uncased",
            _row("71.72 84.95 77.68 83.64 79.76 80.82 73.38 78.85"),
            "Zeng et al. (2022), ConPVP, Table 3 (unsupervised STS, BERT-base)",
            "best of 4 seeds (best Avg.)", configs=("conpvp",), seed_paper_file="conpvp_zeng2022.txt",
        ),
        PaperRow(
            "dcpcse", "unsupervised DCPCSE-BERT-base", "bert-base-uncased",
            _row("73.03 85.18 76.70 84.19 79.69 80.62 70.00 78.49"),
            "Jiang & Wang (2022), DCPCSE, Table 1 (unsupervised models)",
            "mean of 10 random runs (§3.1, no std)", configs=("dcpcse",), seed_paper_file="dcpcse_jiang2022.txt",
        ),
        PaperRow(
            "dcpcse_sup", "supervised DCPCSE-BERT-base", "bert-base-uncased",
            _row("75.58 84.33 79.67 85.79 81.24 84.25 80.79 81.65"),
            "Jiang & Wang (2022), DCPCSE, Table 1 (supervised models)",
            "mean of 10 random runs (§3.1, no std)", configs=("dcpcse_sup",), seed_paper_file="dcpcse_jiang2022.txt",
        ),
        PaperRow(
            "clusterns", "Non-Prompt ClusterNS-BERT-base", "bert-base-uncased",
            _row("69.93 83.57 76.00 82.44 80.01 78.85 72.03 77.55"),
            "Deng et al. (2023), ClusterNS, Table 1 (non-prompt models)",
            "single run (checklist C3: 5 seeds give a std of about 0.1-0.2)", spread=0.2,
            configs=("clusterns",), seed_paper_file="clusterns_deng2023.txt",
        ),
        PaperRow(
            "clusterns_prompt", "Prompt-based ClusterNS-BERT-base", "bert-base-uncased",
            _row("72.92 84.86 77.38 84.52 80.23 81.58 69.53 78.72"),
            "Deng et al. (2023), ClusterNS, Table 1 (prompt-based models)",
            "single run (checklist C3: 5 seeds give a std of about 0.1-0.2)", spread=0.2,
            configs=("clusterns_prompt",), seed_paper_file="clusterns_deng2023.txt",
        ),
        *(
            PaperRow(
                f"prompteol_{size}", f"royokong/prompteol-{size}", base,
                _row(values),
                "kongds/scaling_sentemb README, Results on STS Tasks with contrastive learning (Jiang et al., 2023, "
                "PromptEOL, NLI fine-tuned with LoRA)",
                "unstated (the released LoRA checkpoint)",
            )
            for size, base, values in (
                ("opt-1.3b", "facebook/opt-1.3b", "79.01 89.26 84.10 88.30 84.62 87.71 80.52 84.79"),
                ("opt-2.7b", "facebook/opt-2.7b", "79.49 89.64 84.80 89.51 85.91 88.33 81.64 85.62"),
                ("opt-6.7b", "facebook/opt-6.7b", "80.14 90.02 84.94 89.78 85.84 88.75 81.29 85.82"),
                ("opt-13b", "facebook/opt-13b", "80.20 90.24 85.34 89.52 85.90 88.56 82.06 85.97"),
                ("llama-7b", "LLaMA-7B", "79.16 90.22 85.40 88.99 86.25 88.37 81.51 85.70"),
                ("llama-13b", "LLaMA-13B", "78.63 90.03 85.46 89.48 86.18 88.45 82.69 85.85"),
            )
        ),
    )
}


def paper_for_config(config: str) -> PaperRow | None:
    """The row a config under `experiments/` reproduces (`config`: its path relative to
    `experiments/`, without `.yaml`), or None."""
    return next((row for row in PAPERS.values() if config in row.configs), None)


def spread_of(row: PaperRow) -> tuple[float, str]:
    """(the ± around the paper's average a reproduction should fall in, what it is)."""
    if row.spread is not None:
        return row.spread, "the paper's std of the average"
    return DEFAULT_SPREAD, f"no std published: {DEFAULT_SPREAD} points (lightning_sentemb.papers.DEFAULT_SPREAD)"


def format_papers() -> str:
    """Markdown: every published row, then its source."""
    short = {"STSBenchmark": "STS-B", "SICKRelatedness": "SICK-R", "avg": "Avg."}
    lines = ["| name | " + " | ".join(short.get(t, t) for t in TASKS) + " | statistic | configs |",
             "|" + "---|" * (len(TASKS) + 3)]
    for row in PAPERS.values():
        scores = " | ".join(f"{row.scores[t]:.2f}" + (f" ± {row.std[t]:.2f}" if row.std else "") for t in TASKS)
        configs = ", ".join(f"experiments/{c}.yaml" for c in row.configs) or "-"
        lines.append(f"| {row.name} | {scores} | {row.statistic} | {configs} |")
    lines.append("")
    lines.extend(f"- {row.name}: {row.model} ({row.backbone}); {row.source}" for row in PAPERS.values())
    return "\n".join(lines)
