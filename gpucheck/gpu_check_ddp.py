"""gpu-check's DDP part: two ranks on the one GPU with gloo (NCCL refuses two ranks on one device), through
Lightning's DDP strategy, which relaunches this command for rank 1."""

from __future__ import annotations

import tempfile
import time

from gpu_check_common import Context, build_method, trainer_options, training_examples


def ddp(ctx: Context) -> dict | None:
    """Two ranks on the one device, gloo, through Lightning's DDP strategy (which relaunches this
    command for rank 1): SimCSE on bert-base, 2 steps; losses finite and the ranks' weights equal."""
    import torch
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader

    from lightning_sentemb.methods import SimCSE

    ctx.need_models()
    steps, world = 2, 2

    class RankAgreement(Callback):
        """Each rank's losses and a per-parameter (sum, norm) summary of its weights after the last
        step, all-gathered on the CPU (gloo)."""

        def __init__(self) -> None:
            self.losses: list = []
            self.gathered = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses.append(outputs["loss"].detach().float())

        def on_train_end(self, trainer, pl_module) -> None:
            weights = [p.detach().double() for p in pl_module.parameters() if p.requires_grad]
            summary = torch.stack([torch.stack([w.sum(), w.norm()]) for w in weights]).flatten().cpu()
            losses = torch.stack(self.losses).double().cpu()
            self.gathered = trainer.strategy.all_gather(torch.cat([losses, summary])).cpu()

    torch.manual_seed(0)
    method = build_method(SimCSE, ctx.bert, mlp="train")
    agreement = RankAgreement()
    examples = training_examples(method, ctx.sentences, world * steps * ctx.sizes.ddp_batch)
    strategy = DDPStrategy(parallel_devices=[ctx.device] * world, process_group_backend="gloo")
    with tempfile.TemporaryDirectory() as folder:
        trainer = Trainer(strategy=strategy, callbacks=[agreement], **trainer_options(ctx, folder, steps))
        start = time.perf_counter()
        trainer.fit(method, DataLoader(examples, batch_size=ctx.sizes.ddp_batch, collate_fn=method.collator,
                                       drop_last=True))
        seconds = time.perf_counter() - start
    if trainer.global_rank != 0:
        return None  # rank 0 reports
    losses, summaries = agreement.gathered[:, :steps], agreement.gathered[:, steps:]
    spread = float((summaries - summaries[0]).abs().max())
    finite = bool(torch.isfinite(losses).all())
    rows = [{"rank": rank, "device": str(ctx.device), "backend": "gloo", "steps": trainer.global_step,
             "batch per rank": ctx.sizes.ddp_batch, "losses": ", ".join(f"{x:.4f}" for x in losses[rank].tolist())}
            for rank in range(world)]
    rows[0].update({"weight summaries: largest difference to rank 0": spread, "fit seconds": seconds})
    ok = finite and spread == 0.0 and trainer.world_size == world
    return {"status": "pass" if ok else "fail", "rows": rows,
            "notes": [] if ok else [f"world size {trainer.world_size}, losses finite {finite}, "
                                    f"weight spread {spread:g}"]}
