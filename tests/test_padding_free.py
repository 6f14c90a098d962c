"""The padding-free forward against the backbone's own padded forward: same loss, same gradients and
same evaluation embeddings for every method, on BERT and RoBERTa position schemes (dropout off, fp32)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from lightning_sentemb.callbacks.kmeans import initial_centroids
from lightning_sentemb.encoders.kernels import aligned_attention, math_attention
from lightning_sentemb.encoders.layout import TokenLayout
from lightning_sentemb.methods import DCPCSE, BERTFlow, ClusterNS, ConPVP, PromptBERT, SimCSE
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.esimcse import ESimCSE
from lightning_sentemb.methods.mixcse import MixCSE

SENTENCES = ["a man is playing a guitar .", "the cat sat .", "this sentence means something rather long , really .",
             "two dogs run across the field today .", "nice .", "a woman is slicing an onion on the table ."]

METHODS = {
    "simcse_avg": lambda b: build_method(SimCSE, b, pooler="avg", mlp="train"),
    "simcse_cls_first_last": lambda b: build_method(SimCSE, b, pooler="avg_first_last", mlp="train"),
    "simcse_top2_mlm": lambda b: build_method(SimCSE, b, pooler="avg_top2", mlp="none", mlm_weight=0.1),
    "simcse_sup": lambda b: build_method(SimCSE, b, pooler="cls", mlp="always", hard_negative_weight=0.5),
    "promptbert": lambda b: build_method(PromptBERT, b),
    "conpvp": lambda b: build_method(ConPVP, b),
    "dcpcse_shifted": lambda b: build_method(DCPCSE, b, pooler="avg", prefix_len=3),
    "dcpcse_zero_first_last": lambda b: build_method(DCPCSE, b, pooler="avg_first_last", prefix_len=3,
                                                     position_offset="zero"),
    "clusterns": lambda b: build_method(ClusterNS, b, pooler="cls", num_clusters=2, sigma=1.0),
    "flow_first_last": lambda b: build_method(BERTFlow, b, flow_levels=2, flow_depth=2, flow_coupling_width=4),
    "esimcse": lambda b: with_filled_queue(build_method(ESimCSE, b, pooler="avg", queue_size=8)),
    "mixcse": lambda b: build_method(MixCSE, b, pooler="cls", num_mixed=2),
}


def with_filled_queue(method: ESimCSE) -> ESimCSE:
    """ESimCSE after a step of its own (no gradient): the loss reads a queue its momentum encoder filled."""
    with torch.no_grad():
        method.step_loss(batch_for(method, supervised=False))
    return method


def without_dropout(method: nn.Module) -> nn.Module:
    for module in method.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return method


def batch_for(method, supervised: bool) -> dict:
    ids = method.encoder.format.sentence_ids(SENTENCES)
    if supervised:
        examples = [{"sent0": ids[i], "sent1": ids[(i + 1) % 6], "hard_neg": ids[(i + 2) % 6]} for i in range(6)]
    else:
        examples = [{"sent0": row} for row in ids]
    torch.manual_seed(0)  # ConPVP samples templates in collate
    return method.collate(examples)


def loss_and_grads(method, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    method.zero_grad(set_to_none=True)
    loss = method.training_step(copy.deepcopy(batch), 0)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in method.named_parameters() if p.grad is not None}


def assert_packed_equals_padded(fast, batch: dict) -> None:
    """The padding-free forward of `fast` against a copy on the padded forward: loss, every gradient and
    evaluation embeddings to 1e-5 (ClusterNS's centroids initialized from the batch first)."""
    assert not bool(batch["features"]["attention_mask"].all()), "the batch must hold padding"
    if isinstance(fast, ClusterNS):
        with torch.no_grad():
            views = fast.embed(batch["features"]).unflatten(0, (batch["num_views"], -1))
        fast.cluster_state.initialize_(initial_centroids(views[0], 2))
    padded = copy.deepcopy(fast)
    padded.encoder.configure_speed(padding_free=False, compile_layers=False)
    fast_loss, fast_grads = loss_and_grads(fast, batch)
    padded_loss, padded_grads = loss_and_grads(padded, batch)
    torch.testing.assert_close(fast_loss, padded_loss, atol=1e-5, rtol=1e-5)
    assert fast_grads.keys() == padded_grads.keys() and len(fast_grads) > 0
    for key in fast_grads:
        torch.testing.assert_close(fast_grads[key], padded_grads[key], atol=1e-5, rtol=1e-5, msg=key)
    torch.testing.assert_close(fast.encode(SENTENCES), padded.encode(SENTENCES), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["tiny_bert", "tiny_roberta"])
@pytest.mark.parametrize("name", list(METHODS))
def test_fast_path_equals_padded_path(name: str, family: str, request, monkeypatch) -> None:
    monkeypatch.setattr(SimCSE, "log", lambda *a, **k: None)
    monkeypatch.setattr(SimCSE, "log_dict", lambda *a, **k: None)
    torch.manual_seed(0)
    fast = without_dropout(METHODS[name](request.getfixturevalue(family))).train()
    assert fast.encoder.padding_free
    batch = batch_for(fast, supervised=name == "simcse_sup")
    assert_packed_equals_padded(fast, batch)


@pytest.mark.parametrize("name", ["simcse_avg", "dcpcse_shifted"])
def test_nested_kernel_equals_padded_path(name: str, tiny_bert: str, monkeypatch) -> None:
    """The nested-jagged kernel (CUDA's choice under attention dropout) runs on CPU for bidirectional
    encoders: the same code, checked here against the padded forward, the prefix's keys included."""
    monkeypatch.setattr(SimCSE, "log", lambda *a, **k: None)
    monkeypatch.setattr(SimCSE, "log_dict", lambda *a, **k: None)
    torch.manual_seed(0)
    fast = without_dropout(METHODS[name](tiny_bert)).train()
    fast.encoder.packed_kernel = "nested"
    assert_packed_equals_padded(fast, batch_for(fast, supervised=False))


def test_dropout_stays_active_on_the_fast_path(tiny_bert: str) -> None:
    """SimCSE's augmentation: two training forwards of the same batch differ, evaluation ones do not."""
    method = build_method(SimCSE, tiny_bert, pooler="avg", mlp="none").train()
    features = method.encoder.format.build(method.encoder.format.sentence_ids(SENTENCES), None)
    assert not torch.allclose(method.embed(features), method.embed(features))
    method.eval()
    torch.testing.assert_close(method.embed(features), method.embed(features))


def attention_inputs(key_length: int) -> tuple[torch.Tensor, ...]:
    """(batch 3, heads 2, length 4, head_dim 8) queries; keys may be longer (a DCPCSE prefix)."""
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 2, 4, 8, generator=generator, dtype=torch.float64)
    key, value = torch.randn(2, 3, 2, key_length, 8, generator=generator, dtype=torch.float64)
    key_mask = torch.arange(key_length)[None] < torch.tensor([key_length, 2, 1])[:, None]
    return query, key, value, key_mask


