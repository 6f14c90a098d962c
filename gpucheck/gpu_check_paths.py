"""Every training path of the package, one row each: what `make gpu-check`'s bf16 part trains for a few
steps in `Trainer.fit` (bf16-mixed), the last two under CUDA's sync debug mode (`gpu_check_steps`).

A row is (name, method class, keyword arguments, batch kind, model):
- kwargs: the method's `model.init_args`, as a config gives them; `From(...)` values are filled in by the
  harness for the run's sizes: `From("bert")` the bert-base folder (a guide model), `From("chunk")` the
  gradient-cache rows per chunk, `From("clusters")` ClusterNS's K (≤ the batch), `From("lora")` LoRA
  settings of the run's rank (r 64 on a GPU).
- batch: "unsup" (one sentence a line: the sentence's views; with its negation where the method reads one,
  SNCSE), "nli" (SimCSE's triplets: positive and one hard negative) or "pairs" (SBERT's labelled pairs).
- model: "bert" (bert-base) or "decoder" (the Qwen2-0.5B-shaped decoder).

**Adding a method is adding a row** (import its class here): its defaults on the model its paper trains,
plus, when it has its own auxiliary loss or batch, a row (or an option on an existing row) that runs it.
Rows may combine options (e.g. supervised SimCSE with a guide model) to keep the part within its time
limit (`gpu_check.PARTS`): every option on at least one row, rather than every combination. The harness
checks what an option must show: an MLM loss logged (`mlm_weight`), the guide's masked fraction logged
(`guide`), clustering started before the last step (the ClusterNS family, `sigma` 1 here so it starts at
the first step; its σ check reads the host until then).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning_sentemb.methods import (
    DCLR,
    DCPCSE,
    MNTP,
    SBERT,
    SCPCSE,
    SNCSE,
    BERTFlow,
    ClusterNS,
    ClusterNSPrefix,
    ClusterNSPrompt,
    ConPVP,
    ConSERT,
    ConSERTJoint,
    ESimCSE,
    MixCSE,
    PromptBERT,
    SimCSE,
)


class From(str):
    """A keyword argument's value the harness fills in (`resolve`)."""


@dataclass(frozen=True)
class TrainingPath:
    name: str
    method: type
    kwargs: dict[str, Any] = field(default_factory=dict)
    batch: str = "unsup"
    model: str = "bert"


CLUSTERING = {"num_clusters": From("clusters"), "sigma": 1.0}  # clustering starts at the first step
LLM = {"mlp": "none", "lora": From("lora")}

PATHS = [
    TrainingPath("SimCSE unsupervised", SimCSE, {"mlp": "train"}),
    TrainingPath("SimCSE supervised: hard negatives, guide model", SimCSE,
                 {"mlp": "always", "guide": {"model": From("bert"), "pooler": "cls"}}, batch="nli"),
    TrainingPath("SimCSE + MLM, gradient caching", SimCSE,
                 {"mlp": "train", "mlm_weight": 0.1, "grad_cache_chunk": From("chunk")}),
    TrainingPath("PromptBERT", PromptBERT, {"mlp": "train"}),
    TrainingPath("ConPVP, guide self", ConPVP, {"mlp": "train", "guide": "self"}),
    TrainingPath("DCPCSE (prefix 16) supervised: hard negatives, hinge, MLM", DCPCSE,
                 {"prefix_len": 16, "mlp": "always", "hinge_weight": 10.0, "mlm_weight": 0.1}, batch="nli"),
    TrainingPath("ClusterNS", ClusterNS, {"mlp": "train", **CLUSTERING}),
    TrainingPath("ClusterNSPrompt", ClusterNSPrompt, {"mlp": "train", **CLUSTERING}),
    TrainingPath("ClusterNSPrefix (prefix 16) + MLM", ClusterNSPrefix,
                 {"prefix_len": 16, "mlm_weight": 0.1, **CLUSTERING}),
    TrainingPath("MNTP (LLM2Vec), full fine-tuning", MNTP, {}, model="decoder"),
    TrainingPath("SimCSE bidirectional, mean pooling, LoRA (LLM2Vec)", SimCSE,
                 {"bidirectional": True, "pooler": "avg", "dropout": 0.3, **LLM}, model="decoder"),
    TrainingPath("SimCSE echo, LoRA, hard negatives", SimCSE, {"template": "echo", **LLM}, batch="nli",
                 model="decoder"),
    TrainingPath("PromptEOL (last token), LoRA", PromptBERT, {"denoise_train": False, **LLM}, model="decoder"),
    # the attack's backward to the embedding output and its third forward, the collated position gather
    TrainingPath("ConSERT: shuffle + adversarial", ConSERT, {"augmentations": ["shuffle", "adversarial"]}),
    # noise ascent (autograd.grad inside the loss, a CUDA generator); its own similarities weighing negatives
    TrainingPath("DCLR, guide self (self instance weighting)", DCLR, {"guide": "self", "phi": 0.9}),
    TrainingPath("DCLR, complementary model, the reference's objective", DCLR,
                 {"guide": {"model": From("bert"), "pooler": "avg"}, "objective": "reference"}),
    # the momentum encoder's forward (its averaged tensors swapped in) and the queue read from the second step
    TrainingPath("ESimCSE: word repetition, momentum encoder, queue", ESimCSE,
                 {"mlp": "train", "dup_rate": 0.32, "momentum": 0.995, "queue_batches": 2.5}),
    TrainingPath("ESimCSE, gradient caching, LoRA", ESimCSE, {"mlp": "train", "grad_cache_chunk": From("chunk"),
                                                             "lora": From("lora")}),
    # the partners drawn from a CUDA generator each step
    TrainingPath("MixCSE (paper's layout)", MixCSE, {"mlp": "train", "mix_lambda": 0.2, "num_mixed": 1}),
    TrainingPath("MixCSE (the reference's layout)", MixCSE, {"mlp": "train", "mix_layout": "reference"}),
    TrainingPath("SNCSE: negations, bidirectional margin loss", SNCSE, {"mlp": "train"}),
    TrainingPath("SCPCSE (input-layer prompt, frozen backbone)", SCPCSE, {"mlp": "train"}),
    TrainingPath("SBERT: NLI classification", SBERT, {}, batch="pairs"),
    # the classifier beside NT-Xent within the premises and within the hypotheses (token cutoff), on cached rows
    TrainingPath("ConSERTJoint (supervised ConSERT): NLI classification + contrastive, gradient caching",
                 ConSERTJoint, {"grad_cache_chunk": From("chunk")}, batch="pairs"),
    # one host read at the first step (a constant pooled dimension stops the fit), none after
    TrainingPath("BERT-flow (flow on the frozen backbone)", BERTFlow, {"flow_levels": 2, "flow_depth": 2}),
]


def resolve(value: Any, values: dict[str, Any]) -> Any:
    """`value` with every `From(name)` in it replaced by `values[name]`."""
    if isinstance(value, From):
        return values[str(value)]
    if isinstance(value, dict):
        return {key: resolve(item, values) for key, item in value.items()}
    return value
