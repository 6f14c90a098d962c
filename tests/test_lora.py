"""LoRA (peft) and the memory switches on tiny random encoders and decoders: what trains, checkpoints of a
frozen base, both export forms against `encode`, gradient caching, packing and gradient checkpointing
against their plain paths, exact resume (low-precision and 4-bit loading: tests/test_low_precision.py)."""

from __future__ import annotations

import copy
import logging
import shutil
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from safetensors import safe_open
from torch import nn
from torch.utils.data import DataLoader

from lightning_sentemb import methods
from lightning_sentemb.encoders.lora import has_lora
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.export import export
from lightning_sentemb.loading import load_method
from lightning_sentemb.methods import DCPCSE, ClusterNS, ConPVP, PromptBERT, SimCSE
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.consert import ConSERT
from lightning_sentemb.methods.esimcse import ESimCSE
from lightning_sentemb.methods.mixcse import MixCSE
from tests.test_grad_cache import CHUNK, examples, gradients, relative_error
from tests.test_padding_free import without_dropout
from tests.test_resume import KILL_AT, MAX_STEPS, TerminateAt, fit, read_losses, run_args, trained_state

SENTENCES = ["a man is playing a guitar", "an old cat sat on the mat", "a woman is slicing an onion today ."]
LORA = {"r": 4, "alpha": 8.0, "dropout": 0.1, "target_modules": "all-linear"}

# (backbone fixture, method with LoRA): every head kind — MLP, MLM head, prompt vectors, prefix, centroids
METHODS = {
    "simcse_mlm_bert": ("tiny_bert", lambda b, **k: build_method(SimCSE, b, pooler="cls", mlp="always",
                                                                 mlm_weight=0.1, **k)),
    "promptbert_bert": ("tiny_bert", lambda b, **k: build_method(PromptBERT, b, **k)),
    "conpvp_bert": ("tiny_bert", lambda b, **k: build_method(ConPVP, b, prompt_length=2, **k)),
    "dcpcse_bert": ("tiny_bert", lambda b, **k: build_method(DCPCSE, b, pooler="avg", prefix_len=2, **k)),
    "clusterns_roberta": ("tiny_roberta", lambda b, **k: build_method(ClusterNS, b, pooler="avg_first_last",
                                                                      num_clusters=2, **k)),
    "simcse_qwen2": ("tiny_qwen2", lambda b, **k: build_method(SimCSE, b, pooler="avg", **k)),
    "simcse_llama": ("tiny_llama", lambda b, **k: build_method(SimCSE, b, pooler="avg", mlp="always", **k)),
    # the adversarial attack's gradient with respect to a frozen embedding layer's output
    "consert_adversarial_bert": ("tiny_bert", lambda b, **k: build_method(
        ConSERT, b, augmentations=["feature_cutoff", "adversarial"], mlp="train", **k)),
    "esimcse_bert": ("tiny_bert", lambda b, **k: build_method(ESimCSE, b, **k)),  # the adapters' momentum copy
    "consert_joint_bert": ("tiny_bert", lambda b, **k: build_method(methods.ConSERTJoint, b, **k)),  # the classifier
    "mixcse_bert": ("tiny_bert", lambda b, **k: build_method(MixCSE, b, **k)),
}


def build(name: str, request, **kwargs):
    fixture, make = METHODS[name]
    backbone = request.getfixturevalue(fixture)  # before seeding: a first use builds the fixture's model
    torch.manual_seed(0)
    return make(backbone, lora=LORA, **kwargs)


