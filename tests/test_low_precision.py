"""Low-precision and 4-bit backbones: a bf16 base keeps what trains in fp32 and stays bit-identical, a
low-precision backbone that would train is refused, and 4-bit loading names what it needs (a CUDA GPU,
bitsandbytes) in one line."""

from __future__ import annotations

import pytest
import torch

from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.methods import DCPCSE, SimCSE
from lightning_sentemb.methods.building import build_method
from tests.test_lora import LORA, SENTENCES, base_state, short_fit


def test_bf16_backbone_keeps_what_trains_in_fp32(tiny_bert) -> None:
    method = build_method(SimCSE, tiny_bert, pooler="cls", mlp="always", mlm_weight=0.1, lora=LORA,
                          backbone_dtype="bf16")
    assert all(p.dtype == torch.float32 for p in method.parameters() if p.requires_grad)
    base = [p.dtype for n, p in method.encoder.backbone.named_parameters() if ".lora_" not in n]
    assert base and all(dtype == torch.bfloat16 for dtype in base)
    assert torch.isfinite(method.encode(SENTENCES)).all()  # evaluation autocasts to bf16, CPU included
    before = base_state(method)
    short_fit(method, steps=2, precision="bf16-mixed")
    assert all(torch.equal(v, before[k]) for k, v in base_state(method).items())
    with pytest.raises(SentEmbUserError, match="backbone_dtype bf16.*trainer.precision bf16-mixed"):
        short_fit(method, steps=1, precision="32-true")


def test_low_precision_refuses_a_trained_backbone(tiny_bert) -> None:
    with pytest.raises(SentEmbUserError, match="backbone_dtype fp16.*model.init_args.lora"):
        build_method(SimCSE, tiny_bert, backbone_dtype="fp16")
    assert build_method(DCPCSE, tiny_bert, prefix_len=2, backbone_dtype="fp16").backbone_frozen  # a frozen backbone may


def test_4bit_is_refused_without_a_gpu_or_bitsandbytes(tiny_bert, monkeypatch) -> None:
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SentEmbUserError, match="load_in_4bit: 4-bit weights .* need a CUDA GPU"):
        build_method(SimCSE, tiny_bert, lora=LORA, load_in_4bit=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "bitsandbytes" else find_spec(name, *a))
    with pytest.raises(SentEmbUserError, match=r"pip install 'lightning_sentemb\[qlora\]'"):
        build_method(SimCSE, tiny_bert, lora=LORA, load_in_4bit=True)
