"""`make bench`: LoRA and gradient checkpointing — peak memory, step time and `last.ckpt` size.

Unsupervised SimCSE (dropout views, batch `--batch` sentences of `--length` tokens, fp32 weights, AdamW
step included, through Lightning's Trainer) on a randomly initialized Qwen2-shaped decoder of about
100M parameters (`random_models.qwen2_decoder`: hidden 768, 12 layers, 12 query / 2 key-value heads,
FFN 2048, a BPE tokenizer trained on the wiki1m mirror), built here, last-token pooling: full
fine-tuning vs LoRA vs LoRA + gradient checkpointing. Each configuration runs in a fresh process (with
`--shape small`, a check that it runs, all share one: its memory columns then mean nothing); on
CPU peak memory is the process's peak RSS (`ru_maxrss`), on a GPU `torch.cuda.max_memory_allocated`.
The first step is an untimed warm-up. The checkpoint is the one a
fit writes (`trainer.save_checkpoint`: weights or adapters, optimizer and run state), so its size ratio
is about the trainable fraction: LoRA r 16 on all linear layers here (r 64, the PromptEOL reference's,
is 2.4% of a 7B model but 10% of this small one). Prints a Markdown table with the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from random_models import qwen2_decoder

from lightning_sentemb.methods.building import build_method

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
SHAPES = {  # Qwen2Config sizes over random_models.QWEN2_100M
    "100m": {},
    "small": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 128},
}
CONFIGS = {  # name: (lora, gradient checkpointing)
    "full fine-tuning": (False, False),
    "LoRA": (True, False),
    "LoRA + gradient checkpointing": (True, True),
}


def child(args: argparse.Namespace, name: str) -> dict:
    """The configuration `name` in this (fresh) process."""
    import torch
    from lightning.pytorch import Callback, Trainer
    from torch.utils.data import DataLoader

    from lightning_sentemb.methods import SimCSE

    lora, checkpointing = CONFIGS[name]
    torch.manual_seed(0)
    settings = {"r": args.r, "alpha": 2 * args.r, "dropout": 0.05, "target_modules": "all-linear"}
    method = build_method(SimCSE, args.backbone, pooler="last", mlp="none", lr=1e-5,
                          gradient_checkpointing=checkpointing, lora=settings if lora else None)
    vocab = range(1000, len(method.tokenizer))  # ordinary word pieces
    rng = random.Random(0)
    steps = args.steps + 1
    length = args.length - method.encoder.format.num_special_tokens
    examples = [{"sent0": rng.choices(vocab, k=length)} for _ in range(steps * args.batch)]
    cuda = torch.cuda.is_available()

    class StepClock(Callback):
        """Seconds of every training step after the first; resets the GPU's peak after the first."""

        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.start_bytes = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if cuda:
                torch.cuda.synchronize()
            if batch_idx == 1:
                self.start_bytes = torch.cuda.memory_allocated() if cuda else rss_bytes()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
            self.started = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if cuda:
                torch.cuda.synchronize()
            if batch_idx >= 1:
                self.seconds.append(time.perf_counter() - self.started)

    clock = StepClock()
    trainer = Trainer(max_steps=steps, accelerator="auto", devices=1, precision=args.precision, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, callbacks=[clock])
    trainer.fit(method, DataLoader(examples, batch_size=args.batch, collate_fn=method.collate))
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "last.ckpt"
        trainer.save_checkpoint(path)
        checkpoint_bytes = path.stat().st_size
    parameters = sum(p.numel() for p in method.parameters())
    trainable = sum(p.numel() for p in method.parameters() if p.requires_grad)
    return {"ms_per_step": 1000 * sum(clock.seconds) / len(clock.seconds), "peak_mib": peak / 2**20,
            "above_start_mib": (peak - clock.start_bytes) / 2**20, "checkpoint_mib": checkpoint_bytes / 2**20,
            "parameters": parameters, "trainable": trainable, "device": "cuda" if cuda else "cpu"}


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64, help="sentences per step (two views each)")
    parser.add_argument("--length", type=int, default=32, help="tokens per sentence, special tokens included")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    parser.add_argument("--r", type=int, default=16, help="LoRA rank (alpha 2r, all linear layers)")
    parser.add_argument("--shape", choices=list(SHAPES), default="100m", help="small: a quick check that it runs")
    parser.add_argument("--precision", default="32-true", help="trainer.precision, e.g. bf16-mixed on a GPU")
    parser.add_argument("--output", help="also write the results as JSON here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--backbone", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # comma-separated configuration names
        print(json.dumps({name: child(args, name) for name in args.child.split(",")}))
        return
    results = {}
    with tempfile.TemporaryDirectory() as folder:
        # the small shape checks that it runs: its tokenizer needs no more than a few thousand lines
        qwen2_decoder(folder, 20_000 if args.shape == "small" else None, **SHAPES[args.shape])
        # the small shape's configurations share one process: it checks that each runs, not its memory
        groups = [list(CONFIGS)] if args.shape == "small" else [[name] for name in CONFIGS]
        for names in groups:
            command = [sys.executable, __file__, *sys.argv[1:], "--child", ",".join(names), "--backbone", folder]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                raise SystemExit(f"{', '.join(names)} failed:\n{done.stderr[-3000:]}")
            results.update(json.loads(done.stdout.strip().splitlines()[-1]))
            for name in names:
                print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2) + "\n")
    full = results["full fine-tuning"]
    unit = "peak RSS" if full["device"] == "cpu" else "peak allocated"
    print(f"\nLoRA (r {args.r}, all linear layers), SimCSE on a random Qwen2-shaped decoder of "
          f"{full['parameters'] / 1e6:.0f}M parameters, {full['device']}, batch {args.batch}, length {args.length}, "
          f"{args.precision}, last-token pooling, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
    print(f"| configuration | trainable | ms / step | × full | {unit} MiB | × full | above start MiB "
          "| last.ckpt MiB | × full |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {100 * r['trainable'] / r['parameters']:.2f}% | {r['ms_per_step']:.0f} "
              f"| {r['ms_per_step'] / full['ms_per_step']:.2f} | {r['peak_mib']:.0f} "
              f"| {r['peak_mib'] / full['peak_mib']:.2f} | {r['above_start_mib']:.0f} | {r['checkpoint_mib']:.1f} "
              f"| {r['checkpoint_mib'] / full['checkpoint_mib']:.3f} |")


if __name__ == "__main__":
    main()