@pytest.mark.parametrize("key_length", [4, 6])
def test_math_attention_equals_sdpa_without_dropout(key_length: int) -> None:
    inputs = attention_inputs(key_length)
    ours = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    theirs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = math_attention(*ours[:3], ours[3][:, None, None, :], dropout_p=0.0, scale=0.3)
    reference = F.scaled_dot_product_attention(*theirs[:3], attn_mask=theirs[3][:, None, None, :], scale=0.3)
    torch.testing.assert_close(out, reference, atol=1e-12, rtol=1e-12)
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    (reference * weights).sum().backward()
    for mine, other in zip(ours[:3], theirs[:3], strict=True):
        torch.testing.assert_close(mine.grad, other.grad, atol=1e-12, rtol=1e-12)


def test_math_attention_drops_probabilities() -> None:
    """With one-hot values the output is the probability matrix itself: every entry is either dropped
    (0) or the plain softmax probability scaled by 1 / (1 - p); masked keys stay at 0."""
    query, key, _, key_mask = attention_inputs(8)
    value = torch.eye(8, dtype=torch.float64).expand(3, 2, 8, 8)
    p = 0.25
    torch.manual_seed(0)
    dropped = math_attention(query, key, value, key_mask[:, None, None, :], dropout_p=p, scale=0.3)
    scores = torch.einsum("bhqd,bhkd->bhqk", query, key) * 0.3
    probabilities = scores.masked_fill(~key_mask[:, None, None, :], float("-inf")).softmax(-1)
    kept = dropped != 0
    torch.testing.assert_close(dropped[kept], probabilities[kept] / (1 - p))
    assert not kept[~key_mask[:, None, None, :].expand_as(kept)].any()
    real = key_mask[:, None, None, :].expand_as(kept)
    assert 0 < (~kept[real]).sum() < real.sum()


