"""The `README.md` model card every export carries, in the Hugging Face format.

Front matter (YAML) for the hub: `library_name: sentence-transformers`, `pipeline_tag:
sentence-similarity`, `base_model` (when the backbone is a hub id), tags, and `model-index` with the
scores the export knows of: the STS-B dev score `best.ckpt` was selected by (kept in the checkpoint)
and the scores of `sentemb evaluate --output` given to `sentemb export --results`. Then, for a
reader: the method, its paper and citation, what the embedding is (pooling, template, prefix), the
training configuration that matters, the scores, and how to load it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..encoders.pretrained import is_hub_id
from ..errors import SentEmbUserError

if TYPE_CHECKING:
    from .protocol import ExportableMethod

__all__ = ["RunFacts", "model_card", "read_results", "run_facts"]


@dataclass(frozen=True)
class Paper:
    title: str
    url: str
    bibtex: str


PAPERS = {
    "SimCSE": Paper(
        "SimCSE: Simple Contrastive Learning of Sentence Embeddings (Gao et al., EMNLP 2021)",
        "https://aclanthology.org/2021.emnlp-main.552",
        """@inproceedings{gao2021simcse,
  title = {{SimCSE}: Simple Contrastive Learning of Sentence Embeddings},
  author = {Gao, Tianyu and Yao, Xingcheng and Chen, Danqi},
  booktitle = {Proceedings of the 2021 Conference on Empirical Methods in Natural Language Processing},
  year = {2021},
  url = {https://aclanthology.org/2021.emnlp-main.552}
}""",
    ),
    "PromptBERT": Paper(
        "PromptBERT: Improving BERT Sentence Embeddings with Prompts (Jiang et al., EMNLP 2022)",
        "https://arxiv.org/abs/2201.04337",
        """@inproceedings{jiang2022promptbert,
  title = {{PromptBERT}: Improving {BERT} Sentence Embeddings with Prompts},
  author = {Jiang, Ting and Jiao, Jian and Huang, Shaohan and Zhang, Zihan and Wang, Deqing and Zhuang, Fuzhen
            and Wei, Furu and Huang, Haizhen and Deng, Denvy and Zhang, Qi},
  booktitle = {Proceedings of the 2022 Conference on Empirical Methods in Natural Language Processing},
  year = {2022},
  url = {https://arxiv.org/abs/2201.04337}
}""",
    ),
    "ConPVP": Paper(
        "Contrastive Learning with Prompt-derived Virtual Semantic Prototypes for Unsupervised Sentence Embedding "
        "(Zeng et al., Findings of EMNLP 2022)",
        "https://aclanthology.org/2022.findings-emnlp.522",
        """@inproceedings{zeng2022conpvp,
  title = {Contrastive Learning with Prompt-derived Virtual Semantic Prototypes for Unsupervised Sentence Embedding},
  author = {Zeng, Jiali and Yin, Yongjing and Jiang, Yufan and Wu, Shuangzhi and Cao, Yunbo},
  booktitle = {Findings of the Association for Computational Linguistics: EMNLP 2022},
  year = {2022},
  url = {https://aclanthology.org/2022.findings-emnlp.522}
}""",
    ),
    "DCPCSE": Paper(
        "Deep Continuous Prompt for Contrastive Learning of Sentence Embeddings (Jiang & Wang, 2022)",
        "https://arxiv.org/abs/2203.06875",
        """@article{jiang2022dcpcse,
  title = {Deep Continuous Prompt for Contrastive Learning of Sentence Embeddings},
  author = {Jiang, Yuxin and Wang, Wei},
  journal = {arXiv preprint arXiv:2203.06875},
  year = {2022},
  url = {https://arxiv.org/abs/2203.06875}
}""",
    ),
    "PromptEOL": Paper(
        "Scaling Sentence Embeddings with Large Language Models (Jiang et al., Findings of EMNLP 2024)",
        "https://arxiv.org/abs/2307.16645",
        """@article{jiang2023prompteol,
  title = {Scaling Sentence Embeddings with Large Language Models},
  author = {Jiang, Ting and Huang, Shaohan and Luan, Zhongzhi and Wang, Deqing and Zhuang, Fuzhen},
  journal = {arXiv preprint arXiv:2307.16645},
  year = {2023},
  url = {https://arxiv.org/abs/2307.16645}
}""",
    ),
    "ClusterNS": Paper(
        "Clustering-Aware Negative Sampling for Unsupervised Sentence Representation (Deng et al., Findings of ACL "
        "2023)",
        "https://aclanthology.org/2023.findings-acl.555",
        """@inproceedings{deng2023clusterns,
  title = {Clustering-Aware Negative Sampling for Unsupervised Sentence Representation},
  author = {Deng, Jinghao and Wan, Fanqi and Yang, Tao and Quan, Xiaojun and Wang, Rui},
  booktitle = {Findings of the Association for Computational Linguistics: ACL 2023},
  year = {2023},
  url = {https://aclanthology.org/2023.findings-acl.555}
}""",
    ),
    "ConSERT": Paper(
        "ConSERT: A Contrastive Framework for Self-Supervised Sentence Representation Transfer (Yan et al., ACL 2021)",
        "https://aclanthology.org/2021.acl-long.393",
        """@inproceedings{yan2021consert,
  title = {{ConSERT}: A Contrastive Framework for Self-Supervised Sentence Representation Transfer},
  author = {Yan, Yuanmeng and Li, Rumei and Wang, Sirui and Zhang, Fuzheng and Wu, Wei and Xu, Weiran},
  booktitle = {Proceedings of the 59th Annual Meeting of the Association for Computational Linguistics},
  year = {2021},
  pages = {5065--5075},
  url = {https://aclanthology.org/2021.acl-long.393}
}""",
    ),
    "BERTFlow": Paper(
        "On the Sentence Embeddings from Pre-trained Language Models (Li et al., EMNLP 2020)",
        "https://aclanthology.org/2020.emnlp-main.733",
        """@inproceedings{li2020bertflow,
  title = {On the Sentence Embeddings from Pre-trained Language Models},
  author = {Li, Bohan and Zhou, Hao and He, Junxian and Wang, Mingxuan and Yang, Yiming and Li, Lei},
  booktitle = {Proceedings of the 2020 Conference on Empirical Methods in Natural Language Processing},
  year = {2020},
  url = {https://aclanthology.org/2020.emnlp-main.733}
}""",
    ),
}

# model-index datasets: STS tasks as MTEB names them on the hub, transfer tasks as SentEval does
STS_DATASETS = {
    "STS12": "mteb/sts12-sts", "STS13": "mteb/sts13-sts", "STS14": "mteb/sts14-sts", "STS15": "mteb/sts15-sts",
    "STS16": "mteb/sts16-sts", "STSBenchmark": "mteb/stsbenchmark-sts", "SICKRelatedness": "mteb/sickr-sts",
}


@dataclass(frozen=True)
class RunFacts:
    """What the checkpoint says about its run (`run_facts`)."""

    step: int | None = None
    dev_score: float | None = None  # STS-B dev of this very state, when it is the selected best.ckpt
    data: dict[str, Any] = field(default_factory=dict)  # the data module's arguments
    seed: int | None = None


def run_facts(checkpoint_path: str | os.PathLike, trust_checkpoint: bool = False) -> RunFacts:
    """Step, STS-B dev, data arguments and seed of a checkpoint written by `sentemb fit`."""
    from ..checkpoint_file import read_checkpoint

    checkpoint = read_checkpoint(checkpoint_path, trust_checkpoint=trust_checkpoint, mmap=True)
    dev_score = None
    for key, state in checkpoint.get("callbacks", {}).items():
        selected = isinstance(state, dict) and state.get("best_model_score") is not None
        if key.startswith("SentEmbCheckpoint") and selected and \
                Path(state.get("best_model_path", "")).name == Path(checkpoint_path).name:
            dev_score = round(float(state["best_model_score"]), 2)
    data = {k: v for k, v in checkpoint.get("datamodule_hyper_parameters", {}).items() if not k.startswith("_")}
    return RunFacts(checkpoint.get("global_step"), dev_score, data, checkpoint.get("sentemb_run_seed"))


def read_results(path: str | os.PathLike) -> dict[str, Any]:
    """The results of one model from `sentemb evaluate --output` (its JSON file, or its folder); with
    `--dims`, the truncations' results under `dims` ({size: results})."""
    path = Path(path)
    file = path / "results.json" if path.is_dir() else path
    try:
        results = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise SentEmbUserError(f"--results {path}: not a results file of `sentemb evaluate --output` "
                               f"({error})") from error
    if not isinstance(results, dict) or not results:
        raise SentEmbUserError(f"--results {file}: holds no results")
    capped = results.get("max_examples") or next((r.get("max_examples") for r in results.values() if isinstance(r, dict)
                                                  and r.get("max_examples")), None)
    if capped:
        raise SentEmbUserError(f"--results {file}: scores of a quick look capped at {capped} examples per task "
                               "(--max-examples), not for a model card; evaluate without --max-examples")
    if not {"sts", "transfer", "clustering"} & set(results):  # several models: {label: results}
        full = {label: r for label, r in results.items() if "dim" not in r and "whitened" not in r}
        if len(full) != 1:
            raise SentEmbUserError(f"--results {file} holds {len(full)} models ({', '.join(full)}); "
                                   "evaluate this checkpoint alone and pass its results")
        truncations = {r["dim"]: r for r in results.values() if "dim" in r}  # `sentemb evaluate --dims`
        results = next(iter(full.values())) | ({"dims": truncations} if truncations else {})
    return results


def model_card(
    method: ExportableMethod, folder: Path, load_name: str, facts: RunFacts | None = None,
    results: dict[str, Any] | None = None,
) -> str:
    """The model card of the export written in `folder` (its modules.json says how it loads), loaded as
    `load_name` (the export folder's name) and titled after the method and its backbone."""
    facts = facts or RunFacts()
    name = type(method).__name__
    papers = _papers(type(method), method.encoder.family.causal)
    title = f"{name} on {backbone_name(method.hparams.backbone)}"
    index = _model_index(title, facts, results or {})
    front = {
        "library_name": "sentence-transformers",
        "pipeline_tag": "sentence-similarity",
        **({"base_model": method.hparams.backbone} if is_hub_id(method.hparams.backbone) else {}),
        "tags": ["sentence-transformers", "sentence-similarity", "feature-extraction", "lightning_sentemb",
                 *dict.fromkeys(p.lower() for p in papers)],
        **({"model-index": index} if index else {}),
    }
    own = method.own_hyperparameters()
    lines = [
        "---", yaml.safe_dump(front, sort_keys=False, allow_unicode=True).strip(), "---", "",
        f"# {title}", "",
        f"A sentence-embedding model trained with **{name}** by lightning_sentemb on `{method.hparams.backbone}`.", "",
        "## Method", "",
        *(f"- {papers[p].title}: {papers[p].url}" for p in papers),
        *([] if papers else [_custom_method_line(type(method))]), "",
        "## The embedding", "",
        *_embedding_lines(method), "",
        "## Training", "",
        *_training_lines(method, facts, own), "",
    ]
    scores = _score_lines(facts, results or {})
    if scores:
        lines += ["## Scores", "", *scores, ""]
    lines += [
        "## Usage", "",
        "```python",
        "from sentence_transformers import SentenceTransformer",
        "",
        f'model = SentenceTransformer("{load_name}"{", trust_remote_code=True" if _needs_our_code(folder) else ""})',
        'embeddings = model.encode(["A man is playing a guitar.", "Someone plays an instrument."])',
        "print(model.similarity(embeddings, embeddings))",
        "```", "",
        *(["Its first module is lightning_sentemb's own (`pip install lightning_sentemb`); "
           "`trust_remote_code=True` lets sentence-transformers import it.", ""] if _needs_our_code(folder) else []),
        "`transformers.AutoModel.from_pretrained` loads the backbone alone"
        + (" (without the template, prompt or prefix)." if _needs_our_code(folder) else "."), "",
        *(["## Citation", ""] if papers else []),
        *(block for p in papers for block in ("```bibtex", papers[p].bibtex, "```", "")),
    ]
    return "\n".join(lines)


def backbone_name(backbone: str) -> str:
    """The backbone as a title names it: a hub id or `pkg:` name as given, a folder by its name."""
    return backbone if is_hub_id(backbone) or backbone.startswith("pkg:") else Path(backbone).name


def is_ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "lightning_sentemb"


def _custom_method_line(cls: type) -> str:
    """A method defined outside lightning_sentemb: named, with the method it builds on; it implements no
    paper this package knows, so the card cites none."""
    base = next(c for c in cls.__mro__ if is_ours(c))
    return (f"- `{cls.__module__}.{cls.__qualname__}`, a method defined outside lightning_sentemb on its "
            f"`{base.__name__}`; no paper is cited for it.")


def _papers(cls: type, causal: bool) -> dict[str, Paper]:
    """The papers of every method class `cls` builds on (ClusterNSPrompt: ClusterNS and PromptBERT);
    a template method on a causal decoder adds PromptEOL, whose readout it uses. A class defined
    outside the package (a subclass of SimCSE with its own loss) is not the paper: none."""
    if not is_ours(cls):
        return {}
    names = [c.__name__ for c in cls.__mro__]
    found = {name: PAPERS[name] for name in names if name in PAPERS}
    if causal and "PromptMethod" in names:  # PromptBERT, ConPVP, ClusterNSPrompt
        found["PromptEOL"] = PAPERS["PromptEOL"]
    if "ClusteringObjective" in names:  # the ClusterNS mixin names no paper itself
        found = {"ClusterNS": PAPERS["ClusterNS"], **found}
    return found


def _needs_our_code(folder: Path) -> bool:
    modules = json.loads((folder / "modules.json").read_text())
    return any(not module["type"].startswith("sentence_transformers.") for module in modules)


def _embedding_lines(method: ExportableMethod) -> list[str]:
    hp = method.hparams
    readout = "last token" if method.encoder.family.template_readout == "last" else "mask token"
    pooler = method.encoder.pooler  # at inference (ConSERT's test_pooler may differ from training's)
    pooling = f"the hidden state at the template's {readout}" if pooler == "mask" else f"`{pooler}` pooling"
    lines = [f"- Pooling: {pooling}; {'a Linear+Tanh layer after it' if method.eval_mlp is not None else 'no MLP'} "
             f"at inference (training MLP: `{hp.mlp}`).",
             f"- Dimension: {method.output_size}; inputs truncated at {method.eval_length} tokens."]
    if hp.get("matryoshka_dims"):
        lines.append(f"- Matryoshka: trained at sizes {list(hp.matryoshka_dims)}; the first d dimensions, "
                     "re-normalized, are an embedding: `SentenceTransformer(..., truncate_dim=d)`.")
    templates = getattr(method.encoder.format, "templates", None)
    if templates:
        denoise = " (template-bias denoising on)" if hp.get("denoise_test") else ""
        lines.append(f"- Template: `{templates[0].text}`{denoise}.")
    if "prefix_len" in hp:
        lines.append(f"- A trained deep prefix of {hp.prefix_len} vectors per layer on the frozen backbone.")
    if "flow_levels" in hp:
        lines.append(f"- A normalizing flow (Glow, {hp.flow_levels} levels of {hp.flow_depth} steps, "
                     f"{hp.flow_coupling} couplings) after the pooling of the frozen backbone: the embedding is its "
                     "latent.")
    return lines


def _training_lines(method: ExportableMethod, facts: RunFacts, own: dict[str, Any]) -> list[str]:
    hp, data = method.hparams, facts.data
    shared = {
        "backbone": hp.backbone, "steps trained": facts.step, "batch size (per device)": data.get("batch_size"),
        "learning rate": hp.lr, "temperature": hp.temperature, "max sequence length": data.get("max_seq_len"),
        "training corpus": data.get("train_file"), "MLM weight": hp.mlm_weight or None, "seed": facts.seed,
        "LoRA (merged into the weights unless exported adapter-only)": hp.get("lora"),
    }
    rows = [(key, value) for key, value in {**shared, **own}.items() if value is not None]
    return ["| setting | value |", "|---|---|", *(f"| {key} | `{value}` |" for key, value in rows)]


def _score_lines(facts: RunFacts, results: dict[str, Any]) -> list[str]:
    lines = []
    if facts.dev_score is not None:
        lines.append(f"STS-B dev (Spearman ×100), the score this checkpoint was selected by: {facts.dev_score:.2f}.")
    sts = results.get("sts", {})
    if sts:
        lines += ["", "STS test sets, Spearman ×100 of cosine similarities (`sentemb evaluate`):", "",
                  "| " + " | ".join(sts) + " |", "|" + "---|" * len(sts),
                  "| " + " | ".join(f"{value:.2f}" for value in sts.values()) + " |"]
    truncations = {dim: r["sts"] for dim, r in results.get("dims", {}).items() if "sts" in r}
    if sts and truncations:
        lines += ["", "STS test sets at each Matryoshka size (`sentemb evaluate --dims`; `truncate_dim=d`):", "",
                  "| dimensions | " + " | ".join(sts) + " |", "|" + "---|" * (len(sts) + 1),
                  *(f"| {dim} | " + " | ".join(f"{scores[task]:.2f}" for task in sts) + " |"
                    for dim, scores in {"all": sts, **truncations}.items())]
    transfer = {task: r["acc"] for task, r in results.get("transfer", {}).items() if "acc" in r}
    if transfer:
        lines += ["", "Transfer tasks, accuracy (%):", "", "| " + " | ".join(transfer) + " |",
                  "|" + "---|" * len(transfer), "| " + " | ".join(f"{v:.2f}" for v in transfer.values()) + " |"]
    return lines


def _model_index(name: str, facts: RunFacts, results: dict[str, Any]) -> list[dict[str, Any]]:
    """HF `model-index` entries: one per scored data set."""

    def entry(task: str, task_name: str, dataset: str, dataset_name: str, split: str, metric: str, value: float):
        return {"task": {"type": task, "name": task_name},
                "dataset": {"type": dataset, "name": dataset_name, "split": split},
                "metrics": [{"type": metric, "value": round(float(value), 2)}]}

    found = []
    if facts.dev_score is not None:
        found.append(entry("sentence-similarity", "Semantic Textual Similarity", STS_DATASETS["STSBenchmark"],
                           "STS Benchmark (dev)", "validation", "spearman_cosine", facts.dev_score))
    for task, value in results.get("sts", {}).items():
        if task in STS_DATASETS:
            found.append(entry("sentence-similarity", "Semantic Textual Similarity", STS_DATASETS[task], task, "test",
                               "spearman_cosine", value))
    for task, result in results.get("transfer", {}).items():
        if "acc" in result:
            found.append(entry("text-classification", "SentEval transfer", task, task, "test", "accuracy",
                               result["acc"]))
    return [{"name": name, "results": found}] if found else []
