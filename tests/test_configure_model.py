"""One way to build a method: `__init__` leaves the backbone's weights to `configure_model` (each rank
once, onto the device Lightning gives it), which the trainer calls and `build_method` calls elsewhere;
the FSDP strategy wraps each transformer layer and refuses what it does not run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer
from peft.tuners.lora import LoraLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.fsdp import LayerFSDPStrategy, mixed_precision_policy, shard_by_layer
from lightning_sentemb.methods import DCPCSE, SimCSE
from lightning_sentemb.methods.building import build_method, weights_device

LORA = {"r": 2, "target_modules": ["query", "value"]}


def trainable(method) -> set[str]:
    return {name for name, p in method.named_parameters() if p.requires_grad}


@pytest.mark.parametrize(("method_class", "kwargs"), [
    (SimCSE, {"pooler": "cls", "lora": LORA, "gradient_checkpointing": True}),
    (SimCSE, {"pooler": "cls", "mlm_weight": 0.1}),
    (DCPCSE, {"prefix_len": 2, "mlm_weight": 0.1}),
], ids=["simcse-lora", "simcse-mlm", "dcpcse-mlm"])
def test_configure_model_loads_the_weights_once(method_class, kwargs, tiny_bert):
    """A method holds a skeleton on the meta device until `configure_model`, which loads the checkpoint's
    weights with the adapters and frozen parts, once; `build_method` is exactly that."""
    from transformers import AutoModel

    eager = build_method(method_class, tiny_bert, **kwargs)
    method = method_class(tiny_bert, **kwargs)
    assert method.encoder.weights_deferred and all(p.is_meta for p in method.encoder.backbone.parameters())
    assert method.tokenizer("a cat")["input_ids"] and method.output_size == 32  # all but the weights is there
    method.configure_model()
    method.configure_model()  # Lightning calls it at every stage: no second load, no second adapter
    assert not method.encoder.weights_deferred
    assert not any(p.is_meta for p in method.parameters())
    torch.testing.assert_close(method.encoder.backbone.get_input_embeddings().weight,
                               AutoModel.from_pretrained(tiny_bert).get_input_embeddings().weight, rtol=0, atol=0)
    state, expected = method.state_dict(), eager.state_dict()
    assert state.keys() == expected.keys() and trainable(method) == trainable(eager)
    from_the_checkpoint = [k for k in state if k.startswith("encoder.backbone.") and ".lora_" not in k]
    assert from_the_checkpoint and all(torch.equal(state[k], expected[k]) for k in from_the_checkpoint)
    assert sum(isinstance(m, LoraLayer) for m in method.modules()) == (2 * 2 if "lora" in kwargs else 0)
    assert method.backbone_frozen == eager.backbone_frozen
    if method_class is DCPCSE:
        assert method.encoder.prefixed.backbone is method.encoder.backbone
        assert not any(p.requires_grad for p in method.encoder.backbone.parameters())
    # what starts random (adapters, prefix, heads) drew in another order: given the same, the same model
    method.load_state_dict(eager.state_dict())
    features = method.sentence_features(["a man plays guitar .", "kids play"])
    method.eval(), eager.eval()
    torch.testing.assert_close(method.embed_features(features), eager.embed_features(features), rtol=0, atol=0)


def test_weights_load_onto_the_trainers_root_device(tiny_bert, monkeypatch):
    """The device is Lightning's root device (numbered by its local rank under torchrun and SLURM alike),
    never the LOCAL_RANK variable, which srun does not set."""
    monkeypatch.setenv("LOCAL_RANK", "5")
    method = SimCSE(tiny_bert, backbone_dtype="bf16", lora=LORA)
    asked = {}
    monkeypatch.setattr(method.encoder, "load_backbone", lambda **options: asked.update(options))
    monkeypatch.setattr("lightning_sentemb.methods.building.add_lora", lambda *args: None)
    method._trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cuda", 1)))
    method.configure_model()
    assert asked["device_map"] == {"": torch.device("cuda", 1)} and asked["dtype"] == torch.bfloat16
    method._trainer = SimpleNamespace(strategy=LayerFSDPStrategy())
    assert weights_device(method) is None  # FSDP shards from host memory


def test_a_cli_fit_loads_the_backbone_in_configure_model(tiny_bert, sts_fixture, tmp_path):
    from lightning.pytorch import Callback

    from lightning_sentemb.lightning_cli import lightning_main
    from tests.test_end_to_end import fit_args

    seen = []

    class Watch(Callback):
        def setup(self, trainer, pl_module, stage):  # before configure_model
            seen.append(pl_module.encoder.weights_deferred)

        def on_fit_start(self, trainer, pl_module):
            seen.append(pl_module.encoder.weights_deferred)

    lightning_main(["fit", *fit_args(tiny_bert, sts_fixture, tmp_path, "--trainer.max_steps", "1",
                                     "--trainer.logger", "false")], callbacks=[Watch()])
    assert seen == [True, False]


def shard_worker(rank: int, init_file: str, backbones: list[str]) -> None:
    """One FSDP unit per transformer layer, one root per child of the method holding parameters; parameter
    names unchanged (no wrapper prefix); bf16-mixed: bf16 compute, fp32 reduction and sharded parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule

    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool (it hangs)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    for backbone in backbones:
        method = build_method(SimCSE, backbone)
        names = [name for name, _ in method.named_parameters()]
        shard_by_layer(method, mesh, mixed_precision_policy("bf16-mixed"))
        units = {module for module in method.modules() if isinstance(module, FSDPModule)}
        layers = {module for module in method.modules() if isinstance(module, GradientCheckpointingLayer)}
        assert layers and units == layers | {method.encoder, method.mlp}
        assert [name for name, _ in method.named_parameters()] == names
        assert all(p.dtype == torch.float32 for p in method.parameters())
        policy = method.encoder._get_fsdp_state()._mp_policy
        assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    torch.distributed.destroy_process_group()


def test_fsdp_wraps_every_transformer_layer_of_each_family(tiny_bert, tiny_qwen2, tiny_modernbert, tmp_path):
    strategy = Trainer(strategy="fsdp_layers", accelerator="cpu", devices=2, logger=False,
                       enable_checkpointing=False).strategy  # the preset's name
    assert isinstance(strategy, LayerFSDPStrategy)
    # fork: the ranks start with this process's imports (spawn re-imports torch and transformers in each)
    torch.multiprocessing.start_processes(shard_worker, args=(str(tmp_path / "init"), [tiny_bert, tiny_qwen2,
                                          tiny_modernbert]), nprocs=2, join=True, start_method="fork")


@pytest.mark.parametrize("option", ["grad_cache_chunk", "load_in_4bit"])
def test_fsdp_refuses_gradient_caching_and_4bit(option, tiny_bert, monkeypatch):
    method = build_method(SimCSE, tiny_bert, grad_cache_chunk=2)
    monkeypatch.setitem(method.hparams, "grad_cache_chunk", 2 if option == "grad_cache_chunk" else 0)
    monkeypatch.setitem(method.hparams, "load_in_4bit", option == "load_in_4bit")
    method._trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), precision="bf16-mixed", gradient_clip_val=None,
                                      accumulate_grad_batches=1, strategy=LayerFSDPStrategy())
    with pytest.raises(SentEmbUserError, match=f"model.init_args.{option} is not supported under FSDP"):
        method.configure_callbacks()
