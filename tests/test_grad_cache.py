"""Gradient caching (`grad_cache_chunk`): for every method the cached gradient equals the one-forward
gradient (dropout off), each chunk's second forward replays its first's dropout, the Lightning
manual-optimization step matches automatic optimization, and DDP (2 CPU processes) matches one process.

Exactness is checked in float64: in fp32 the one-forward gradient of these random tiny models is
itself only within 1e-5–5e-4 (relative) of the float64 one, and chunked matmuls round differently,
so two fp32 gradients cannot agree to 1e-6; fp32 caching is checked to be as close to float64."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader

from lightning_sentemb import methods
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.methods import DCPCSE, ClusterNS, ClusterNSPrefix, ClusterNSPrompt, ConPVP, PromptBERT, SimCSE
from lightning_sentemb.methods.base import SentEmbMethod
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.consert import ConSERT
from lightning_sentemb.methods.mixcse import MixCSE
from tests.examples import training_examples
from tests.launch import fork_ranks

WORDS = ["a man plays guitar", "the cat sleeps on the sofa", "kids play football", "a woman cooks dinner",
         "the sun shines", "birds fly south for the winter", "a car drives fast", "a dog runs"]
CHUNK = 3  # divides neither the views nor the rows: chunks straddle views and template-bias rows

METHODS = {
    "simcse": lambda path: build_method(SimCSE, path),
    "simcse_mlm": lambda path: build_method(SimCSE, path, mlm_weight=0.1),
    "simcse_sup": lambda path: build_method(SimCSE, path, hard_negative_weight=0.5),
    "promptbert": lambda path: build_method(PromptBERT, path),
    "conpvp": lambda path: build_method(ConPVP, path),
    "dcpcse_mlm": lambda path: build_method(DCPCSE, path, mlm_weight=0.1, prefix_len=2),
    "clusterns": lambda path: build_method(ClusterNS, path, num_clusters=2),
    "clusterns_prompt": lambda path: build_method(ClusterNSPrompt, path, num_clusters=2),
    "clusterns_prefix_mlm": lambda path: build_method(ClusterNSPrefix, path, num_clusters=2, prefix_len=2,
                                                      mlm_weight=0.1),
    # Matryoshka: the loss over truncations (views, template-bias rows, prototypes, centroids truncated alike)
    "simcse_mlm_matryoshka": lambda path: build_method(SimCSE, path, mlm_weight=0.1, matryoshka_dims=[32, 8]),
    "promptbert_matryoshka": lambda path: build_method(PromptBERT, path, matryoshka_dims=[32, 16, 8],
                                                       matryoshka_weights=[1, .5, 2]),
    "conpvp_matryoshka": lambda path: build_method(ConPVP, path, matryoshka_dims=[16, 8]),
    "dcpcse_matryoshka": lambda path: build_method(DCPCSE, path, prefix_len=2, matryoshka_dims=[32, 8]),
    "clusterns_prompt_matryoshka": lambda path: build_method(ClusterNSPrompt, path, num_clusters=2,
                                                             matryoshka_dims=[32, 16, 8]),
    # the collated draws (element masks, shuffled positions) sliced with their chunk's rows
    "consert": lambda path: build_method(ConSERT, path, augmentations=["dropout", "shuffle"]),
    # a third view (the negations); a classifier over pairs, trained through the cached rows
    "sncse": lambda path: build_method(methods.SNCSE, path),
    "sbert": lambda path: build_method(methods.SBERT, path),
    # the classifier beside NT-Xent within the premises and within the hypotheses, the edits sliced by chunk
    "consert_joint": lambda path: build_method(methods.ConSERTJoint, path, augmentations=["token_cutoff", "shuffle"]),
    # DCLR's noise (ascended against the whole batch) and a complementary model's weights (its BERT-large config
    # names grad_cache_chunk for GPUs too small for the reference's global batch)
    "dclr": lambda path: build_method(methods.DCLR, path, objective="reference", guide={"model": path}),
    # MixCSE's mixed negatives (ESimCSE's momentum step: tests/test_esimcse.py)
    "mixcse_matryoshka": lambda path: build_method(MixCSE, path, num_mixed=2, matryoshka_dims=[32, 8]),
}


def build(name: str, path: str, dropout: bool = False, dtype: torch.dtype = torch.float32) -> SentEmbMethod:
    torch.manual_seed(0)
    method = METHODS[name](path)
    if not dropout:
        for module in method.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
    if hasattr(method, "cluster_state"):  # clustering on: the loss uses centroids and the BML
        method.cluster_state.initialize_(torch.randn(2, method.output_size))
    return method.to(dtype)


def examples(method: SentEmbMethod, supervised: bool = False) -> list[dict[str, list[int]]]:
    if not supervised:
        return training_examples(method, WORDS)
    ids = method.encoder.format.sentence_ids(WORDS[:4])
    return [{"sent0": ids[i], "sent1": ids[(i + 1) % 4], "hard_neg": ids[(i + 2) % 4]} for i in range(4)]


def batch_for(name: str, method: SentEmbMethod) -> dict:
    torch.manual_seed(1)  # ConPVP samples prototype templates
    return method.collate(examples(method, supervised=name == "simcse_sup"))


def gradients(method: SentEmbMethod, batch: dict, chunk: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    method.zero_grad(set_to_none=True)
    method.hparams.grad_cache_chunk = chunk
    if chunk:
        loss, _ = method.grad_cache_backward(batch)
    else:
        loss, _ = method.step_loss(batch)
        loss.backward()
    grads = {n: torch.zeros_like(p) if p.grad is None else p.grad.clone() for n, p in method.named_parameters()
             if p.requires_grad}
    return loss.detach(), grads


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([(got[k] - want[k]).flatten() for k in want])
    return float(diff.norm() / torch.cat([want[k].flatten() for k in want]).norm())


@pytest.mark.parametrize("name", list(METHODS))
def test_cached_gradient_equals_one_forward(name: str, tiny_bert: str) -> None:
    method = build(name, tiny_bert, dtype=torch.float64)
    batch = batch_for(name, method)
    if name.removesuffix("_matryoshka") in ("promptbert", "conpvp", "clusterns_prompt"):
        assert batch["features"]["input_ids"].size(0) > batch["batch_size"] * batch["num_views"]  # bias rows
    assert ("mlm" in batch) == ("_mlm" in name)
    loss, want = gradients(method, batch, 0)
    cached_loss, got = gradients(method, batch, CHUNK)
    torch.testing.assert_close(cached_loss, loss, rtol=1e-12, atol=0)
    assert relative_error(got, want) < 1e-10, name


# rounding, which the methods before them already show for their encoders and losses
FP32_METHODS = [name for name in METHODS if name not in ("sncse", "sbert", "consert_joint")]


@pytest.mark.parametrize("family", ["tiny_bert", "tiny_roberta"])
@pytest.mark.parametrize("name", FP32_METHODS)
def test_fp32_cached_gradient_is_as_close_to_float64(name: str, family: str, request) -> None:
    """In fp32 the two paths sum in different orders, so they differ by rounding (1e-7 to 2e-4 relative
    on these tiny random models), never more than the uncached path's own distance from float64
    (3e-6 to 3e-3): caching adds no error of its own."""
    method = build(name, request.getfixturevalue(family))
    batch = batch_for(name, method)
    _, want32 = gradients(method, batch, 0)
    _, got32 = gradients(method, batch, CHUNK)
    _, truth = gradients(method.double(), batch, 0)
    error = relative_error({k: v.double() for k, v in want32.items()}, truth)
    assert relative_error({k: v.double() for k, v in got32.items()}, truth) < 2 * error + 1e-6


@pytest.mark.parametrize("name", ["simcse_mlm", "dcpcse_mlm"])
def test_second_forward_replays_the_first_forward_dropout(name: str, tiny_bert: str) -> None:
    method = build(name, tiny_bert, dropout=True)
    batch = batch_for(name, method)
    outputs: list[torch.Tensor] = []
    hook = method.encoder.register_forward_hook(lambda module, args, out: outputs.append(out.detach().clone()))
    method.hparams.grad_cache_chunk = CHUNK
    method.grad_cache_backward(batch)
    hook.remove()
    first, second = outputs[: len(outputs) // 2], outputs[len(outputs) // 2 :]
    assert len(first) == len(second) == -(-batch["features"]["input_ids"].size(0) // CHUNK)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    # the test can fail: without the replay, a forward of the same rows draws other masks
    rows = {k: v[:CHUNK] for k, v in batch["features"].items() if k not in method.encoder.combine_keys}
    assert not torch.allclose(method.encoder(rows), first[0])


class RecordGradients(Callback):
    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.requires_grad})


def fit_steps(method: SentEmbMethod, examples_: list, steps: int, callbacks: tuple = (),
              **trainer_args) -> RecordGradients:
    record = RecordGradients()
    loader = DataLoader(examples_, batch_size=4, collate_fn=method.collate)
    trainer = Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      callbacks=[record, *callbacks], **trainer_args)
    trainer.fit(method, loader)
    return record


def test_trainer_step_matches_automatic_optimization(tiny_bert: str) -> None:
    """Manual optimization under caching: same gradients, same scheduled learning rate."""
    runs = {}
    for chunk in (0, CHUNK):
        torch.manual_seed(0)
        method = build_method(SimCSE, tiny_bert, warmup_steps=1, lr=1e-3, grad_cache_chunk=chunk, mlm_weight=0.1)
        for module in method.modules():
            if isinstance(module, nn.Dropout):
                module.p = 0.0
        record = fit_steps(method, examples(method), steps=2)
        runs[chunk] = (record.grads, method.lr_schedulers().get_last_lr(), method.global_step)
    (want, want_lr, want_steps), (got, got_lr, got_steps) = runs[0], runs[CHUNK]
    assert got_steps == want_steps == 2 and got_lr == want_lr
    for g, w in zip(got, want, strict=True):
        assert relative_error(g, w) < 1e-5  # step 2 starts from step 1's AdamW update


class RecordSteppedGradients(Callback):
    """The gradients the optimizer stepped with (clipped), read after the step: neither optimization
    zeroes them before the next batch."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.requires_grad})


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_trainer_gradient_clipping_applies_under_caching(algorithm: str, tiny_bert: str) -> None:
    """`trainer.gradient_clip_val` under caching clips as automatic optimization does: the same clipped
    gradients at every step; and the clipping is active (the unclipped gradients differ)."""
    runs = {}
    for chunk in (0, CHUNK):
        method = build("simcse", tiny_bert, dtype=torch.float64)  # exact to 1e-5 (see the module)
        method.hparams.update(lr=1e-3, grad_cache_chunk=chunk)
        stepped = RecordSteppedGradients()
        unclipped = fit_steps(method, examples(method), steps=2, gradient_clip_val=1e-5,
                              gradient_clip_algorithm=algorithm, callbacks=[stepped])
        runs[chunk] = stepped.grads, unclipped.grads
    (want, want_unclipped), (got, got_unclipped) = runs[0], runs[CHUNK]
    assert len(got) == len(want) == 2
    for g, w, raw in zip(got, want, want_unclipped, strict=True):
        assert relative_error(g, w) < 1e-5
        assert relative_error(raw, w) > 0.1  # clipped well below the raw gradient
    for g, w in zip(got_unclipped, want_unclipped, strict=True):
        assert relative_error(g, w) < 1e-5



