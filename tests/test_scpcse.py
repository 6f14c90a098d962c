"""SCPCSE's shallow continuous prompt against a hand-built forward (fp64, 1e-6): at initialization each
prompt vector is its template token's input embedding, the vectors sit where the template's tokens sit
(around the sentence, not on the special tokens or the mask), the embedding is the [MASK] state of a
backbone that stays frozen while only the prompt (and the training MLP) trains."""

from __future__ import annotations

import torch
from transformers import AutoModel, AutoTokenizer

from lightning_sentemb.methods import SCPCSE, PromptBERT
from lightning_sentemb.methods.building import build_method

SENTENCES = ["a man is playing a guitar .", "the cat sleeps", "kids play football in the park"]
TEMPLATE = 'This sentence : "[X]" means [MASK] .'


def by_hand(path: str) -> tuple[list[int], list[int], list[int], int]:
    """The template's token ids before the sentence, between it and [MASK], and after [MASK] (without the
    tokenizer's special tokens), and the mask id."""
    tokenizer = AutoTokenizer.from_pretrained(path)

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    return ids('This sentence : "'), ids('" means'), ids("."), tokenizer.mask_token_id


def test_prompt_placement_equals_a_hand_built_forward(tiny_bert: str) -> None:
    method = build_method(SCPCSE, tiny_bert).double().eval()
    before, between, after, mask_id = by_hand(tiny_bert)
    model = AutoModel.from_pretrained(tiny_bert).double().eval()
    words = model.get_input_embeddings()
    prompt = method.encoder.prompt
    torch.testing.assert_close(prompt, words(torch.tensor(before + between + after)), rtol=0, atol=0)
    with torch.no_grad():
        prompt.normal_()  # trained vectors differ from the embeddings they started from
    tokenizer = method.tokenizer
    for sentence, ours in zip(SENTENCES, method.encode(SENTENCES).double(), strict=True):
        ids = tokenizer(sentence, add_special_tokens=False)["input_ids"]
        row = [tokenizer.cls_token_id, *before, *ids, *between, mask_id, *after, tokenizer.sep_token_id]
        slots = ([1 + i for i in range(len(before))] + [1 + len(before) + len(ids) + i for i in range(len(between))]
                 + [len(row) - 1 - len(after) + i for i in range(len(after))])
        inputs = words(torch.tensor([row]))
        inputs[0, slots] = prompt.detach()
        with torch.no_grad():
            hidden = model(inputs_embeds=inputs).last_hidden_state[0]
        torch.testing.assert_close(ours, hidden[row.index(mask_id)], rtol=1e-6, atol=1e-6)


def test_at_initialization_it_is_the_discrete_template(tiny_bert: str) -> None:
    shallow = build_method(SCPCSE, tiny_bert)
    discrete = build_method(PromptBERT, tiny_bert, templates=[TEMPLATE], denoise_test=False)
    torch.testing.assert_close(shallow.encode(SENTENCES), discrete.encode(SENTENCES), rtol=0, atol=0)


def test_the_backbone_is_frozen_and_only_the_prompt_trains(tiny_bert: str) -> None:
    method = build_method(SCPCSE, tiny_bert)
    assert method.backbone_frozen and not any(p.requires_grad for p in method.encoder.backbone.parameters())
    assert {n for n, p in method.named_parameters() if p.requires_grad} == {"encoder.prompt", "mlp.0.weight",
                                                                           "mlp.0.bias"}
    assert method.trainable_state_keys() == {"encoder.prompt", "mlp.0.weight", "mlp.0.bias"}
    assert method.encoder.backbone.training  # dropout makes the two views differ
    state = {k: v.clone() for k, v in method.state_dict().items()}
    batch = method.collate([{"sent0": ids} for ids in method.encoder.format.sentence_ids(SENTENCES)])
    assert batch["num_views"] == 2 and torch.equal(*batch["features"]["input_ids"].unflatten(0, (2, -1)))
    optimizer = torch.optim.SGD([p for p in method.parameters() if p.requires_grad], lr=1.0)
    method.step_loss(batch)[0].backward()
    optimizer.step()
    changed = {k for k, v in method.state_dict().items() if not torch.equal(v, state[k])}
    assert changed == {"encoder.prompt", "mlp.0.weight", "mlp.0.bias"}


def test_with_lora_the_adapters_and_the_prompt_train(tiny_bert: str) -> None:
    lora = {"r": 2, "alpha": 4.0, "dropout": 0.0, "target_modules": "all-linear"}
    method = build_method(SCPCSE, tiny_bert, lora=lora)
    trainable = {n for n, p in method.named_parameters() if p.requires_grad}
    assert {"encoder.prompt", "mlp.0.weight", "mlp.0.bias"} < trainable
    assert all(".lora_" in n for n in trainable - {"encoder.prompt", "mlp.0.weight", "mlp.0.bias"})
    batch = method.collate([{"sent0": ids} for ids in method.encoder.format.sentence_ids(SENTENCES)])
    method.step_loss(batch)[0].backward()
    assert method.encoder.prompt.grad.abs().sum() > 0


def test_a_checkpoint_restores_the_trained_prompt_and_the_export_reads_it(tiny_bert: str, tmp_path) -> None:
    """What a checkpoint keeps (the trainable tensors) loads after `configure_model`, which starts the prompt
    from the embeddings again (Lightning restores a resumed fit and `load_from_checkpoint` in that order);
    the export records the continuous template and gives `encode`'s embeddings."""
    from sentence_transformers import SentenceTransformer

    from lightning_sentemb.export import export

    trained = build_method(SCPCSE, tiny_bert)
    with torch.no_grad():
        trained.encoder.prompt.normal_()
    kept = {k: v for k, v in trained.state_dict().items() if k in trained.trainable_state_keys()}
    restored = build_method(SCPCSE, tiny_bert)
    restored.load_state_dict(kept)
    assert torch.equal(restored.encoder.prompt, trained.encoder.prompt)
    folder = export(restored.eval(), tmp_path / "export")
    assert '"continuous": true' in (folder / "sentemb_template_config.json").read_text()
    model = SentenceTransformer(str(folder), device="cpu", trust_remote_code=True)
    torch.testing.assert_close(model.encode(SENTENCES, convert_to_tensor=True), trained.encode(SENTENCES),
                               rtol=1e-5, atol=1e-5)


def test_the_prompt_gradient_repeats_bit_for_bit(tiny_bert: str) -> None:
    """The prompt vectors reach the input through a gather whose backward must not depend on thread timing:
    CPU advanced indexing accumulates its gradient with racing atomic adds once it has 32,768 elements
    (torch's grain; the demo's batch is past it), which made two identical runs differ (issue 46, item 9).
    66 rows x 17 tokens x 32 wide on 2 threads are past that grain too."""
    method = build_method(SCPCSE, tiny_bert).eval()  # no dropout: only the order of the sums could differ
    encoder = method.encoder
    features = encoder.format.build(encoder.format.sentence_ids(SENTENCES * 22), None)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(4):
            encoder.prompt.grad = None
            encoder(features).square().sum().backward()
            grads.append(encoder.prompt.grad)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(grad, grads[0]) for grad in grads[1:])
