"""The packed forward's kernels: the choice (`choose_kernel`, a pure function of torch, device and call),
the torch API they are called with (torch 2.11's `varlen_attn`: no `enable_gqa`), the autocast dtype that
reaches them, the backbone still a plain Hugging Face model, and `compile_layers` compiling once."""

from __future__ import annotations

import configparser
import copy
import functools
import re
from importlib import metadata
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from packaging.version import Version
from transformers import AutoModel

from lightning_sentemb.encoders import kernels
from lightning_sentemb.encoders.kernels import TorchFeatures, choose_kernel, features_of
from lightning_sentemb.encoders.layout import TokenLayout
from lightning_sentemb.encoders.packed import SENTEMB_ATTENTION, packed_forward, set_attention
from lightning_sentemb.methods import SimCSE
from lightning_sentemb.methods.building import build_method

REPO = Path(__file__).resolve().parents[1]
ALL = TorchFeatures(varlen=True, varlen_gqa_keyword=True, varlen_window=True, flash_dropout=True, nested=True)
TORCH_2_11 = TorchFeatures(varlen=True, varlen_gqa_keyword=False, varlen_window=True, flash_dropout=True, nested=True)
NO_VARLEN = TorchFeatures(flash_dropout=True, nested=True)  # torch before varlen_attn, e.g. the 2.6 floor
NO_FLASH_OP = TorchFeatures(varlen=True, varlen_window=True, nested=True)
H100, A100, V100 = (9, 0), (8, 0), (7, 0)
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32


@pytest.mark.parametrize("features, device, capability, dtype, dropout, causal, window, softcap, prefix, expected", [
    (ALL, "cuda", H100, BF16, 0.0, True, None, None, False, "varlen"),
    (TORCH_2_11, "cuda", A100, FP16, 0.0, False, 4, None, False, "varlen"),
    (ALL, "cuda", H100, BF16, 0.1, False, None, None, False, "varlen"),  # dropout: the flash op itself
    (ALL, "cuda", H100, BF16, 0.1, False, None, None, True, "varlen"),  # ... with DCPCSE's prefix
    (NO_VARLEN, "cuda", A100, FP16, 0.1, True, None, None, False, "varlen"),
    (NO_FLASH_OP, "cuda", H100, BF16, 0.1, False, None, None, False, "aligned"),  # not nested: measured 6x slow
    (ALL, "cuda", H100, BF16, 0.1, True, 8, None, False, "aligned"),  # dropout and a window: nothing fused
    (NO_VARLEN, "cuda", H100, BF16, 0.0, True, None, None, False, "nested"),
    (ALL, "cuda", V100, FP16, 0.0, True, None, None, False, "nested"),  # no flash before sm80: memory-efficient
    (ALL, "cuda", V100, FP16, 0.1, False, None, None, False, "aligned"),
    (ALL, "cuda", V100, BF16, 0.0, False, None, None, False, "aligned"),  # no bf16 before sm80
    (ALL, "cuda", V100, FP16, 0.0, True, 8, None, False, "aligned"),
    (ALL, "cuda", H100, FP32, 0.0, False, None, None, False, "aligned"),
    (ALL, "cuda", H100, BF16, 0.0, False, None, 50.0, False, "aligned"),  # soft-capping
    (ALL, "cuda", H100, BF16, 0.0, False, None, None, True, "varlen"),  # a prefix on a bidirectional layer
    (ALL, "cuda", H100, BF16, 0.0, True, None, None, True, "aligned"),  # ... and on a causal one
    (TorchFeatures(varlen=True, nested=True), "cuda", H100, BF16, 0.0, True, 4, None, False, "aligned"),
    (ALL, "cpu", None, BF16, 0.0, False, None, None, False, "aligned"),
])
def test_choose_kernel(features, device, capability, dtype, dropout, causal, window, softcap, prefix, expected):
    assert choose_kernel(features, device, capability, dtype, dropout, causal, window, softcap, prefix) == expected