@pytest.mark.parametrize("chunk", [0, CHUNK])
def test_fp16_loss_scaling_unscales_before_clipping(chunk: int, tiny_bert: str) -> None:
    """Under `16-mixed` (the SimCSE-family seed rows' precision) with the clip every reference applies, the step
    goes through the GradScaler with the gradients unscaled before they are clipped, cached or not: the step
    sees global norm = the clip value, not the clip value / the loss scale (and fused AdamW, which unscales
    inside its step, made Lightning refuse the clip). Lightning turns `16-mixed` on CPU into bf16; the plugin
    given here keeps fp16's scaler on CPU."""
    torch.manual_seed(0)
    method = build_method(SimCSE, tiny_bert, lr=1e-3, grad_cache_chunk=chunk)
    scale, clip = 2.0**10, 1e-3
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=scale))
    stepped = RecordSteppedGradients()
    raw = fit_steps(method, examples(method), steps=2, plugins=[plugin], gradient_clip_val=clip,
                    callbacks=[stepped])
    assert plugin.scaler.get_scale() == scale  # no step skipped for overflow

    def global_norm(grads: dict[str, torch.Tensor]) -> float:
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads.values()]))

    assert len(stepped.grads) == 2
    for before, after in zip(raw.grads, stepped.grads, strict=True):
        assert global_norm(before) > 10 * clip  # unscaled before the clip, and well above it
        assert global_norm(after) == pytest.approx(clip, rel=1e-3)


