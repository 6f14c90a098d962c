"""`sentemb data mine`: negatives obey the rank window, the margin and the score bound (on a hand-made
embedding whose cosines are known), chunked mining equals one chunk and a brute-force reference, and
the triplet file is what the supervised data path reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.mining import MiningFilters, mine_hard_negatives, read_pairs, triplet_rows

# Unit vectors at these angles (degrees): the cosine of two texts is cos(angle difference). The first
# pair (q, p) sees, besides its positive p at 10° (cosine .985), the candidates c1..c5 ranked
# c1 .996, c2 .940, c3 .866, c4 .500, c5 .000; the x's anchor the pairs that make c1..c5 candidates.
ANGLES = {"q": 0, "p": 10, "c1": 5, "c2": 20, "c3": 30, "c4": 60, "c5": 90,
          "x1": 180, "x2": 190, "x3": 200, "x4": 210, "x5": 220}
ANCHORS = ["q", "x1", "x2", "x3", "x4", "x5"]
POSITIVES = ["p", "c1", "c2", "c3", "c4", "c5"]


def circle(sentences: list[str]) -> np.ndarray:
    radians = np.deg2rad([ANGLES[s] for s in sentences])
    return np.stack([np.cos(radians), np.sin(radians)], axis=1) * 3.0  # unnormalized on purpose


def first_pair_negatives(anchors=ANCHORS, positives=POSITIVES, **filters) -> list[str]:
    mined = mine_hard_negatives(anchors, positives, circle, MiningFilters(**filters))
    return [mined.candidates[i] for i in mined.negatives[0]]


@pytest.mark.parametrize("filters, expected", [
    ({}, ["c1"]),                                                     # the most similar non-positive
    ({"num_negatives": 2}, ["c1", "c2"]),
    ({"range_min": 1}, ["c2"]),                                       # rank 0 (c1) skipped
    ({"range_min": 2, "num_negatives": 3}, ["c3", "c4", "c5"]),
    ({"margin": 0.1}, ["c3"]),                                        # ≤ .985 - .1 = .885: c1, c2 out
    ({"margin": 0.5, "margin_strategy": "relative"}, ["c5"]),         # ≤ .985 - .5 × .985 = .492: c4 (.5) out
    ({"max_score": 0.9}, ["c3"]),                                     # c1 .996, c2 .940 out
    ({"max_score": 0.9, "range_min": 3}, ["c4"]),                     # ranks count before the score filters
    ({"range_max": 2, "margin": 0.1}, []),                            # the window holds only c1, c2
])
def test_negatives_obey_the_filters(filters: dict, expected: list[str]) -> None:
    assert first_pair_negatives(**filters) == expected


def test_the_summary_counts_each_filter() -> None:
    mined = mine_hard_negatives(ANCHORS, POSITIVES, circle, MiningFilters(range_max=3, margin=0.1, max_score=0.5))
    first = mine_hard_negatives(["q", "q"], ["p", "p"], circle, MiningFilters())  # the only candidate is p
    assert first.counts["negatives"] == 0 and first.counts["pairs without a negative (dropped)"] == 2
    counts = mined.counts
    assert counts["searched"] == 6 * 5  # depth: range_max + 2 (room for the positive and the anchor's text)
    assert counts["in the rank window"] == 6 * 3
    assert counts["in the rank window"] - counts["removed by --margin"] - counts["removed by --max-score"] \
        == counts["passed every filter"] >= counts["negatives"]
    # the first pair: window c1 c2 c3; margin (≤ .885) removes c1 c2; max-score .5 removes c3
    assert mined.negatives[0].size == 0


def test_identical_texts_and_other_positives_of_the_anchor_are_never_negatives() -> None:
    anchors, positives = ["q", "q", "x1"], ["p", "c1", "q"]  # q pairs with p and c1; q is also a candidate
    mined = mine_hard_negatives(anchors, positives, circle, MiningFilters(num_negatives=2))
    assert [mined.candidates[i] for i in mined.negatives[0]] == ["c1"]  # q itself is aside; c1 allowed
    mined = mine_hard_negatives(anchors, positives, circle, MiningFilters(num_negatives=2, exclude_positives=True))
    assert [mined.candidates[i] for i in mined.negatives[0]] == []      # c1 is q's other positive


def reference(anchors, positives, encode, filters: MiningFilters) -> list[list[int]]:
    """Brute force over the full similarity matrix, with a stable sort."""
    candidates = list(dict.fromkeys(positives))
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    a, c = unit(np.asarray(encode(anchors), dtype=np.float32)), unit(np.asarray(encode(candidates), dtype=np.float32))
    similarity = a @ c.T
    out = []
    for i, (anchor, positive) in enumerate(zip(anchors, positives)):
        order = [j for j in np.argsort(-similarity[i], kind="stable") if candidates[j] not in (anchor, positive)]
        positive_score = similarity[i, candidates.index(positive)]
        kept = [j for rank, j in enumerate(order) if filters.range_min <= rank < filters.range_max
                and similarity[i, j] <= filters.threshold(np.array([positive_score]))[0]
                and (filters.max_score is None or similarity[i, j] <= filters.max_score)]
        out.append(kept[: filters.num_negatives])
    return out


def test_chunked_equals_one_chunk_and_the_brute_force_reference() -> None:
    rng = np.random.default_rng(0)
    table = {f"s{i}": rng.standard_normal(8).astype(np.float32) for i in range(60)}
    encode = lambda sentences: np.stack([table[s] for s in sentences])  # noqa: E731
    anchors = [f"s{i}" for i in rng.integers(0, 60, 80)]
    positives = [f"s{i}" for i in rng.integers(0, 60, 80)]
    filters = MiningFilters(num_negatives=3, range_min=2, range_max=12, margin=0.05, max_score=0.6)
    whole = mine_hard_negatives(anchors, positives, encode, filters, chunk_size=10_000)
    chunked = mine_hard_negatives(anchors, positives, encode, filters, chunk_size=7)
    assert [n.tolist() for n in chunked.negatives] == [n.tolist() for n in whole.negatives]
    assert chunked.counts == whole.counts
    ours = [[whole.candidates[j] for j in n] for n in whole.negatives]
    expected = reference(anchors, positives, encode, filters)
    candidates = list(dict.fromkeys(positives))
    assert ours == [[candidates[j] for j in n] for n in expected]
    assert sum(map(len, ours)) > 40  # the filters leave something to compare


def test_bad_options_and_files_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(SentEmbUserError, match="range-min"):
        MiningFilters(range_min=5, range_max=5)
    with pytest.raises(SentEmbUserError, match="cannot fit"):
        MiningFilters(num_negatives=4, range_min=0, range_max=3)
    bad = tmp_path / "pairs.csv"
    bad.write_text("question,answer\na,b\n")
    with pytest.raises(SentEmbUserError, match="sent0,sent1 or anchor,positive"):
        read_pairs(bad)


def test_cli_writes_triplets_the_supervised_path_reads(tiny_bert: str, tmp_path: Path, capsys) -> None:
    from lightning_sentemb.cli import main
    from lightning_sentemb.data.corpus import CorpusReader

    pairs = tmp_path / "pairs.jsonl"
    texts = ["a man plays a guitar .", "a man is playing music .", "a woman slices an onion .",
             "someone cuts a vegetable .", "the cat sleeps .", "a cat is asleep on a mat .",
             "two dogs run in a park .", "dogs are running outside ."]
    pairs.write_text("".join(json.dumps({"anchor": a, "positive": p}) + "\n" for a, p in zip(texts[::2], texts[1::2])))
    assert read_pairs(pairs) == (texts[::2], texts[1::2])
    out = tmp_path / "triplets.csv"
    main(["data", "mine", str(pairs), "--model", tiny_bert, "--pooler", "avg", "--output", str(out),
          "--num-negatives", "2", "--range-max", "3", "--chunk-size", "2"])
    printed = capsys.readouterr().out
    assert "in the rank window [0, 3)" in printed and "negatives (at most 2 a pair): 8" in printed
    rows = [row for chunk in CorpusReader(out) for row in zip(*chunk.values())]
    assert list(next(iter(CorpusReader(out)))) == ["sent0", "sent1", "hard_neg"]
    assert len(rows) == 8 and all(neg in texts[1::2] and neg != pos for _, pos, neg in rows)
    assert rows == triplet_rows(texts[::2], texts[1::2], mine_hard_negatives(
        texts[::2], texts[1::2], lambda s: _tiny_bert_avg(tiny_bert)(s), MiningFilters(2, 0, 3)))


def _tiny_bert_avg(path: str):
    from lightning_sentemb.loading import load_embedder

    embedder = load_embedder(path, "avg")
    return lambda sentences: embedder.encode(sentences)