def randomize_adapters(method: nn.Module) -> nn.Module:
    """LoRA starts with B = 0 (no change to the backbone): give every adapter a visible effect."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in method.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return method


def base_state(method) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in method.encoder.backbone.state_dict().items() if ".lora_" not in k}


def short_fit(method, steps: int = 3, **trainer_args) -> Trainer:
    loader = DataLoader(examples(method), batch_size=4, collate_fn=method.collate)
    trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, **trainer_args)
    trainer.fit(method, loader)
    return trainer


# ----- what trains ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(METHODS))
def test_only_adapters_and_heads_train_and_the_base_stays_bit_identical(name, request, caplog) -> None:
    method = build(name, request)
    backbone = method.encoder.backbone
    adapters = {id(p) for n, p in backbone.named_parameters() if ".lora_" in n}
    base = {id(p) for n, p in backbone.named_parameters() if ".lora_" not in n}
    heads = {id(p) for p in method.parameters()} - adapters - base
    assert adapters and all(p.requires_grad == (id(p) in adapters | heads) for p in method.parameters())
    assert all(p.dtype == torch.float32 for p in method.parameters() if p.requires_grad)
    if name != "simcse_qwen2":  # every other method has a head (MLP, prompt, prefix, MLM transform)
        assert heads
    before_base = base_state(method)
    before_trainable = {n: p.detach().clone() for n, p in method.named_parameters() if p.requires_grad}
    with caplog.at_level(logging.INFO):
        short_fit(method, steps=3)
    trainable = sum(p.numel() for p in method.parameters() if p.requires_grad)
    assert f"{trainable:,} trainable parameters of {sum(p.numel() for p in method.parameters()):,}" in caplog.text
    after_base = base_state(method)
    assert after_base.keys() == before_base.keys()
    assert all(torch.equal(after_base[k], before_base[k]) for k in before_base)
    assert all(p.grad is None for p in method.parameters() if not p.requires_grad)
    moved = {n for n, p in method.named_parameters() if p.requires_grad and not torch.equal(p, before_trainable[n])}
    assert any(".lora_A" in n for n in moved) and any(".lora_B" in n for n in moved)


def test_lora_settings_are_checked_in_one_line(tiny_bert) -> None:
    with pytest.raises(SentEmbUserError, match=r"lora: unknown key\(s\) rank"):
        build_method(SimCSE, tiny_bert, lora={"rank": 4})
    with pytest.raises(SentEmbUserError, match="lora.r must be a positive integer"):
        build_method(SimCSE, tiny_bert, lora={"r": 0})
    with pytest.raises(SentEmbUserError, match="matches no layer of this bert backbone.*query, value"):
        build_method(SimCSE, tiny_bert, lora={"target_modules": ["q_proj"]})
    # the BERT pooler feeds no pooler of ours: never adapted, also when a target names its layer
    method = build_method(SimCSE, tiny_bert, lora={"r": 2, "target_modules": ["dense"]})
    assert not has_lora(method.encoder.backbone.pooler) and has_lora(method.encoder.backbone.encoder)


# ----- exports ---------------------------------------------------------------------------------------
def sentence_transformer(folder: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(folder), device="cpu", trust_remote_code=True)


def weight_names(folder: Path) -> set[str]:
    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, "pt") as weights:
            names |= set(weights.keys())
    return names


@pytest.mark.parametrize("name", ["simcse_mlm_bert", "promptbert_bert", "dcpcse_bert", "simcse_qwen2", "simcse_llama"])
def test_merged_export_equals_the_unmerged_model(name, request, tmp_path) -> None:
    from transformers import AutoModel

    method = randomize_adapters(build(name, request))
    expected = method.encode(SENTENCES)
    assert not torch.allclose(expected, build(name, request).encode(SENTENCES), atol=1e-3)  # adapters matter
    folder = export(method, tmp_path / "export")
    assert has_lora(method.encoder.backbone)  # exporting leaves the method as it was
    torch.testing.assert_close(method.encode(SENTENCES), expected, rtol=0, atol=0)
    assert not (folder / "adapter_config.json").exists()
    assert weight_names(folder) and not any("lora" in k or "base_layer" in k for k in weight_names(folder))
    assert not has_lora(AutoModel.from_pretrained(folder))  # a plain model: no peft needed
    torch.testing.assert_close(torch.as_tensor(sentence_transformer(folder).encode(SENTENCES)), expected,
                               rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["simcse_mlm_bert", "clusterns_roberta", "promptbert_bert", "dcpcse_bert",
                                  "simcse_qwen2"])
def test_adapter_only_export_reloads_to_the_same_embeddings(name, request, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModel

    method = randomize_adapters(build(name, request))
    expected = method.encode(SENTENCES)
    folder = export(method, tmp_path / "export", adapter_only=True)
    assert (folder / "adapter_config.json").exists() and not (folder / "config.json").exists()
    adapter_size = (folder / "adapter_model.safetensors").stat().st_size
    assert adapter_size < sum(p.numel() for p in method.encoder.backbone.parameters()) * 4 / 4  # no base weights
    torch.testing.assert_close(torch.as_tensor(sentence_transformer(folder).encode(SENTENCES)), expected,
                               rtol=0, atol=1e-5)
    # peft's own loader puts the same adapters on the base model
    reloaded = PeftModel.from_pretrained(AutoModel.from_pretrained(method.hparams.backbone), folder).base_model.model
    theirs = dict(reloaded.named_parameters())
    for key, value in method.encoder.backbone.named_parameters():
        if ".lora_" in key:
            torch.testing.assert_close(theirs[key], value, rtol=0, atol=0)
    # and our own loader too (sentemb evaluate --model FOLDER)
    if name.startswith("simcse"):
        plain = load_method(str(folder), pooler=method.hparams.pooler)
        plain.mlp, plain.hparams.mlp = method.mlp, method.hparams.mlp
        torch.testing.assert_close(plain.encode(SENTENCES), expected, rtol=0, atol=1e-5)


def test_adapter_only_needs_lora_and_leaves_no_folder(tiny_bert, tmp_path) -> None:
    with pytest.raises(SentEmbUserError, match="--adapter-only needs a model trained with LoRA"):
        export(build_method(SimCSE, tiny_bert, pooler="avg"), tmp_path / "export", adapter_only=True)
    assert not (tmp_path / "export").exists()


# ----- gradient caching, packing, gradient checkpointing -------------------------------------------
@pytest.mark.parametrize("name", ["simcse_mlm_bert", "promptbert_bert", "dcpcse_bert", "simcse_qwen2"])
def test_cached_gradient_with_lora_equals_one_forward(name, request) -> None:
    method = without_dropout(randomize_adapters(build(name, request))).to(torch.float64)
    batch = method.collate(examples(method))
    loss, want = gradients(method, batch, 0)
    cached_loss, got = gradients(method, batch, CHUNK)
    assert any(".lora_" in k and v.abs().sum() > 0 for k, v in want.items())
    torch.testing.assert_close(cached_loss, loss, rtol=1e-12, atol=0)
    assert relative_error(got, want) < 1e-10


def loss_and_grads(method, batch: dict, seed: int = 3) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    method.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks for both methods
    loss, _ = method.step_loss(copy.deepcopy(batch))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in method.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["simcse_mlm_bert", "promptbert_bert", "dcpcse_bert"])
def test_padding_free_forward_equals_padded_with_lora(name, request) -> None:
    fast = without_dropout(randomize_adapters(build(name, request)))
    assert fast.encoder.padding_free
    padded = copy.deepcopy(fast)
    padded.encoder.configure_speed(padding_free=False, compile_layers=False)
    batch = fast.collate(examples(fast))
    fast_loss, fast_grads = loss_and_grads(fast, batch)
    padded_loss, padded_grads = loss_and_grads(padded, batch)
    torch.testing.assert_close(fast_loss, padded_loss, atol=1e-5, rtol=1e-5)
    assert fast_grads.keys() == padded_grads.keys() and any(".lora_" in k for k in fast_grads)
    for key in fast_grads:
        torch.testing.assert_close(fast_grads[key], padded_grads[key], atol=1e-5, rtol=1e-5, msg=key)
    torch.testing.assert_close(fast.encode(SENTENCES), padded.encode(SENTENCES), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, padding_free, lora", [
    ("simcse_mlm_bert", True, True), ("simcse_mlm_bert", False, True), ("dcpcse_bert", True, True),
    ("dcpcse_bert", False, False),  # the prefix rides in the forward's arguments: checkpointing keeps it
    ("promptbert_bert", True, False), ("simcse_qwen2", False, True),
])
def test_gradient_checkpointing_gives_the_same_loss_and_gradients(name, padding_free, lora, request) -> None:
    """Dropout on: the recomputation must replay each layer's masks."""
    fixture, make = METHODS[name]
    backbone = request.getfixturevalue(fixture)  # before seeding: a first use builds the fixture's model
    methods = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        method = make(backbone, lora=LORA if lora else None, attn_implementation=None if padding_free else "padded",
                      gradient_checkpointing=checkpointing)
        methods.append(randomize_adapters(method) if lora else method)
    batch = methods[0].collate(examples(methods[0]))
    calls = []
    for method in methods:  # a layer's first projection runs once per forward, once more when recomputed
        backbone = method.encoder.backbone
        projection = (backbone.layers[0].self_attn.q_proj if "qwen2" in name
                      else backbone.encoder.layer[0].attention.self.query)
        calls.append([])
        projection.register_forward_hook(lambda *_, seen=calls[-1]: seen.append(1))
    (plain_loss, plain_grads), (checkpointed_loss, checkpointed_grads) = (loss_and_grads(m, batch) for m in methods)
    assert len(calls[1]) == 2 * len(calls[0])  # checkpointing recomputed the layer in backward
    torch.testing.assert_close(checkpointed_loss, plain_loss, rtol=0, atol=0)
    assert plain_grads.keys() == checkpointed_grads.keys() and plain_grads
    for key in plain_grads:
        torch.testing.assert_close(checkpointed_grads[key], plain_grads[key], rtol=1e-6, atol=1e-7, msg=key)