@pytest.mark.parametrize("dropout_p", [0.0, 0.1])
def test_windowed_attention_of_rows_of_very_different_lengths_has_finite_gradients(dropout_p: float) -> None:
    """A padding query far past its row's end has no real key within a local window (ModernBERT's
    local layers): it must not turn into NaN, forward or backward (with dropout on CPU: our GEMMs)."""
    layout = TokenLayout.from_mask(torch.tensor([[1] * 8, [1, 1] + [0] * 6]))
    generator = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(10, 2, 4, generator=generator, requires_grad=True) for _ in range(3))
    torch.manual_seed(0)
    out = aligned_attention(query, key, value, layout, 0.5, dropout_p, causal=False, window=3, softcap=None,
                            prefix=None).flatten(1)
    out.sum().backward()
    assert out.isfinite().all()
    for tensor in (query, key, value):
        assert tensor.grad.isfinite().all()
    if dropout_p == 0:  # the short row's tokens see each other only: its own two-token attention
        short = torch.arange(8, 10)
        scores = torch.einsum("qhd,khd->hqk", query[short], key[short]) * 0.5
        expected = torch.einsum("hqk,khd->qhd", scores.softmax(-1), value[short]).flatten(1)
        torch.testing.assert_close(out[short], expected)


@pytest.mark.parametrize("causal", [False, True])
def test_aligned_kernel_equals_attention_sentence_by_sentence(causal: bool) -> None:
    """The aligned kernel (heads gathered both ways, padding repeating each sentence's last token) on SDPA
    and on our GEMMs (a soft-cap of 1e9: the identity to 1e-18), grouped-query heads, against SDPA on each
    sentence alone: the output and every gradient, to 1e-12 in float64."""
    lengths = [3, 1, 5, 4]
    layout = TokenLayout.from_mask(torch.arange(6)[None] < torch.tensor(lengths)[:, None])
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(13, 4, 8, generator=generator, dtype=torch.float64)
    key, value = torch.randn(2, 13, 2, 8, generator=generator, dtype=torch.float64)
    weights = torch.randn(13, 4, 8, generator=generator, dtype=torch.float64)
    reference = [t.clone().requires_grad_() for t in (query, key, value)]
    outs, start = [], 0
    for length in lengths:
        q, k, v = (t[start:start + length].transpose(0, 1) for t in reference)
        k, v = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
        outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.5).transpose(0, 1))
        start += length
    (torch.cat(outs) * weights).sum().backward()
    for softcap in (None, 1e9):
        ours = [t.clone().requires_grad_() for t in (query, key, value)]
        out = aligned_attention(*ours, layout, 0.5, 0.0, causal=causal, window=None, softcap=softcap, prefix=None)
        torch.testing.assert_close(out, torch.cat(outs).detach(), atol=1e-12, rtol=1e-12)
        (out * weights).sum().backward()
        for mine, other in zip(ours, reference, strict=True):
            torch.testing.assert_close(mine.grad, other.grad, atol=1e-12, rtol=1e-12)


def test_token_layout_round_trip() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]])
    layout = TokenLayout.from_mask(mask)
    padded = torch.arange(9.0).view(3, 3, 1)
    packed = layout.pack(padded)
    assert packed.flatten().tolist() == [0.0, 1.0, 3.0, 6.0, 7.0, 8.0]
    assert layout.unpack(packed).flatten().tolist() == [0.0, 1.0, 0.0, 3.0, 0.0, 0.0, 6.0, 7.0, 8.0]
    assert layout.align_heads(packed[:, None]).flatten().tolist() == [0.0, 1.0, 1.0, 3.0, 3.0, 3.0, 6.0, 7.0, 8.0]


