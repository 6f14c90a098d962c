"""Two CPU processes (gloo): SimCSE's global-negative loss and gradients equal the single-process
loss on the same global batch, also with a guide (its embeddings gathered as the model's); so do
BERT-flow's, whose flow starts from the statistics of the global batch."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_sentemb.losses.info_nce import InfoNCELoss
from lightning_sentemb.methods.guide import Guide, guide_settings
from lightning_sentemb.methods.simcse import SimCSE

GLOBAL_BATCH, DIM, WORLD = 8, 6, 2


def make_inputs():
    generator = torch.Generator().manual_seed(0)
    views = torch.randn(3, GLOBAL_BATCH, DIM, generator=generator)  # anchor, positive, hard negative
    layer = torch.nn.Linear(DIM, DIM)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(DIM, DIM, generator=generator))
        layer.bias.copy_(torch.randn(DIM, generator=generator))
    return views, layer


def loss_and_grad(views: torch.Tensor, layer: torch.nn.Linear, guided: bool = False, keys: torch.Tensor | None = None):
    """Run SimCSE.embedding_loss on a linear layer over precomputed view inputs; `guided`: a guide
    (its own view of the same rows) drops the negatives it scores within 0.3 of the positive: about a
    fifth, across ranks too; and the columns whose key (`keys`, the rows' texts) is the positive's."""
    stub = SimpleNamespace(loss_fn=InfoNCELoss(0.05, 0.7))
    embeddings = layer(views.flatten(0, 1))
    batch = {"num_views": views.size(0)}
    drop, logs = None, {}
    if guided:
        guide = Guide(guide_settings({"model": "stub", "margin": 0.3}))
        guide_rows = torch.stack([views[0], views[0] + views[1], views[2]])  # the guide sees the positives near
        guide.rows = lambda embeddings, batch: guide_rows.flatten(0, 1)
        drop, logs = guide.drop(embeddings, {**batch, "row_keys": keys.flatten()})
    loss, _ = SimCSE.embedding_loss(stub, embeddings, batch, drop)
    layer.zero_grad()
    loss.backward()
    return loss.detach(), layer.weight.grad.clone(), logs


FLOW_SENTENCES = ["a man is playing a guitar .", "the cat sat .", "two dogs run across the field today .", "nice .",
                  "a woman is slicing an onion on the table .", "kids play football in the park", "the sun shines",
                  "this sentence means something rather long , really ."]


def flow_loss_and_grads(backbone: str, sentences: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """BERT-flow's first training loss on `sentences` (its flow started from them: the global batch under DDP)."""
    from lightning_sentemb.methods import BERTFlow
    from lightning_sentemb.methods.building import build_method

    torch.manual_seed(0)
    method = build_method(BERTFlow, backbone, pooler="avg", dropout=0.0, flow_levels=2, flow_depth=2,
                          flow_coupling_width=4)
    batch = method.collate([{"sent0": ids} for ids in method.encoder.format.sentence_ids(sentences)])
    loss, _ = method.training_loss(batch)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in method.flow.named_parameters()}


def make_keys() -> torch.Tensor:
    """One key a row; rank 1's positive 6 repeats rank 0's positive 1 (one text in two examples)."""
    keys = torch.arange(3 * GLOBAL_BATCH).view(3, GLOBAL_BATCH)
    keys[1, 6] = keys[1, 1]
    return keys


def worker(rank: int, init_file: str, out_file: str, guided: bool, flow_backbone: str | None = None) -> None:
    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool (it hangs), as DataLoader workers
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    views, layer = make_inputs()
    local = views[:, rank * GLOBAL_BATCH // WORLD : (rank + 1) * GLOBAL_BATCH // WORLD]
    local_keys = make_keys()[:, rank * GLOBAL_BATCH // WORLD : (rank + 1) * GLOBAL_BATCH // WORLD]
    loss, grad, _ = loss_and_grad(local, layer, guided, local_keys)
    flow_loss, flow_grads = flow_loss_and_grads(flow_backbone, FLOW_SENTENCES[rank::WORLD]) if flow_backbone else (
        torch.zeros(()), {})
    for tensor in (loss, grad, flow_loss, *flow_grads.values()):  # what DDP does: average across ranks
        dist.all_reduce(tensor)
        tensor /= WORLD
    if rank == 0:
        torch.save({"loss": loss, "grad": grad, "flow_loss": flow_loss, "flow_grads": flow_grads}, out_file)
    dist.destroy_process_group()


@pytest.mark.parametrize("guided", [False, True])
def test_global_negatives_match_single_process(guided, tiny_bert, tmp_path):
    # fork: the ranks start with this process's imports (spawn re-imports torch and transformers in each,
    # most of the test's time)
    flow_backbone = None if guided else tiny_bert  # BERT-flow rides along in the same launch
    mp.start_processes(worker, args=(str(tmp_path / "init"), str(tmp_path / "out.pt"), guided, flow_backbone),
                       nprocs=WORLD, join=True, start_method="fork")
    distributed = torch.load(tmp_path / "out.pt")
    if flow_backbone:
        flow_loss, flow_grads = flow_loss_and_grads(tiny_bert, FLOW_SENTENCES)
        torch.testing.assert_close(distributed["flow_loss"], flow_loss, atol=1e-6, rtol=1e-6)
        assert distributed["flow_grads"].keys() == flow_grads.keys()
        for name, grad in flow_grads.items():
            torch.testing.assert_close(distributed["flow_grads"][name], grad, atol=1e-5, rtol=1e-5, msg=name)
        # each rank's flow started from its own half (no gather) would give another loss: the test can fail
        local_start = sum(flow_loss_and_grads(tiny_bert, FLOW_SENTENCES[r::WORLD])[0] for r in range(WORLD)) / WORLD
        assert not torch.allclose(local_start, flow_loss, atol=1e-3)
    views, layer = make_inputs()
    loss, grad, logs = loss_and_grad(views, layer, guided, make_keys())
    assert torch.allclose(distributed["loss"], loss, atol=1e-6)
    assert torch.allclose(distributed["grad"], grad, atol=1e-5)
    # and the local-only loss (no gathering) would differ: the test can fail
    half = slice(0, GLOBAL_BATCH // WORLD)
    local_loss, _, _ = loss_and_grad(views[:, half], layer, guided, make_keys()[:, half])
    assert not torch.allclose(local_loss, loss, atol=1e-3)
    if guided:  # the guide drops some negatives, not all: the guided and plain losses differ
        assert 0 < float(logs["guide/masked_fraction"]) < 0.5
        key_only = Guide(guide_settings({"model": "stub", "threshold": 2.0}))  # no score passes 2: keys alone
        key_only.rows = lambda embeddings, batch: torch.randn(3 * GLOBAL_BATCH, DIM)
        drop, _ = key_only.drop(views.flatten(0, 1), {"num_views": 3, "row_keys": make_keys().flatten()})
        assert drop.nonzero().tolist() == [[1, 6], [6, 1]]
        assert not torch.allclose(loss_and_grad(views, layer)[0], loss, atol=1e-3)