def lora_simcse(backbone: str) -> SimCSE:
    """The LoRA SimCSE whose cached gradient on 2 processes equals one process's: its fit shares the launch
    of tests/test_grad_cache.py's DDP fits (test_ddp_cached_gradient_equals_one_process, "simcse_lora")."""
    torch.manual_seed(0)
    method = build_method(SimCSE, backbone, pooler="avg", lora=LORA)
    return without_dropout(randomize_adapters(method)).to(torch.float64)


# ----- checkpoints: exact resume, the frozen base left out, its identity ---------------------------
LORA_ARGS = ["--model.lora", "{r: 4, alpha: 8, dropout: 0.1, target_modules: all-linear}"]


@pytest.mark.parametrize("family, extra", [("tiny_bert", ["--model.mlm_weight", "0.1"]),
                                           ("tiny_qwen2", ["--model.pooler", "avg", "--model.mlp", "always"])])
def test_resume_with_lora_is_bit_exact_and_checkpoints_hold_no_base(family, extra, request, sts_fixture, corpus,
                                                                    tmp_path) -> None:
    backbone = request.getfixturevalue(family)
    reference = tmp_path / "reference"
    fit(run_args("simcse", backbone, sts_fixture, corpus, reference, 0, *LORA_ARGS, *extra),
        reference / "losses.jsonl")
    root = tmp_path / "run"
    args = run_args("simcse", backbone, sts_fixture, corpus, root, 0, *LORA_ARGS, *extra)
    with pytest.raises(SystemExit):
        fit(args, tmp_path / "losses.jsonl", TerminateAt(KILL_AT))
    fit([*args, "--ckpt_path", "last"], tmp_path / "losses.jsonl")
    assert read_losses(tmp_path / "losses.jsonl") == read_losses(reference / "losses.jsonl")
    assert sorted(read_losses(tmp_path / "losses.jsonl")) == list(range(1, MAX_STEPS + 1))
    state, expected = trained_state(root), trained_state(reference)
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)

    checkpoint = torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)
    assert all(".lora_" in k or k.startswith(("mlp.", "encoder.mlm_model.cls.")) for k in checkpoint["state_dict"])
    method = load_method(str(root / "checkpoints" / "last.ckpt"))
    trainable = {n for n, p in method.named_parameters(remove_duplicate=False) if p.requires_grad}
    assert set(checkpoint["state_dict"]) == trainable
    moments = [t for s in checkpoint["optimizer_states"][0]["state"].values() for t in s.values() if t.dim()]
    assert sum(t.numel() for t in moments) == 2 * sum(p.numel() for p in method.parameters() if p.requires_grad)
    assert checkpoint["sentemb_backbone"]["name"] == backbone


