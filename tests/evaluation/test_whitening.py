"""BERT-whitening: the transform equals the paper's equations computed independently (numpy, fp64), a fit
needs more sentences than dimensions, `sentemb evaluate --whiten` scores each model with and without it,
and `sentemb export --whiten` writes it as a module sentence-transformers applies."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lightning_sentemb.cli import main
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.evaluation.whitening import fit_whitening


def papers_whitening(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Su et al. (2021): μ, W = U·Λ^(−1/2) from the SVD of Σ = (1/N)(x − μ)ᵀ(x − μ), x̃ = (x − μ)·W[:, :k]."""
    mean = x.mean(0)
    u, s, _ = np.linalg.svd(np.cov(x.T, bias=True))
    kernel = (u / np.sqrt(s))[:, :k]
    return mean, kernel, (x - mean) @ kernel


@pytest.mark.parametrize("k", [6, 3])
def test_transform_equals_the_papers_equations(k):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 6)) @ rng.standard_normal((6, 6)) + 5.0  # anisotropic, far from the origin
    whitening = fit_whitening(torch.from_numpy(x), k if k < 6 else None)
    mean, kernel, whitened = papers_whitening(x, k)
    signs = np.sign((whitening.kernel.numpy() * kernel).sum(0))  # an eigenvector's sign is arbitrary
    np.testing.assert_allclose(whitening.mean.numpy(), mean, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(whitening.kernel.numpy(), kernel * signs, rtol=1e-6, atol=1e-6)
    ours = ((torch.from_numpy(x) - whitening.mean) @ whitening.kernel).numpy()
    np.testing.assert_allclose(ours, whitened * signs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.cov(ours.T, bias=True), np.eye(k), atol=1e-9)  # white
    assert whitening(torch.from_numpy(x).float()).dtype == torch.float32


def test_a_fit_needs_more_sentences_than_dimensions():
    with pytest.raises(SentEmbUserError, match="--whiten corpus.txt: 8 sentence.s. for 8 whitened dimensions") as error:
        fit_whitening(torch.randn(8, 8), source="corpus.txt")
    assert "\n" not in str(error.value)
    assert fit_whitening(torch.randn(8, 8), dim=4).kernel.shape == (8, 4)
    with pytest.raises(SentEmbUserError, match="span fewer than 8 directions"):
        fit_whitening(torch.randn(4, 8).repeat(5, 1))


def test_evaluate_prints_sts_with_and_without_whitening_each_task_its_own(tiny_bert, sts_fixture, tmp_path, capsys):
    from lightning_sentemb.data.senteval import load_sts_task
    from lightning_sentemb.evaluation.sts import spearman
    from lightning_sentemb.loading import load_method

    output = tmp_path / "results.json"
    main(["evaluate", "--model", tiny_bert, "--pooler", "avg", "--data-dir", str(sts_fixture), "--whiten", "task",
          "--whiten-dim", "8", "--output", str(output)])
    out = capsys.readouterr().out
    results = json.loads(output.read_text())
    raw, whitened = results  # the model, then its whitened row
    assert whitened == f"{raw} whitened (task, 8d)" and f"| {whitened} |" in out and f"| {raw} |" in out
    assert results[whitened]["whitened"] == {"source": "task", "dim": 8}
    task = load_sts_task("STSBenchmark", sts_fixture)
    sentences = list(dict.fromkeys(task.first + task.second))
    x = load_method(tiny_bert, "avg").encode(sentences).double().numpy()
    rows = dict(zip(sentences, papers_whitening(x, 8)[2], strict=True))
    first, second = np.array([rows[s] for s in task.first]), np.array([rows[s] for s in task.second])
    cosines = (first * second).sum(1) / np.linalg.norm(first, axis=1) / np.linalg.norm(second, axis=1)
    assert results[whitened]["sts"]["STSBenchmark"] == pytest.approx(100 * spearman(cosines, task.gold), abs=1e-4)
    assert results[whitened]["sts"]["STSBenchmark"] != results[raw]["sts"]["STSBenchmark"]


@pytest.mark.parametrize(("args", "message"), [
    (["--whiten", "task"], "--whiten task: a task has 16 distinct sentences for 32 whitened dimensions"),
    (["--whiten-dim", "8"], "--whiten-dim applies to a whitening: add --whiten task|nli|FILE"),
    (["--whiten", "task", "--tasks", "sts,transfer"], "--whiten task fits each STS task on its own sentences"),
    (["--whiten", "nope.txt"], "--whiten nope.txt: no such file; give task, nli or a corpus file"),
])
def test_whitening_options_that_cannot_work_are_one_line(args, message, tiny_bert, sts_fixture, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["evaluate", "--model", tiny_bert, "--pooler", "avg", "--data-dir", str(sts_fixture), *args])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith(f"sentemb: error: {message}") and "\n" not in err


def test_export_writes_the_whitening_as_sentence_transformers_own_module(tiny_bert, corpus_file, tmp_path, capsys):
    """No code of ours to trust: the Dense module applies (x − μ)·W[:, :k]; `sentemb evaluate` reads the folder
    through sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    from lightning_sentemb.evaluation.whitening import source_sentences
    from lightning_sentemb.loading import load_embedder, load_method

    folder = tmp_path / "export"
    main(["export", tiny_bert, str(folder), "--pooler", "avg", "--whiten", str(corpus_file), "--whiten-dim", "16"])
    method = load_method(tiny_bert, "avg")
    whitening = fit_whitening(method.encode(source_sentences(str(corpus_file))), 16)
    sentences = ["a man plays a guitar", "the cat sleeps on the mat", "kids play football"]
    want = whitening(method.encode(sentences))
    model = SentenceTransformer(str(folder), device="cpu")
    torch.testing.assert_close(model.encode(sentences, convert_to_tensor=True), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(load_embedder(str(folder)).encode(sentences), want, atol=1e-5, rtol=1e-5)
    assert "## Whitening" in (folder / "README.md").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["export", tiny_bert, str(tmp_path / "other"), "--whiten", "task"])
    assert "sentemb export --whiten task: an export serves every task" in capsys.readouterr().err
