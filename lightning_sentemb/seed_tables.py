"""The three seed papers' main STS tables in their own order, each row beside what we reproduced:
`sentemb reproduce --table conpvp|dcpcse|clusterns`.

A table lists its rows by their names in `papers.PAPERS`, under the paper's section headings and
with the labels it prints (its marks: † ‡ § quote another paper, * ClusterNS's own models). Beside
each: our mean ± std of the average where `sentemb reproduce` has left its `reproduce.json` under
`RUNS/<config>/` (the command's default `--root`), or which tasks that run tested when they are not
the row's seven (its average is of another set), else the command that reproduces the row, else
"not implemented". A system another seed table prints with other figures gets a line of those below
it. Also `--list-papers` (`format_papers`), and what judges a run against a row (`spread_of`,
`task_mismatch`). Only the standard library and `papers` are imported: the table prints in well under
a second.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .data.senteval import SHORT_NAMES, STS_TASKS
from .papers import DEFAULT_SPREAD, PAPERS, RUNS, TASKS, PaperRow


@dataclass(frozen=True)
class SeedTable:
    title: str
    file: str  # in ../shared/papers/
    sections: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]  # (heading, ((label, row name), ...))

    @property
    def rows(self) -> list[str]:
        return [name for _, rows in self.sections for _, name in rows]


TABLES = {
    "conpvp": SeedTable(
        "ConPVP Table 3 (Zeng et al., 2022): unsupervised STS. †: quoted from the system's paper; the others "
        "the best Avg. of 4 seeds, ConPVP's runs", "conpvp_zeng2022.txt", (
            ("BERT-base", (("ConSERT†", "consert"), ("SimCSE", "simcse_conpvp"), ("ESimCSE", "esimcse"),
                           ("PromptBERT†", "promptbert"), ("ConPVP", "conpvp"))),
            ("BERT-large", (("ConSERT†", "consert_bert_large"), ("SimCSE", "simcse_bert_large_conpvp"),
                            ("ESimCSE", "esimcse_bert_large"), ("PromptBERT", "promptbert_bert_large_conpvp"),
                            ("ConPVP", "conpvp_bert_large"))),
            ("RoBERTa-base", (("SimCSE", "simcse_roberta_base_conpvp"), ("ESimCSE", "esimcse_roberta_base"),
                              ("PromptBERT†", "promptbert_roberta_base"), ("ConPVP", "conpvp_roberta_base"))),
            ("RoBERTa-large", (("SimCSE†", "simcse_roberta_large"), ("ESimCSE†", "esimcse_roberta_large"),
                               ("PromptBERT", "promptbert_roberta_large"), ("ConPVP", "conpvp_roberta_large"))),
        )),
    "dcpcse": SeedTable(
        "DCPCSE Table 1 (Jiang & Wang, 2022). †: from Reimers and Gurevych, 2019b; ‡: from Gao et al., 2021; "
        "§: from Yan et al., 2021; the others the mean of 10 runs", "dcpcse_jiang2022.txt", (
            ("Unsupervised models", (
                ("BERT-base† (first-last avg.)", "bert_first_last_avg"), ("BERT-base-flow†", "bert_flow"),
                ("BERT-base-whitening†", "bert_whitening"), ("ConSERT-BERT-base§", "consert"),
                ("SimCSE-BERT-base‡", "simcse"), ("SCPCSE-BERT-base", "scpcse"), ("DCPCSE-BERT-base", "dcpcse"),
                ("SimCSE-BERT-large‡", "simcse_bert_large"), ("DCPCSE-BERT-large", "dcpcse_bert_large"),
                ("SimCSE-RoBERTa-base‡", "simcse_roberta_base"), ("DCPCSE-RoBERTa-base", "dcpcse_roberta_base"))),
            ("Supervised models", (
                ("SBERT-base†", "sbert"), ("SBERT-base-flow†", "sbert_flow"),
                ("SBERT-base-whitening†", "sbert_whitening"),
                ("ConSERT-BERT-base§", "consert_sup"), ("SimCSE-BERT-base‡", "simcse_sup"),
                ("DCPCSE-BERT-base", "dcpcse_sup"), ("SimCSE-BERT-large‡", "simcse_sup_bert_large"),
                ("DCPCSE-BERT-large", "dcpcse_sup_bert_large"), ("SimCSE-RoBERTa-base‡", "simcse_sup_roberta_base"),
                ("DCPCSE-RoBERTa-base", "dcpcse_sup_roberta_base"),
                ("SimCSE-RoBERTa-large‡", "simcse_sup_roberta_large"),
                ("DCPCSE-RoBERTa-large", "dcpcse_sup_roberta_large"))),
        )),
    "clusterns": SeedTable(
        "ClusterNS Table 1 (Deng et al., 2023). *: its models (single runs); the baselines quoted from their "
        "papers (the raw embeddings from Gao et al., 2021)", "clusterns_deng2023.txt", (
            ("Non-prompt models", (
                ("GloVe embeddings", "glove"), ("BERT-base embeddings", "bert_first_last_avg"),
                ("BERT-base-flow", "bert_flow"), ("BERT-base-whitening", "bert_whitening"),
                ("SimCSE-BERT-base", "simcse"), ("*ClusterNS-BERT-base", "clusterns"),
                ("RoBERTa-base embeddings", "roberta_embeddings"), ("RoBERTa-base-whitening", "roberta_whitening"),
                ("SimCSE-RoBERTa-base", "simcse_roberta_base"), ("ESimCSE-RoBERTa-base", "esimcse_roberta_base"),
                ("DCLR-RoBERTa-base", "dclr_roberta_base"), ("*ClusterNS-RoBERTa-base", "clusterns_roberta_base"),
                ("SimCSE-BERT-large", "simcse_bert_large"), ("MixCSE-BERT-large", "mixcse_bert_large"),
                ("DCLR-BERT-large", "dclr_bert_large"), ("*ClusterNS-BERT-large", "clusterns_bert_large"))),
            ("Prompt-based models", (
                ("PromptBERT-base", "promptbert"), ("*ClusterNS-BERT-base", "clusterns_prompt"),
                ("ConPVP-BERT-base", "conpvp"), ("SNCSE-BERT-base", "sncse"),
                ("PromptRoBERTa-base", "promptbert_roberta_base"), ("ConPVP-RoBERTa-base", "conpvp_roberta_base"),
                ("SNCSE-RoBERTa-base", "sncse_roberta_base"),
                ("*ClusterNS-RoBERTa-base", "clusterns_prompt_roberta_base"),
                ("PromptBERT-large", "promptbert_bert_large"), ("ConPVP-BERT-large", "conpvp_bert_large"),
                ("SNCSE-BERT-large", "sncse_bert_large"), ("*ClusterNS-BERT-large", "clusterns_prompt_bert_large"))),
        )),
}


def task_mismatch(tested: Iterable[str]) -> str | None:
    """None when a run tested the seven STS tasks a row's Avg. is over; else which of them it tested
    ("2/7 tasks (STS-B, SICK-R)"): its average is not the row's."""
    found = [task for task in STS_TASKS if task in tested]
    if len(found) == len(STS_TASKS):
        return None
    return f"{len(found)}/{len(STS_TASKS)} tasks ({', '.join(SHORT_NAMES.get(task, task) for task in found)})"


