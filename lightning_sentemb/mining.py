"""Hard-negative mining (`sentemb data mine`): for each (anchor, positive) pair, the candidates that a
model ranks close to the anchor, kept by rank, margin and score, written as the file the supervised
configs read: one row a pair, `sent0,sent1,hard_neg` or with k negatives `sent0,sent1,hard_neg_1..k`
(`columns`, the default), or one `sent0,sent1,hard_neg` row a negative (`triplets`).

The filters are sentence-transformers' (`util.mine_hard_negatives`): every positive the file pairs with
the anchor is set aside, the margin is measured from the anchor's lowest positive score, and a candidate
scoring exactly a threshold stays (`losses.threshold`, the rule the guide shares). Our conventions differ
in three places (docs/negatives.md lists them): a text identical to the anchor is set aside too; a
candidate's rank is its place in the anchor's ranking of the candidates (0 = most similar) once the
set-aside texts are skipped, `--range-min/--range-max` keep ranks in [min, max) *before* `--margin` and
`--max-score` remove candidates, and the first `--num-negatives` left are the negatives (sentence-transformers
skips its range_min among the candidates left *after* those filters; here a negative's rank is checkable
against the option on its own); and the window searched is range_max candidates past the set-aside ones
(sentence-transformers' reaches range_max + the most positives any anchor has, set-aside or not).

The candidates are the file's distinct positives. Memory is bounded: candidates are encoded and added
to a faiss inner-product index (exact, on normalized embeddings, i.e. cosine) `chunk_size` at a time,
and anchors encoded and searched `chunk_size` at a time; nothing grows with pairs × candidates.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .data.senteval import read_stsb
from .errors import SentEmbUserError
from .losses.threshold import MARGIN_STRATEGIES, MarginStrategy, margin_threshold, too_close

ANCHOR_KEYS, POSITIVE_KEYS = ("sent0", "anchor"), ("sent1", "positive")


@dataclass(frozen=True)
class MiningFilters:
    """What makes a candidate a negative; see the module docstring for the order they apply in."""

    num_negatives: int = 1
    range_min: int = 0
    range_max: int = 50
    margin: float | None = None
    margin_strategy: MarginStrategy = "absolute"
    max_score: float | None = None

    def __post_init__(self) -> None:
        if self.num_negatives < 1:
            raise SentEmbUserError(f"--num-negatives {self.num_negatives}: give at least 1")
        if not 0 <= self.range_min < self.range_max:
            raise SentEmbUserError(f"--range-min {self.range_min} --range-max {self.range_max}: need "
                                   "0 <= range-min < range-max")
        if self.range_max - self.range_min < self.num_negatives:
            raise SentEmbUserError(f"--num-negatives {self.num_negatives} cannot fit in ranks [{self.range_min}, "
                                   f"{self.range_max}); raise --range-max")
        if self.margin_strategy not in MARGIN_STRATEGIES:
            raise SentEmbUserError(f"--margin-strategy {self.margin_strategy}: choose {' or '.join(MARGIN_STRATEGIES)}")

    def keeps(self, scores: np.ndarray, positive_scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(within the margin, within the margin and max-score): where a candidate's score is at most the
        threshold of each, ties kept (`losses.threshold`); `positive_scores` (n,) are the anchors' lowest
        positive scores, `scores` (n, depth) the candidates'."""
        margin_ok = np.ones_like(scores, dtype=bool)
        if self.margin is not None:
            threshold = margin_threshold(positive_scores, self.margin, self.margin_strategy)
            margin_ok = ~too_close(scores, threshold[:, None], "kept")
        if self.max_score is None:
            return margin_ok, margin_ok
        return margin_ok, margin_ok & ~too_close(scores, self.max_score, "kept")


@dataclass
class MinedNegatives:
    """Per pair, its negatives as rows of `candidates` (most similar first) with their cosines; `counts`:
    the candidates each filter saw and left, in order."""

    candidates: list[str]
    negatives: list[np.ndarray] = field(default_factory=list)
    scores: list[np.ndarray] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)


