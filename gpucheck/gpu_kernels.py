"""gpu-check's first part: every packed-attention kernel (`lightning_sentemb.encoders.kernels`) forced on
bf16 packed rows of 1 to 128 tokens, forward and backward, against fp32 attention run sentence by sentence
(`gpu_attention.reference`).

A kernel this device or torch cannot run is a skipped row with the reason (`unavailable`). The relative
error is ‖kernel − reference‖ / ‖reference‖, of the output and of the gradients of query, key, value
(and the prefix) under a fixed random cotangent; bf16 keeps 8 significant bits, so `TOLERANCE` is a few
times its unit roundoff, while a wrong mask, offset or head grouping makes errors of order 1.

The cases with attention dropout (BERT-family training; DCPCSE's prefix too) check what dropout must do:
one draw differs from the reference (`DROPPED`: dropout was applied) and the same seed draws the same
output; then (`gpu_dropout`) `varlen`, which calls aten's flash op, against the reference under the op's
own dropout mask, exactly; `aligned` and `nested`, which cannot return their masks, by the 1 / (1 − p)
rescale on values of 1 and by the mean of `DRAWS` draws (output and gradients: inverted dropout is
unbiased; within `dropout_tolerance`, a loose check: its noise is about sqrt(p / (1 − p) / draws) of the
reference, 0.021 at p 0.1 over 256 draws). In the smoke run on a CPU, `varlen`'s dropout rows run through
`gpu_dropout.flash_stand_in`, so the exact comparison is exercised without a GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from gpu_attention import (
    DRAWS,
    RESCALE_DRAWS,
    SMOKE_DRAWS,
    SMOKE_RESCALE_DRAWS,
    TOLERANCE,
    reference,
    relative_error,
    sentence_probabilities,
)
from gpu_dropout import against_own_mask, flash_stand_in, recorded_flash_calls, rescale_tolerance

from lightning_sentemb.encoders.kernels import (
    KERNEL_NAMES,
    Packing,
    TorchFeatures,
    installed_flash_forward,
    run_kernel,
    torch_features,
)
from lightning_sentemb.encoders.layout import TokenLayout

DROPPED = 2e-2
# name: (query heads, key/value heads, causal, sliding window, prefix length, attention dropout)
CASES: dict[str, tuple[int, int, bool, int | None, int, float]] = {
    "bidirectional": (4, 4, False, None, 0, 0.0),
    "causal": (4, 4, True, None, 0, 0.0),
    "causal + window 16": (4, 4, True, 16, 0, 0.0),
    "GQA 14/2, causal": (14, 2, True, None, 0, 0.0),
    "prefix 4, bidirectional": (4, 4, False, None, 4, 0.0),
    "bidirectional, dropout 0.1": (4, 4, False, None, 0, 0.1),
    "GQA 14/2, causal, dropout 0.1": (14, 2, True, None, 0, 0.1),
    "prefix 4, bidirectional, dropout 0.1": (4, 4, False, None, 4, 0.1),
}
LENGTHS = [1, 2, 3, 7, 16, 31, 64, 100, 128]
SMOKE_LENGTHS = [1, 2, 5, 9, 16]
STAND_IN = "a CPU stand-in of the flash op: checks the comparison, not a kernel"


def unavailable(kernel: str, features: TorchFeatures, device: torch.device, causal: bool, window: int | None,
                prefix: bool, dropout: float = 0.0) -> str | None:
    """Why `kernel` cannot run this case on this device and torch (bf16 inputs), or None."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if kernel == "varlen":
        if dropout and not features.flash_dropout:
            return f"torch {torch.__version__} has no aten._flash_attention_forward"
        if not dropout and not features.varlen:
            return f"torch {torch.__version__} has no usable torch.nn.attention.varlen.varlen_attn"
        if capability is None or capability < (8, 0):
            return "flash needs a CUDA GPU of sm80 or newer"
        if window and not features.varlen_window:
            return f"varlen_attn of torch {torch.__version__} takes no window_size"
        if prefix and causal:
            return "a prefix on a causal layer: keys longer than queries (auto runs aligned)"
    if kernel == "nested":
        if not features.nested:
            return f"torch {torch.__version__} has no nested jagged tensors with max_seqlen"
        if window:
            return "nested tensors take no sliding window"
        if capability is None and causal:
            return "causal attention on nested tensors needs CUDA (the CPU math kernel is bidirectional only)"
        if capability is not None and capability < (8, 0):
            return "bf16 needs sm80 or newer"
    return None


def dropout_tolerance(dropout: float, draws: int) -> float:
    """`TOLERANCE` plus three times the relative noise of a mean over `draws` dropout draws."""
    return TOLERANCE + 3 * math.sqrt(dropout / (1 - dropout) / draws)


