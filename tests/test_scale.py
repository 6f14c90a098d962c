"""Trainer presets (experiments/trainer/*.yaml) combine with every experiment file (2-process CPU fits through
the CLI, as a user runs them: the FSDP preset in test_fsdp.py, the multinode one under torchrun in test_resume.py)."""

from pathlib import Path

import pytest
import yaml

from lightning_sentemb.cli import main

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted((REPO / "experiments" / "trainer").glob("*.yaml"))
EXPERIMENTS = sorted((REPO / "experiments").rglob("*.yaml"))
EXPERIMENTS = [p for p in EXPERIMENTS if p.parent.name not in ("trainer", "sweeps")]


def method_of(experiment: Path) -> str:
    return yaml.safe_load(experiment.read_text())["model"]["class_path"]


# The presets meet one experiment of each method class (a paper config where there is one): a preset's keys
# are checked against the method's arguments, and how two config files merge does not depend on the recipe
# (every pair took 234 config prints, 80 s of the suite).
FIRST_OF_METHOD = {method_of(p): p
                   for p in sorted(EXPERIMENTS, key=lambda p: (p.parent.name == "demo", p), reverse=True)}


def shape(experiment: Path) -> dict[str, object]:
    """Every key of the file, with the type of its value, and its text where it is a choice (a string other
    than the backbone's name and the run's folder)."""
    def walk(node: object, prefix: str) -> dict[str, object]:
        if isinstance(node, dict):
            return {k: v for key, value in node.items() for k, v in walk(value, f"{prefix}{key}.").items()}
        free = prefix in ("model.init_args.backbone.", "trainer.default_root_dir.")
        return {prefix: node if isinstance(node, str) and not free else type(node)}

    return walk(yaml.safe_load(experiment.read_text()), "")


# A paper config that differs from a printed one of its method only in numbers and the backbone (the same
# keys, value types and choices; e.g. simcse_roberta_large.yaml beside simcse.yaml) is checked by that
# shape: printing it would check the same keys against the same arguments again (half a second each).
PRINTED: dict[tuple, Path] = {}
for _path in EXPERIMENTS:
    PRINTED.setdefault(tuple(sorted(shape(_path).items(), key=lambda item: item[0])), _path)


def printed_config(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit):
        main(["fit", *args, "--print_config"])
    return yaml.safe_load(capsys.readouterr().out)


def preset_case(experiment: Path):
    """SimCSE's experiment meets the presets in the fast suite; the other method classes' in the slow one
    (the merge of two config files does not depend on the method: only the keys checked against its
    arguments do)."""
    slow = FIRST_OF_METHOD[method_of(experiment)] == experiment and not method_of(experiment).endswith(".SimCSE")
    return pytest.param(experiment, marks=[pytest.mark.slow] if slow else [],
                        id=str(experiment.relative_to(REPO / "experiments")))


def test_every_unprinted_experiment_has_the_shape_of_a_printed_one():
    printed = set(PRINTED.values()) | set(FIRST_OF_METHOD.values())
    for experiment in EXPERIMENTS:
        twin = PRINTED[tuple(sorted(shape(experiment).items(), key=lambda item: item[0]))]
        assert twin in printed and method_of(twin) == method_of(experiment), experiment


def preset_chains(experiment: Path) -> list[list[Path]]:
    """The preset files to print the experiment with: SimCSE's first experiment meets each preset alone; every
    other method's first experiment meets all of them at once (the keys of all presets are checked against its
    arguments in one print: the merge itself is SimCSE's cases'); other experiments meet none."""
    if FIRST_OF_METHOD[method_of(experiment)] != experiment:
        return []
    return [[preset] for preset in PRESETS] if method_of(experiment).endswith(".SimCSE") else [PRESETS]


@pytest.mark.parametrize("experiment", [preset_case(p) for p in EXPERIMENTS
                                        if p in PRINTED.values() or FIRST_OF_METHOD[method_of(p)] == p])
def test_every_preset_is_a_second_config_for_the_experiment(experiment, capsys):
    """A preset sets only hardware keys of the trainer, the data loader's workers and memory (and at
    most the model's memory switches: gradient-caching chunk and gradient checkpointing, which leave
    loss and gradient unchanged, and the storage of a frozen backbone); the recipe is untouched."""
    alone = printed_config(capsys, "-c", str(experiment))
    memory = {"grad_cache_chunk", "gradient_checkpointing", "backbone_dtype", "load_in_4bit"}
    for chain in preset_chains(experiment):
        wanted: dict = {"trainer": {}, "model": {}, "data": {}}
        for preset in chain:
            read = yaml.safe_load(preset.read_text())
            model = read.pop("model", {"init_args": {}})
            data = read.pop("data", {})
            assert set(read) == {"trainer"} and set(model) == {"init_args"}, preset.name
            assert set(model["init_args"]) <= memory, preset.name
            assert set(data) <= {"num_workers", "persistent_workers", "pin_memory"}, preset.name
            wanted = {"trainer": {**wanted["trainer"], **read["trainer"]},
                      "model": {**wanted["model"], **model["init_args"]}, "data": {**wanted["data"], **data}}
        names = [preset.name for preset in chain]
        combined = printed_config(capsys, "-c", str(experiment), *(a for p in chain for a in ("-c", str(p))))
        assert combined["trainer"] == {**alone["trainer"], **wanted["trainer"]}, names
        expected = {**alone["model"], "init_args": {**alone["model"]["init_args"], **wanted["model"]}}
        assert combined["model"] == expected, names
        assert combined["data"] == {**alone["data"], **wanted["data"]}, names
        assert {k: v for k, v in combined.items() if k not in ("trainer", "model", "data")} == {
            k: v for k, v in alone.items() if k not in ("trainer", "model", "data")
        }


def test_gpu_presets_feed_the_loader_from_persistent_pinned_workers():
    for preset in PRESETS:
        data = yaml.safe_load(preset.read_text())["data"]
        assert data["num_workers"] >= 2 and data["persistent_workers"] and data["pin_memory"], preset.name
