"""Every seed-row config trains as the code behind its published number did: each setting read from a
reference repository (`tests/reference_settings`, with the file and line) is checked against the config,
a key the config leaves out by the default it then takes. An edit that drifts from the reference fails."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest
import yaml
from lightning.pytorch import Trainer

from lightning_sentemb.callbacks.checkpointing import SentEmbCheckpoint
from lightning_sentemb.data.datamodule import SentEmbDataModule
from lightning_sentemb.lightning_cli import CHECKPOINT_DEFAULTS
from lightning_sentemb.papers import PAPERS

from .conftest import REPO
from .reference_settings import Setting, all_settings

SETTINGS = all_settings()
SEED_ROW_CONFIGS = sorted({config for row in PAPERS.values() if row.seed_paper_file for config in row.configs})
MISSING = object()


def load(config: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / "experiments" / f"{config}.yaml").read_text())


def signature_default(cls: type, name: str) -> Any:
    """`name`'s default in `cls.__init__`, following `**kwargs` up the MRO (a method passes the shared
    options on to `SentEmbMethod`)."""
    for klass in cls.__mro__:
        parameter = inspect.signature(klass.__init__).parameters.get(name)
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            return parameter.default
    raise AssertionError(f"{cls.__name__} takes no option {name!r}")


def callback_option(callbacks: list[dict[str, Any]], class_name: str, option: str) -> Any:
    for callback in callbacks or []:
        path = callback["class_path"]
        if path.rsplit(".", 1)[-1] == class_name:
            init_args = callback.get("init_args", {})
            if option in init_args:
                return init_args[option]
            module, name = path.rsplit(".", 1)
            return signature_default(getattr(importlib.import_module(module), name), option)
    return MISSING


def resolve(config: dict[str, Any], key: str) -> Any:
    """The value `key` takes when the config trains: its own, else the default of whoever reads it.
    `trainer.callbacks.<Class>.<option>` reads a callback's option (MISSING when the config has none)."""
    parts = key.split(".")
    if parts[:2] == ["trainer", "callbacks"]:
        trainer = config.get("trainer", {})
        return callback_option(trainer.get("callbacks", []) + trainer.get("callbacks+", []), parts[2], parts[3])
    node: Any = config
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            break
        node = node[part]
    else:
        return node
    if parts[:2] == ["model", "init_args"]:
        module, name = config["model"]["class_path"].rsplit(".", 1)
        return signature_default(getattr(importlib.import_module(module), name), parts[2])
    if parts[0] == "data":
        return signature_default(SentEmbDataModule, parts[1])
    if parts[0] == "trainer":
        return signature_default(Trainer, parts[1])
    if parts[0] == "checkpoint":  # the CLI's defaults, else the callback's
        return CHECKPOINT_DEFAULTS.get(key) or signature_default(SentEmbCheckpoint, parts[1])
    return MISSING


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: f"{s.config}:{s.key}")
def test_config_follows_its_reference(setting: Setting):
    value = resolve(load(setting.config), setting.key)
    assert value == setting.value, (
        f"experiments/{setting.config}.yaml: {setting.key} is {value!r}; the reference "
        f"({setting.source}) trains with {setting.value!r}")


@pytest.mark.parametrize("config", SEED_ROW_CONFIGS)
def test_every_seed_row_config_pins_its_trainer(config: str):
    """At least the loop every reference shares: its clipping, learning rate and batch, each with a source."""
    pinned = {s.key for s in SETTINGS if s.config == config}
    assert {"trainer.gradient_clip_val", "model.init_args.lr", "data.batch_size"} <= pinned, (
        f"experiments/{config}.yaml has no reference settings for "
        f"{sorted({'trainer.gradient_clip_val', 'model.init_args.lr', 'data.batch_size'} - pinned)}")


def test_resolve_reads_defaults():
    """A key the config leaves out takes its reader's default; a callback's option its class's."""
    config = {"model": {"class_path": "lightning_sentemb.methods.SimCSE", "init_args": {"lr": 1e-5}},
              "trainer": {"callbacks": [{"class_path": "lightning.pytorch.callbacks.EarlyStopping",
                                         "init_args": {"monitor": "val/avg"}}]}}
    assert resolve(config, "model.init_args.lr") == 1e-5
    assert resolve(config, "model.init_args.temperature") == 0.05
    assert resolve(config, "trainer.gradient_clip_val") is None
    assert resolve(config, "trainer.callbacks.EarlyStopping.patience") == 3
    assert resolve(config, "trainer.callbacks.ModelCheckpoint.monitor") is MISSING
    assert resolve(config, "checkpoint.monitor") == "val/STSBenchmark-dev"
    assert resolve({"checkpoint": {"mode": "min"}}, "checkpoint.mode") == "min"
    assert resolve(config, "checkpoint.every_n_train_steps") is None