def test_token_layout_aligns_left_padded_rows() -> None:
    """Attention runs on each sentence moved to the start of its row, whichever side it was padded on."""
    mask = torch.tensor([[0, 1, 1], [0, 0, 1], [1, 1, 1]])
    layout = TokenLayout.from_mask(mask)
    packed = layout.pack(torch.arange(9.0).view(3, 3, 1))
    assert packed.flatten().tolist() == [1.0, 2.0, 5.0, 6.0, 7.0, 8.0]
    aligned = layout.align_heads(packed[:, None])  # padding repeats the sentence's last token
    assert aligned.flatten().tolist() == [1.0, 2.0, 2.0, 5.0, 5.0, 5.0, 6.0, 7.0, 8.0]
    assert layout.unalign_heads(aligned)[:, 0].equal(packed)
    assert layout.key_mask().tolist() == [[True, True, False], [True, False, False], [True, True, True]]


def test_token_layout_rows_equals_the_layout_of_the_rows() -> None:
    """A gradient-cache chunk's layout, cut with the host lengths, is the layout of its rows alone."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 1, 1]])
    whole = TokenLayout.from_mask(mask)
    for span in (slice(0, 2), slice(1, 3), slice(2, 4)):
        part, direct = whole.rows(span), TokenLayout.from_mask(mask[span])
        for name in ("index", "aligned", "lengths"):
            assert getattr(part, name).equal(getattr(direct, name)), (span, name)
        assert part.host_lengths == direct.host_lengths


def test_unsupported_backbone_falls_back_with_a_reason(tmp_path, caplog) -> None:
    """MPNet's attention does not go through transformers' attention interface: padded, reason logged."""
    from transformers import MPNetConfig

    from tests.conftest import minilm_ids, save_tiny

    ids = minilm_ids()
    path = save_tiny(tmp_path / "mpnet", MPNetConfig(vocab_size=ids["vocab_size"], pad_token_id=1, hidden_size=32,
                                                     num_hidden_layers=2, num_attention_heads=4, intermediate_size=64))
    with caplog.at_level(logging.WARNING):
        method = build_method(SimCSE, path, pooler="avg")
    assert not method.encoder.padding_free and "attention interface" in caplog.text


def test_attn_implementation_selects_transformers_padded_forward(tiny_bert: str) -> None:
    method = build_method(SimCSE, tiny_bert, attn_implementation="eager")
    assert not method.encoder.padding_free
    assert method.encoder.backbone.config._attn_implementation == "eager"


def test_a_model_that_bypasses_the_attention_interface_fails_loudly(tiny_bert: str, monkeypatch) -> None:
    """A layer computing attention itself would let the packed sentences see each other: refused at once."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.models.bert import modeling_bert

    class OwnAttention:
        def get_interface(self, *args):
            return sdpa_attention_forward

    method = build_method(SimCSE, tiny_bert)
    monkeypatch.setattr(modeling_bert, "ALL_ATTENTION_FUNCTIONS", OwnAttention())
    with pytest.raises(RuntimeError, match="without the attention interface"):
        method.encode(SENTENCES[:2])


def test_one_switch_chooses_the_attention_path(tiny_bert: str) -> None:
    """`attn_implementation` null = padding-free, a kernel = the padded forward with it; the deprecated
    `padding_free: false` says so once and becomes "padded" (what checkpoints then keep)."""
    import warnings

    from lightning_sentemb.methods import building

    assert build_method(SimCSE, tiny_bert).encoder.padding_free
    padded = build_method(SimCSE, tiny_bert, attn_implementation="eager")
    assert not padded.encoder.padding_free and padded.encoder.backbone.config._attn_implementation == "eager"
    building._warn_padding_free.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = build_method(SimCSE, tiny_bert, padding_free=False)
        build_method(SimCSE, tiny_bert, padding_free=True)
    said = [w for w in caught
            if w.category is FutureWarning and "padding_free is deprecated: use attn" in str(w.message)]
    assert len(said) == 1
    assert not old.encoder.padding_free and old.hparams.attn_implementation == "padded"
    assert old.hparams.padding_free is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_method(SimCSE, tiny_bert, attn_implementation="sdpa")  # the new switch alone: no warning


@pytest.mark.slow
def test_gpu_benchmark_smoke_runs_every_method(tmp_path) -> None:
    """`benchmarks/gpu.py --smoke`: tiny config on CPU, every method both ways and sentence-transformers."""
    import json

    from tests.launch import REPO, run_script

    output = tmp_path / "gpu.json"
    run_script(REPO / "benchmarks" / "gpu.py", "--smoke", "--output", str(output))
    rows = json.loads(output.read_text())["rows"]
    assert len(rows) == 11 and all(row["sentences_per_s"] > 0 for row in rows)