def test_gradient_accumulation_is_refused_under_caching(tiny_bert: str) -> None:
    method = build_method(SimCSE, tiny_bert, grad_cache_chunk=CHUNK)
    with pytest.raises(SentEmbUserError, match="grad_cache_chunk"):
        fit_steps(method, examples(method), steps=1, accumulate_grad_batches=2)


class SaveRankZeroGradients(RecordGradients):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            torch.save(self.grads, self.path)


# simcse_lora: tests.test_lora's LoRA SimCSE (random adapters), its fit in this launch rather than one of its own
DDP_NAMES = ["simcse", "promptbert_matryoshka", "simcse_lora"]


def ddp_method(name: str, backbone: str) -> SentEmbMethod:
    """METHODS[name] in float64, or for "simcse_lora" tests.test_lora's LoRA SimCSE."""
    if name == "simcse_lora":
        from tests.test_lora import lora_simcse

        return lora_simcse(backbone)
    return build(name, backbone, dtype=torch.float64)


def ddp_fit(backbone: str, out: str, *names: str) -> None:
    """One cached step of each METHODS[name] on each of 2 CPU processes (forked ranks, tests/launch.py), one fit
    after the other in the same process group. Rank 0 writes out/<name>.pt."""
    for name in names:
        method = ddp_method(name, backbone)
        method.hparams.grad_cache_chunk = CHUNK
        trainer = Trainer(max_steps=1, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          limit_val_batches=0, callbacks=[SaveRankZeroGradients(str(Path(out) / f"{name}.pt"))])
        trainer.fit(method, DataLoader(examples(method), batch_size=4, collate_fn=method.collate))


