"""The `tf32` switch of `sentemb fit` (default on): TF32 float32 matmuls where CUDA is, nothing without;
the one-line notice for a bf16 fit on a CPU that runs bf16 slowly."""

import pytest
import torch
import yaml

import lightning_sentemb.precision as precision_module
from lightning_sentemb.cli import main
from lightning_sentemb.precision import slow_bf16_notice, use_tf32


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


@pytest.mark.parametrize(("precision", "accelerator", "cuda", "slow_cpu", "said"), [
    ("bf16-mixed", "cpu", False, True, True),
    ("bf16-true", "auto", False, True, True),
    ("bf16-mixed", "cpu", True, True, True),       # a GPU present, but the fit was put on the CPU
    ("bf16-mixed", "auto", True, True, False),     # the fit runs on the GPU
    ("bf16-mixed", "gpu", False, True, False),
    ("bf16-mixed", "cpu", False, False, False),    # the CPU has bf16 instructions
    ("32-true", "cpu", False, True, False),
    ("16-mixed", "cpu", False, True, False),
])
def test_a_bf16_fit_on_a_cpu_without_bf16_instructions_is_told_how_to_run_fast(
        monkeypatch, precision, accelerator, cuda, slow_cpu, said):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(precision_module, "cpu_runs_bf16_slowly", lambda: slow_cpu)
    notice = slow_bf16_notice(precision, accelerator)
    if said:
        assert notice is not None and "\n" not in notice
        assert f"trainer.precision {precision}" in notice and "--trainer.precision 32-true" in notice
    else:
        assert notice is None