@dataclass
class Trial:
    """One kernel on one case's random bf16 inputs (query, key, value and the prefix's key, value) and their
    fp32 copies, the reference's output and gradients under `cotangent`."""

    kernel: str
    case: tuple[int, int, bool, int | None, int, float]
    lengths: list[int]
    layout: TokenLayout
    scale: float
    inputs: list[torch.Tensor]
    fp32: list[torch.Tensor]
    cotangent: torch.Tensor
    theirs: torch.Tensor
    theirs_grads: tuple[torch.Tensor, ...]

    @property
    def prefix(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return (self.inputs[3], self.inputs[4]) if len(self.inputs) > 3 else None

    def attention(self, seed: int, value: torch.Tensor | None = None, prefix_value: torch.Tensor | None = None):
        """The kernel's output from `seed` (other values than the inputs' when given)."""
        _, _, causal, window, _, dropout = self.case
        query, key = self.inputs[:2]
        prefix = self.prefix
        if prefix is not None and prefix_value is not None:
            prefix = (prefix[0], prefix_value)
        torch.manual_seed(seed)
        return run_kernel(Packing(self.layout, self.kernel), query, key, self.inputs[2] if value is None else value,
                          self.scale, dropout, causal, window, None, prefix)

    def draw(self, seed: int) -> list[torch.Tensor]:
        """The kernel's output (fp32) and the gradients of the inputs under `cotangent`."""
        out = self.attention(seed)
        grads = torch.autograd.grad((out.float() * self.cotangent).sum(), self.inputs)
        return [out.detach().float(), *grads]


def trial(kernel: str, case: str, device: torch.device, lengths: list[int], head_dim: int) -> Trial:
    heads, kv_heads, causal, window, prefix_len, _ = CASES[case]
    generator = torch.Generator(device="cpu").manual_seed(0)
    tokens, batch = sum(lengths), len(lengths)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device, torch.bfloat16).requires_grad_()

    inputs = [leaf(tokens, heads, head_dim), leaf(tokens, kv_heads, head_dim), leaf(tokens, kv_heads, head_dim)]
    inputs += [leaf(batch, kv_heads, prefix_len, head_dim) for _ in range(2)] if prefix_len else []
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    cotangent = torch.randn(tokens, heads, head_dim, generator=generator).to(device)
    fp32 = [t.detach().float().requires_grad_() for t in inputs]
    scale = head_dim ** -0.5
    theirs = reference(*fp32[:3], lengths, causal, window, (fp32[3], fp32[4]) if prefix_len else None, scale)
    theirs_grads = torch.autograd.grad((theirs * cotangent).sum(), fp32)
    return Trial(kernel, CASES[case], lengths, TokenLayout.from_mask(mask).to(device), scale, inputs, fp32, cotangent,
                 theirs.detach(), theirs_grads)


def check(kernel: str, case: str, device: torch.device, lengths: list[int], head_dim: int, draws: int = DRAWS,
          flash: Any = None) -> dict[str, Any]:
    """One kernel on one case: forward and backward errors against `reference`; with dropout, the checks
    of the module docstring. `flash`: the op `varlen` calls with dropout (None: the installed one)."""
    row: dict[str, Any] = {"kernel": kernel, "case": case}
    run = trial(kernel, case, device, lengths, head_dim)
    dropout = run.case[-1]
    if not dropout:
        ours, *ours_grads = run.draw(0)
        return {**row, **errors(ours, ours_grads, run, TOLERANCE, [])}
    if kernel != "varlen":
        first = run.draw(0)
        return {**row, **without_mask(run, first, draws, basic_dropout_notes(first[0], run.draw(0)[0], run.theirs))}
    with recorded_flash_calls(flash or installed_flash_forward()) as calls:  # the op's calls, replayed below
        first, again = run.draw(0), run.draw(0)
        if not calls:
            return {**row, "result": "fail: the varlen kernel did not call the flash op"}
        causal, window = run.case[2:4]
        own = against_own_mask(calls[0], flash or installed_flash_forward(), 0, first, run.fp32, run.cotangent,
                               lengths, (causal, window, run.scale, dropout))
        notes = [*basic_dropout_notes(first[0], again[0], run.theirs), *own.pop("notes")]
        if "dropped share" in own and not notes:
            return {**row, "dropout check": "the op's own mask", **own, "result": "pass"}
        if "dropped share" in own:  # the checks without a mask follow: a wrong kernel, or a misread mask?
            own["own mask: forward, backward rel. error"] = (f"{own.pop('forward rel. error'):.3g}, "
                                                             f"{own.pop('backward rel. error'):.3g}")
        return {**row, **own, **without_mask(run, first, draws, notes)}  # (or no mask came back)