def spread_of(row: PaperRow) -> tuple[float, str]:
    """(the ± around the paper's average a reproduction should fall in, what it is)."""
    if row.spread is not None:
        return row.spread, "the paper's std of the average"
    return DEFAULT_SPREAD, f"no std published: {DEFAULT_SPREAD} points (lightning_sentemb.papers.DEFAULT_SPREAD)"


def same_system(row: PaperRow) -> list[PaperRow]:
    """The other rows of the system `row` is with other figures (another source's; ConPVP's own SimCSE runs
    print Gao et al.'s to the digit, so they add no line)."""
    key = row.system or row.name
    return [other for other in PAPERS.values()
            if other is not row and (other.system or other.name) == key and other.scores != row.scores]


def reproduced(row: PaperRow, runs: Path = RUNS) -> str | None:
    """Our mean ± std of the average from the row's `sentemb reproduce` output, with the best of N for a
    best-of-seeds row (of its first N seeds, `PaperRow.compared_seeds`); which tasks it tested instead when
    they are not the row's seven; None when no run is there."""
    path = next((runs / config / "reproduce.json" for config in row.configs
                 if (runs / config / "reproduce.json").is_file()), None)
    if path is None:
        return None
    saved = json.loads(path.read_text())
    where = f"{len(saved['seeds'])} seeds; {path.parent}"
    mismatch = task_mismatch(saved["mean"])
    if mismatch:
        return f"{mismatch} tested: no Avg. to compare ({where})"
    text = f"{saved['mean']['avg']:.2f} ± {saved['std']['avg']:.2f}"
    if row.best_of_seeds:
        seeds = row.compared_seeds(list(saved["seeds"]))
        best = max(saved["seeds"][seed]["avg"] for seed in seeds)
        which = "" if len(seeds) == len(saved["seeds"]) else f" of seeds {seeds[0]}-{seeds[-1]}"
        return f"{text} ({len(saved['seeds'])} seeds, best{which} {best:.2f}; {path.parent})"
    return f"{text} ({where})"


