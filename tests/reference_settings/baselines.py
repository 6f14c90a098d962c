"""ESimCSE, MixCSE, DCLR, SNCSE, ConSERT, SBERT and BERT-flow: the reference settings of their seed rows.

The SimCSE-derived references (ESimCSE, MixCSE, DCLR, SNCSE) train with a copy of HF `Trainer.train` of
transformers 4.2.1, whose `max_grad_norm` defaults to 1.0 and which none of their scripts sets: the clipping
rows cite the copy's clipping line. ConSERT trains with the sentence-transformers `fit` it vendors, SBERT with
sentence-transformers' `fit`, BERT-flow with its TF flow optimizer."""

from . import Setting

CLIP = "trainer.gradient_clip_val"
LR, BATCH, PRECISION = "model.init_args.lr", "data.batch_size", "trainer.precision"
# how dev and test are encoded: the SimCSE-derived trainers' evaluate() and sentence-transformers' evaluators
# run outside autocast (fp32); ConSERT's apex O1 patches torch's functions for the whole process (half)
EVAL_PRECISION = "model.init_args.eval_precision"
MONITOR, STS_B = "checkpoint.monitor", "val/STSBenchmark-dev"


def rows(config: str, *settings: tuple[str, object, str]) -> list[Setting]:
    return [Setting(config, key, value, source) for key, value, source in settings]


ESIMCSE = "caskcsg/sentemb/ESimCSE/"
ESIMCSE_RUN = {  # config: (backbone's lr line, neg_size line, dup_rate line, lr, neg_size, dup_rate)
    "esimcse": (8, 9, 11, 3e-5, 160, 0.32),
    "esimcse_bert_large": (14, 15, 17, 1e-5, 160, 0.32),
    "esimcse_roberta_base": (20, 21, 23, 1e-5, 160, 0.3),
    "esimcse_roberta_large": (26, 27, 29, 1e-5, 128, 0.28),
}
ESIMCSE_SETTINGS = [
    setting
    for config, (lr_line, neg_line, dup_line, lr, neg, dup) in ESIMCSE_RUN.items()
    for setting in rows(
        config,
        (CLIP, 1.0, f"{ESIMCSE}esimcse/trainers.py:478"),
        (LR, lr, f"{ESIMCSE}run.sh:{lr_line}"),
        (BATCH, 64, f"{ESIMCSE}run.sh:3"),
        ("model.init_args.queue_size", neg, f"{ESIMCSE}run.sh:{neg_line}"),
        ("model.init_args.dup_rate", dup, f"{ESIMCSE}run.sh:{dup_line}"),
        ("model.init_args.dup_unit", "subword", f"{ESIMCSE}run.sh:4"),
        ("model.init_args.momentum", 0.995, f"{ESIMCSE}run.sh:2"),
        ("model.init_args.dup_rule", "reference", f"{ESIMCSE}train.py:517"),
        ("model.init_args.momentum_init", "fresh", f"{ESIMCSE}esimcse/models.py:94"),
        (PRECISION, "16-mixed", f"{ESIMCSE}run.sh:52"),
        (EVAL_PRECISION, "32", f"{ESIMCSE}esimcse/trainers.py:115"),
        ("trainer.val_check_interval", 125, f"{ESIMCSE}run.sh:45"),
        (MONITOR, STS_B, f"{ESIMCSE}run.sh:43"),
        ("model.init_args.weight_decay", 0.0, f"{ESIMCSE}esimcse/trainers.py:478"),
    )
] + rows("esimcse_roberta_large", ("model.init_args.dropout", 0.15, f"{ESIMCSE}run.sh:28"))