def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1)):
    """torch 2.11's `varlen_attn` signature (no `enable_gqa`, no **kwargs: grouped-query heads natively),
    on the CPU: SDPA per sentence, the key/value heads repeated per query group, windows as a mask."""
    calls.append({"dtypes": (query.dtype, key.dtype, value.dtype), "heads": (query.shape[1], key.shape[1])})
    groups = query.shape[1] // key.shape[1]
    left, right = window_size
    outs = []
    for i in range(len(cu_seq_q) - 1):
        q = query[cu_seq_q[i]:cu_seq_q[i + 1]].transpose(0, 1)
        k, v = (t[cu_seq_k[i]:cu_seq_k[i + 1]].transpose(0, 1).repeat_interleave(groups, 0) for t in (key, value))
        distance = torch.arange(q.shape[1])[:, None] - torch.arange(k.shape[1])[None]  # no prefix: same length
        allowed = ((distance <= left) | (left < 0)) & ((-distance <= right) | (right < 0))
        outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale).transpose(0, 1))
    return torch.cat(outs)


calls: list[dict] = []


@pytest.fixture
def torch_2_11_varlen(monkeypatch):
    """torch 2.11's `varlen_attn` stands in for the installed one; the features are read again."""
    calls.clear()
    monkeypatch.setattr(kernels, "installed_varlen", lambda: varlen_attn_2_11)
    kernels.torch_features.cache_clear()
    yield
    kernels.torch_features.cache_clear()


def test_features_of_each_torch_signature() -> None:
    def with_is_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, *, scale=None):
        raise AssertionError

    flash = kernels.installed_flash_forward()
    assert flash is not None  # in every torch since 2.0, CPU builds included (without a CPU kernel)
    assert features_of(varlen_attn_2_11, flash) == TORCH_2_11
    assert features_of(with_is_causal) == TorchFeatures(varlen=True, nested=True)
    assert features_of(None, flash) == NO_VARLEN
    installed = kernels.installed_varlen()
    if installed is not None and Version(torch.__version__).release >= (2, 13):
        assert features_of(installed, flash) == ALL


def right_padded_batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (3, 7), generator=generator)
    mask = (torch.arange(7)[None] < torch.tensor([7, 3, 5])[:, None]).long()
    return ids * mask, mask


def packed_and_padded(path: str, kernel: str, autocast: bool = False) -> tuple[torch.Tensor, ...]:
    """Last hidden states of the packed forward (`kernel`) and of a plain SDPA copy, and the real-token mask."""
    model = AutoModel.from_pretrained(path).eval()
    plain = copy.deepcopy(model)
    set_attention(model, SENTEMB_ATTENTION)
    ids, mask = right_padded_batch(model.config.vocab_size)
    positions = torch.arange(7).expand(3, 7)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        ours = packed_forward(model, TokenLayout.from_mask(mask), ids, position_ids=positions, kernel=kernel)
        theirs = plain(input_ids=ids, attention_mask=mask, position_ids=positions)
    return ours.last_hidden_state.float(), theirs.last_hidden_state.float(), mask.bool()


def test_forced_varlen_runs_torch_2_11s_signature_and_equals_the_padded_forward(tiny_qwen2, torch_2_11_varlen):
    ours, theirs, real = packed_and_padded(tiny_qwen2, "varlen")
    assert calls and all(call["heads"] == (4, 2) for call in calls)  # grouped K/V handed over as they are
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-5)


flash_calls: list[dict] = []


def flash_forward_stand_in(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                           return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                           seqused_k=None, alibi_slopes=None):
    """aten's `_flash_attention_forward` schema on the CPU, returning its expectation over the dropout
    (the attention without it) and its five outputs; records what it was handed."""
    flash_calls.append({"dropout_p": dropout_p, "is_causal": is_causal, "heads": (query.shape[1], key.shape[1]),
                        "cum_seq": (cum_seq_q.tolist(), cum_seq_k.tolist()), "max": (max_q, max_k)})
    out = varlen_attn_2_11(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, scale=scale,
                           window_size=(-1, 0 if is_causal else -1))
    return out, None, None, None, None


@pytest.mark.parametrize("family, dropout", [
    ("tiny_bert", {"attention_probs_dropout_prob": 0.1, "hidden_dropout_prob": 0.0}),  # only attention drops
    ("tiny_qwen2", {"attention_dropout": 0.1})])
