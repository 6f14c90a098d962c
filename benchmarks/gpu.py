"""GPU benchmark: every method on a bert-base-shaped model with random weights, bf16 autocast.

    python benchmarks/gpu.py [--batches 64 256 512] [--steps 20] [--peak-tflops 989.4] [--output gpu.json]
    python benchmarks/gpu.py --smoke     # tiny config on CPU: checks the script end to end

The model is `BertConfig()` (bert-base) with random weights and a WordPiece vocabulary of bert-base's
size built in code (`random_models.random_bert`): speed does not depend on the weights, and no raw
bert-base checkpoint is installable offline. Sentences are the first lines of wiki1m (`$SENTEMB_DATA`;
`random_models.synthetic_sentences` where it is absent), max_len 32.

Per method and batch size, for the padding-free and the padded forward: sentences/s (median step),
model FLOP utilization (MFU) against the GPU's dense bf16 peak, and peak allocated memory. MFU
counts the useful work only (`step_flops`): 6 × (non-embedding parameters) FLOPs per real token
(forward and backward; 4 × for DCPCSE, whose frozen backbone computes no weight gradients) plus the
attention products over each sentence's real tokens. sentence-transformers runs at the same settings:
its SimCSE recipe (MultipleNegativesRankingLoss, scale 20, on (s, s) pairs) through its own model and
loss, stepped in the same hand-written loop (no Trainer overhead: an upper bound for its Trainer).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from methods import prepare, train_step  # noqa: E402
from random_models import TINY_BERT, random_bert, synthetic_sentences  # noqa: E402

from lightning_sentemb.methods import DCPCSE, ClusterNS, ConPVP, PromptBERT, SimCSE  # noqa: E402
from lightning_sentemb.methods.building import build_method

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from the vendors' data sheets.
BF16_PEAK_TFLOPS = {"H200": 989.4, "H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100": 989.4,
                    "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}


def methods(backbone: str, batch: int) -> dict:
    """Every method at its defaults for the backbone's family (cls pooling on BERT, the last token on a
    decoder), with the training MLP."""
    return {
        "SimCSE": lambda: build_method(SimCSE, backbone, mlp="train"),
        "PromptBERT": lambda: build_method(PromptBERT, backbone, mlp="train"),
        "ConPVP": lambda: build_method(ConPVP, backbone, mlp="train"),
        "DCPCSE (prefix 16)": lambda: build_method(DCPCSE, backbone, prefix_len=16),
        "ClusterNS (K 16)": lambda: build_method(ClusterNS, backbone, num_clusters=min(16, batch)),
    }


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(step, device: torch.device, steps: int, warmup: int) -> tuple[float, float]:
    """(median seconds per step, peak allocated MiB; NaN on CPU) of `step()`."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for index in range(warmup + steps):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        if index >= warmup:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")
    return statistics.median(times), peak


def non_embedding_parameters(model: torch.nn.Module) -> int:
    """N of the 6·N FLOPs per token: every parameter outside the embedding tables."""
    embeddings = sum(p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters())
    return sum(p.numel() for p in model.parameters()) - embeddings


def step_flops(config, non_embedding: int, attention_mask: torch.Tensor, frozen: bool = False,
               causal: bool = False) -> float:
    """Useful training FLOPs of one step: per real token 6·N (`non_embedding` parameters; 4·N for a
    `frozen` base, which computes no weight gradients: LoRA, DCPCSE), plus attention over each row's
    real tokens (QKᵀ and AV: 4·width·len² forward, ×3 with backward; half under a `causal` mask)."""
    heads = config.num_attention_heads
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    lengths = attention_mask.sum(1).double()
    attention = 3 * config.num_hidden_layers * 4 * width * float((lengths**2).sum()) * (0.5 if causal else 1.0)
    return (4.0 if frozen else 6.0) * non_embedding * float(lengths.sum()) + attention


def method_flops(method, attention_mask: torch.Tensor) -> float:
    """`step_flops` of a method's training rows."""
    backbone = method.encoder.backbone
    return step_flops(backbone.config, non_embedding_parameters(backbone), attention_mask, method.backbone_frozen,
                      method.family.causal)