MIXCSE = "BDBC-KG-NLP/MixCSE_AAAI2022/"
MIXCSE_SETTINGS = [
    setting
    for config, (lr, lr_source) in {"mixcse_bert_large": (1e-5, "princeton-nlp/SimCSE/README.md:244")}.items()
    for setting in rows(
        config,
        (CLIP, 1.0, f"{MIXCSE}mixcse/trainers.py:591"),
        (LR, lr, lr_source),
        (BATCH, 64, f"{MIXCSE}run_unsup_example.sh:11"),
        ("model.init_args.mix_lambda", 0.2, f"{MIXCSE}run_unsup_example.sh:24"),
        ("model.init_args.mix_layout", "reference", f"{MIXCSE}mixcse/models_mix.py:220"),
        ("model.init_args.val_mlp", True, f"{MIXCSE}mixcse/models_mix.py:329"),
        ("model.init_args.mlp", "train", f"{MIXCSE}run_unsup_example.sh:28"),
        (PRECISION, "32-true", f"{MIXCSE}run_unsup_example.sh:5"),
        (EVAL_PRECISION, "32", f"{MIXCSE}mixcse/trainers.py:232"),
        ("trainer.val_check_interval", 125, f"{MIXCSE}run_unsup_example.sh:17"),
        (MONITOR, STS_B, f"{MIXCSE}run_unsup_example.sh:15"),
    )
]

DCLR = "RUCAIBox/DCLR/"
DCLR_RUN = {  # config: run.sh's lines for it
    "dclr_bert_large": dict(batch=77, lr=78, phi=88, noise=89, fp16=94, epochs=76),
    "dclr_roberta_base": dict(batch=43, lr=44, phi=54, noise=55, fp16=60, epochs=42),
}
DCLR_SETTINGS = [
    setting
    for config, lines in DCLR_RUN.items()
    for large in [config == "dclr_bert_large"]
    for setting in rows(
        config,
        (CLIP, 1.0, f"{DCLR}simcse/trainers.py:512"),
        (LR, 3e-5, f"{DCLR}run.sh:{lines['lr']}"),
        # 4 processes of 64 (run.sh:71): the global batch on one device
        (BATCH, 256 if large else 128, f"{DCLR}run.sh:{lines['batch']}"),
        ("model.init_args.phi", 0.9 if large else 0.85, f"{DCLR}run.sh:{lines['phi']}"),
        ("model.init_args.noise_times", 3.0 if large else 2.5, f"{DCLR}run.sh:{lines['noise']}"),
        ("trainer.max_epochs", 1 if large else 3, f"{DCLR}run.sh:{lines['epochs']}"),
        ("model.init_args.objective", "reference", f"{DCLR}simcse/models.py:709"),
        (MONITOR, "val/avg", f"{DCLR}simcse/trainers.py:137"),
        (PRECISION, "32-true", f"{DCLR}run.sh:{lines['fp16']}"),
        (EVAL_PRECISION, "32", f"{DCLR}simcse/trainers.py:116"),
    )
] + rows("dclr_bert_large", ("model.init_args.global_batch", 256, f"{DCLR}run.sh:71"))

SNCSE = "Sense-GVT/SNCSE/"
SNCSE_SETTINGS = [
    setting
    for config, (start, batch_line, batch, lr) in {"sncse": (5, 10, 256, 1e-5), "sncse_bert_large": (21, 26, 128, 5e-6),
                                                   "sncse_roberta_base": (36, 41, 256, 1e-5)}.items()
    for setting in rows(
        config,
        (CLIP, 1.0, f"{SNCSE}SNCSE/simcse/trainers.py:474"),
        (LR, lr, f"{SNCSE}train_SNCSE.sh:{batch_line + 1}"),
        (BATCH, batch, f"{SNCSE}train_SNCSE.sh:{batch_line}"),
        (PRECISION, "32-true", f"{SNCSE}train_SNCSE.sh:{start}"),
        (EVAL_PRECISION, "32", f"{SNCSE}SNCSE/simcse/trainers.py:115"),
        ("trainer.val_check_interval", 125, f"{SNCSE}train_SNCSE.sh:{batch_line + 7}"),
        (MONITOR, STS_B, f"{SNCSE}train_SNCSE.sh:{batch_line + 3}"),
    )
]

