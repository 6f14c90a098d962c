"""The shared LightningModule: optimizer and schedule, MLM auxiliary loss, encode, STS validation.

A method subclasses `SentEmbMethod` and contributes only what makes it different:
`build_encoder` (input format), `collate` (the views of a training example) and `training_loss`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from ..data.senteval import DEV_TASKS, STS_SUBSETS, STS_TASKS
from ..encoders.plain import Encoder
from ..evaluation.sts import StsSpearman, format_table
from ..evaluation.suite import evaluate_suite, headline_scores
from ..export import write_plain_export
from ..losses.mlm import mask_tokens, mlm_loss

MlpMode = Literal["none", "train", "always"]


def autocast_for(device: torch.device, precision: str) -> torch.autocast:
    """bf16 autocast on GPUs that support it (fp16 on older ones); on CPU only when asked."""
    if device.type == "cuda" and precision == "auto":
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.autocast("cuda", dtype=dtype)
    enabled = precision == "bf16"
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


class SentEmbMethod(LightningModule):
    """Base of every method.

    Args:
        backbone: Hugging Face hub name or local folder (BERT and RoBERTa families).
        pooler: cls | cls_before_pooler | avg | avg_first_last | avg_top2 | mask.
        mlp: Linear+Tanh projection over the pooled vector: "train" (SimCSE unsupervised: used in
            training, dropped at evaluation), "always" (supervised SimCSE), or "none".
        temperature: τ of the contrastive softmax.
        lr, weight_decay, warmup_steps: AdamW with linear warm-up then linear decay to 0.
        mlm_weight: weight of the masked-LM auxiliary loss (0 disables it; SimCSE uses 0.1).
        mlm_probability: fraction of tokens masked for the auxiliary loss.
        eval_max_length: truncation at evaluation; None = the model's maximum (SimCSE's
            evaluation does not truncate; the 32-token limit is for training only).
        eval_batch_size: sentences per forward in `encode`.
        eval_precision: autocast during `encode`: "auto" (bf16/fp16 on GPU, fp32 on CPU),
            "bf16", or "32".
        sts_aggregation: how STS12–16 subsets combine: "all" (SentEval/SimCSE), "wmean", "mean".
        padding_free: run the encoder without computing on padding (`encoders.packed`; same
            results); false = the backbone's own padded forward. Unsupported backbones fall back
            with a logged reason.
        compile_layers: `torch.compile` the padding-free layer (dynamic token counts: no recompile
            per batch length). Off by default: compiling costs minutes and pays only on long runs.
    """

    def __init__(
        self,
        backbone: str,
        pooler: str = "cls",
        mlp: MlpMode = "train",
        temperature: float = 0.05,
        lr: float = 3e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        mlm_weight: float = 0.0,
        mlm_probability: float = 0.15,
        eval_max_length: int | None = None,
        eval_batch_size: int = 128,
        eval_precision: Literal["auto", "bf16", "32"] = "auto",
        sts_aggregation: Literal["all", "wmean", "mean"] = "all",
        padding_free: bool = True,
        compile_layers: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = self.build_encoder()
        self.encoder.configure_speed(padding_free, compile_layers)
        hidden = self.encoder.hidden_size
        self.mlp = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) if mlp != "none" else None
        self.sts_metrics = nn.ModuleDict(
            {
                task.replace(".", "_"): StsSpearman(STS_SUBSETS.get(task, (task,)), sts_aggregation)
                for task in STS_TASKS + DEV_TASKS
            }
        )
        self.mlm_generator = torch.Generator().manual_seed(0)

    # ----- what a method provides -------------------------------------------------------
    def build_encoder(self) -> Encoder:
        """The backbone with this method's input format; plain `[CLS] s [SEP]` by default."""
        return Encoder(self.hparams.backbone, self.hparams.pooler, with_mlm_head=self.hparams.mlm_weight > 0)

    def collate(self, examples: list[dict[str, list[int]]]) -> dict[str, Any]:
        """Training batch from tokenized examples (runs in DataLoader workers)."""
        raise NotImplementedError

    def training_loss(self, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss, extra values to log) for one training batch."""
        raise NotImplementedError

    # ----- shared -----------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.encoder.tokenizer

    @property
    def eval_mlp(self) -> nn.Module | None:
        """The MLP kept at evaluation (mlp='always'), or None: what `encode` and the exports apply."""
        return self.mlp if self.hparams.mlp == "always" else None

    def embed(self, features: dict[str, Tensor]) -> Tensor:
        """Sentence vectors; the MLP applies in training, and at evaluation only with mlp='always'."""
        pooled = self.encoder(features)
        mlp = self.mlp if self.training else self.eval_mlp
        return mlp(pooled) if mlp is not None else pooled

    def add_mlm_inputs(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Attach corrupted copies of the training rows for the MLM auxiliary loss, when enabled."""
        if self.hparams.mlm_weight > 0:
            features = batch["features"]
            ids, labels = mask_tokens(
                features["input_ids"], features["attention_mask"], self.tokenizer,
                self.hparams.mlm_probability, self.mlm_generator,
            )
            batch["mlm"] = {"input_ids": ids, "attention_mask": features["attention_mask"], "labels": labels}
        return batch

    def mlm_weight_at(self, step: int) -> float:
        """Weight of the MLM loss at a global step (constant here; DCPCSE decays it)."""
        return self.hparams.mlm_weight

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, logs = self.training_loss(batch)
        if "mlm" in batch:
            mlm = batch["mlm"]
            logits = self.encoder.mlm_logits(mlm["input_ids"], mlm["attention_mask"])
            logs["mlm_loss"] = mlm_loss(logits, mlm["labels"])
            loss = loss + self.mlm_weight_at(self.global_step) * logs["mlm_loss"]
        # collate may give "batch_size" when its features hold extra rows (e.g. template-bias rows)
        batch_size = batch.get("batch_size") or batch["features"]["input_ids"].size(0) // batch["num_views"]
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log_dict({f"train/{k}": v for k, v in logs.items()}, batch_size=batch_size)
        return loss

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        # fused: one kernel for all parameters, no per-tensor launches (CPU and CUDA alike)
        optimizer = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, fused=True)
        total = self.trainer.estimated_stepping_batches
        total = int(total) if math.isfinite(total) else 10**9
        schedule = get_linear_schedule_with_warmup(optimizer, self.hparams.warmup_steps, total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ----- encoding ---------------------------------------------------------------------
    def sentence_features(self, sentences: list[str]) -> dict[str, Tensor]:
        """Model inputs for raw sentences at evaluation (method's format, evaluation truncation)."""
        return self.features_from_ids(self.encoder.format.sentence_ids(sentences))

    def features_from_ids(self, sentence_ids: list[list[int]]) -> dict[str, Tensor]:
        return self.encoder.format.build(sentence_ids, self.hparams.eval_max_length or self.encoder.max_length)

    def encode_batch(self, sentences: list[str]) -> Tensor:
        return self.embed_features(self.sentence_features(sentences))

    def embed_features(self, features: dict[str, Tensor]) -> Tensor:
        return self.embed({k: v.to(self.device, non_blocking=True) for k, v in features.items()})

    @torch.inference_mode()
    def encode(self, sentences: list[str], batch_size: int | None = None, show_progress: bool | None = None) -> Tensor:
        """(n, hidden) float32 embeddings on CPU, in the input order.

        Tokenized once, sorted by length so each batch pads little; evaluation mode, no gradient,
        autocast per `eval_precision`. Every evaluator calls this.
        """
        batch_size = batch_size or self.hparams.eval_batch_size
        was_training = self.training
        self.eval()
        sentence_ids = self.encoder.format.sentence_ids(sentences)
        order = np.argsort([len(ids) for ids in sentence_ids], kind="stable")[::-1]
        show = len(sentences) > 10 * batch_size if show_progress is None else show_progress
        out = torch.empty(len(sentences), self.output_size, dtype=torch.float32)
        with autocast_for(self.device, self.hparams.eval_precision):
            for start in tqdm(range(0, len(sentences), batch_size), desc="encode", disable=not show):
                rows = order[start : start + batch_size]
                features = self.features_from_ids([sentence_ids[i] for i in rows])
                out[torch.as_tensor(rows.copy())] = self.embed_features(features).float().cpu()
        self.train(was_training)
        return out

    @property
    def output_size(self) -> int:
        return self.encoder.hidden_size

    # ----- STS validation and test --------------------------------------------------------
    def _sts_step(self, batch: dict[str, Any]) -> None:
        n = len(batch["first"])
        embeddings = self.encode_batch(batch["first"] + batch["second"])
        cosines = torch.nn.functional.cosine_similarity(embeddings[:n].float(), embeddings[n:].float(), dim=-1)
        self.sts_metrics[batch["task"].replace(".", "_")].update(batch["index"], cosines, batch["gold"], batch["subset"])

    def _log_sts(self, stage: str, tasks: list[str]) -> dict[str, float]:
        scores = {}
        for task in tasks:
            metric = self.sts_metrics[task.replace(".", "_")]
            scores[task] = float(metric.compute())
            metric.reset()
        if len(scores) > 1:
            scores["avg"] = float(np.mean(list(scores.values())))
        self.log_dict({f"{stage}/{k}": v for k, v in scores.items()}, sync_dist=False)
        return scores

    def validation_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._sts_step(batch)

    def test_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> None:
        self._sts_step(batch)

    def _stage_tasks(self, stage: str) -> list[str]:
        datamodule = self.trainer.datamodule
        return list(datamodule.val_tasks if stage == "val" else datamodule.test_tasks)

    def _run_extra_evaluators(self, stage: str) -> None:
        """Evaluators beyond STS named by the DataModule (`val_evaluators` / `test_evaluators`):
        run on rank 0 with `encode`, logged straight to the loggers, other ranks wait."""
        datamodule = self.trainer.datamodule
        names = list(getattr(datamodule, f"{stage}_evaluators", ()))
        if not names:
            return
        if self.trainer.is_global_zero:
            figures = Path(self.trainer.default_root_dir) / "figures" / f"{stage}-step{self.global_step}"
            results = evaluate_suite(self.encode, names, datamodule.data_dir, figures, name=type(self).__name__)
            metrics = {f"{stage}/{k}": v for k, v in headline_scores(results).items()}
            for logger in self.loggers:
                logger.log_metrics(metrics, step=self.global_step)
        self.trainer.strategy.barrier()

    def on_validation_epoch_end(self) -> None:
        if not self.trainer.sanity_checking:
            self._log_sts("val", self._stage_tasks("val"))
            self._run_extra_evaluators("val")
        else:
            for metric in self.sts_metrics.values():
                metric.reset()

    def on_test_epoch_end(self) -> None:
        self.test_results = self._log_sts("test", self._stage_tasks("test"))
        self._run_extra_evaluators("test")
        if self.trainer.is_global_zero:
            print("\n" + format_table({type(self).__name__: self.test_results}), flush=True)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Record the method class so `sentemb evaluate/export` can rebuild it from the file alone."""
        checkpoint["sentemb_method"] = f"{type(self).__module__}.{type(self).__qualname__}"

    def write_export(self, folder: Path) -> None:
        """Write this method as a HF + sentence-transformers folder (prompt formats override)."""
        write_plain_export(self, folder)