def time_sentence_transformers(backbone: str, sentences: list[str], device: torch.device, steps: int,
                               warmup: int) -> tuple[float, float, float]:
    """(seconds per step, peak MiB, FLOPs per step) of sentence-transformers' SimCSE recipe."""
    from sentence_transformers import SentenceTransformer, losses, models

    transformer = models.Transformer(backbone, max_seq_length=32)
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), "cls")
    model = SentenceTransformer(modules=[transformer, pooling], device=str(device))
    loss_fn = losses.MultipleNegativesRankingLoss(model, scale=20.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-5, fused=True)
    tokenize = getattr(model, "preprocess", None) or model.tokenize  # renamed in sentence-transformers 6
    features = {k: v.to(device) for k, v in tokenize(sentences).items() if torch.is_tensor(v)}

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn([dict(features), dict(features)], None)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    seconds, peak = timed(step, device, steps, warmup)
    mask, backbone = features["attention_mask"], model[0].auto_model
    return seconds, peak, step_flops(backbone.config, non_embedding_parameters(backbone), torch.cat([mask, mask]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: by GPU name)")
    parser.add_argument("--data-dir", default=os.environ.get("SENTEMB_DATA", "../shared/data"))
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model on CPU, batch 8, 1 step: checks the script, measures nothing")
    parser.add_argument("--output", default=None, help="also write the rows as JSON")
    options = parser.parse_args()
    if options.smoke:
        options.batches, options.steps, options.warmup = [8], 1, 0
    device = torch.device("cuda" if torch.cuda.is_available() and not options.smoke else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    peak = options.peak_tflops or next((v for k, v in BF16_PEAK_TFLOPS.items() if k in name), None)
    corpus = Path(options.data_dir) / "corpora" / "wiki1m_for_simcse.txt"
    lines = corpus.read_text(encoding="utf8").splitlines()[: max(options.batches)] if corpus.is_file() else []
    if len(lines) < max(options.batches):
        lines = synthetic_sentences(max(options.batches))
    rows = []

    def record(method: str, forward: str, batch: int, seconds: float, memory: float, flops: float) -> None:
        mfu = flops / seconds / (peak * 1e12) if peak else float("nan")
        rows.append({"method": method, "forward": forward, "batch": batch, "sentences_per_s": batch / seconds,
                     "mfu": mfu, "peak_mib": memory})
        print(f"| {method} | {forward} | {batch} | {batch / seconds:,.0f} | {mfu:.1%} | {memory:,.0f} MiB |",
              flush=True)

    with tempfile.TemporaryDirectory() as folder:
        backbone = random_bert(folder, **(TINY_BERT if options.smoke else {}))
        print(f"{name}; bert-base {'(smoke: tiny config) ' if options.smoke else ''}random weights, bf16 autocast, "
              f"max_len 32, median of {options.steps} steps after {options.warmup}; MFU vs "
              f"{peak or 'unknown'} TFLOP/s dense bf16")
        print("| method | forward | batch | sentences/s | MFU | peak memory |")
        print("|---|---|---|---|---|---|")
        for batch in options.batches:
            sentences = lines[:batch]
            for method_name, build in methods(backbone, batch).items():
                torch.manual_seed(0)
                method = build().to(device)
                prepared, optimizer, clustering = prepare(method, sentences)
                flops = method_flops(method, prepared["features"]["attention_mask"])
                for padding_free in (True, False):
                    method.encoder.configure_speed(padding_free, compile_layers=False)
                    step = partial(train_step, method, prepared, optimizer, clustering, True)
                    seconds, memory = timed(step, device, options.steps, options.warmup)
                    record(method_name, "padding-free" if padding_free else "padded", batch, seconds, memory, flops)
                method = optimizer = step = None  # free this method before the next one is built
            seconds, memory, flops = time_sentence_transformers(backbone, sentences, device, options.steps,
                                                                options.warmup)
            record("sentence-transformers (MNRL)", "padded", batch, seconds, memory, flops)
    if options.output:
        from lightning_sentemb.atomic_io import atomic_write_json

        atomic_write_json(options.output, {"device": name, "peak_tflops": peak, "rows": rows})


if __name__ == "__main__":
    main()
