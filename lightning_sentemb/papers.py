"""The published STS rows of the papers behind the configs in `experiments/`, with their sources:
every row of the three seed papers' main tables (ConPVP Table 3, DCPCSE Table 1, ClusterNS Table 1;
their layout is `seed_tables`), and a few more.

Every number here was copied from a source named in its row: a seed paper (the text files in
`../shared/papers/`), a reference repository's README, or a paper quoted by another. Tasks are the
seven STS test sets plus their average, Spearman × 100 ("all" aggregation, as every paper here).
A config without a published row has none: `experiments/modernbert_simcse.yaml`,
`clusterns_dcpcse.yaml` and `experiments/llm/*.yaml` (Qwen2-0.5B) are runs no paper reports; the
PromptEOL rows (OPT, LLaMA) are there for `sentemb reproduce --paper NAME`.

`statistic` says what the number is: the best of N seeds, a mean over N seeds (with its std where
the source gives one), one run, or unstated. `spread` is the ± the source gives for the average, or
None; `sentemb reproduce` then uses `DEFAULT_SPREAD` (`seed_tables.spread_of`). A row is reproduced
by its `configs` (`sentemb reproduce`), or by a `command` (the raw backbones and whitening: `sentemb
evaluate`), or is `missing` (a system nothing here builds). Where two seed papers print different
figures for one system, each is a row, the second naming the first as its `system`; when the same
configs reproduce both, the second reads the first's runs (`PaperRow.runs_of`): one run, two statistics.

ClusterNS's extracted text repeats rows with different digits (garbled copies): each row here is its
tab-separated copy, whose average is the mean of its tasks; `disagreeing_copies` lists the other
averages the garbled copies print after the same task scores (checked against the text by the tests).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from .data.senteval import STS_TASKS

TASKS = (*STS_TASKS, "avg")
# The spread assumed where a source gives none: the seed-to-seed std of the STS average that the
# sources do report for this family of methods lies between 0.15 (PromptBERT README, BERT-base) and
# 0.88 (ConPVP Table 4, SimCSE RoBERTa-large); half a point sits inside that range.
DEFAULT_SPREAD = 0.5
# `sentemb reproduce`'s runs: RUNS/<config>/ by default (`--root`), where `--table` looks for them
RUNS = Path("out") / "reproduce"


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
        command: for a row without configs, the command that reproduces it (`sentemb evaluate ...`).
        missing: for a row nothing here reproduces, why (the system no method here builds).
        system: the row of the same system that another source prints with other figures.
        disagreeing_copies: other averages that garbled copies in ClusterNS's text print after these tasks.
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
    command: str | None = None
    missing: str | None = None
    system: str | None = None
    disagreeing_copies: tuple[str, ...] = ()
    # an earlier stage the config starts from (its run and export, `stage_commands`), run once before the seeds
    first_stage: str | None = None

    @property
    def best_of_seeds(self) -> bool:
        return self.statistic.startswith("best of")

    @property
    def seeds(self) -> int:
        """The seeds to run: the N of "best of N" / "mean of N", else 5."""
        match = re.match(r"(?:best|mean) of (\d+)", self.statistic)
        return int(match[1]) if match else 5

    def compared_seeds(self, seeds: list[int]) -> list[int]:
        """The seeds of a run this row is compared with: a best-of-N row's first N (a best of more is not the
        best of N), all of them for any other row."""
        return seeds[: self.seeds] if self.best_of_seeds else seeds

    @property
    def runs_of(self) -> PaperRow:
        """The row whose `sentemb reproduce` runs this one reads: its system's row when the same configs
        reproduce both (ConPVP's own best-of-4 runs of SimCSE and PromptBERT-large: one run of the config
        serves both rows, each with its own statistic), else itself."""
        system = PAPERS.get(self.system) if self.system else None
        return system if system is not None and system.configs == self.configs else self

    @property
    def how_to_reproduce(self) -> str:
        if self.runs_of is not self:
            return self.runs_of.how_to_reproduce
        if self.configs:
            run = f"sentemb reproduce --method {self.configs[0]} --seeds {self.seeds}"
            return f"{self.first_stage} && {run}" if self.first_stage else run
        return self.command or f"not implemented ({self.missing})"


def _row(values: str) -> dict[str, float]:
    numbers = [float(v) for v in values.split()]
    if len(numbers) != len(TASKS):
        raise ValueError(f"a paper row needs {len(TASKS)} numbers, got {values!r}")
    return dict(zip(TASKS, numbers, strict=True))


CONPVP_T3 = "Zeng et al. (2022), ConPVP, Table 3"
DCPCSE_T1 = "Jiang & Wang (2022), DCPCSE, Table 1"
CLUSTERNS_T1 = "Deng et al. (2023), ClusterNS, Table 1"
CONPVP, DCPCSE, CLUSTERNS = "conpvp_zeng2022.txt", "dcpcse_jiang2022.txt", "clusterns_deng2023.txt"
SIMCSE_README = "the avg also in princeton-nlp/SimCSE README, Model List"
# how the seed tables obtained the figures they did not run themselves
QUOTED = "unstated (quoted from the system's paper)"
RELEASED = "unstated (the released checkpoint scores it)"
CONPVP_RUN = "best of 4 seeds (ConPVP's own run of the baseline, best Avg.)"
CLUSTERNS_RUN = "single run (checklist C3: 5 seeds give a std of about 0.1-0.2)"
DCPCSE_RUN = "mean of 10 random runs (§3.1, no std)"
NO_TRAINING = "one evaluation of the pretrained model (nothing trained)"
# the raw backbones' rows. BERT-base (first-last avg.), 56.70, averaged the embedding output with the last
# layer (SimCSE's first release; SimCSE issue 285 measures 60.73 with the first transformer layer);
# BERT-whitening's code (bojone/BERT-whitening, eng/utils.py get_encoder) averages the first transformer layer's
# output with the last, and fits "target" (eng/eval.py: each task's train, dev and test pairs)
FIRST_LAST = "sentemb evaluate --model bert-base-uncased --pooler avg_emb_last"
WHITENING = "sentemb evaluate --model bert-base-uncased --pooler avg_first_last --whiten target"
FIT_DATA = ("the seed tables do not say which data the whitening/flow was fitted on (Su et al. and Li et al. "
            "report the NLI sentences and the target task's): target here, the reference's `target` (each task's "
            "train, dev and test sentences), nli the other")


def stage_commands(row: str, config: str) -> tuple[str, str]:
    """(the commands that run `config` once and export its best checkpoint, the export's folder), all in
    `RUNS/<row>/stage-1-<config>`: never the root of a row's own runs (`RUNS/<config>`, whose
    `reproduce.json` and checkpoint a 1-seed stage would replace), nor another row's stage."""
    root = (RUNS / row / f"stage-1-{config}").as_posix()
    export = f"{root}/export"
    return (f"sentemb reproduce --method {config} --seeds 1 --root {root} && "
            f"sentemb export {root}/seed-0/checkpoints/best.ckpt {export}"), export


