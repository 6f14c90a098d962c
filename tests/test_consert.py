"""ConSERT (`methods.consert`): its loss and gradients against the paper's equation and the reference
code's, each augmentation's draws against the documented order (seeded) and its effect against the
plain backbone with the same edit by hand, the adversarial view against an independent FGV step, the
padding-free forward against the padded one, the one-line refusals, and the STS sentences as a corpus.
Families, gradient caching, DDP, resume, LoRA, Matryoshka and export: the shared tables
(test_backbones, test_grad_cache, test_world_size, test_resume, test_lora, test_matryoshka)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from lightning_sentemb.data.datamodule import SentEmbDataModule
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.losses.nt_xent import nt_xent
from lightning_sentemb.methods import ConSERT
from lightning_sentemb.methods.building import build_method
from tests.test_backbones import SENTENCES, quiet, unsupervised_examples
from tests.test_padding_free import assert_packed_equals_padded, without_dropout

TAU = 0.1


def paper_nt_xent(a: torch.Tensor, b: torch.Tensor, tau: float, drop: torch.Tensor | None = None) -> torch.Tensor:
    """ConSERT's Eq. 1 written out: 2N anchors, each against the 2N − 1 other rows (less the dropped)."""
    z = torch.cat([a, b])
    z = z / z.norm(dim=1, keepdim=True)
    n, sim = a.size(0), z @ z.T / tau
    losses = []
    for i in range(2 * n):
        j = (i + n) % (2 * n)
        others = [k for k in range(2 * n) if k != i and (k == j or drop is None or not drop[i % n, k % n])]
        losses.append(torch.logsumexp(sim[i, others], 0) - sim[i, j])
    return torch.stack(losses).mean()


def reference_loss(a: torch.Tensor, b: torch.Tensor, tau: float) -> torch.Tensor:
    """The reference's `AdvCLSoftmaxLoss._contrastive_loss_forward` times its scripts' `--cl_rate 0.15`."""
    a, b = F.normalize(a, dim=-1), F.normalize(b, dim=-1)
    labels, masks = torch.arange(a.size(0)), torch.eye(a.size(0), dtype=a.dtype) * 1e9
    loss_a = F.cross_entropy(torch.cat([a @ b.T / tau, a @ a.T / tau - masks], dim=1), labels)
    loss_b = F.cross_entropy(torch.cat([b @ a.T / tau, b @ b.T / tau - masks], dim=1), labels)
    return 0.15 * (loss_a + loss_b)


@pytest.mark.parametrize("guided", [False, True])
def test_loss_and_its_gradients_equal_the_papers_equation(guided):
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(5, 7, generator=generator, dtype=torch.float64, requires_grad=True) for _ in range(2))
    drop = torch.rand(5, 5, generator=generator) < 0.3 if guided else None
    if drop is not None:
        drop.fill_diagonal_(False)  # a guide never drops the anchor's own positive
    ours = nt_xent(a, b, a, b, torch.arange(5), TAU, drop)
    expected = paper_nt_xent(a, b, TAU, drop)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    for got, want in zip(torch.autograd.grad(ours, (a, b)), torch.autograd.grad(expected, (a, b)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12)


def test_loss_weight_0_3_is_the_reference_codes_loss(tiny_bert):
    """The reference trains on 0.15 × (sum of both directions): 0.3 × the paper's mean."""
    method = build_method(ConSERT, tiny_bert, loss_weight=0.3)
    embeddings = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ours, _ = method.embedding_loss(embeddings, {"num_views": 2})
    expected = reference_loss(embeddings[:4], embeddings[4:], TAU)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=0)
    gradients = [torch.autograd.grad(x, embeddings)[0] for x in (ours, expected)]
    torch.testing.assert_close(*gradients, rtol=1e-6, atol=1e-12)


def collate(method: ConSERT, seed: int, sentences: list[list[int]]) -> dict:
    method.collate_generator.manual_seed(seed)
    return method.collate([{"sent0": ids} for ids in sentences])


