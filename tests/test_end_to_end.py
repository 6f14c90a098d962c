"""Short fits through the `sentemb` CLI, checkpoint selection, test table, export round trip."""

import json
from pathlib import Path

import pytest
import torch

from lightning_sentemb.cli import main
from lightning_sentemb.loading import load_method
from lightning_sentemb.methods.building import build_method

SENTENCES = ["a man plays guitar .", "the cat sleeps on the sofa all day long", "kids play football"]


def fit_args(backbone: str, data: Path, root: Path, *extra: str) -> list[str]:
    return [
        "--model", "lightning_sentemb.methods.SimCSE", "--model.backbone", backbone,
        "--data.data_dir", str(data), "--data.batch_size", "8", "--data.cache_dir", str(root / "cache"),
        "--trainer.default_root_dir", str(root), "--trainer.max_steps", "4", "--trainer.val_check_interval", "2",
        "--trainer.check_val_every_n_epoch", "null", "--trainer.enable_progress_bar", "false",
        "--trainer.accelerator", "cpu", "--trainer.log_every_n_steps", "1", "--model.lr", "1e-3", *extra,
    ]


@pytest.fixture(scope="module")
def trained(tiny_bert, sts_fixture, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    main(["fit", *fit_args(tiny_bert, sts_fixture, root, "--model.pooler", "cls", "--model.mlp", "train")])
    return root


def test_fit_keeps_best_checkpoint_by_stsb_dev(trained):
    best = trained / "checkpoints" / "best.ckpt"
    assert best.exists()
    checkpoint = torch.load(best, weights_only=False)
    assert checkpoint["sentemb_method"] == "lightning_sentemb.methods.simcse.SimCSE"
    callback = next(v for k, v in checkpoint["callbacks"].items() if "SentEmbCheckpoint" in k)
    assert callback["monitor"] == "val/STSBenchmark-dev"
    metrics = (trained / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "val/STSBenchmark-dev" in metrics and "val/SICKRelatedness-dev" in metrics and "train/loss" in metrics


def test_test_with_best_checkpoint_in_a_new_process_prints_seven_tasks(trained, tiny_bert, sts_fixture, capsys):
    main(["test", *fit_args(tiny_bert, sts_fixture, trained), "--ckpt_path", "best"])
    out = capsys.readouterr().out
    for column in ("STS12", "STS13", "STS14", "STS15", "STS16", "STS-B", "SICK-R", "Avg."):
        assert column in out


def test_evaluate_checkpoint_writes_json(trained, sts_fixture, tmp_path):
    output = tmp_path / "scores.json"
    main(["evaluate", "--model", str(trained / "checkpoints" / "best.ckpt"), "--tasks", "sts",
          "--data-dir", str(sts_fixture), "--output", str(output)])
    scores = json.loads(output.read_text())["sts"]
    assert list(scores) == ["STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness", "avg"]
    assert all(-100 <= v <= 100 for v in scores.values())


def test_unsupervised_export_drops_training_mlp_and_round_trips(trained, tmp_path):
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, AutoTokenizer

    method = load_method(str(trained / "checkpoints" / "best.ckpt"))
    assert method.hparams.mlp == "train"
    main(["export", str(trained / "checkpoints" / "best.ckpt"), str(tmp_path / "export")])
    expected = method.encode(SENTENCES)
    st = SentenceTransformer(str(tmp_path / "export"), device="cpu")
    assert torch.allclose(torch.as_tensor(st.encode(SENTENCES)), expected, atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export")
    model = AutoModel.from_pretrained(tmp_path / "export").eval()
    with torch.no_grad():
        cls = model(**tokenizer(SENTENCES, padding=True, return_tensors="pt")).last_hidden_state[:, 0]
    assert torch.allclose(cls, expected, atol=1e-5)


@pytest.mark.parametrize("pooler", ["avg", "avg_first_last", "avg_top2"])
def test_export_round_trip_for_each_plain_pooler(pooler, tiny_roberta, tmp_path):
    from sentence_transformers import SentenceTransformer

    from lightning_sentemb.export import export
    from lightning_sentemb.methods import SimCSE

    method = build_method(SimCSE, tiny_roberta, pooler=pooler, mlp="none")
    export(method, tmp_path / "export")
    st = SentenceTransformer(str(tmp_path / "export"), device="cpu")
    assert torch.allclose(torch.as_tensor(st.encode(SENTENCES)), method.encode(SENTENCES), atol=1e-5)


def test_mlp_kept_at_evaluation_is_exported_as_pooler_and_dense(tiny_bert, tmp_path):
    from sentence_transformers import SentenceTransformer

    from lightning_sentemb.export import export
    from lightning_sentemb.methods import SimCSE

    method = build_method(SimCSE, tiny_bert, pooler="cls", mlp="always")
    export(method, tmp_path / "export")
    expected = method.encode(SENTENCES)
    st = SentenceTransformer(str(tmp_path / "export"), device="cpu")
    assert torch.allclose(torch.as_tensor(st.encode(SENTENCES)), expected, atol=1e-5)
    # SimCSE's convention: `--pooler cls` on the exported folder is the backbone pooler = the MLP
    reloaded = load_method(str(tmp_path / "export"), pooler="cls")
    assert torch.allclose(reloaded.encode(SENTENCES), expected, atol=1e-5)


def test_export_refuses_a_non_empty_folder(tiny_bert, tmp_path):
    from lightning_sentemb.export import export
    from lightning_sentemb.methods import SimCSE

    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        export(build_method(SimCSE, tiny_bert, pooler="avg", mlp="none"), tmp_path / "export")


def test_supervised_fit_with_nli_triplets(tiny_bert, sts_fixture, tmp_path):
    nli = tmp_path / "nli.csv"
    nli.write_text("sent0,sent1,hard_neg\n"
                   + "".join(f"a man {i} runs,a person {i} moves,nobody {i} sits\n" for i in range(32)))
    main(["fit", *fit_args(tiny_bert, sts_fixture, tmp_path, "--data.train_file", str(nli), "--model.mlp", "always",
                          "--model.hard_negative_weight", "0.5", "--model.mlm_weight", "0.1")])
    metrics = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()
    assert "train/mlm_loss" in metrics


def test_encode_is_order_preserving_and_batch_independent(tiny_bert):
    from lightning_sentemb.methods import SimCSE

    method = build_method(SimCSE, tiny_bert, pooler="avg", mlp="none")
    together = method.encode(SENTENCES, batch_size=2)
    alone = torch.cat([method.encode([s]) for s in SENTENCES])
    assert torch.allclose(together, alone, atol=1e-5)
    assert method.training  # encode restores the mode it found


@pytest.mark.slow
def test_lightning_alias_runs_the_demo_config(shared_data, tmp_path, monkeypatch):
    monkeypatch.setenv("SENTEMB_DATA", str(shared_data))
    # fewer steps than the config's val_check_interval (30): validated after the last step all the same
    main(["fit", "-c", "experiments/demo/simcse.yaml", "--trainer.max_steps", "3",
          "--trainer.limit_val_batches", "1", "--trainer.default_root_dir", str(tmp_path),
          "--data.cache_dir", str(tmp_path / "cache"), "--data.max_train_examples", "512",
          "--data.batch_size", "16", "--data.eval_batch_size", "64",
          "--trainer.precision", "32-true"])
    assert (tmp_path / "checkpoints" / "best.ckpt").exists() and (tmp_path / "checkpoints" / "last.ckpt").exists()
    assert "val/STSBenchmark-dev" in (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text()


def test_evaluate_writes_a_report_folder_for_several_models(trained, tiny_bert, sts_fixture, tmp_path):
    main(["evaluate", "--model", str(trained / "checkpoints" / "best.ckpt"), tiny_bert, "--pooler", "avg",
          "--tasks", "sts,analysis", "--data-dir", str(sts_fixture), "--output", str(tmp_path / "report")])
    report = (tmp_path / "report" / "report.md").read_text()
    assert "## STS" in report and report.count("| ") > 4
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    assert len(results) == 2 and all({"sts", "analysis", "frequent_tokens"} <= set(r) for r in results.values())
    assert list((tmp_path / "report" / "figures").glob("*.png"))


def test_two_checkpoints_named_best_get_their_own_figures_written_once(trained, sts_fixture, tmp_path):
    for run in ("run_a", "run_b"):
        (tmp_path / run / "checkpoints").mkdir(parents=True)
        (tmp_path / run / "checkpoints" / "best.ckpt").write_bytes((trained / "checkpoints" / "best.ckpt").read_bytes())
    main(["evaluate", "--model", str(tmp_path / "run_a" / "checkpoints" / "best.ckpt"),
          str(tmp_path / "run_b" / "checkpoints" / "best.ckpt"), "--tasks", "analysis", "--data-dir", str(sts_fixture),
          "--output", str(tmp_path / "report")])
    assert list(json.loads((tmp_path / "report" / "results.json").read_text())) == ["run_a/best", "run_b/best"]
    figures = sorted(p.name for p in (tmp_path / "report" / "figures").iterdir())
    assert figures == ["alignment_uniformity.png", "frequent_tokens.png", "run_a_best_cosine_distribution.png",
                       "run_a_best_tsne.png", "run_b_best_cosine_distribution.png", "run_b_best_tsne.png"]


def test_evaluate_rejects_unknown_tasks(trained, capsys):
    with pytest.raises(SystemExit):
        main(["evaluate", "--model", str(trained / "checkpoints" / "best.ckpt"), "--tasks", "sts,glue"])
    assert "unknown evaluator(s) glue" in capsys.readouterr().err


def test_test_time_evaluators_are_config(trained, tiny_bert, sts_fixture):
    main(["test", *fit_args(tiny_bert, sts_fixture, trained), "--ckpt_path", "best",
          "--data.test_tasks", "[STSBenchmark]", "--data.test_evaluators", "[analysis]"])
    metrics = sorted((trained / "lightning_logs").glob("version_*/metrics.csv"))[-1].read_text()
    assert "test/analysis/alignment" in metrics and "test/STSBenchmark" in metrics
    assert list((trained / "figures").glob("test-step*/*.png"))