def test_forced_varlen_with_attention_dropout_calls_the_flash_op_with_it(family, dropout, request, monkeypatch):
    """In training with attention dropout, `varlen` hands aten's flash op the packed rows, their offsets,
    the longest row, the layer's dropout and causality; its output (here the op's expectation) and the
    gradients through it equal the padded forward without attention dropout."""
    flash_calls.clear()
    monkeypatch.setattr(kernels, "installed_flash_forward", lambda: flash_forward_stand_in)
    path = request.getfixturevalue(family)
    model = AutoModel.from_pretrained(path, **dropout).train()
    plain = AutoModel.from_pretrained(path, attn_implementation="sdpa", **dropout).eval()
    set_attention(model, SENTEMB_ATTENTION)
    ids, mask = right_padded_batch(model.config.vocab_size)
    positions = torch.arange(7).expand(3, 7)
    layout = TokenLayout.from_mask(mask)
    ours = packed_forward(model, layout, ids, position_ids=positions, kernel="varlen").last_hidden_state
    theirs = plain(input_ids=ids, attention_mask=mask, position_ids=positions).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(ours[real], theirs[real], atol=1e-5, rtol=1e-5)
    ours[real].square().sum().backward()
    theirs[real].square().sum().backward()
    for (name, mine), other in zip(model.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, other.grad, atol=5e-5, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    causal, heads = family == "tiny_qwen2", (4, 2) if family == "tiny_qwen2" else (4, 4)
    assert flash_calls and all(call == {"dropout_p": 0.1, "is_causal": causal, "heads": heads, "max": (7, 7),
                                        "cum_seq": ([0, 7, 10, 15], [0, 7, 10, 15])} for call in flash_calls)


@pytest.mark.parametrize("dropout, window, prefix", [(0.0, 4, False), (0.1, None, False), (0.1, None, True)])
def test_the_installed_torchs_own_ops_take_the_varlen_call_on_the_meta_device(dropout, window, prefix) -> None:
    """torch's ops themselves (`varlen_attn` without dropout, aten's flash op with it), with their real
    schemas, take the call as `varlen` makes it and differentiate through it: on the meta device, where
    they run their shape functions (there is no CPU kernel). GQA 14/2, causal unless a prefix."""
    if not kernels.varlen_runs(kernels.torch_features(), dropout, window):
        pytest.skip(f"torch {torch.__version__} runs no varlen here")
    layout = TokenLayout.from_mask(torch.arange(7)[None] < torch.tensor([7, 3, 5])[:, None]).to("meta")
    query, key, value = (torch.empty(15, heads, 64, dtype=BF16, device="meta", requires_grad=True)
                         for heads in (14, 2, 2))
    pair = (torch.empty(3, 2, 4, 64, dtype=BF16, device="meta"),) * 2 if prefix else None
    out = kernels.varlen_attention(query, key, value, layout, 0.125, dropout, not prefix, window, pair)
    assert out.shape == (15, 14, 64) and out.dtype == BF16
    assert ("FlashAttentionBackward" if dropout else "varlen_attn") in type(out.grad_fn).__name__
    out.sum().backward()
    assert [t.grad.shape for t in (query, key, value)] == [(15, 14, 64), (15, 2, 64), (15, 2, 64)]


def test_forced_varlen_with_dropout_and_a_window_is_refused_in_one_line() -> None:
    layout = TokenLayout.from_mask(torch.ones(1, 4))
    query = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="needs aten's _flash_attention_forward and no sliding window"):
        kernels.run_kernel(kernels.Packing(layout, "varlen"), query, query, query, 1.0, 0.1, True, 2, None, None)


@pytest.mark.parametrize("family", ["tiny_qwen2", "tiny_llama"])
def test_under_bf16_autocast_query_key_and_value_reach_the_kernel_in_bf16(family, request, torch_2_11_varlen):
    ours, theirs, real = packed_and_padded(request.getfixturevalue(family), "varlen", autocast=True)
    assert calls and all(call["dtypes"] == (BF16, BF16, BF16) for call in calls)
    torch.testing.assert_close(ours[real], theirs[real], atol=5e-2, rtol=5e-2)