def test_each_augmentation_draws_what_its_docstring_says(tiny_bert):
    """Rows `[CLS] s [SEP]` of 5 and 3 tokens; view after view, row after row, from the collator's generator."""
    sentences = [[1000, 1001, 1002], [1003]]
    lengths, width = [5, 3], 32  # tiny_bert's embedding width
    expected = torch.Generator()

    def draw(n: int) -> torch.Tensor:
        return torch.randperm(n, generator=expected)

    method = build_method(ConSERT, tiny_bert, augmentations=["token_cutoff", "shuffle"], token_cutoff_rate=0.5)
    features = collate(method, 3, sentences)["features"]
    expected.manual_seed(3)
    cut = [draw(n)[: n // 2] for n in lengths]  # int(5 · 0.5) = 2 tokens, int(3 · 0.5) = 1
    orders = [draw(n) for n in lengths]
    keep = torch.ones(4, 5, dtype=torch.bool)
    keep[0, cut[0]], keep[1, cut[1]] = False, False
    assert features["token_keep"].equal(keep) and keep[:2].sum().item() == 10 - 3
    index = torch.arange(5).repeat(4, 1)  # view 0, and padding: their own positions
    index[2, :5], index[3, :3] = orders[0], orders[1]
    assert features["shuffle_index"].equal(index) and features["input_ids"][2:].equal(features["input_ids"][:2])
    # by hand, seed 3: view 0 cuts [CLS] and the first word of row 0, the word of row 1; view 1 puts row 0's
    # tokens at positions 0 2 3 4 1 ([SEP] second), row 1's at 1 2 0 (padding keeps 3 4)
    assert features["token_keep"][:2].tolist() == [[False, False, True, True, True], [True, False, True, True, True]]
    assert features["shuffle_index"][2:].tolist() == [[0, 2, 3, 4, 1], [1, 2, 0, 3, 4]]

    method = build_method(ConSERT, tiny_bert, augmentations=["feature_cutoff", "span_cutoff"], feature_cutoff_rate=0.25,
                          span_cutoff_rate=0.4)
    features = collate(method, 4, sentences)["features"]
    expected.manual_seed(4)
    columns = [draw(width)[:8] for _ in lengths]  # int(32 · 0.25)
    starts = [int(torch.randint(n - int(n * 0.4) + 1, (1,), generator=expected)) for n in lengths]  # spans of 2, 1
    for row, (dropped, start, n) in enumerate(zip(columns, starts, lengths, strict=True)):
        assert set(torch.nonzero(~features["feature_keep"][row]).flatten().tolist()) == set(dropped.tolist())
        span = torch.nonzero(~features["token_keep"][2 + row]).flatten().tolist()
        assert span == list(range(start, start + int(n * 0.4)))
    assert features["feature_keep"][2:].all() and features["token_keep"][:2].all()
    # by hand, seed 4: view 1 erases row 0's last word and [SEP] (2 of 5 tokens), row 1's [SEP] (1 of 3)
    assert features["token_keep"][2:].tolist() == [[True, True, True, False, False], [True, True, False, True, True]]

    method = build_method(ConSERT, tiny_bert, augmentations=["dropout", "span_cutoff"], dropout_rate=0.3,
                          span_cutoff="keep", span_cutoff_rate=0.4)
    features = collate(method, 5, sentences)["features"]
    expected.manual_seed(5)
    elements = [torch.rand(n, width, generator=expected) >= 0.3 for n in lengths]
    kept = [max(int(n * 0.6), 1) for n in lengths]  # 3 and 1 tokens of the rows
    starts = [int(torch.randint(n - k + 1, (1,), generator=expected)) for n, k in zip(lengths, kept, strict=True)]
    for row in range(2):
        assert features["element_keep"][row, : lengths[row]].equal(elements[row])
        assert features["element_keep"][row, lengths[row]:].all() and features["element_keep"][2 + row].all()
        real = features["input_ids"][2 + row][features["attention_mask"][2 + row].bool()]
        full = features["input_ids"][row][: lengths[row]]
        assert real.equal(full[starts[row] : starts[row] + kept[row]])
    assert features["position_shift"].tolist() == [0, 0, *starts]


def plain_embeddings(method: ConSERT, features: dict, position_ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The backbone called directly, its embedding output multiplied by `keep` by a hook of the test's, average
    pooling: what the augmented rows must give."""
    backbone = method.encoder.backbone
    handle = backbone.embeddings.register_forward_hook(lambda module, args, output: output * keep)
    try:
        hidden = backbone(input_ids=features["input_ids"], attention_mask=features["attention_mask"],
                          position_ids=position_ids).last_hidden_state
    finally:
        handle.remove()
    mask = features["attention_mask"][..., None].to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1)


@pytest.mark.parametrize("augmentations", [("token_cutoff", "shuffle"), ("feature_cutoff", "dropout")])
def test_edits_act_on_the_embedding_output_as_drawn(augmentations, tiny_bert):
    method = without_dropout(build_method(ConSERT, tiny_bert, augmentations=list(augmentations),
                                          token_cutoff_rate=0.3, dropout_rate=0.3, attn_implementation="padded"))
    features = collate(method, 0, method.encoder.format.sentence_ids(SENTENCES[:4]))["features"]
    rows, width = features["input_ids"].shape
    keep = torch.ones(rows, width, 32)
    keep *= features["token_keep"][..., None] if "token_keep" in features else 1
    keep *= features["feature_keep"][:, None, :] if "feature_keep" in features else 1
    keep *= features["element_keep"] if "element_keep" in features else 1
    assert (keep == 0).any()
    positions = torch.arange(width).repeat(rows, 1)
    positions = positions.gather(1, features["shuffle_index"]) if "shuffle_index" in features else positions
    with torch.no_grad():
        torch.testing.assert_close(method.embed(features), plain_embeddings(method, features, positions, keep),
                                   atol=1e-6, rtol=1e-6)


def test_shuffling_tokens_equals_shuffling_positions_under_average_pooling(tiny_bert):
    """The two ways a family may shuffle (`token_shuffle`): the same sentence embeddings on BERT."""
    method = without_dropout(build_method(ConSERT, tiny_bert, augmentations=["none", "shuffle"]))
    ids = method.encoder.format.sentence_ids(SENTENCES)
    by_positions = collate(method, 2, ids)["features"]
    method.encoder.format.token_shuffle = "tokens"
    by_tokens = collate(method, 2, ids)["features"]
    assert "shuffle_index" not in by_tokens and not by_tokens["input_ids"].equal(by_positions["input_ids"])
    with torch.no_grad():
        torch.testing.assert_close(method.embed(by_tokens), method.embed(by_positions), atol=1e-5, rtol=1e-5)


def test_adversarial_view_is_the_fgv_step_of_the_losss_gradient(tiny_bert):
    """An independent computation in float64: the backbone's embedding output e for both rows (the other view
    `none`: e itself), L(e) the paper's NT-Xent of the average-pooled rows, g = ∂L/∂e, the adversarial rows
    e + 0.5·g/‖g‖ per token, then the loss, and every parameter's gradient through both forwards."""
    method = quiet(without_dropout(build_method(ConSERT, tiny_bert, augmentations=["none", "adversarial"],
                                                adversarial_norm=0.5, attn_implementation="padded"))).double()
    batch = collate(method, 0, method.encoder.format.sentence_ids(SENTENCES[:4]))
    loss, _ = method.training_loss(batch)
    loss.backward()
    want = {name: p.grad.clone() for name, p in method.named_parameters() if p.grad is not None}
    method.zero_grad(set_to_none=True)

    features, backbone, n = batch["features"], method.encoder.backbone, 4

    def pooled(rows: slice, embedding_output: torch.Tensor) -> torch.Tensor:
        handle = backbone.embeddings.register_forward_hook(lambda module, args, output: embedding_output)
        try:
            hidden = backbone(input_ids=features["input_ids"][rows],
                              attention_mask=features["attention_mask"][rows]).last_hidden_state
        finally:
            handle.remove()
        mask = features["attention_mask"][rows, :, None].double()
        return (hidden * mask).sum(1) / mask.sum(1)

    e = backbone.embeddings(input_ids=features["input_ids"])
    clean = pooled(slice(None), e)
    attack = paper_nt_xent(clean[:n], clean[n:], TAU)
    (g,) = torch.autograd.grad(attack, e, retain_graph=True)
    adversarial = e[n:] + 0.5 * g[n:] / (g[n:].norm(dim=-1, keepdim=True) + 1e-10)
    expected = paper_nt_xent(clean[:n], pooled(slice(n, None), adversarial), TAU)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=0)
    got = {name: p.grad for name, p in method.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and "encoder.backbone.embeddings.word_embeddings.weight" in got
    for name, grad in got.items():
        torch.testing.assert_close(want[name], grad, rtol=1e-6, atol=1e-10, msg=name)


PACKED = {  # with test_backbones's packed table (token cutoff, dropout, shuffled tokens): every kind of edit
    "shuffle_adversarial": ("tiny_roberta", dict(augmentations=["shuffle", "adversarial"])),
    "span_kept_dropout": ("tiny_bert", dict(augmentations=["span_cutoff", "dropout"], span_cutoff="keep",
                                            span_cutoff_rate=0.3, dropout_rate=0.2)),
    "feature_adversarial": ("tiny_qwen2", dict(augmentations=["feature_cutoff", "adversarial"])),
}


@pytest.mark.parametrize("name", list(PACKED))
def test_packed_forward_equals_padded_for_the_same_draws(name, request):
    """The padding-free forward against the padded one on RoBERTa's, BERT's and a decoder's positions
    (shuffled, shifted), the adversarial record and replacement: loss, every gradient (the other families:
    test_backbones's packed table)."""
    family, options = PACKED[name]
    torch.manual_seed(0)
    method = quiet(without_dropout(build_method(ConSERT, request.getfixturevalue(family), **options))).train()
    assert method.encoder.padding_free
    assert_packed_equals_padded(method, collate(method, 0, [ex["sent0"] for ex in unsupervised_examples(method)]))


@pytest.mark.parametrize(("options", "message"), [
    (dict(augmentations=["shuffle"]), "give two"),
    (dict(augmentations=["shuffle", "mixup"]), "give two"),
    (dict(augmentations=["adversarial", "adversarial"]), "one view may be adversarial"),
    (dict(augmentations=["shuffle", "adversarial"], grad_cache_chunk=2), "grad_cache_chunk computes only chunk"),
    (dict(feature_cutoff_rate=1.0), "feature_cutoff_rate must be in [0, 1)"),
    (dict(span_cutoff="both"), "span_cutoff must be erase or keep"),
])
def test_settings_that_cannot_train_are_one_line(options, message, tiny_bert):
    with pytest.raises(SentEmbUserError, match=re.escape(message)) as refusal:
        build_method(ConSERT, tiny_bert, **options)
    assert "\n" not in str(refusal.value) and str(refusal.value).startswith("model.init_args.")


def test_the_sts_sentences_are_a_training_corpus(sts_fixture, tmp_path):
    """`senteval:sts`: both sentences of every pair of every STS file and split, unscored pairs included."""
    module = SentEmbDataModule(train_file="senteval:sts", data_dir=str(sts_fixture), cache_dir=str(tmp_path))
    path = module.train_path()
    lines = open(path, encoding="utf8").read().splitlines()
    # 24 STS12–16 subsets of 6 pairs, STS-B's 3 splits of 60, SICK's 3 of 12: two sentences each
    assert len(lines) == 2 * (24 * 6 + 3 * 60 + 3 * 12) and lines[:2] == ["a man plays guitar", "a dog runs today"]
    assert module.train_path() == path and "\r" not in "".join(lines)
    missing = SentEmbDataModule(train_file="senteval:sts", data_dir=str(tmp_path / "none"), cache_dir=str(tmp_path))
    with pytest.raises(SentEmbUserError, match="--data.data_dir"):
        missing.train_path()


def test_test_pooler_scores_test_encode_and_the_export_while_the_fit_pools_as_it_trains(tiny_bert, tmp_path):
    """`test_pooler: avg_top2` (the reference's `--last2avg` test): outside a fit `encode` and the export read
    the mean of the last two layers' token states; inside a fit the encoder pools with `pooler` (avg)."""
    from types import SimpleNamespace

    from sentence_transformers import SentenceTransformer

    from lightning_sentemb.export import export

    method = build_method(ConSERT, tiny_bert, test_pooler="avg_top2").eval()
    features = method.sentence_features(SENTENCES)
    with torch.no_grad():
        states = method.encoder.backbone(input_ids=features["input_ids"], attention_mask=features["attention_mask"],
                                         output_hidden_states=True).hidden_states
        mask = features["attention_mask"][..., None].float()
        last_two = (((states[-1] + states[-2]) / 2) * mask).sum(1) / mask.sum(1)
        last = (states[-1] * mask).sum(1) / mask.sum(1)
        torch.testing.assert_close(method.encode(SENTENCES), last_two, atol=1e-5, rtol=1e-5)
        model = SentenceTransformer(str(export(method, tmp_path / "export")), device="cpu")
        torch.testing.assert_close(model.encode(SENTENCES, convert_to_tensor=True), last_two, atol=1e-5, rtol=1e-5)
        method._trainer = SimpleNamespace(strategy=SimpleNamespace(model=None))
        method.on_fit_start()
        torch.testing.assert_close(method.encode_batch(SENTENCES), last, atol=1e-5, rtol=1e-5)
        method.on_fit_end()
        torch.testing.assert_close(method.encode_batch(SENTENCES), last_two, atol=1e-5, rtol=1e-5)
    with pytest.raises(SentEmbUserError, match="test_pooler: 'mask' is no plain pooler"):
        build_method(ConSERT, tiny_bert, test_pooler="mask")
