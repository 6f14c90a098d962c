"""`bidirectional: true` on decoders (LLM2Vec's first step) against a hand-written bidirectional forward:
the same weights through transformers' eager attention with a (batch, 1, length, length) mask that hides
padding only, made here. Loss and every gradient to 1e-5, packed and padded; windows (Gemma-2) off too;
DCPCSE's prefix and gradient caching stay exact with it; encoders refuse it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_sentemb.backbones import UnsupportedBackbone
from lightning_sentemb.encoders.packed import set_attention
from lightning_sentemb.methods import DCPCSE, PromptBERT, SimCSE
from lightning_sentemb.methods.building import build_method

from .test_grad_cache import gradients

SENTENCES = ["a man is playing a guitar .", "the cat sat .", "this sentence means something rather long , really .",
             "nice .", "two dogs run across the field today ."]


def quiet(method: nn.Module) -> nn.Module:
    for module in method.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    method.log = method.log_dict = lambda *a, **k: None
    return method.train()


def hand_written(method: nn.Module) -> nn.Module:
    """A copy whose backbone runs transformers' eager attention, causal flag untouched, under a padding-only
    additive 4D mask (transformers takes a 4D mask as given, for full and sliding layers alike)."""
    reference = copy.deepcopy(method)
    encoder = reference.encoder
    encoder.backbone.config.is_causal = True
    set_attention(encoder.backbone, "eager")

    def call_backbone(features: dict[str, Any], input_ids=None, inputs_embeds=None, position_ids=None,
                      output_hidden_states=None) -> Any:
        real = features["attention_mask"].bool()
        if position_ids is None:
            position_ids = encoder.family.position_ids(input_ids, features["attention_mask"])
        mask = torch.zeros(real.shape[0], 1, real.shape[1], real.shape[1])
        mask = mask.masked_fill(~real[:, None, None, :], torch.finfo(mask.dtype).min)
        return encoder.backbone(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=mask,
                                position_ids=position_ids, output_hidden_states=bool(output_hidden_states))

    encoder.call_backbone = call_backbone
    return reference


def loss_and_grads(method: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    method.zero_grad(set_to_none=True)
    loss, _ = method.step_loss(copy.deepcopy(batch))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in method.named_parameters() if p.grad is not None}


def assert_same(first: tuple, second: tuple) -> None:
    torch.testing.assert_close(first[0], second[0], atol=1e-5, rtol=1e-5)
    assert first[1].keys() == second[1].keys() and first[1]
    for name in first[1]:
        torch.testing.assert_close(first[1][name], second[1][name], atol=1e-5, rtol=1e-5, msg=name)


def unsupervised_batch(method: nn.Module) -> dict:
    ids = method.encoder.format.sentence_ids(SENTENCES)
    return method.collate([{"sent0": row} for row in ids])


METHODS = {
    "simcse_avg": lambda path, **kw: build_method(SimCSE, path, pooler="avg", **kw),
    # explicit positions, the template's last token
    "prompteol": lambda path, **kw: build_method(PromptBERT, path, **kw),
}


@pytest.mark.parametrize(("family", "name"), [("tiny_qwen2", "simcse_avg"), ("tiny_qwen2", "prompteol"),
                                              ("tiny_llama", "simcse_avg"), ("tiny_gemma2", "simcse_avg")])
def test_bidirectional_equals_hand_written_forward(family: str, name: str, request) -> None:
    """Packed (aligned and nested kernels; soft-capping's math kernel on Gemma-2) and padded forwards against the eager
    reference: loss and every gradient; the causal model gives another loss."""
    path = request.getfixturevalue(family)
    torch.manual_seed(0)
    packed = quiet(METHODS[name](path, bidirectional=True))
    assert packed.encoder.padding_free
    padded = copy.deepcopy(packed)
    padded.encoder.configure_speed(padding_free=False, compile_layers=False)
    batch = unsupervised_batch(packed)
    assert not bool(batch["features"]["attention_mask"].all())
    expected = loss_and_grads(hand_written(packed), batch)
    assert_same(loss_and_grads(packed, batch), expected)
    assert_same(loss_and_grads(padded, batch), expected)
    if family != "tiny_gemma2":  # the nested kernel (CUDA's under dropout) runs bidirectional layers on CPU too
        packed.encoder.packed_kernel = "nested"
        assert_same(loss_and_grads(packed, batch), expected)
    torch.manual_seed(0)
    causal = quiet(METHODS[name](path))
    assert not torch.allclose(loss_and_grads(causal, batch)[0], expected[0], atol=1e-4)


def test_bidirectional_without_padding_on_the_padded_path(tiny_qwen2: str) -> None:
    """A batch without padding (transformers builds no mask then) is bidirectional as well."""
    torch.manual_seed(0)
    method = quiet(build_method(SimCSE, tiny_qwen2, pooler="avg", bidirectional=True))
    method.encoder.configure_speed(padding_free=False, compile_layers=False)
    ids = method.encoder.format.sentence_ids(["the cat sat .", "the dog sat ."])
    batch = method.collate([{"sent0": row} for row in ids])
    assert bool(batch["features"]["attention_mask"].all())
    assert_same(loss_and_grads(method, batch), loss_and_grads(hand_written(method), batch))


def test_dcpcse_prefix_with_bidirectional_attention(tiny_qwen2: str) -> None:
    """The prefix joins bidirectional attention alike packed and padded; without the switch it differs."""
    torch.manual_seed(0)
    packed = quiet(build_method(DCPCSE, tiny_qwen2, pooler="avg", prefix_len=2, bidirectional=True))
    padded = copy.deepcopy(packed)
    padded.encoder.configure_speed(padding_free=False, compile_layers=False)
    batch = unsupervised_batch(packed)
    assert_same(loss_and_grads(packed, batch), loss_and_grads(padded, batch))
    causal = copy.deepcopy(packed)
    causal.encoder.backbone.config.is_causal = True
    assert not torch.allclose(loss_and_grads(causal, batch)[0], loss_and_grads(packed, batch)[0], atol=1e-4)


def test_gradient_caching_with_bidirectional_attention(tiny_llama: str) -> None:
    """Chunked (gradient-cached) loss and gradients equal one forward's, in float64."""
    torch.manual_seed(0)
    method = quiet(build_method(SimCSE, tiny_llama, pooler="avg", bidirectional=True)).double()
    batch = unsupervised_batch(method)

    assert_same(gradients(method, batch, 3), gradients(method, batch, 0))


def test_encoders_refuse_bidirectional(tiny_bert: str, tiny_qwen2: str) -> None:
    with pytest.raises(UnsupportedBackbone, match="encoder, bidirectional already"):
        build_method(SimCSE, tiny_bert, bidirectional=True)
    with pytest.raises(UnsupportedBackbone, match="attn_implementation null"):
        build_method(SimCSE, tiny_qwen2, bidirectional=True, attn_implementation="sdpa")
