"""Every method on every backbone family: BERT, RoBERTa, ModernBERT, DistilBERT, ELECTRA and decoder LLMs
(Llama, Qwen2, Qwen3, Mistral, Gemma, Gemma-2, Phi-3, OPT, GPT-2), tiny random models built in code
(tests/conftest.py).

- the method × backbone table (README "Backbones"): each pair trains 3 steps with a finite loss or is
  refused with its one line;
- decoder pooling: `last`, `avg` and template pooling give the same embeddings left- and right-padded;
- the packed forward equals the padded one (loss, every gradient, embeddings) on each new family;
- gradient caching is exact and resume bit-exact on a decoder;
- the export round trip through sentence-transformers for decoders and ModernBERT.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModel

from lightning_sentemb import methods
from lightning_sentemb.backbones import UnsupportedBackbone
from lightning_sentemb.callbacks.kmeans import initial_centroids
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.export import export
from lightning_sentemb.methods import (
    DCLR,
    DCPCSE,
    BERTFlow,
    ClusterNS,
    ClusterNSPrefix,
    ClusterNSPrompt,
    ConPVP,
    PromptBERT,
    SimCSE,
)
from lightning_sentemb.methods.base import SentEmbMethod
from lightning_sentemb.methods.building import build_method
from lightning_sentemb.methods.consert import ConSERT
from lightning_sentemb.methods.esimcse import ESimCSE
from lightning_sentemb.methods.mixcse import MixCSE
from tests.examples import training_examples
from tests.test_padding_free import assert_packed_equals_padded, without_dropout

SENTENCES = ["a man is playing a guitar .", "the cat sat .", "this sentence means something rather long , really .",
             "two dogs run across the field today .", "nice .", "a woman is slicing an onion on the table .",
             "kids play football in the park", "the sun shines"]

METHODS = {
    "SimCSE": lambda path: build_method(SimCSE, path),
    "PromptBERT": lambda path: build_method(PromptBERT, path),
    "ConPVP": lambda path: build_method(ConPVP, path, prompt_length=2),
    "DCPCSE": lambda path: build_method(DCPCSE, path, prefix_len=2),
    "ClusterNS": lambda path: build_method(ClusterNS, path, num_clusters=2),
    "ClusterNSPrompt": lambda path: build_method(ClusterNSPrompt, path, num_clusters=2),
    "ClusterNSPrefix": lambda path: build_method(ClusterNSPrefix, path, num_clusters=2, prefix_len=2),
    # its default pair shuffles tokens, which decoders refuse (REFUSED): cutoffs run on every family
    "ConSERT": lambda path: build_method(ConSERT, path, augmentations=["token_cutoff", "feature_cutoff"]),
    "DCLR": lambda path: build_method(DCLR, path, guide="self"),
}
# SNCSE (PromptBERT's encoder), SCPCSE (ConPVP's prompt vectors, at a template's own tokens, on a frozen
# backbone) and SBERT (SimCSE's plain encoder) trained once on every family (docs/backbones.md); the suite
# keeps SCPCSE's continuous template under a byte-level BPE and a decoder's last-token readout (all three
# train on BERT in their own tests), and ConSERTJoint's classifier beside its views there.
NEWER_METHODS = {"SCPCSE": lambda path: build_method(methods.SCPCSE, path),
                 "ConSERTJoint": lambda path: build_method(methods.ConSERTJoint, path)}  # token cutoff: any family
BACKBONES = ["tiny_bert", "tiny_roberta", "tiny_modernbert", "tiny_distilbert", "tiny_electra", "tiny_llama",
             "tiny_qwen2", "tiny_opt", "tiny_gemma2", "tiny_gpt2", "tiny_phi3"]
ENCODERS = ["tiny_modernbert", "tiny_distilbert", "tiny_electra"]
DECODERS = ["tiny_llama", "tiny_qwen2", "tiny_qwen3", "tiny_mistral", "tiny_gemma", "tiny_gemma2", "tiny_phi3",
            "tiny_opt", "tiny_gpt2"]
NEW_FAMILIES = [*ENCODERS, *DECODERS]

# The README's method × backbone table: every default-configured pair works. What a family refuses:
REFUSED = {
    ("SimCSE", "pooler cls", "tiny_llama"): (lambda path: build_method(SimCSE, path, pooler="cls"), "sees only itself"),
    ("SimCSE", "MLM loss", "tiny_qwen2"): (lambda path: build_method(SimCSE, path, mlm_weight=0.1),
                                           "no masked-LM head"),
    ("DCPCSE", "MLM loss", "tiny_llama"): (lambda path: build_method(DCPCSE, path, prefix_len=2, mlm_weight=0.1),
                                           "no masked-LM head"),
    ("SimCSE", "pooler mask", "tiny_bert"): (lambda path: build_method(SimCSE, path, pooler="mask"), "template"),
    ("ConSERT", "shuffle", "tiny_qwen2"): (lambda path: build_method(ConSERT, path), "reads in the order of its mask"),
}


def quiet(method: SentEmbMethod) -> SentEmbMethod:
    method.log = lambda *args, **kwargs: None
    method.log_dict = lambda *args, **kwargs: None
    return method


def unsupervised_examples(method: SentEmbMethod) -> list[dict[str, list[int]]]:
    """The sentences as the method trains on them (with their negations, SNCSE; as labelled pairs, SBERT)."""
    return training_examples(method, SENTENCES)


def train_steps(method: SentEmbMethod, steps: int = 3) -> list[float]:
    """`steps` optimizer steps on the unsupervised sentences, the ClusterNS centroids live after the first."""
    optimizer = torch.optim.AdamW([p for p in method.parameters() if p.requires_grad], lr=1e-3)
    examples = unsupervised_examples(method)
    losses = []
    for step in range(steps):
        method.collate_generator.manual_seed(step)
        batch = method.collate(examples)
        if hasattr(method, "cluster_state") and step == 1:
            with torch.no_grad():
                anchors = method.embed(batch["features"]).unflatten(0, (batch["num_views"], -1))[0]
            method.cluster_state.initialize_(initial_centroids(anchors, 2))
        loss, _ = method.step_loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize(("name", "backbone"), [*itertools.product(METHODS, BACKBONES),
                                              *itertools.product(NEWER_METHODS, ["tiny_roberta", "tiny_qwen2"])])
def test_every_method_trains_on_every_backbone(name: str, backbone: str, request) -> None:
    torch.manual_seed(0)
    method = quiet({**METHODS, **NEWER_METHODS}[name](request.getfixturevalue(backbone)))
    losses = train_steps(method)
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert method.encode(SENTENCES[:3]).isfinite().all()


@pytest.mark.parametrize("key", list(REFUSED), ids=lambda key: "-".join(key))
def test_refused_pairs_get_one_line_naming_method_model_type_and_why(key, request) -> None:
    name, _, backbone = key
    build, why = REFUSED[key]
    with pytest.raises(SentEmbUserError) as refusal:
        build(request.getfixturevalue(backbone))
    message = str(refusal.value)
    assert "\n" not in message and why in message
    if isinstance(refusal.value, UnsupportedBackbone):
        assert message.startswith(f"{name} on ") and ("llama" in message or "qwen2" in message)


def test_decoders_default_to_last_token_pooling_and_the_prompteol_template(tiny_qwen2: str) -> None:
    assert build_method(SimCSE, tiny_qwen2).hparams.pooler == "last"
    method = build_method(PromptBERT, tiny_qwen2)
    assert not method.hparams.denoise_train  # PromptEOL trains without denoising
    template = method.encoder.format.templates[0]
    assert template.text == 'This sentence : "[X]" means in one word:"'
    tokenizer = method.tokenizer
    features = method.sentence_features(["the cat sat"])
    row = features["input_ids"][0].tolist()
    # the row ends with the template's last token (no [SEP]/EOS after it), and that token is the one read
    assert tokenizer.decode(row[-1:]) == '"' and features["pool_position"].tolist() == [len(row) - 1]


def test_a_decoder_template_written_with_mask_is_cut_before_it(tiny_llama: str) -> None:
    """ConPVP's and PromptBERT's [MASK] templates on a decoder: read at the token that predicts the mask."""
    method = build_method(PromptBERT, tiny_llama, templates=['This sentence : "[X]" means [MASK] .'])
    cut = build_method(PromptBERT, tiny_llama, templates=['This sentence : "[X]" means'])
    sentences = ["the cat sat", "a dog runs in the park"]
    assert method.sentence_features(sentences)["input_ids"].equal(cut.sentence_features(sentences)["input_ids"])
    with pytest.raises(SentEmbUserError, match="must come first"):
        build_method(PromptBERT, tiny_llama, templates=['[MASK] is what "[X]" means'])


def left_padded(features: dict, pad_id: int) -> dict:
    """The same rows padded on the left: every (rows, width) tensor shifted right by its row's padding,
    `pool_position` with it; the packed layout is rebuilt from the mask."""
    mask = features["attention_mask"]
    width = mask.shape[1]
    shift = width - mask.sum(1, keepdim=True)
    source = (torch.arange(width)[None] - shift).clamp_min(0)
    keep = torch.arange(width)[None] >= shift
    out = {}
    for key, value in features.items():
        if key == "layout":
            continue
        if key == "pool_position":
            out[key] = value + shift[:, 0]
        elif isinstance(value, torch.Tensor) and value.shape == mask.shape:
            fill = {"input_ids": pad_id, "prompt_slots": -1}.get(key, 0)
            out[key] = torch.where(keep, value.gather(1, source), torch.full_like(value, fill))
        else:
            out[key] = value
    return out


@pytest.mark.parametrize("padding_free", [True, False])
@pytest.mark.parametrize("pooling", ["last", "avg", "template", "prompt_slots"])
@pytest.mark.parametrize("backbone", ["tiny_llama", "tiny_qwen2", "tiny_opt", "tiny_gemma2", "tiny_phi3"])
def test_left_and_right_padding_give_the_same_embeddings(backbone: str, pooling: str, padding_free: bool,
                                                         request) -> None:
    path = request.getfixturevalue(backbone)
    if pooling == "template":
        method = build_method(PromptBERT, path)
    elif pooling == "prompt_slots":
        method = build_method(ConPVP, path, prompt_length=2)
    else:
        method = build_method(SimCSE, path, pooler=pooling, mlp="none")
    method.encoder.configure_speed(padding_free, compile_layers=False)
    method.eval()
    right = method.sentence_features(SENTENCES)
    assert right["attention_mask"][:, -1].eq(0).any()  # the batch holds padding
    left = left_padded(right, method.encoder.format.pad_id)
    assert left["attention_mask"][:, 0].eq(0).any()
    with torch.no_grad():
        torch.testing.assert_close(method.embed(left), method.embed(right), atol=1e-5, rtol=1e-5)


PACKED_METHODS = {
    "simcse": lambda path, family: build_method(SimCSE, path, pooler="cls" if family in ENCODERS else "last"),
    "simcse_avg_first_last": lambda path, family: build_method(SimCSE, path, pooler="avg_first_last",
                                                               hard_negative_weight=0.5),
    "promptbert_denoised": lambda path, family: build_method(PromptBERT, path, denoise_train=True),
    "conpvp": lambda path, family: build_method(ConPVP, path, prompt_length=2),
    "dcpcse_shifted": lambda path, family: build_method(DCPCSE, path, pooler="avg", prefix_len=3),
    "dcpcse_zero": lambda path, family: build_method(DCPCSE, path, pooler="avg", prefix_len=3, position_offset="zero"),
    "clusterns": lambda path, family: build_method(ClusterNS, path, pooler="avg", num_clusters=2),
    # ModernBERT, DistilBERT and ELECTRA shuffle their tokens (decoders refuse it); element masks on each
    # family's embedding output (its adversarial view: tests/test_consert.py)
    "consert": lambda path, family: build_method(
        ConSERT, path, augmentations=["shuffle" if family in ENCODERS else "token_cutoff", "dropout"]),
    "scpcse": lambda path, family: build_method(methods.SCPCSE, path),  # on a decoder only (NEWER_METHODS)
    "dclr": lambda path, family: build_method(DCLR, path, pooler="avg", guide="self", phi=0.95),
    # the momentum forward (the encoder with the averaged tensors swapped in) on each family, packed and padded
    "esimcse": lambda path, family: build_method(ESimCSE, path, queue_size=6),
    "mixcse": lambda path, family: build_method(MixCSE, path, num_mixed=2),
}


PACKED_PAIRS = [*itertools.product([m for m in PACKED_METHODS if m != "scpcse"], NEW_FAMILIES),
                ("scpcse", "tiny_qwen2")]


@pytest.mark.parametrize(("name", "backbone"), PACKED_PAIRS)
def test_packed_forward_equals_padded_forward(name: str, backbone: str, request) -> None:
    torch.manual_seed(0)
    fast = quiet(without_dropout(PACKED_METHODS[name](request.getfixturevalue(backbone), backbone))).train()
    assert fast.encoder.padding_free
    torch.manual_seed(0)
    batch = fast.collate(unsupervised_examples(fast))
    assert_packed_equals_padded(fast, batch)


DECODER_GRAD_METHODS = {
    "simcse": lambda path: build_method(SimCSE, path),
    "simcse_sup": lambda path: build_method(SimCSE, path, hard_negative_weight=0.5),
    "promptbert": lambda path: build_method(PromptBERT, path, denoise_train=True),
    "conpvp": lambda path: build_method(ConPVP, path, prompt_length=2),
    "dcpcse": lambda path: build_method(DCPCSE, path, prefix_len=2),
    "clusterns_prompt": lambda path: build_method(ClusterNSPrompt, path, num_clusters=2),
}


@pytest.mark.parametrize("name", list(DECODER_GRAD_METHODS))
def test_gradient_caching_is_exact_on_a_decoder(name: str, tiny_qwen2: str, monkeypatch) -> None:
    from tests import test_grad_cache as grad_cache

    monkeypatch.setitem(grad_cache.METHODS, name, DECODER_GRAD_METHODS[name])
    method = grad_cache.build(name, tiny_qwen2, dtype=torch.float64)
    batch = grad_cache.batch_for(name, method)
    loss, want = grad_cache.gradients(method, batch, 0)
    cached_loss, got = grad_cache.gradients(method, batch, grad_cache.CHUNK)
    torch.testing.assert_close(cached_loss, loss, rtol=1e-12, atol=0)
    assert grad_cache.relative_error(got, want) < 1e-10, name


@pytest.mark.parametrize("method", ["SimCSE", "PromptBERT"])
def test_resume_is_bit_exact_on_a_decoder(method: str, tiny_qwen2, sts_fixture, tmp_path, monkeypatch) -> None:
    """SIGTERM mid-run, then `--ckpt_path last`: the same per-step losses and final weights as an
    uninterrupted run (dropout set to 0.1, so the per-step random state matters)."""
    from tests import test_resume as resume

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"sentence {i} is about {['cats', 'dogs', 'birds'][i % 3]} .\n" for i in range(20)))
    monkeypatch.setitem(resume.METHODS, method,
                        ["--model", f"lightning_sentemb.methods.{method}", "--model.dropout", "0.1"])

    def args(root):
        return resume.run_args(method, tiny_qwen2, sts_fixture, corpus, root, 0)

    reference = tmp_path / "reference"
    resume.fit(args(reference), tmp_path / "reference.jsonl")
    root = tmp_path / "run"
    with pytest.raises(SystemExit):
        resume.fit(args(root), tmp_path / "run.jsonl", resume.TerminateAt(resume.KILL_AT))
    resume.fit([*args(root), "--ckpt_path", "last"], tmp_path / "run.jsonl")
    assert resume.read_losses(tmp_path / "run.jsonl") == resume.read_losses(tmp_path / "reference.jsonl")
    state, expected = resume.trained_state(root), resume.trained_state(reference)
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)


EXPORTED = {
    "SimCSE": lambda path: build_method(SimCSE, path, mlp="train"),
    "SimCSE_sup_mlp": lambda path: build_method(SimCSE, path, mlp="always"),
    "PromptBERT": lambda path: build_method(PromptBERT, path),
    "ConPVP": lambda path: build_method(ConPVP, path, prompt_length=2),
    "DCPCSE": lambda path: build_method(DCPCSE, path, prefix_len=2),
    "ClusterNSPrefix": lambda path: build_method(ClusterNSPrefix, path, num_clusters=2, prefix_len=2),
    "ConSERT": lambda path: build_method(ConSERT, path, augmentations=["token_cutoff", "dropout"]),
    "BERTFlow": lambda path: build_method(BERTFlow, path, flow_levels=2, flow_depth=2),  # the first-last average
    "DCLR": lambda path: build_method(DCLR, path, guide="self"),
    "ESimCSE": lambda path: build_method(ESimCSE, path),  # its momentum encoder and queue stay out
}


@pytest.mark.parametrize("backbone", ["tiny_qwen2", "tiny_modernbert"])
@pytest.mark.parametrize("name", list(EXPORTED))
def test_export_round_trip_through_sentence_transformers(name: str, backbone: str, request, tmp_path) -> None:
    from sentence_transformers import SentenceTransformer

    torch.manual_seed(0)
    method = EXPORTED[name](request.getfixturevalue(backbone))
    train_steps(quiet(method), steps=1)  # trained weights, not the backbone's own
    folder = export(method.eval(), tmp_path / "export")
    model = SentenceTransformer(str(folder), device="cpu", trust_remote_code=True)
    torch.testing.assert_close(model.encode(SENTENCES, convert_to_tensor=True), method.encode(SENTENCES),
                               atol=1e-5, rtol=1e-5)
    card = (folder / "README.md").read_text()
    if name == "PromptBERT" and backbone == "tiny_qwen2":  # the model card says what the embedding is
        assert "template's last token" in card and "Scaling Sentence Embeddings with Large Language Models" in card


def test_a_decoder_folder_is_evaluated_with_last_token_pooling_by_default(tiny_qwen2: str) -> None:
    """`sentemb evaluate --model <LLM folder>` without `--pooler`: the family's default, not cls."""
    from lightning_sentemb.loading import load_method

    method = load_method(tiny_qwen2)
    assert method.encoder.pooler == "last"
    torch.testing.assert_close(method.encode(SENTENCES[:2]),
                               load_method(tiny_qwen2, pooler="last").encode(SENTENCES[:2]))