@pytest.fixture(scope="module")
def ddp_gradients(tiny_bert, tmp_path_factory) -> Path:
    """The folder where the 2-process fits of DDP_NAMES wrote their synced cached gradients."""
    out = tmp_path_factory.mktemp("ddp_grads")
    fork_ranks(ddp_fit, tiny_bert, str(out), *DDP_NAMES)
    return out


@pytest.mark.slow
def test_ddp_cached_gradient_equals_one_process(tiny_bert: str, ddp_gradients: Path) -> None:
    """2 CPU processes (gloo), 4 sentences each: the synced cached gradient is the one-process
    gradient of the 8-sentence global batch (InfoNCE is invariant to the order of the batch), also
    with Matryoshka truncations (each all-gathers its truncated rows), and with LoRA (only the adapters' and
    the MLP's gradients, synced). One test for every method: their fits share one launch, which a test a
    method would repeat on each xdist worker that got one."""
    for name in DDP_NAMES:
        (got,) = torch.load(ddp_gradients / f"{name}.pt")
        method = ddp_method(name, tiny_bert)
        _, want = gradients(method, method.collate(examples(method)), 0)
        if name == "simcse_lora":
            assert set(got) == set(want) and all(".lora_" in k or k.startswith("mlp.") for k in want)
        assert relative_error(got, want) < 1e-10, name

