"""The `tf32` switch of `sentemb fit` (default on): TF32 float32 matmuls where CUDA is, nothing without;
the one-line notice for a bf16 fit on a CPU that runs bf16 slowly."""

import pytest
import torch
import yaml

import lightning_sentemb.precision as precision_module
from lightning_sentemb import lightning_cli
from lightning_sentemb.cli import main
from lightning_sentemb.precision import slow_bf16_notice, use_tf32
from tests.test_end_to_end import fit_args


@pytest.fixture()
def restore_precision():
    previous = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(previous)


def test_tf32_follows_the_switch_on_cuda(monkeypatch, restore_precision):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    use_tf32(True)
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32
    use_tf32(False)
    assert torch.get_float32_matmul_precision() == "highest"


def test_tf32_changes_nothing_without_cuda(monkeypatch, restore_precision):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.set_float32_matmul_precision("highest")
    use_tf32(True)
    assert torch.get_float32_matmul_precision() == "highest"


def test_the_switch_is_a_config_key_on_by_default(tiny_bert, capsys):
    for extra, expected in (([], True), (["--tf32", "false"], False)):
        with pytest.raises(SystemExit):
            main(["fit", "--model", "lightning_sentemb.methods.SimCSE", "--model.backbone", tiny_bert, *extra,
                  "--print_config"])
        assert yaml.safe_load(capsys.readouterr().out)["tf32"] is expected


@pytest.mark.parametrize(("precision", "device_type", "slow_cpu", "said"), [
    ("bf16-mixed", "cpu", True, True),
    ("bf16-true", "cpu", True, True),
    ("bf16-mixed", "cuda", True, False),
    ("bf16-mixed", "cpu", False, False),    # the CPU has bf16 instructions
    ("32-true", "cpu", True, False),
    ("16-mixed", "cpu", True, False),
])
def test_a_bf16_fit_on_a_cpu_without_bf16_instructions_is_told_how_to_run_fast(
        monkeypatch, precision, device_type, slow_cpu, said):
    monkeypatch.setattr(precision_module, "cpu_runs_bf16_slowly", lambda: slow_cpu)
    notice = slow_bf16_notice(precision, device_type)
    if said:
        assert notice is not None and "\n" not in notice
        assert f"trainer.precision {precision}" in notice and "--trainer.precision 32-true" in notice
    else:
        assert notice is None


@pytest.mark.parametrize(("accelerator", "precision", "said"),
                         [("auto", "bf16-mixed", True), ("cpu", "32-true", False)])
def test_the_fit_says_it_from_the_trainer_it_built(monkeypatch, tiny_bert, sts_fixture, tmp_path, accelerator,
                                                   precision, said):
    """Judged on the Trainer (its device and precision), not guessed from the options; said by `fit`."""
    monkeypatch.setattr(precision_module, "cpu_runs_bf16_slowly", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    said_lines = []
    monkeypatch.setattr(lightning_cli, "rank_zero_info", said_lines.append)
    args = fit_args(tiny_bert, sts_fixture, tmp_path, "--trainer.accelerator", accelerator,
                    "--trainer.precision", precision, "--trainer.max_steps", "1", "--trainer.logger", "false")
    lightning_cli.lightning_main(["fit", *args])
    assert any("without bf16 instructions" in line for line in said_lines) == said
