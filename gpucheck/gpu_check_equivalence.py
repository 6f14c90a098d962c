"""gpu-check's equivalence part: the fast paths against the plain ones on this device, loss and every
gradient of one batch (dropout 0), under bf16 autocast and in fp32 with TF32 off: the padding-free forward
against the padded one (`auto`, and the nested kernel forced), gradient caching against the full batch."""

from __future__ import annotations

import math
from typing import Any, Callable

from gpu_check_common import Context, build_method, kernels_text, one_line, outcome

# Relative tolerances of the equivalence checks: |Δloss| / max(1, |loss|) and ‖Δgradient‖ / ‖gradient‖.
# bf16 keeps 8 significant bits (unit roundoff 2⁻⁹ ≈ 2e-3) and two exact paths round differently in every
# layer; a real fault (a wrong mask, position or row) moves the loss by ≥ 0.1 and the gradient by O(1).
# The fp32 rows (TF32 off) are the sharp check.
TOLERANCES = {"bf16": {"loss": 5e-2, "gradient": 1.5e-1}, "fp32": {"loss": 1e-4, "gradient": 1e-3}}


def equivalence(ctx: Context) -> dict:
    """Padding-free against padded forward, and gradient caching against the full batch, on one batch
    with dropout 0, under bf16 autocast and in fp32: loss and gradient of every trainable parameter."""
    import torch

    from lightning_sentemb.encoders.kernels import kernels_ran, reset_kernels_ran
    from lightning_sentemb.methods import PromptBERT, SimCSE

    ctx.need_models()
    bert, decoder = ctx.bert, ctx.decoder
    lora = ctx.lora(dropout=0.0)
    packed = "padding-free vs padded", {"attn_implementation": None}, {"attn_implementation": "padded"}
    nested = ("padding-free (nested kernel) vs padded", {"attn_implementation": None, "kernel": "nested"},
              {"attn_implementation": "padded"})
    cached = f"grad cache (chunk {ctx.sizes.chunk}) vs full batch", {"grad_cache_chunk": ctx.sizes.chunk}, {}
    cases: list[tuple[str, Callable[..., Any], tuple[str, dict, dict]]] = [
        ("SimCSE, bert-base", lambda **kw: build_method(SimCSE, bert, dropout=0.0, **kw), packed),
        ("SimCSE, bert-base", lambda **kw: build_method(SimCSE, bert, dropout=0.0, **kw), nested),
        ("PromptBERT, bert-base", lambda **kw: build_method(PromptBERT, bert, dropout=0.0, **kw), packed),
        ("SimCSE (last token), decoder", lambda **kw: build_method(SimCSE, decoder, dropout=0.0, **kw), packed),
        ("SimCSE, bert-base", lambda **kw: build_method(SimCSE, bert, dropout=0.0, **kw), cached),
        ("PromptEOL + LoRA, decoder", lambda **kw: build_method(PromptBERT, decoder, dropout=0.0, mlp="none",
                                                                denoise_train=False, lora=lora, **kw), cached),
    ]
    torch.set_float32_matmul_precision("highest")  # TF32 off: the fp32 rows are fp32
    rows = []
    for precision in ("bf16", "fp32"):
        for index, (case, build, (comparison, fast, plain)) in enumerate(cases):
            row: dict[str, Any] = {"case": case, "comparison": comparison, "precision": precision}
            if ctx.smoke and precision == "bf16" and index > 1:
                continue  # the rehearsal: bf16 (emulated on a CPU without bf16 instructions) on SimCSE only
            if fast.get("kernel") == "nested" and precision == "bf16" and ctx.device.type != "cuda":
                rows.append({**row, "result": "skipped: on the CPU the nested kernel is torch's bf16 math kernel, "
                                               "checked against fp32 in the kernels part"})
                continue
            try:
                reset_kernels_ran()
                loss_fast, grads_fast = loss_and_gradients(ctx, build, fast, precision)
                row["kernels"] = kernels_text(kernels_ran())
                loss_plain, grads_plain = loss_and_gradients(ctx, build, plain, precision)
                loss_error = abs(loss_fast - loss_plain) / max(1.0, abs(loss_plain))
                difference = sum(float((a - b).square().sum()) for a, b in zip(grads_fast, grads_plain, strict=True))
                norm = sum(float(b.square().sum()) for b in grads_plain)
                # both zero (every embedding identical: a degenerate random model) agree
                gradient_error = math.sqrt(difference / norm) if norm > 0 else (0.0 if difference == 0 else math.inf)
                tolerance = TOLERANCES[precision]
                ok = loss_error <= tolerance["loss"] and gradient_error <= tolerance["gradient"]
                row.update({"loss (fast)": loss_fast, "loss (plain)": loss_plain, "loss rel. error": loss_error,
                            "gradient norm": math.sqrt(norm), "gradient rel. error": gradient_error,
                            "result": "pass" if ok else "fail: beyond tolerance"})
            except Exception as error:
                row["result"] = f"fail: {one_line(error)}"
            grads_fast = grads_plain = None
            ctx.free()
            rows.append(row)
            ctx.keep_rows(rows)
    return outcome(rows)


def loss_and_gradients(ctx: Context, build: Callable[..., Any], switches: dict, precision: str) -> tuple[float, list]:
    """Loss and the gradients (fp32, on the device) of one batch of `ctx.sentences`, the method built
    from seed 0 with `switches` (`kernel`: the packed attention kernel); by gradient caching when they set
    `grad_cache_chunk`."""
    import torch
    from methods import prepare

    torch.manual_seed(0)
    switches = dict(switches)
    kernel = switches.pop("kernel", "auto")
    method = build(**switches).to(ctx.device)
    method.encoder.packed_kernel = kernel
    batch, _, _ = prepare(method, ctx.sentences[: ctx.sizes.check_batch])
    torch.manual_seed(0)
    with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
        if switches.get("grad_cache_chunk"):
            loss = method.grad_cache_backward(batch)[0]
        else:
            loss = method.step_loss(batch)[0]
            loss.backward()
    trainable = [p for p in method.parameters() if p.requires_grad]
    grads = [p.grad.float() if p.grad is not None else torch.zeros_like(p, dtype=torch.float32) for p in trainable]
    return float(loss), grads

