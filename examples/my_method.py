"""A method of your own in one file, trained, evaluated and exported like the built-in ones
(docs/extending.md walks through it):

    sentemb fit -c examples/my_method.yaml      # the module is found beside its config
    sentemb evaluate --model out/my_method/checkpoints/best.ckpt --tasks sts    # run where my_method.py is
    sentemb export out/my_method/checkpoints/best.ckpt out/my_method/export

`SymmetricSimCSE` is unsupervised SimCSE whose contrastive loss runs both ways: each sentence's first
view picks its second view among the batch's second views (SimCSE's loss), and each second view picks
its first among the first views; the two losses are averaged. It changes only the loss, so everything
else (views, encoder, evaluation, export) is SimCSE's.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from lightning_sentemb.distributed import gather_with_grad, local_labels
from lightning_sentemb.losses.info_nce import info_nce
from lightning_sentemb.methods import SimCSE


class SymmetricSimCSE(SimCSE):
    """SimCSE with the InfoNCE loss averaged over both directions; logs the positive pairs' mean
    cosine as `train/positive_cosine`. With NLI triplets the hard negatives (third view) are unused."""

    def embedding_loss(self, embeddings: Tensor, batch: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        # `embeddings` stacks the views along dim 0: rows [0, n) are every example's first view, [n, 2n) its second
        first, second = embeddings.unflatten(0, (batch["num_views"], -1))[:2]
        labels = local_labels(first.size(0), first.device)  # each anchor's column in the (global) batch
        temperature = self.hparams.temperature
        loss = (info_nce(first, gather_with_grad(second), labels, temperature)
                + info_nce(second, gather_with_grad(first), labels, temperature)) / 2
        return loss, {"positive_cosine": F.cosine_similarity(first, second, dim=-1).mean().detach()}
