"""The `tf32` switch of `sentemb fit` (default on): TF32 float32 matmuls where CUDA is, nothing without."""

import pytest
import torch
import yaml

from lightning_sentemb.cli import main
from lightning_sentemb.precision import use_tf32


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
