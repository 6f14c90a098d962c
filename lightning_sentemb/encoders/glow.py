"""Glow on a vector: BERT-flow's normalizing flow (Li et al., EMNLP 2020), as its reference
(github.com/bohanli/BERT-flow, `flow/glow_ops_1x1.py`) builds it on the pooled embedding seen as a
1×1 image, where every 1×1 convolution is a matrix product.

`levels` levels of `depth` steps (actnorm → invertible mixing → coupling); after every level but the
last, a split: the second half of the channels leaves as part of the latent, the first half goes on.
The latent is [split₀, split₁, …, top] (the reference's `concat(eps + [z])`; its split priors are
fixed standard normals, so eps is the split half itself), and

    log p(x) = log N(latent; 0, I) + Σ log |det ∂step/∂x|.

What the reference does, kept here:
- actnorm: y = (x + b) · exp(3·s), b and s initialized from the first batch (data-dependent: b = −mean,
  s = log(1 / (rms(x + b) + 1e-6)) / 3), in the flow steps and inside the coupling networks alike;
- coupling network: linear (weights N(0, 0.05²), no bias) + actnorm + ReLU, twice, `coupling_width`
  wide; then a zero-initialized linear with a bias and a per-output log-scale (×3): every coupling
  starts as the identity;
- `mixing`: "reverse", the reference's configs (`permutation: true`): the channels reversed, log-det 0;
  or "lu", Glow's invertible 1×1 convolution W = P·L·(U + diag(sign(s)·exp(log s))) from the LU
  decomposition of a random rotation (P and sign(s) fixed), log-det Σ log s;
- `coupling`: "additive", the reference's configs: x₂ + NN(x₁), log-det 0; or "affine", Glow's:
  (x₂ + t)·σ(h + 2) with t, h the even and odd outputs of NN(x₁), log-det Σ log σ(h + 2).
Its coupling dropout (0 in every config it ships) is not offered.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from ..errors import SentEmbUserError
from .started import StartedOnce

Coupling = Literal["additive", "affine"]
Mixing = Literal["reverse", "lu"]
LOGSCALE_FACTOR = 3.0  # the reference's `logscale_factor`: log-scales are stored divided by it


class ActNorm(nn.Module):
    """y = (x + b) · exp(3·s) per channel; `initializing` makes the next forward set b and s from its batch."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(channels))
        self.logs = nn.Parameter(torch.zeros(channels))
        self.initializing = False

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(y, log-det, the same for every row)."""
        if self.initializing:
            with torch.no_grad():
                self.bias.copy_(-x.mean(0))
                rms = (x + self.bias).pow(2).mean(0).sqrt()
                self.logs.copy_(torch.log(1.0 / (rms + 1e-6)) / LOGSCALE_FACTOR)
        logs = self.logs * LOGSCALE_FACTOR
        return (x + self.bias) * logs.exp(), logs.sum()


class LinearActNorm(nn.Module):
    """The reference's `conv` with actnorm: a bias-free linear layer, N(0, 0.05²), then actnorm."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.linear = nn.Linear(inputs, outputs, bias=False)
        nn.init.normal_(self.linear.weight, std=0.05)
        self.actnorm = ActNorm(outputs)

    def forward(self, x: Tensor) -> Tensor:
        return self.actnorm(self.linear(x))[0]