def without_mask(run: Trial, first: list[torch.Tensor], draws: int, notes: list[str]) -> dict[str, Any]:
    """The dropout checks of a kernel that cannot return its mask: the rescale on values of 1, and the
    mean of `draws` draws (`first` the first) against the reference."""
    rescale_draws = RESCALE_DRAWS if draws == DRAWS else SMOKE_RESCALE_DRAWS
    mean, tolerance = rescale_mean(run, rescale_draws)
    if abs(mean - 1) > tolerance:
        notes = [*notes, f"values of 1 gave {mean:.4f} on average, not 1 ± {tolerance:.3f}: the 1/(1-p) rescale?"]
    totals = first
    for seed in range(1, draws):
        totals = [total + part for total, part in zip(totals, run.draw(seed), strict=True)]
    ours, *ours_grads = (total / draws for total in totals)
    return {"dropout check": f"rescale on values 1 ({rescale_draws} draws), mean of {draws} draws",
            "mean output on values 1": mean, "its tolerance": tolerance,
            **errors(ours, ours_grads, run, dropout_tolerance(run.case[-1], draws), notes)}


def rescale_mean(run: Trial, draws: int) -> tuple[float, float]:
    """The kernel's mean output on values of 1 over `draws` draws (each output the kept
    probabilities' sum times 1 / (1 − p)), and its tolerance around 1 (`rescale_tolerance`)."""
    causal, window, dropout = run.case[2], run.case[3], run.case[5]
    with torch.no_grad():
        ones, ones_prefix = torch.ones_like(run.inputs[2]), torch.ones_like(run.inputs[4]) if run.prefix else None
        mean = sum(float(run.attention(seed, ones, ones_prefix).float().mean()) for seed in range(draws))
        probs = sentence_probabilities(run.fp32[0], run.fp32[1], run.lengths, causal, window,
                                       run.fp32[3] if run.prefix else None, run.scale)
    return mean / draws, rescale_tolerance(probs, dropout, draws)


def basic_dropout_notes(first: torch.Tensor, again: torch.Tensor, theirs: torch.Tensor) -> list[str]:
    """Failures of the two checks every kernel's dropout passes: the same seed draws the same output, and a
    draw differs from the attention without dropout."""
    notes = [] if torch.equal(first, again) else ["the same seed drew another output"]
    return notes + (["no dropout applied"] if relative_error(first, theirs) < DROPPED else [])


def errors(ours: torch.Tensor, ours_grads: list[torch.Tensor], run: Trial, tolerance: float,
           notes: list[str]) -> dict[str, Any]:
    """The row's forward and backward errors against the reference and its result (`notes`: failures found
    before)."""
    forward = relative_error(ours, run.theirs)
    backward = max(relative_error(a, b) for a, b in zip(ours_grads, run.theirs_grads, strict=True))
    if not (forward <= tolerance and backward <= tolerance and math.isfinite(forward + backward)):
        notes = [*notes, "beyond tolerance"]
    return {"forward rel. error": forward, "backward rel. error": backward,
            "result": f"fail: {'; '.join(notes)}" if notes else "pass"}


def kernel_rows(device: torch.device, smoke: bool) -> list[dict[str, Any]]:
    """Every kernel on every case (a failure is its row's result, the others still run). A kernel the device
    cannot run is skipped, but for `varlen` with dropout in the smoke run: `flash_stand_in` then stands in."""
    lengths, head_dim, draws = (SMOKE_LENGTHS, 16, SMOKE_DRAWS) if smoke else (LENGTHS, 64, DRAWS)
    rows = []
    for kernel in KERNEL_NAMES:
        for case in CASES:
            heads, kv_heads, causal, window, prefix_len, dropout = CASES[case]
            reason = unavailable(kernel, torch_features(), device, causal, window, prefix_len > 0, dropout)
            stand_in = smoke and device.type == "cpu" and kernel == "varlen" and dropout > 0 and not window
            try:
                if reason is not None and not stand_in:
                    rows.append({"kernel": kernel, "case": case, "result": f"skipped: {reason}"})
                    continue
                row = check(kernel, case, device, lengths, head_dim, draws, flash_stand_in if stand_in else None)
                if stand_in and row["result"] == "pass":
                    row["result"] = f"pass ({STAND_IN})"
                rows.append(row)
            except Exception as error:  # one kernel failing must not hide the others
                rows.append({"kernel": kernel, "case": case, "result": f"fail: {type(error).__name__}: {error}"[:300]})
    return rows


def kernels_part(ctx: Any) -> dict[str, Any]:
    """gpu-check's part: `kernel_rows` on the context's device, and what this torch offers."""
    from gpu_check_common import outcome

    return outcome(kernel_rows(ctx.device, ctx.smoke), [f"this torch: {torch_features()}"])