def read_pairs(path: str | os.PathLike, min_score: float | None = None) -> tuple[list[str], list[str]]:
    """(anchors, positives) of a `.csv` with a header, or of JSON lines (`.jsonl`/`.json`, one object a
    line), whose columns are `sent0,sent1` (our supervised files; hard-negative columns are ignored) or
    `anchor,positive`; or of an STS Benchmark file (headerless, tab-separated, scored), its pairs scored
    at least `min_score`."""
    path = Path(path)
    if not path.is_file():
        raise SentEmbUserError(f"pair file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    first = text.partition("\n")[0].split("\t")
    if len(first) >= 7 and first[4].replace(".", "", 1).isdigit():  # STS-B: score in column 5, pair in 6-7
        if min_score is None:
            raise SentEmbUserError(f"pair file {path} is an STS Benchmark file (scored pairs): give --min-score S "
                                   "to take the pairs scored at least S as (anchor, positive), e.g. --min-score 4")
        stsb = read_stsb(path)
        keep = stsb.gold >= min_score
        return ([a for a, k in zip(stsb.first, keep, strict=True) if k],
                [b for b, k in zip(stsb.second, keep, strict=True) if k])
    if min_score is not None:
        raise SentEmbUserError(f"--min-score: {path} is not an STS Benchmark file; its pairs have no score")
    if path.suffix == ".csv":
        rows = list(csv.DictReader(io.StringIO(text, newline="")))
    elif path.suffix in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(text.splitlines(), 1):
            try:
                rows += [json.loads(line)] if line.strip() else []
            except json.JSONDecodeError as error:
                raise SentEmbUserError(f"{path}: line {number} is not JSON ({error.msg}); "
                                       "give one object a line") from None
    else:
        raise SentEmbUserError(f"pair file {path}: give a .csv with a header, or .jsonl (one JSON object a line)")
    keys = set(rows[0]) if rows else set()
    anchor = next((k for k in ANCHOR_KEYS if k in keys), None)
    positive = next((k for k in POSITIVE_KEYS if k in keys), None)
    if not rows or anchor is None or positive is None:
        raise SentEmbUserError(f"pair file {path}: needs columns sent0,sent1 or anchor,positive; got "
                               f"{sorted(keys) or 'no rows'}")
    return [str(r[anchor]) for r in rows], [str(r[positive]) for r in rows]


def mine_hard_negatives(
    anchors: list[str], positives: list[str], encode: Callable[[list[str]], "np.ndarray"],
    filters: MiningFilters, chunk_size: int = 8192,
) -> MinedNegatives:
    """The negatives of each pair among the distinct positives; `encode(sentences)` gives embeddings
    (any array-like, normalized here). A pair's anchor text decides: every positive the file pairs with
    it is set aside, and its margin is measured from the lowest of their scores (pairs that share an
    anchor get the same negatives, as sentence-transformers gives them)."""
    import faiss

    if not anchors:
        raise SentEmbUserError("no (anchor, positive) pairs to mine: the pair file has none (or none scored "
                               "at least --min-score)")
    candidates = list(dict.fromkeys(positives))
    row_of = {text: i for i, text in enumerate(candidates)}
    index = None
    for start in range(0, len(candidates), chunk_size):
        embeddings = _normalized(encode(candidates[start : start + chunk_size]))
        if index is None:
            index = faiss.IndexFlatIP(embeddings.shape[1])
        index.add(embeddings)
    paired: dict[str, list[int]] = {}
    for anchor, positive in zip(anchors, positives, strict=True):
        rows = paired.setdefault(anchor, [])
        rows += [] if row_of[positive] in rows else [row_of[positive]]
    most = max(map(len, paired.values()))
    # each pair's anchor's positives, padded with its first (a repeat changes neither the minimum nor the set)
    anchor_positives = np.array([paired[a] + paired[a][:1] * (most - len(paired[a])) for a in anchors])
    anchor_rows = np.array([row_of.get(a, -1) for a in anchors])  # an anchor that is also a candidate
    depth = min(len(candidates), filters.range_max + most + 1)
    mined = MinedNegatives(candidates)
    counts = dict.fromkeys(["searched", "set aside (the anchor's positives and text)", "in the rank window",
                            "removed by --margin", "removed by --max-score", "passed every filter", "negatives"], 0)
    for start in range(0, len(anchors), chunk_size):
        rows = slice(start, start + chunk_size)
        query = _normalized(encode(anchors[rows]))
        own = anchor_positives[rows]
        positive_vectors = index.reconstruct_batch(own.ravel()).reshape(*own.shape, -1)
        positive_scores = np.einsum("nd,npd->np", query, positive_vectors).min(axis=1)
        scores, found = index.search(query, depth)
        aside = (found[:, :, None] == own[:, None, :]).any(-1) | (found == anchor_rows[rows, None]) | (found < 0)
        rank = np.cumsum(~aside, axis=1) - 1
        window = ~aside & (rank >= filters.range_min) & (rank < filters.range_max)
        within_margin, within_both = filters.keeps(scores, positive_scores)
        margin_ok, keep = window & within_margin, window & within_both
        chosen = keep & (np.cumsum(keep, axis=1) <= filters.num_negatives)
        mined.negatives += [f[c] for f, c in zip(found, chosen, strict=True)]
        mined.scores += [s[c] for s, c in zip(scores, chosen, strict=True)]
        values = [(found >= 0).sum(), (aside & (found >= 0)).sum(), window.sum(), (window & ~margin_ok).sum(),
                  (margin_ok & ~keep).sum(), keep.sum(), chosen.sum()]
        for key, value in zip(counts, values, strict=True):
            counts[key] += int(value)
    counts["pairs without a negative (dropped)"] = sum(len(n) == 0 for n in mined.negatives)
    mined.counts = counts
    return mined


def _normalized(embeddings: object) -> np.ndarray:
    array = np.ascontiguousarray(np.asarray(embeddings, dtype=np.float32))
    return array / np.maximum(np.linalg.norm(array, axis=1, keepdims=True), 1e-12)


def triplet_rows(anchors: list[str], positives: list[str], mined: MinedNegatives) -> list[tuple[str, str, str]]:
    """One `(sent0, sent1, hard_neg)` row per negative, in pair order (a pair with k negatives gives k
    rows, as sentence-transformers' "triplet" format): what the supervised data path reads."""
    return [(a, p, mined.candidates[n]) for a, p, negatives in zip(anchors, positives, mined.negatives, strict=True)
            for n in negatives]


def output_table(anchors: list[str], positives: list[str], mined: MinedNegatives, output_format: str,
                 num_negatives: int) -> tuple[list[str], list[tuple[str, ...]]]:
    """The header and rows of the output. `triplets`: `triplet_rows`. `columns`: one row a pair with its
    k = `num_negatives` negatives, most similar first, in `hard_neg` (k = 1, the same file as triplets) or
    `hard_neg_1..hard_neg_k` (as sentence-transformers' "n-tuple"); a pair with fewer than k is dropped,
    as every row fills every column."""
    if output_format == "triplets":
        return ["sent0", "sent1", "hard_neg"], triplet_rows(anchors, positives, mined)
    negatives = ["hard_neg"] if num_negatives == 1 else [f"hard_neg_{j}" for j in range(1, num_negatives + 1)]
    rows = [(a, p, *(mined.candidates[n] for n in found))
            for a, p, found in zip(anchors, positives, mined.negatives, strict=True)
            if len(found) == num_negatives]
    return ["sent0", "sent1", *negatives], rows


def summary(mined: MinedNegatives, pairs: int, filters: MiningFilters) -> str:
    """How many candidates each filter saw and left, one line each."""
    margin = "" if filters.margin is None else f" {filters.margin} ({filters.margin_strategy})"
    options = {"in the rank window": f" [{filters.range_min}, {filters.range_max})",
               "removed by --margin": margin or " (not set)",
               "removed by --max-score": " (not set)" if filters.max_score is None else f" {filters.max_score}",
               "negatives": f" (at most {filters.num_negatives} a pair)"}
    lines = [f"mined {pairs:,} pairs against {len(mined.candidates):,} distinct positives"]
    lines += [f"  {key}{options.get(key, '')}: {value:,}" for key, value in mined.counts.items()]
    return "\n".join(lines)


def mine_command(options: object) -> None:
    """`sentemb data mine`: read, load the model, mine, write the triplets atomically, print the summary."""
    import torch

    from .atomic_io import atomic_write_text
    from .loading import load_embedder
    from .loggers import silence_known_noise

    filters = MiningFilters(options.num_negatives, options.range_min, options.range_max, options.margin,
                            options.margin_strategy, options.max_score)
    if not options.output.endswith(".csv"):
        raise SentEmbUserError(f"--output {options.output}: the supervised configs read a .csv (sent0,sent1,hard_neg)")
    anchors, positives = read_pairs(options.pairs, options.min_score)
    silence_known_noise()
    device = options.device or ("cuda" if torch.cuda.is_available() else "cpu")
    embedder = load_embedder(options.model, options.pooler, device, options.batch_size, options.trust_checkpoint)
    mined = mine_hard_negatives(anchors, positives, lambda sentences: embedder.encode(sentences, label="mine"),
                                filters, options.chunk_size)
    header, rows = output_table(anchors, positives, mined, options.output_format, filters.num_negatives)
    text = io.StringIO(newline="")
    writer = csv.writer(text)
    writer.writerow(header)
    writer.writerows(rows)
    atomic_write_text(options.output, text.getvalue())
    short = sum(0 < len(found) < filters.num_negatives for found in mined.negatives)
    dropped = (f"\n  pairs with 1 to {filters.num_negatives - 1} negatives (dropped: --output-format columns fills "
               f"every column; triplets keeps them): {short:,}" if options.output_format == "columns" and short else "")
    print(summary(mined, len(anchors), filters) + dropped +
          f"\n{len(rows):,} rows ({','.join(header)}): {options.output}")