class ZeroLinear(nn.Module):
    """The reference's zero-initialized last `conv`: (x·Wᵀ + b) · exp(3·s), all three zeros at start."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(outputs, inputs))
        self.bias = nn.Parameter(torch.zeros(outputs))
        self.logs = nn.Parameter(torch.zeros(outputs))

    def forward(self, x: Tensor) -> Tensor:
        return (x @ self.weight.T + self.bias) * (self.logs * LOGSCALE_FACTOR).exp()


class CouplingLayer(nn.Module):
    """x₁ unchanged; x₂ shifted (additive) or shifted and scaled (affine) by a network of x₁."""

    def __init__(self, channels: int, width: int, coupling: Coupling) -> None:
        super().__init__()
        half = channels // 2
        self.affine = coupling == "affine"
        self.net = nn.Sequential(LinearActNorm(half, width), nn.ReLU(), LinearActNorm(width, width), nn.ReLU(),
                                 ZeroLinear(width, channels if self.affine else channels - half))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        x1, x2 = x.chunk(2, dim=-1)
        out = self.net(x1)
        if not self.affine:
            return torch.cat([x1, x2 + out], dim=-1), x.new_zeros(())
        scale = torch.sigmoid(out[:, 1::2] + 2.0)
        return torch.cat([x1, (x2 + out[:, 0::2]) * scale], dim=-1), scale.log().sum(-1)


class ReverseMixing(nn.Module):
    """The channels in reverse order (the reference's `permutation: true`)."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x.flip(-1), x.new_zeros(())


class LUMixing(nn.Module):
    """Glow's invertible 1×1 convolution, LU-parameterized, from a random rotation (torch's RNG)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        rotation = torch.linalg.qr(torch.rand(channels, channels, dtype=torch.float64))[0]
        p, lower, upper = torch.linalg.lu(rotation)
        s = upper.diagonal()
        self.register_buffer("p", p.float())
        self.register_buffer("sign_s", s.sign().float())
        self.lower = nn.Parameter(lower.float())
        self.upper = nn.Parameter(upper.triu(1).float())
        self.log_s = nn.Parameter(s.abs().log().float())

    def weight(self) -> Tensor:
        eye = torch.eye(len(self.log_s), dtype=self.lower.dtype, device=self.lower.device)
        lower = self.lower.tril(-1) + eye
        upper = self.upper.triu(1) + torch.diag(self.sign_s * self.log_s.exp())
        return self.p @ lower @ upper

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x @ self.weight(), self.log_s.sum()


class FlowStep(nn.Module):
    def __init__(self, channels: int, width: int, coupling: Coupling, mixing: Mixing) -> None:
        super().__init__()
        self.actnorm = ActNorm(channels)
        self.mixing = LUMixing(channels) if mixing == "lu" else ReverseMixing()
        self.coupling = CouplingLayer(channels, width, coupling)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logdet = x.new_zeros(x.shape[0])
        for layer in (self.actnorm, self.mixing, self.coupling):
            x, step_logdet = layer(x)
            logdet = logdet + step_logdet
        return x, logdet


def normal_log_prob(z: Tensor) -> Tensor:
    """Σ log N(zᵢ; 0, 1) per row."""
    return -0.5 * (z.pow(2) + math.log(2 * math.pi)).sum(-1)


class Glow(StartedOnce):
    """`forward(x)` → (latent, log p(x)) per row; `initialize_(x)` is the data-dependent start.

    `initialized` (a buffer, so checkpoints carry it) says whether `initialize_` ran, `is_initialized` its
    host copy (`StartedOnce`)."""

    def __init__(self, dim: int, levels: int = 3, depth: int = 3, coupling_width: int = 32,
                 coupling: Coupling = "additive", mixing: Mixing = "reverse") -> None:
        super().__init__()
        if levels < 1 or depth < 1 or dim % 2**levels:
            raise SentEmbUserError(f"model.init_args.flow_levels {levels}, flow_depth {depth}: a flow of {levels} "
                                   f"level(s) halves the {dim} dimensions {levels} time(s) and needs depth >= 1; "
                                   f"choose levels with {dim} divisible by 2**levels")
        self.levels = nn.ModuleList(
            nn.ModuleList(FlowStep(dim >> level, coupling_width, coupling, mixing) for _ in range(depth))
            for level in range(levels)
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logdet = x.new_zeros(x.shape[0])
        latents = []
        for level, steps in enumerate(self.levels):
            for step in steps:
                x, step_logdet = step(x)
                logdet = logdet + step_logdet
            if level < len(self.levels) - 1:
                x, leaving = x.chunk(2, dim=-1)
                latents.append(leaving)
        latent = torch.cat([*latents, x], dim=-1)
        return latent, normal_log_prob(latent) + logdet

    @torch.no_grad()
    def initialize_(self, x: Tensor) -> None:
        """Every actnorm from the batch `x` (each from what reaches it), as the reference's first step."""
        actnorms = [module for module in self.modules() if isinstance(module, ActNorm)]
        for actnorm in actnorms:
            actnorm.initializing = True
        try:
            self(x)
        finally:
            for actnorm in actnorms:
                actnorm.initializing = False
        self.mark_initialized()