def test_other_encoders_get_their_own_positions_a_frozen_pooler_and_a_dropout_refusal(tmp_path) -> None:
    """MPNet (no packed forward) numbers positions from padding_idx + 1 like RoBERTa: our padded forward
    must give what the model itself gives; its unread pooler gets no gradient (DDP); a config with no
    known dropout field (DistilBERT) refuses `dropout` in one line instead of ignoring it."""
    from transformers import DistilBertConfig, MPNetConfig

    from tests.conftest import minilm_ids, save_tiny

    ids = minilm_ids()
    config = MPNetConfig(vocab_size=ids["vocab_size"], pad_token_id=1, hidden_size=32,  # MPNet's padding_idx
                         num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=130)
    path = save_tiny(tmp_path / "mpnet", config)
    method = build_method(SimCSE, path, pooler="avg", mlp="none").eval()
    assert not method.encoder.padding_free
    assert not any(p.requires_grad for p in method.encoder.backbone.pooler.parameters())
    features = method.sentence_features(SENTENCES[:3])
    model = AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        hidden = model(input_ids=features["input_ids"], attention_mask=features["attention_mask"]).last_hidden_state
    mask = features["attention_mask"].unsqueeze(-1).float()
    torch.testing.assert_close(method.encode(SENTENCES[:3]), (hidden * mask).sum(1) / mask.sum(1), atol=1e-5, rtol=1e-5)

    distilbert = save_tiny(tmp_path / "distilbert", DistilBertConfig(vocab_size=ids["vocab_size"], dim=32, n_layers=2,
                                                                     n_heads=4, hidden_dim=64))
    with pytest.raises(SentEmbUserError, match="model.init_args.dropout: no known dropout setting in the distilbert"):
        build_method(SimCSE, distilbert, pooler="avg", dropout=0.1)