def test_a_checkpoint_on_a_different_base_is_one_line(tiny_qwen2, tiny_llama, tmp_path, capsys) -> None:
    """Qwen2 and Llama of the same shape have the same adapter names: only the identity tells them apart."""
    from lightning_sentemb.cli import main

    backbone = tmp_path / "base"
    shutil.copytree(tiny_qwen2, backbone)
    method = build_method(SimCSE, str(backbone), pooler="avg", lora=LORA)
    trainer = short_fit(method, steps=1)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    load_method(str(tmp_path / "last.ckpt"))  # the same base: loads
    shutil.rmtree(backbone)
    shutil.copytree(tiny_llama, backbone)
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        main(["export", str(tmp_path / "last.ckpt"), str(tmp_path / "export")])
    assert stopped.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and "trained on backbone" in error and "different model" in error


def test_a_checkpoint_missing_trained_tensors_is_refused(tiny_bert, tmp_path) -> None:
    method = build_method(SimCSE, tiny_bert, pooler="avg", lora=LORA)
    short_fit(method, steps=1).save_checkpoint(tmp_path / "last.ckpt")
    checkpoint = torch.load(tmp_path / "last.ckpt", weights_only=True)
    name = next(k for k in checkpoint["state_dict"] if ".lora_A" in k)
    del checkpoint["state_dict"][name]
    torch.save(checkpoint, tmp_path / "broken.ckpt")
    with pytest.raises(RuntimeError, match=f"Missing key.*{name}"):
        SimCSE.load_from_checkpoint(tmp_path / "broken.ckpt")


@pytest.mark.slow
def test_lora_benchmark_runs_on_a_small_shape(shared_data, tmp_path) -> None:
    """`benchmarks/lora.py --shape small`: every configuration trains and checkpoints; LoRA's is smaller.
    (Its decoder's tokenizer is trained on the wiki1m mirror.)"""
    import json

    from tests.launch import REPO, run_script

    output = tmp_path / "lora.json"
    run_script(REPO / "benchmarks" / "lora.py", "--shape", "small", "--batch", "4", "--steps", "1",
               "--output", str(output))
    results = json.loads(output.read_text())
    assert list(results) == ["full fine-tuning", "LoRA", "LoRA + gradient checkpointing"]
    full, lora = results["full fine-tuning"], results["LoRA"]
    assert full["trainable"] == full["parameters"] and lora["trainable"] < lora["parameters"] / 20
    assert lora["checkpoint_mib"] < full["checkpoint_mib"] / 10