CONSERT = "yym6472/ConSERT/"
FIT = f"{CONSERT}sentence_transformers/SentenceTransformer.py"
CONSERT_SETTINGS = [
    setting
    for config, (script, eval_steps, warmup) in {
        "consert": ("unsup-consert-base.sh", 200, 930), "consert_bert_large": ("unsup-consert-large.sh", 100, 2323),
        "consert_sup_unsup": ("sup-consert-joint-unsup-base.sh", 200, 2323)}.items()
    for setting in rows(
        config,
        (CLIP, 1.0, f"{FIT}:465"),
        (LR, 5e-7, f"{CONSERT}scripts/{script}:1"),
        (BATCH, 96, f"{CONSERT}scripts/{script}:1"),
        ("data.max_seq_len", 64, f"{CONSERT}scripts/{script}:1"),
        ("model.init_args.temperature", 0.1, f"{CONSERT}scripts/{script}:1"),
        ("model.init_args.loss_weight", 0.3, f"{CONSERT}scripts/{script}:1"),
        ("model.init_args.weight_decay", 0.01, f"{FIT}:461"),
        ("model.init_args.warmup_steps", warmup, f"{CONSERT}main.py:284"),
        (PRECISION, "16-mixed", f"{CONSERT}scripts/{script}:1"),
        # amp.initialize (O1) casts every later call, the evaluator's and the test's (main.py:309-315) too
        (EVAL_PRECISION, "auto", f"{FIT}:552"),
        ("trainer.val_check_interval", eval_steps, f"{CONSERT}scripts/{script}:1"),
        ("trainer.check_val_every_n_epoch", 1, f"{FIT}:558"),
        (MONITOR, STS_B, f"{CONSERT}main.py:278"),
        ("trainer.callbacks.EarlyStopping.patience", 10, f"{CONSERT}scripts/{script}:1"),
        ("trainer.callbacks.EarlyStopping.monitor", STS_B, f"{FIT}:614"),
        ("model.init_args.pooler", "avg", f"{CONSERT}main.py:190"),
        ("model.init_args.test_pooler", "avg_top2", f"{CONSERT}main.py:316"),
    )
]

ST = "UKPLab/sentence-transformers/"
SBERT_SETTINGS = rows(
    "sbert_sup",
    (CLIP, 1.0, f"{ST}sentence_transformers/fit_mixin.py:179"),
    (LR, 2e-5, f"{ST}sentence_transformers/fit_mixin.py:174"),
    (BATCH, 16, f"{ST}examples/sentence_transformer/training/nli/training_nli.py:31"),
    ("model.init_args.weight_decay", 0.01, f"{ST}sentence_transformers/fit_mixin.py:175"),
    ("model.init_args.pooler", "avg", f"{ST}examples/sentence_transformer/training/nli/training_nli.py:38"),
    (PRECISION, "32-true", f"{ST}sentence_transformers/fit_mixin.py:180"),
    (EVAL_PRECISION, "32", f"{ST}sentence_transformers/evaluation/EmbeddingSimilarityEvaluator.py:251"),
)

FLOW = "bohanli/BERT-flow/"
FLOW_SETTINGS = [
    setting
    for config in ("flow", "flow_sbert")
    for setting in rows(
        config,
        (CLIP, 1.0, f"{FLOW}optimization_bert_flow.py:92"),
        (LR, 1e-3, f"{FLOW}run_siamese.py:126"),
        (BATCH, 32, f"{FLOW}run_siamese.py:97"),
        # a batch of pairs, both sentences (run_siamese.py:298-302): SNLI + MNLI's labelled pairs
        ("data.train_file", "corpora/allnli_pairs.csv", f"{FLOW}run_siamese.py:298"),
        ("data.max_seq_len", 64, f"{FLOW}scripts/train_siamese.sh:34"),
        ("model.init_args.weight_decay", 0.01, f"{FLOW}optimization_bert_flow.py:82"),
        ("model.init_args.lr_schedule", "constant", f"{FLOW}optimization_bert_flow.py:81"),
        (MONITOR, None, f"{FLOW}run_siamese.py:843"),
        (PRECISION, "32-true", f"{FLOW}run_siamese.py:843"),
        (EVAL_PRECISION, "32", f"{FLOW}run_siamese.py:847"),
    )
] + rows("flow", ("model.init_args.pooler", "avg_first_last", f"{FLOW}run_siamese.py:174"))

SETTINGS: list[Setting] = [*ESIMCSE_SETTINGS, *MIXCSE_SETTINGS, *DCLR_SETTINGS, *SNCSE_SETTINGS, *CONSERT_SETTINGS,
                           *SBERT_SETTINGS, *FLOW_SETTINGS]