def test_the_kernel_that_ran_is_counted_and_logged(tiny_bert, caplog) -> None:
    kernels.reset_kernels_ran()
    with caplog.at_level("INFO"):
        packed_and_padded(tiny_bert, "auto")
    assert kernels.kernels_ran() == {"aligned": 2}  # two layers
    assert [r.getMessage() for r in caplog.records if "kernel runs" in r.getMessage()] == [
        "packed attention: the aligned kernel runs (cpu, torch.float32, dropout 0, bidirectional)"]


@pytest.mark.parametrize("family", ["tiny_bert", "tiny_qwen2"])
def test_the_backbone_called_directly_is_a_plain_hugging_face_model(family, request) -> None:
    path = request.getfixturevalue(family)
    method = build_method(SimCSE, path, pooler="avg").eval()
    assert method.encoder.padding_free
    plain = AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    ids, mask = right_padded_batch(plain.config.vocab_size)
    with torch.no_grad():
        ours = method.encoder.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
        theirs = plain(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-6)
    assert method.encoder.backbone.config._attn_implementation == SENTEMB_ATTENTION


@pytest.mark.parametrize("family", ["tiny_qwen2", "tiny_bert", "tiny_gemma2"])
def test_the_packed_forward_builds_no_mask_and_keeps_the_config(family, request, monkeypatch) -> None:
    """transformers builds no mask for the packed row, under any registered name (causal, bidirectional and
    sliding-window masks alike), nor searches its position ids for packed sequences (a read-back); the
    backbone's attention implementation is ours throughout the call, never switched."""
    import transformers.masking_utils as masking

    def refuse(*args, **kwargs):
        raise AssertionError("a mask was built on the packed path")

    seen = []
    model = AutoModel.from_pretrained(request.getfixturevalue(family)).eval()
    set_attention(model, SENTEMB_ATTENTION)
    model.get_input_embeddings().register_forward_hook(lambda *_: seen.append(model.config._attn_implementation))
    mapping = masking.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    assert SENTEMB_ATTENTION in mapping and "sdpa" in mapping
    for name in list(mapping):
        monkeypatch.setitem(mapping, name, refuse)
    monkeypatch.setattr(masking, "find_packed_sequence_indices", refuse)
    ids, mask = right_padded_batch(model.config.vocab_size)
    with torch.no_grad():
        packed_forward(model, TokenLayout.from_mask(mask), ids, position_ids=torch.arange(7).expand(3, 7))
    assert seen == [SENTEMB_ATTENTION] and model.config._attn_implementation == SENTEMB_ATTENTION
    with pytest.raises(AssertionError, match="a mask was built"):  # the test can fail: a padded call builds one
        model(input_ids=ids, attention_mask=mask)


@pytest.mark.slow  # ~30 s: dynamo traces the layers twice
def test_compile_layers_compiles_once_for_batches_of_every_shape(tiny_bert, monkeypatch) -> None:
    """5 training steps of different batch sizes and widths through compiled layers: after the first two
    (static, then dynamic shapes) dynamo compiles nothing new (the kernels' Python state stays outside)."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    monkeypatch.setattr(SimCSE, "log", lambda *a, **k: None)
    method = build_method(SimCSE, tiny_bert, pooler="avg", mlp="none", compile_layers=True).train()
    stats = torch._dynamo.utils.counters["stats"]
    stats.clear()
    sentences = ["a b c", "a much longer sentence with words", "x", "some more words here", "y z"]
    graphs = []
    for step in range(5):
        ids = method.encoder.format.sentence_ids(sentences[: step + 1] * 2)
        method.training_step(method.collate([{"sent0": row} for row in ids]), step).backward()
        graphs.append(stats["unique_graphs"])
    assert graphs[1] == graphs[-1] <= 6, graphs


def test_setup_cfg_states_the_oldest_torch_that_transformers_and_our_kernels_take() -> None:
    parser = configparser.ConfigParser()
    parser.read(REPO / "setup.cfg")
    floor = re.search(r"^\s*torch>=([\d.]+)", parser["options"]["install_requires"], re.M).group(1)
    theirs = [re.search(r"torch>=([\d.]+)", r).group(1) for r in metadata.requires("transformers") or []
              if r.startswith("torch>=") or r.startswith("torch >=")]
    assert theirs and Version(floor) >= Version(theirs[0])
    assert Version(floor) >= Version("2.6")  # SDPA's enable_gqa, nested jagged min/max_seqlen, get_autocast_dtype
