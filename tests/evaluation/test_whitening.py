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
        fit_whitening(torch.randn(8, 8), 8, source="corpus.txt")
    assert "\n" not in str(error.value)
    assert fit_whitening(torch.randn(8, 8), dim=4).kernel.shape == (8, 4)
    with pytest.raises(SentEmbUserError, match=r"span fewer than 8 directions \(3: .*--whiten-dim 3 or less"):
        fit_whitening(torch.randn(4, 8).repeat(5, 1), 8)


def test_without_a_dim_the_whitening_keeps_the_span_of_the_sentences_and_says_so():
    """Two of eight dimensions constant (as MiniLM leaves three under avg): k = 6, the rank of Σ, and the
    six whitened dimensions are white; the same fit as an explicit 6, up to each eigenvector's sign."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 8)) @ rng.standard_normal((8, 8))
    x[:, 2], x[:, 5] = 0.5, -1.0
    said = []
    whitening = fit_whitening(torch.from_numpy(x), source="task", say=said.append)
    assert whitening.kernel.shape == (8, 6)
    assert said == ["--whiten task: the 40 sentences' embeddings span 6 of 8 directions; whitened within them, "
                    "6 dimensions (--whiten-dim K keeps K ≤ 6)"]
    white = whitening(torch.from_numpy(x)).double().numpy()
    np.testing.assert_allclose(np.cov(white.T, bias=True), np.eye(6), atol=1e-5)
    explicit = fit_whitening(torch.from_numpy(x), 6, say=said.append)
    np.testing.assert_allclose(np.abs(explicit.kernel.numpy()), np.abs(whitening.kernel.numpy()), atol=1e-9)
    assert len(said) == 1  # an explicit k says nothing
    full = fit_whitening(torch.randn(40, 8), say=said.append)
    assert full.kernel.shape == (8, 8) and len(said) == 1


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


@pytest.fixture()
def target_data(sts_fixture, tmp_path):
    """The STS fixture whose STS-B train split holds sentences of its own (the fixture's splits are copies)."""
    import shutil

    root = tmp_path / "data"
    shutil.copytree(sts_fixture, root)
    words = ["a girl reads a book", "two men ride horses", "the river floods", "an old man sings", "a boy jumps"]
    rows = [f"main-captions\tMSRvid\t2012train\t{i:04d}\t{i % 5}.0\t{words[i % 5]} now\t{words[(i + 2) % 5]} {i}"
            for i in range(30)]
    (root / "senteval/downstream/STS/STSBenchmark/sts-train.csv").write_text("\n".join(rows) + "\n")
    return root


def test_target_fits_each_task_on_every_pair_of_its_splits(tiny_bert, target_data, tmp_path, capsys):
    """BERT-whitening's "target" (eng/eval.py, compute_kernel_bias): STS-B fitted on both sides of every pair of
    train, dev and test, repeats counted; an STS year on its test pairs. Computed here with numpy. (4 dimensions:
    the fixture's 16 sentences span 5 clear ones; a direction of variance 1e-7 would amplify rounding.)"""
    from lightning_sentemb.data.senteval import load_sts_task, read_stsb
    from lightning_sentemb.evaluation.sts import spearman
    from lightning_sentemb.loading import load_method

    output = tmp_path / "results.json"
    main(["evaluate", "--model", tiny_bert, "--pooler", "avg", "--data-dir", str(target_data), "--whiten", "target",
          "--whiten-dim", "4", "--output", str(output)])
    results = json.loads(output.read_text())
    raw, whitened = results
    assert whitened == f"{raw} whitened (target, 4d)" and results[whitened]["whitened"] == {"source": "target",
                                                                                          "dim": 4}
    method = load_method(tiny_bert, "avg")
    stsb = target_data / "senteval/downstream/STS/STSBenchmark"
    for name, splits in [("STSBenchmark", [read_stsb(stsb / f"sts-{split}.csv") for split in ("test", "train", "dev")]),
                         ("STS12", [load_sts_task("STS12", target_data)])]:
        task = splits[0]
        fit = [s for split in splits for s in split.first + split.second]
        distinct = list(dict.fromkeys(fit))  # a sentence is one row (its pairs' cosines tie exactly, as scored)
        rows = dict(zip(distinct, method.encode(distinct).double().numpy(), strict=True))
        mean, kernel, _ = papers_whitening(np.array([rows[s] for s in fit]), 4)
        first, second = ((np.array([rows[s] for s in side]) - mean) @ kernel for side in (task.first, task.second))
        cosines = (first * second).sum(1) / np.linalg.norm(first, axis=1) / np.linalg.norm(second, axis=1)
        cosines = cosines.round(6)  # a repeated pair's cosines tie (BLAS may differ in the last bit by row)
        assert results[whitened]["sts"][name] == pytest.approx(100 * spearman(cosines, task.gold), abs=1e-4), name
    task_mode = tmp_path / "task.json"
    main(["evaluate", "--model", tiny_bert, "--pooler", "avg", "--data-dir", str(target_data), "--whiten", "task",
          "--whiten-dim", "4", "--output", str(task_mode)])
    by_task = json.loads(task_mode.read_text())[f"{raw} whitened (task, 4d)"]["sts"]
    assert by_task["STSBenchmark"] != pytest.approx(results[whitened]["sts"]["STSBenchmark"], abs=1e-3)


def test_target_without_a_train_split_is_one_line(tiny_bert, target_data, capsys):
    (target_data / "senteval/downstream/SICK/SICK_train.txt").unlink()
    with pytest.raises(SystemExit):
        main(["evaluate", "--model", tiny_bert, "--pooler", "avg", "--data-dir", str(target_data),
              "--whiten", "target"])
    err = capsys.readouterr().err.strip()
    assert "--whiten target: SICKRelatedness's split" in err and "SICK_train.txt" in err and "\n" not in err


@pytest.mark.parametrize(("args", "message"), [
    (["--whiten", "task", "--whiten-dim", "32"], "--whiten task: a task has 16 distinct sentences for 32 whitened "
                                                 "dimensions"),
    (["--whiten-dim", "8"], "--whiten-dim applies to a whitening: add --whiten target|task|nli|FILE"),
    (["--whiten", "task", "--tasks", "sts,transfer"], "--whiten task fits each STS task on its own sentences"),
    (["--whiten", "target", "--mteb", "STS12"], "--whiten target fits each STS task on its own sentences"),
    (["--whiten", "nope.txt"], "--whiten nope.txt: no such file; give target, task, nli or a corpus file"),
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
    # the public path sentence-transformers 3-5 import too, not sentence-transformers 6's module of the class
    assert [entry["type"] for entry in json.loads((folder / "modules.json").read_text())][-1] == \
        "sentence_transformers.models.Dense"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["export", tiny_bert, str(tmp_path / "other"), "--whiten", "task"])
    assert "sentemb export --whiten task: an export serves every task" in capsys.readouterr().err