SBERT_FLOW_STAGE, SBERT_FLOW_EXPORT = stage_commands("flow_sbert", "sbert_sup")
SBERT_WHITENING_STAGE, SBERT_WHITENING_EXPORT = stage_commands("sbert_whitening", "sbert_sup")
CONSERT_JOINT_STAGE, CONSERT_JOINT_EXPORT = stage_commands("consert_sup_unsup", "consert_sup")


def _seed(name: str, model: str, backbone: str, values: str, source: str, statistic: str, file: str,
          **extra) -> PaperRow:
    """A row of a seed table (`seed_paper_file` = `file`)."""
    return PaperRow(name, model, backbone, _row(values), source, statistic, seed_paper_file=file, **extra)


PAPERS: dict[str, PaperRow] = {
    row.name: row
    for row in (
        # ----- BERT-base, unsupervised ------------------------------------------------------------------
        _seed("bert_first_last_avg", "BERT-base (first-last avg.)", "bert-base-uncased",
              "39.70 59.38 49.67 66.03 66.19 53.87 62.06 56.70",
              f"{DCPCSE_T1} (†: attributed to Reimers & Gurevych, 2019b) and {CLUSTERNS_T1} ('BERT-base "
              "embeddings', from Gao et al., 2021)", NO_TRAINING, DCPCSE, command=FIRST_LAST),
        _seed("bert_flow", "BERT-base-flow", "bert-base-uncased", "58.40 67.10 60.85 75.16 71.22 68.66 64.47 66.55",
              f"{DCPCSE_T1} (†) and {CLUSTERNS_T1} (Li et al., 2020a); {FIT_DATA}", QUOTED, DCPCSE,
              configs=("flow",)),
        _seed("bert_whitening", "BERT-base-whitening", "bert-base-uncased",
              "57.83 66.90 60.90 75.08 71.31 68.24 63.73 66.28",
              f"{DCPCSE_T1} (†) and {CLUSTERNS_T1} (Su et al., 2021); {FIT_DATA}", QUOTED, DCPCSE,
              command=WHITENING),
        _seed("glove", "GloVe embeddings (avg.)", "glove.840B.300d", "55.14 70.66 59.73 68.25 63.66 58.02 53.76 61.32",
              f"{CLUSTERNS_T1} (from Gao et al., 2021)", QUOTED, CLUSTERNS,
              missing="averaged static GloVe vectors: no method here builds them"),
        *(  # ConSERT (Yan et al., 2021), as ConPVP (†) and DCPCSE (§) quote it
            _seed(name, model, backbone, values, source, QUOTED, file, configs=(name,))
            for name, model, backbone, values, source, file in (
                ("consert", "ConSERT-BERT-base", "bert-base-uncased", "64.64 78.49 69.07 79.72 75.95 73.97 67.31 72.74",
                 f"{CONPVP_T3} (†) and {DCPCSE_T1} (§), both from Yan et al. (2021)", CONPVP),
                ("consert_bert_large", "ConSERT-BERT-large", "bert-large-uncased",
                 "70.69 82.96 74.13 82.78 76.66 77.53 70.37 76.45", f"{CONPVP_T3} (†: from Yan et al., 2021)", CONPVP),
            )
        ),
        _seed("consert_sup", "supervised ConSERT-BERT-base", "bert-base-uncased",
              "74.07 83.93 77.05 83.66 78.76 81.36 76.77 79.37", f"{DCPCSE_T1} (§: from Yan et al., 2021)", QUOTED,
              DCPCSE, configs=("consert_sup_unsup",), first_stage=CONSERT_JOINT_STAGE),
        _seed("simcse", "unsup-SimCSE-BERT-base", "bert-base-uncased",
              "68.40 82.41 74.38 80.91 78.56 76.85 72.23 76.25",
              f"Gao et al. (2021), as {DCPCSE_T1} (‡), {CONPVP_T3} and {CLUSTERNS_T1} print it; {SIMCSE_README}",
              RELEASED, DCPCSE, configs=("simcse",),
              disagreeing_copies=("76.23",)),
        _seed("esimcse", "ESimCSE-BERT-base", "bert-base-uncased", "73.40 83.27 77.25 82.66 78.81 80.17 72.30 78.27",
              CONPVP_T3, CONPVP_RUN, CONPVP, configs=("esimcse",)),
        PaperRow(
            "promptbert", "unsupervised PromptBERT", "bert-base-uncased",
            _row("71.56 84.58 76.98 84.47 80.60 81.60 69.87 78.54"),
            "kongds/Prompt-BERT README, Results on STS Tasks (Jiang et al., 2022); the means also in ConPVP "
            "Table 3 (†) and ClusterNS Table 1",
            "mean ± std over random seeds (the README does not say how many)",
            std=_row("0.18 0.22 0.26 0.24 0.21 0.22 0.40 0.15"), spread=0.15, configs=("promptbert",),
            seed_paper_file=CONPVP, disagreeing_copies=("78.52",),
        ),
        PaperRow(
            "promptbert_sup", "supervised PromptBERT", "bert-base-uncased",
            _row("75.48 85.59 80.57 85.99 81.08 84.56 80.52 81.97"),
            "kongds/Prompt-BERT README, Results on STS Tasks (Jiang et al., 2022)",
            "unstated (the released checkpoint)", configs=("promptbert_sup",),
        ),
        _seed("conpvp", "ConPVP BERT-base", "bert-base-uncased", "71.72 84.95 77.68 83.64 79.76 80.82 73.38 78.85",
              f"{CONPVP_T3} (unsupervised STS, BERT-base); also {CLUSTERNS_T1}", "best of 4 seeds (best Avg.)", CONPVP,
              configs=("conpvp",), disagreeing_copies=("78.45", "78.72", "78.77", "78.82", "78.83", "78.84")),
        _seed("scpcse", "SCPCSE-BERT-base", "bert-base-uncased", "64.28 78.97 70.51 78.45 75.71 76.33 68.73 73.28",
              f"{DCPCSE_T1} (its shallow-prompt ablation, §3.3)", DCPCSE_RUN, DCPCSE, configs=("scpcse",)),
        _seed("dcpcse", "unsupervised DCPCSE-BERT-base", "bert-base-uncased",
              "73.03 85.18 76.70 84.19 79.69 80.62 70.00 78.49", f"{DCPCSE_T1} (unsupervised models)", DCPCSE_RUN,
              DCPCSE, configs=("dcpcse",)),
        _seed("clusterns", "Non-Prompt ClusterNS-BERT-base", "bert-base-uncased",
              "69.93 83.57 76.00 82.44 80.01 78.85 72.03 77.55", f"{CLUSTERNS_T1} (non-prompt models)", CLUSTERNS_RUN,
              CLUSTERNS, spread=0.2, configs=("clusterns",), disagreeing_copies=("77.53",)),
        _seed("clusterns_prompt", "Prompt-based ClusterNS-BERT-base", "bert-base-uncased",
              "72.92 84.86 77.38 84.52 80.23 81.58 69.53 78.72", f"{CLUSTERNS_T1} (prompt-based models)", CLUSTERNS_RUN,
              CLUSTERNS, spread=0.2, configs=("clusterns_prompt",), disagreeing_copies=("78.74",)),
        _seed("sncse", "SNCSE-BERT-base", "bert-base-uncased", "70.67 84.79 76.99 83.69 80.51 81.35 74.77 78.97",
              f"{CLUSTERNS_T1} (from Wang et al., 2022a)", QUOTED, CLUSTERNS, configs=("sncse",),
              disagreeing_copies=("78.92", "78.94", "78.99")),
        # ----- BERT-large, unsupervised -----------------------------------------------------------------
        _seed("simcse_bert_large", "unsup-SimCSE-BERT-large", "bert-large-uncased",
              "70.88 84.16 76.43 84.50 79.76 79.26 73.88 78.41",
              f"Gao et al. (2021), as {DCPCSE_T1} (‡), {CONPVP_T3} and {CLUSTERNS_T1} print it; {SIMCSE_README}",
              RELEASED, DCPCSE, configs=("simcse_bert_large",),
              disagreeing_copies=("78.44", "78.49")),
        _seed("esimcse_bert_large", "ESimCSE-BERT-large", "bert-large-uncased",
              "73.21 85.37 77.73 84.30 78.92 80.73 74.89 79.31", CONPVP_T3, CONPVP_RUN, CONPVP,
              configs=("esimcse_bert_large",)),
        _seed("promptbert_bert_large", "PromptBERT-BERT-large", "bert-large-uncased",
              "73.29 86.39 77.90 85.18 79.97 81.92 71.26 79.42", f"{CLUSTERNS_T1} (from Jiang et al., 2022)", QUOTED,
              CLUSTERNS, configs=("promptbert_bert_large",), disagreeing_copies=("79.44", "79.47")),
        _seed("promptbert_bert_large_conpvp", "PromptBERT-BERT-large (ConPVP's run)", "bert-large-uncased",
              "71.55 86.83 78.63 85.10 79.79 82.20 72.19 79.47", CONPVP_T3, CONPVP_RUN, CONPVP,
              configs=("promptbert_bert_large",), system="promptbert_bert_large"),
        _seed("mixcse_bert_large", "MixCSE-BERT-large", "bert-large-uncased",
              "72.55 84.32 76.69 84.31 79.67 79.90 74.07 78.80", f"{CLUSTERNS_T1} (from Zhang et al., 2022a)", QUOTED,
              CLUSTERNS, configs=("mixcse_bert_large",), disagreeing_copies=("78.86",)),
        _seed("dclr_bert_large", "DCLR-BERT-large", "bert-large-uncased",
              "71.87 84.83 77.37 84.70 79.81 79.55 74.19 78.90", f"{CLUSTERNS_T1} (from Zhou et al., 2022)", QUOTED,
              CLUSTERNS, configs=("dclr_bert_large",), disagreeing_copies=("78.96", "78.99")),
        _seed("sncse_bert_large", "SNCSE-BERT-large", "bert-large-uncased",
              "71.94 86.66 78.84 85.74 80.72 82.29 75.11 80.19", f"{CLUSTERNS_T1} (from Wang et al., 2022a)", QUOTED,
              CLUSTERNS, configs=("sncse_bert_large",)),
        # ----- RoBERTa-base, unsupervised ---------------------------------------------------------------
        _seed("roberta_embeddings", "RoBERTa-base embeddings", "roberta-base",
              "32.11 56.33 45.22 61.34 61.98 54.53 62.03 53.36",
              f"{CLUSTERNS_T1} (from Gao et al., 2021; its pooling unstated: avg here)", NO_TRAINING, CLUSTERNS,
              command="sentemb evaluate --model roberta-base --pooler avg", disagreeing_copies=("53.30", "53.33")),
        _seed("roberta_whitening", "RoBERTa-base-whitening", "roberta-base",
              "46.99 63.24 57.23 71.36 68.99 61.36 62.91 61.73", f"{CLUSTERNS_T1} (Su et al., 2021); {FIT_DATA}",
              QUOTED, CLUSTERNS, command=WHITENING.replace("bert-base-uncased", "roberta-base"),
              disagreeing_copies=("61.77",)),
        _seed("simcse_roberta_base", "unsup-SimCSE-RoBERTa-base", "roberta-base",
              "70.16 81.77 73.24 81.36 80.65 80.22 68.56 76.57",
              f"Gao et al. (2021), as {DCPCSE_T1} (‡), {CONPVP_T3} and {CLUSTERNS_T1} print it; {SIMCSE_README}",
              RELEASED, DCPCSE, configs=("simcse_roberta_base",)),
        _seed("esimcse_roberta_base", "ESimCSE-RoBERTa-base", "roberta-base",
              "69.90 82.50 74.68 83.19 80.30 80.99 70.54 77.44",
              f"{CONPVP_T3} (its own run) and {CLUSTERNS_T1} (quoting Wu et al., 2022), the same figures", CONPVP_RUN,
              CONPVP, configs=("esimcse_roberta_base",)),
        _seed("dclr_roberta_base", "DCLR-RoBERTa-base", "roberta-base",
              "70.01 83.08 75.09 83.66 81.06 81.86 70.33 77.87",
              f"{CLUSTERNS_T1} (from Zhou et al., 2022)", QUOTED, CLUSTERNS, configs=("dclr_roberta_base",),
              disagreeing_copies=("77.84",)),
        _seed("promptbert_roberta_base", "unsupervised PromptRoBERTa", "roberta-base",
              "73.94 84.74 77.28 84.99 81.74 81.88 69.50 79.15",
              f"kongds/Prompt-BERT README (Jiang et al., 2022); the means also in {CONPVP_T3} (†) and {CLUSTERNS_T1}",
              "mean ± std over random seeds (the README does not say how many)", CONPVP,
              std=_row("0.90 0.36 0.41 0.25 0.29 0.37 0.57 0.25"), spread=0.25, configs=("promptbert_roberta_base",),
              disagreeing_copies=("79.12", "79.13", "79.14")),
        _seed("sncse_roberta_base", "SNCSE-RoBERTa-base", "roberta-base",
              "70.62 84.42 77.24 84.85 81.49 83.07 72.92 79.23", f"{CLUSTERNS_T1} (from Wang et al., 2022a)", QUOTED,
              CLUSTERNS, configs=("sncse_roberta_base",), disagreeing_copies=("79.22", "79.24", "79.27")),
        # ----- RoBERTa-large, unsupervised (ConPVP) -----------------------------------------------------
        _seed("simcse_roberta_large", "unsup-SimCSE-RoBERTa-large", "roberta-large",
              "72.86 83.99 75.62 84.77 81.80 81.98 71.26 78.90",
              f"{CONPVP_T3} (†: from Gao et al., 2021); {SIMCSE_README}", RELEASED, CONPVP,
              configs=("simcse_roberta_large",)),
        _seed("esimcse_roberta_large", "ESimCSE-RoBERTa-large", "roberta-large",
              "73.20 84.93 76.88 84.86 81.21 82.79 72.27 79.45", f"{CONPVP_T3} (†: from Wu et al., 2022)", QUOTED,
              CONPVP, configs=("esimcse_roberta_large",)),
        _seed("promptbert_roberta_large", "PromptBERT-RoBERTa-large (ConPVP's run)", "roberta-large",
              "72.89 86.44 78.10 85.09 79.37 81.52 70.85 79.18", CONPVP_T3, CONPVP_RUN, CONPVP,
              configs=("promptbert_roberta_large",)),
        *(  # ConPVP's own rows beyond BERT-base (Table 3, best of 4), ClusterNS printing the first two again
            _seed(f"conpvp_{suffix}", f"ConPVP {size}", backbone, values, source, "best of 4 seeds (best Avg.)", CONPVP,
                  configs=(f"conpvp_{suffix}",), disagreeing_copies=copies)
            for suffix, size, backbone, values, source, copies in (
                ("bert_large", "BERT-large", "bert-large-uncased", "72.63 86.68 78.14 85.50 80.13 82.18 74.79 80.01",
                 f"{CONPVP_T3}; also {CLUSTERNS_T1}", ("80.07",)),
                ("roberta_base", "RoBERTa-base", "roberta-base", "73.20 83.22 76.24 83.37 81.49 82.18 74.59 79.18",
                 f"{CONPVP_T3}; also {CLUSTERNS_T1}", ("79.12",)),
                ("roberta_large", "RoBERTa-large", "roberta-large", "74.75 84.09 77.88 83.13 83.44 83.64 74.31 80.18",
                 CONPVP_T3, ()),
            )
        ),
        *(  # DCPCSE's own unsupervised rows beyond BERT-base (Table 1, mean of 10)
            _seed(f"dcpcse_{suffix}", f"unsupervised DCPCSE-{size}", backbone, values, DCPCSE_T1, DCPCSE_RUN, DCPCSE,
                  configs=(f"dcpcse_{suffix}",))
            for suffix, size, backbone, values in (
                ("bert_large", "BERT-large", "bert-large-uncased", "73.34 85.90 77.10 85.26 80.08 80.96 73.28 79.42"),
                ("roberta_base", "RoBERTa-base", "roberta-base", "70.57 81.91 74.60 82.90 80.96 82.84 71.70 77.93"),
            )
        ),
        *(  # ClusterNS's own rows beyond BERT-base (Table 1, single runs)
            _seed(name, model, backbone, values, CLUSTERNS_T1, CLUSTERNS_RUN, CLUSTERNS, spread=0.2, configs=(name,),
                  disagreeing_copies=copies)
            for name, model, backbone, values, copies in (
                ("clusterns_bert_large", "Non-Prompt ClusterNS-BERT-large", "bert-large-uncased",
                 "71.64 85.97 77.74 83.48 79.68 80.80 75.02 79.19", ()),
                ("clusterns_prompt_bert_large", "Prompt-based ClusterNS-BERT-large", "bert-large-uncased",
                 "73.99 87.53 78.82 85.47 80.84 82.85 72.59 80.30", ()),
                ("clusterns_roberta_base", "Non-Prompt ClusterNS-RoBERTa-base", "roberta-base",
                 "71.17 83.53 75.29 82.47 82.25 81.95 69.22 77.98", ("77.90", "77.94", "77.97", "77.99")),
                ("clusterns_prompt_roberta_base", "Prompt-based ClusterNS-RoBERTa-base", "roberta-base",
                 "74.02 85.12 77.96 84.47 82.84 83.28 70.47 79.74", ("79.47",)),
            )
        ),
        # ----- supervised (DCPCSE) ------------------------------------------------------------------------
        _seed("sbert", "SBERT-base", "bert-base-uncased", "70.97 76.53 73.19 79.09 74.30 77.03 72.91 74.89",
              f"{DCPCSE_T1} (†: Reimers & Gurevych, 2019b)", QUOTED, DCPCSE, configs=("sbert_sup",)),
        _seed("sbert_flow", "SBERT-base-flow", "bert-base-uncased", "69.78 77.27 74.35 82.01 77.46 79.12 76.21 76.60",
              f"{DCPCSE_T1} (†); {FIT_DATA}", QUOTED, DCPCSE, configs=("flow_sbert",), first_stage=SBERT_FLOW_STAGE),
        _seed("sbert_whitening", "SBERT-base-whitening", "bert-base-uncased",
              "69.65 77.57 74.66 82.27 78.39 79.52 76.91 77.00", f"{DCPCSE_T1} (†); {FIT_DATA}", QUOTED, DCPCSE,
              command=f"{SBERT_WHITENING_STAGE} && sentemb evaluate --model {SBERT_WHITENING_EXPORT} "
                      "--whiten target"),
        _seed("simcse_sup", "sup-SimCSE-BERT-base", "bert-base-uncased",
              "75.30 84.67 80.19 85.40 80.82 84.25 80.39 81.57",
              f"Gao et al. (2021), as {DCPCSE_T1} (‡) prints it; {SIMCSE_README}",
              RELEASED, DCPCSE, configs=("simcse_sup",)),
        _seed("dcpcse_sup", "supervised DCPCSE-BERT-base", "bert-base-uncased",
              "75.58 84.33 79.67 85.79 81.24 84.25 80.79 81.65", f"{DCPCSE_T1} (supervised models)", DCPCSE_RUN,
              DCPCSE, configs=("dcpcse_sup",)),
        *(  # the larger supervised rows, in DCPCSE's order: SimCSE (quoted), then DCPCSE's own
            _seed(f"{method}_sup_{suffix}", f"{model}-{size}", backbone, values, source, statistic, DCPCSE,
                  configs=(f"{method}_sup_{suffix}",))
            for suffix, size, backbone, simcse, dcpcse, note in (
                ("bert_large", "BERT-large", "bert-large-uncased", "75.78 86.33 80.44 86.60 80.86 84.87 81.14 82.21",
                 "77.97 86.54 81.04 86.33 81.81 85.24 81.31 82.89",
                 "; its STS15 86.60 does not average to 82.21 (86.06 does: a transposed digit in DCPCSE's copy?)"),
                ("roberta_base", "RoBERTa-base", "roberta-base", "76.53 85.21 80.95 86.03 82.57 85.83 80.50 82.52",
                 "76.75 85.86 80.98 86.51 83.51 86.58 80.41 82.94", ""),
                ("roberta_large", "RoBERTa-large", "roberta-large", "77.46 87.27 82.36 86.66 83.93 86.70 81.95 83.76",
                 "79.14 88.64 83.73 87.33 84.57 87.84 82.07 84.76", ""),
            )
            for method, model, values, source, statistic in (
                ("simcse", "sup-SimCSE", simcse,
                 f"Gao et al. (2021), as {DCPCSE_T1} (‡) prints it; {SIMCSE_README}{note}", RELEASED),
                ("dcpcse", "supervised DCPCSE", dcpcse, DCPCSE_T1, DCPCSE_RUN),
            )
        ),
        *(
            PaperRow(
                f"prompteol_{size}", f"royokong/prompteol-{size}", base,
                _row(values),
                "kongds/scaling_sentemb README, Results on STS Tasks with contrastive learning (Jiang et al., 2023, "
                "PromptEOL, NLI fine-tuned with LoRA)",
                "unstated (the released LoRA checkpoint)",
                command=f"sentemb reproduce -c experiments/llm/prompteol_nli.yaml --paper prompteol_{size} -- "
                        f"--model.backbone {base}",
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

for _name in ("simcse", "simcse_bert_large", "simcse_roberta_base"):  # ConPVP Table 3's unmarked SimCSE rows: its
    # own runs (best of 4), though their figures are Gao et al.'s to the digit; one run of `simcse` serves both
    PAPERS[f"{_name}_conpvp"] = replace(
        PAPERS[_name], name=f"{_name}_conpvp", model=f"{PAPERS[_name].model} (ConPVP's run)", statistic=CONPVP_RUN,
        source=f"{CONPVP_T3} (unmarked: its own run; Gao et al.'s figures)", seed_paper_file=CONPVP, system=_name,
        disagreeing_copies=())


def paper_for_config(config: str) -> PaperRow | None:
    """The row a config under `experiments/` reproduces (`config`: its path relative to
    `experiments/`, without `.yaml`), or None."""
    return next((row for row in PAPERS.values() if config in row.configs), None)
