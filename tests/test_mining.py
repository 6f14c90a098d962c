"""`sentemb data mine`: negatives obey the rank window, the margin and the score bound (on a hand-made
embedding whose cosines are known), chunked mining equals one chunk and a brute-force reference, and
the triplet file is what the supervised data path reads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.mining import MiningFilters, mine_hard_negatives, output_table, read_pairs, triplet_rows

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
    assert [[mined.candidates[i] for i in n] for n in mined.negatives] == [[], [], ["p", "c1"]]


def test_with_its_defaults_no_anchor_gets_one_of_its_own_positives() -> None:
    """Two anchors with two positives each (issue 42: before, the defaults gave each of these 4 pairs the
    anchor's other positive): each pair's negative is the other anchor's nearest positive, the same for
    both of its pairs."""
    anchors, positives = ["q", "q", "x1", "x1"], ["p", "c1", "x2", "x3"]
    mined = mine_hard_negatives(anchors, positives, circle, MiningFilters())
    negatives = [[mined.candidates[i] for i in n] for n in mined.negatives]
    assert negatives == [["x3"], ["x3"], ["p"], ["p"]]


def test_the_margin_is_measured_from_the_anchors_lowest_positive() -> None:
    """q pairs with p (.985) and c2 (.940): at margin .1 a negative of either pair scores at most .84 (c3,
    .866, is out); measured from p, the pair (q, p) would allow .885 and take c3."""
    anchors, positives = ["q", "q", "x1", "x2", "x3", "x4"], ["p", "c2", "c1", "c3", "c4", "c5"]
    mined = mine_hard_negatives(anchors, positives, circle, MiningFilters(margin=0.1))
    assert [mined.candidates[i] for i in mined.negatives[0]] == [mined.candidates[i] for i in mined.negatives[1]] \
        == ["c4"]


def reference(anchors, positives, encode, filters: MiningFilters) -> list[list[int]]:
    """Brute force over the full similarity matrix, with a stable sort: every positive of the anchor and its
    own text aside, the absolute margin from its lowest positive score."""
    candidates = list(dict.fromkeys(positives))
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    a, c = unit(np.asarray(encode(anchors), dtype=np.float32)), unit(np.asarray(encode(candidates), dtype=np.float32))
    similarity = a @ c.T
    out = []
    for i, anchor in enumerate(anchors):
        own = {p for a_, p in zip(anchors, positives, strict=True) if a_ == anchor}
        order = [j for j in np.argsort(-similarity[i], kind="stable") if candidates[j] not in own | {anchor}]
        lowest = min(similarity[i, candidates.index(p)] for p in own)
        bound = np.inf if filters.margin is None else lowest - filters.margin
        kept = [j for rank, j in enumerate(order) if filters.range_min <= rank < filters.range_max
                and similarity[i, j] <= bound and (filters.max_score is None or similarity[i, j] <= filters.max_score)]
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
    assert sum(map(len, ours)) > 15  # the filters leave something to compare


def test_bad_options_and_files_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(SentEmbUserError, match="range-min"):
        MiningFilters(range_min=5, range_max=5)
    with pytest.raises(SentEmbUserError, match="cannot fit"):
        MiningFilters(num_negatives=4, range_min=0, range_max=3)
    bad = tmp_path / "pairs.csv"
    bad.write_text("question,answer\na,b\n")
    with pytest.raises(SentEmbUserError, match="sent0,sent1 or anchor,positive"):
        read_pairs(bad)


def test_cli_writes_files_the_supervised_path_reads(tiny_bert: str, tmp_path: Path, capsys) -> None:
    from lightning_sentemb.cli import main
    from lightning_sentemb.data.corpus import CorpusReader

    pairs = tmp_path / "pairs.jsonl"
    texts = ["a man plays a guitar .", "a man is playing music .", "a woman slices an onion .",
             "someone cuts a vegetable .", "the cat sleeps .", "a cat is asleep on a mat .",
             "two dogs run in a park .", "dogs are running outside ."]
    pairs.write_text("".join(json.dumps({"anchor": a, "positive": p}) + "\n"
                             for a, p in zip(texts[::2], texts[1::2], strict=True)))
    assert read_pairs(pairs) == (texts[::2], texts[1::2])
    out = tmp_path / "triplets.csv"
    main(["data", "mine", str(pairs), "--model", tiny_bert, "--pooler", "avg", "--output", str(out),
          "--num-negatives", "2", "--range-max", "3", "--chunk-size", "2", "--output-format", "triplets"])
    printed = capsys.readouterr().out
    assert "in the rank window [0, 3)" in printed and "negatives (at most 2 a pair): 8" in printed
    rows = [row for chunk in CorpusReader(out) for row in zip(*chunk.values(), strict=True)]
    assert list(next(iter(CorpusReader(out)))) == ["sent0", "sent1", "hard_neg"]
    assert len(rows) == 8 and all(neg in texts[1::2] and neg != pos for _, pos, neg in rows)
    mined = mine_hard_negatives(texts[::2], texts[1::2], _tiny_bert_avg(tiny_bert), MiningFilters(2, 0, 3))
    assert rows == triplet_rows(texts[::2], texts[1::2], mined)
    # the default format: one row a pair, its two negatives in hard_neg_1, hard_neg_2
    main(["data", "mine", str(pairs), "--model", tiny_bert, "--pooler", "avg", "--output", str(out),
          "--num-negatives", "2", "--range-max", "3"])
    assert "4 rows (sent0,sent1,hard_neg_1,hard_neg_2)" in capsys.readouterr().out
    chunks = list(CorpusReader(out))
    assert list(chunks[0]) == ["sent0", "sent1", "hard_neg_1", "hard_neg_2"]
    assert [row for chunk in chunks for row in zip(*chunk.values(), strict=True)] == \
        output_table(texts[::2], texts[1::2], mined, "columns", 2)[1]


def _tiny_bert_avg(path: str):
    from lightning_sentemb.loading import load_embedder

    embedder = load_embedder(path, "avg")
    return lambda sentences: embedder.encode(sentences)


# Four pairs on the circle, (q, p), (y, a), (z, b), (w, c): besides its positive q sees a (.996), b (.940),
# c (.866); y (180°) sees c (-.866), b (-.940), p (-.985); z (260°) sees a (-.259), p (-.342), c (-.643);
# w (100°) sees b (.174), p (0), a (-.087).
SMALL = {"q": 0, "p": 10, "a": 5, "b": 20, "c": 30, "y": 180, "z": 260, "w": 100}


def small_circle(sentences: list[str]) -> np.ndarray:
    radians = np.deg2rad([SMALL[s] for s in sentences])
    return np.stack([np.cos(radians), np.sin(radians)], axis=1)


def test_columns_hold_each_pairs_negatives_and_drop_pairs_with_fewer() -> None:
    """Two negatives a pair under --max-score 0.9: q keeps only c (a and b score above .9), so the
    columns file drops q and the triplets file keeps it."""
    anchors, positives = ["q", "y", "z", "w"], ["p", "a", "b", "c"]
    mined = mine_hard_negatives(anchors, positives, small_circle, MiningFilters(num_negatives=2, max_score=0.9))
    assert output_table(anchors, positives, mined, "columns", 2) == (
        ["sent0", "sent1", "hard_neg_1", "hard_neg_2"],
        [("y", "a", "c", "b"), ("z", "b", "a", "p"), ("w", "c", "b", "p")])
    assert output_table(anchors, positives, mined, "triplets", 2) == (
        ["sent0", "sent1", "hard_neg"],
        [("q", "p", "c"), ("y", "a", "c"), ("y", "a", "b"), ("z", "b", "a"), ("z", "b", "p"), ("w", "c", "b"),
         ("w", "c", "p")])
    one = mine_hard_negatives(anchors, positives, small_circle, MiningFilters(max_score=0.9))
    assert output_table(anchors, positives, one, "columns", 1) == output_table(anchors, positives, one, "triplets", 1) \
        == (["sent0", "sent1", "hard_neg"], [("q", "p", "c"), ("y", "a", "c"), ("z", "b", "a"), ("w", "c", "b")])


def test_the_columns_file_trains_with_every_negative_in_the_anchors_batch(tmp_path: Path, tiny_bert: str) -> None:
    """The corpus reads hard_neg_1..k in order; the collator makes them views 3..2+k; the loss is SimCSE's
    with each anchor's k own negatives weighted, by hand."""
    import csv as csv_module
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F

    from lightning_sentemb.build import build_method
    from lightning_sentemb.data.corpus import CorpusReader, nli_columns
    from lightning_sentemb.losses.info_nce import InfoNCELoss
    from lightning_sentemb.methods import SimCSE

    path = tmp_path / "mined.csv"
    with open(path, "w", newline="") as file:
        csv_module.writer(file).writerows([("hard_neg_2", "sent0", "sent1", "hard_neg_1"), ("n2", "s0", "s1", "n1")])
    assert next(iter(CorpusReader(path))) == {"sent0": ["s0"], "sent1": ["s1"], "hard_neg_1": ["n1"],
                                              "hard_neg_2": ["n2"]}
    for header, problem in [(["sent0", "sent1", "hard_neg", "hard_neg_1"], "both"),
                            (["sent0", "sent1", "hard_neg_2"], "gaps"),
                            (["sent0", "hard_neg_1"], "needs a header")]:
        with pytest.raises(SentEmbUserError, match=f"x.csv: an NLI csv .*{problem}"):
            nli_columns(header, "x.csv")

    method = build_method(SimCSE, tiny_bert)
    ids = {t: method.encoder.format.sentence_ids([t])[0] for t in ("s0", "s1", "n1", "n2")}
    batch = method.collate([{"hard_neg_2": ids["n2"], "sent0": ids["s0"], "hard_neg_1": ids["n1"], "sent1": ids["s1"]}])
    assert batch["num_views"] == 4
    assert method.encoder.format.tokenizer.batch_decode(batch["features"]["input_ids"], skip_special_tokens=True) \
        == ["s0", "s1", "n1", "n2"]

    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(4 * 3, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    stub = SimpleNamespace(loss_fn=InfoNCELoss(0.05, hard_negative_weight=0.5), guide=None)
    loss, _ = SimCSE.embedding_loss(stub, rows, {"num_views": 4})
    anchors, columns = rows[:3], rows[3:]  # positives 0..2, first negatives 3..5, second negatives 6..8
    by_hand = [F.cross_entropy((F.cosine_similarity(anchors[i, None], columns, dim=-1) / 0.05
                                + torch.tensor([0.5 if j in (3 + i, 6 + i) else 0.0 for j in range(9)],
                                               dtype=torch.float64))[None], torch.tensor([i])) for i in range(3)]
    torch.testing.assert_close(loss, torch.stack(by_hand).mean(), rtol=1e-12, atol=1e-12)


def test_an_stsb_file_gives_its_pairs_scored_at_least_min_score(tmp_path: Path) -> None:
    stsb = tmp_path / "sts-train.csv"
    stsb.write_text("main-captions\tMSRvid\t2012test\t0001\t5.000\ta plane is taking  off .\t"
                    "an air plane is taking off .\n"
                    "main-captions\tMSRvid\t2012test\t0004\t3.800\ta man plays a flute .\t"
                    "a man is playing a flute .\textra\n"
                    "main-captions\tMSRvid\t2012test\t0005\t4.000\ta cat \"sleeps\" .\ta cat is asleep .\n")
    assert read_pairs(stsb, 4.0) == (["a plane is taking off .", 'a cat "sleeps" .'],
                                     ["an air plane is taking off .", "a cat is asleep ."])
    with pytest.raises(SentEmbUserError, match="sts-train.csv is an STS Benchmark file .*--min-score 4"):
        read_pairs(stsb)
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("sent0,sent1\na,b\n")
    with pytest.raises(SentEmbUserError, match="--min-score: .*pairs.csv is not an STS Benchmark file"):
        read_pairs(pairs, 4.0)


class TableModel:
    """What `sentence_transformers.util.mine_hard_negatives` reads of a SentenceTransformer (its
    exhaustive-search path), over a table of fixed embeddings: no model, no download."""

    device = "cpu"

    def __init__(self, table: dict[str, np.ndarray]) -> None:
        self.table = table

    def encode_document(self, sentences, **options) -> np.ndarray:
        vectors = np.stack([self.table[s] for s in sentences])
        return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)

    encode_query = encode_document

    def similarity(self, a, b):
        import torch

        return torch.as_tensor(a) @ torch.as_tensor(b).T

    def similarity_pairwise(self, a, b):
        import torch

        return (torch.as_tensor(a) * torch.as_tensor(b)).sum(-1)


@pytest.mark.parametrize("filters", [
    MiningFilters(num_negatives=3, range_max=40),
    MiningFilters(num_negatives=2, range_max=40, margin=0.1, max_score=0.7),
    MiningFilters(num_negatives=3, range_max=40, margin=0.2, margin_strategy="relative"),
], ids=["top", "margin-max-score", "relative"])
def test_our_negatives_are_sentence_transformers_where_the_rules_agree(filters: MiningFilters) -> None:
    """The same embeddings mined by `sentence_transformers.util.mine_hard_negatives` (triplets, top
    sampling, range_min 0, a window past every candidate) and by ours: the same negatives, in the same
    order, for every pair, where anchors have one to three positives (margin from the lowest) and no
    anchor is a candidate's text (we set that aside, sentence-transformers does not)."""
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives as st_mine

    rng = np.random.default_rng(1)
    table = {f"t{i}": rng.standard_normal(6).astype(np.float32) for i in range(40)}
    anchors = [f"t{i}" for i in rng.integers(0, 15, 30)]
    positives = [f"t{i}" for i in rng.integers(15, 40, 30)]
    pairs = list(dict.fromkeys(zip(anchors, positives, strict=True)))  # no repeated pair
    anchors, positives = [a for a, _ in pairs], [p for _, p in pairs]
    assert max(anchors.count(a) for a in anchors) >= 3

    ours = mine_hard_negatives(anchors, positives, TableModel(table).encode_document, filters)
    theirs = st_mine(Dataset.from_dict({"anchor": anchors, "positive": positives}), TableModel(table),
                     range_max=filters.range_max, num_negatives=filters.num_negatives, max_score=filters.max_score,
                     absolute_margin=filters.margin if filters.margin_strategy == "absolute" else None,
                     relative_margin=filters.margin if filters.margin_strategy == "relative" else None,
                     output_format="triplet", verbose=False)
    by_pair: dict[tuple[str, str], list[str]] = {}
    for row in theirs:
        by_pair.setdefault((row["anchor"], row["positive"]), []).append(row["negative"])
    expected = [by_pair.get(pair, []) for pair in pairs]
    assert [[ours.candidates[i] for i in n] for n in ours.negatives] == expected
    assert sum(map(len, expected)) > len(pairs) // 2  # the filters leave something to compare