def _line(label: str, row: PaperRow, beside: str) -> str:
    return f"| {label} | " + " | ".join(f"{row.scores[t]:.2f}" for t in TASKS) + f" | {beside} |"


def format_seed_table(name: str, runs: Path = RUNS) -> str:
    """Markdown: the table's rows in the paper's order, ours (or how to get them) beside, then each row's
    source and statistic, and what garbled copies of the seed text print otherwise."""
    table = TABLES[name]
    header = ("| Model | " + " | ".join(SHORT_NAMES.get(t, t) for t in TASKS)
              + " | ours: Avg. mean ± std, or how to reproduce |")
    lines = [table.title, "", header, "|" + "---|" * (len(TASKS) + 2)]
    notes = []
    for heading, rows in table.sections:
        lines.append(f"| **{heading}** |" + " |" * (len(TASKS) + 1))
        for label, row_name in rows:
            row = PAPERS[row_name]
            ours = reproduced(row, runs)
            lines.append(_line(label, row, ours or f"`{row.how_to_reproduce}`"
                               if row.missing is None else row.how_to_reproduce))
            lines += [_line(f"↳ {other.model}, as {other.source}", other, other.statistic)
                      for other in same_system(row)]
            notes.append(f"- {label} (`{row.name}`): {row.source}; {row.statistic}"
                         + (f"; ClusterNS's garbled copies also print Avg. {', '.join(row.disagreeing_copies)}"
                            if row.disagreeing_copies else ""))
    return "\n".join([*lines, "", "Sources (`sentemb reproduce --paper NAME` compares a run with a row):", *notes])


def format_papers() -> str:
    """Markdown: every published row with how it is reproduced (its configs, a command, or not
    implemented), then its source."""
    lines = ["| name | " + " | ".join(SHORT_NAMES.get(t, t) for t in TASKS) + " | statistic | configs | reproduce |",
             "|" + "---|" * (len(TASKS) + 4)]
    for row in PAPERS.values():
        scores = " | ".join(f"{row.scores[t]:.2f}" + (f" ± {row.std[t]:.2f}" if row.std else "") for t in TASKS)
        configs = ", ".join(f"experiments/{c}.yaml" for c in row.configs) or "-"
        lines.append(f"| {row.name} | {scores} | {row.statistic} | {configs} | `{row.how_to_reproduce}` |")
    lines.append("")
    lines.extend(f"- {row.name}: {row.model} ({row.backbone}); {row.source}" for row in PAPERS.values())
    return "\n".join(lines)
