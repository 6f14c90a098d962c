"""SimCSE, PromptBERT, DCPCSE (and SCPCSE), ConPVP and ClusterNS: the reference settings of their seed rows.

Read in these snapshots (`fetch`): princeton-nlp/SimCSE 49fa580, kongds/Prompt-BERT 690ba6e, YJiangcm/DCPCSE
22c52f9 (its DCPCSE-era tree, March 2022; HEAD is PromCSE, whose README changes the supervised settings),
djz233/ClusterNS 84cbd49, lemon0830/promptCSE de343d7 (ConPVP's code, inside ConPVP.zip). Every one trains with
a copy of HF `Trainer.train` and pins transformers 4.2.1 (requirements.txt), whose `TrainingArguments` defaults
the run scripts leave alone: max_grad_norm 1.0, weight_decay 0, warmup_steps 0, read in the 4.2.1 copy that
ConPVP.zip vendors. A clip row cites the trainer line that clips with it. ConPVP's code has no run script,
SCPCSE none at all: their rows cite the paper's line (`../shared/papers/`).
"""

from __future__ import annotations

from typing import Any

from . import Setting

HF_ARGS = "lemon0830/promptCSE/ConPVP.zip:ConPVP/transformers/training_args.py"  # transformers 4.2.1
SELECTION = "val/STSBenchmark-dev"  # the reference's metric_for_best_model stsb_spearman (STS-B dev)
BERT_OF_FIRST = ['This sentence of "[X]" means [MASK] .', 'This sentence : "[X]" means [MASK] .']


def pins(config: str, *rows: tuple[str, Any, str]) -> list[Setting]:
    return [Setting(config, key, value, source) for key, value, source in rows]


def loop(config: str, trainer: str, clip: int, dev: int, metric: str, eval_steps: str,
         gpus: tuple[int, str] = (1, ""), *, fp16: str) -> list[Setting]:
    """The HF Trainer loop every reference shares (`trainer`, its copy): the clip at line `clip`, AdamW without
    decay or warm-up (4.2.1's defaults), native AMP with loss scaling (the script's `--fp16`, at `fp16`), STS-B
    dev encoded in fp32 (line `dev`: autocast is for training only; the evaluation scripts never cast either)
    every `eval_steps`, the best score's checkpoint kept.

    `gpus`: (k, the line that gathers the views) for a run on k GPUs: each rank's loss is the gathered
    global batch's, through its own rows, and DDP averages the k gradients, so the reference clips the full
    gradient / k at 1.0, which is clipping the full gradient (one GPU, or our DDP) at k."""
    clip = f"{trainer}:{clip}"
    return pins(
        config,
        ("trainer.precision", "16-mixed", fp16),
        ("model.init_args.eval_precision", "32", f"{trainer}:{dev}"),
        ("trainer.gradient_clip_val", float(gpus[0]), gpus[1] if gpus[0] > 1 else clip),
        ("trainer.gradient_clip_algorithm", "norm", clip),
        ("model.init_args.weight_decay", 0.0, f"{HF_ARGS}:289"),
        ("model.init_args.warmup_steps", 0, f"{HF_ARGS}:304"),
        ("checkpoint.monitor", SELECTION, metric),
        ("checkpoint.mode", "max", f"{HF_ARGS}:423"),
        ("trainer.val_check_interval", 125, eval_steps),
    )


# ----- SimCSE: run_unsup_example.sh / run_sup_example.sh and the README's "Hyperparameters" table ---------
SIMCSE = "princeton-nlp/SimCSE"
UNSUP, SUP, README = f"{SIMCSE}/run_unsup_example.sh", f"{SIMCSE}/run_sup_example.sh", f"{SIMCSE}/README.md"


def simcse(config: str, lr: float, lr_line: int, batch: int) -> list[Setting]:
    supervised = "_sup" in config
    script = SUP if supervised else UNSUP
    def line(unsup: int, sup: int) -> str:
        return f"{script}:{sup if supervised else unsup}"

    return [
        # sup: 128 x 4 GPUs (run_sup_example.sh:6, :23), gathered at simcse/models.py:188
        *loop(config, f"{SIMCSE}/simcse/trainers.py", 473, 115, line(16, 27), line(18, 29),
              (4, f"{SIMCSE}/simcse/models.py:188") if supervised else (1, ""), fp16=line(25, 35)),
        *pins(
            config,
            ("model.init_args.lr", lr, f"{README}:{lr_line}"),
            ("data.batch_size", batch, f"{README}:242"),  # sup: 128 x 4 GPUs (run_sup_example.sh:6, :23)
            ("trainer.max_epochs", 3 if supervised else 1, line(11, 22)),
            ("data.max_seq_len", 32, line(14, 25)),
            ("model.init_args.temperature", 0.05, line(22, 32)),
            ("model.init_args.pooler", "cls", line(19, 30)),
            # unsup: --mlp_only_train (tested as cls_before_pooler, README.md:198); sup: the MLP kept
            ("model.init_args.mlp", "always" if supervised else "train", line(20, 30)),
        ),
        *(pins(config, ("model.init_args.hard_negative_weight", 0.0, f"{SIMCSE}/train.py:102")) if supervised else []),
    ]


# ----- PromptBERT: run.sh unsup-bert (lines 91-108) / unsup-roberta (73-90) ------------------------------
PB = "kongds/Prompt-BERT"
RUN = f"{PB}/run.sh"


def promptbert(config: str, roberta: bool) -> list[Setting]:
    """bert-large / roberta-large have no script: the base run's lines (the configs say so)."""
    batch, epochs, lr = (76, 77, 78) if roberta else (94, 95, 96)
    rows = [
        *loop(config, f"{PB}/prompt_bert/trainers.py", 474, 115, f"{RUN}:6", f"{RUN}:5", fp16=f"{RUN}:166"),
        *pins(
            config,
            ("model.init_args.lr", 1e-5, f"{RUN}:{lr}"),
            ("data.batch_size", 256, f"{RUN}:{batch}"),
            ("trainer.max_epochs", 1, f"{RUN}:{epochs}"),
            ("data.max_seq_len", 32, f"{RUN}:158"),
            ("model.init_args.temperature", 0.05, f"{RUN}:164"),
            ("model.init_args.mlp", "train", f"{RUN}:{83 if roberta else 101}"),
            ("model.init_args.denoise_train", True, f"{RUN}:{86 if roberta else 104}"),
            # dev is scored by sentemb_forward, which subtracts the template bias; evaluation.py's
            # arguments (eargs) leave --mask_embedding_sentence_delta out
            ("model.init_args.denoise_val", True, f"{PB}/prompt_bert/models.py:290"),
            ("model.init_args.denoise_test", False, f"{RUN}:{88 if roberta else 106}"),
        ),
    ]
    if not roberta:  # RoBERTa: the family's default pair is run.sh:80-81 token for token (methods/promptbert.py)
        rows += pins(config, ("model.init_args.templates", BERT_OF_FIRST, f"{RUN}:98"))
    return rows


# ----- ConPVP: its code (ConPVP.zip) has no run script; batch and lr from the paper's Table 2 ---------------
CP = "lemon0830/promptCSE/ConPVP.zip:ConPVP"
CONPVP_PAPER = "../shared/papers/conpvp_zeng2022.txt"  # Zeng et al. (2022), Table 2 and §4.1


def conpvp(config: str, lr: float, batch: int, line: int) -> list[Setting]:
    return [
        # no run script: SimCSE's --fp16 assumed (the code is a copy of SimCSE's; its own default is fp32)
        *loop(config, f"{CP}/simcse/trainers.py", 497, 138, f"{CONPVP_PAPER}:332", f"{CONPVP_PAPER}:330",
              fp16=f"{UNSUP}:25"),
        *pins(
            config,
            ("model.init_args.lr", lr, f"{CONPVP_PAPER}:{line}"),
            ("data.batch_size", batch, f"{CONPVP_PAPER}:{line}"),
            ("data.max_seq_len", 32, f"{CP}/train.py:167"),
            ("model.init_args.temperature", 0.05, f"{CP}/train.py:97"),
            ("model.init_args.denoise_val", False, f"{CP}/simcse/models.py:335"),  # sentemb_forward: no bias
        ),
    ]


# ----- DCPCSE at 22c52f9: run_*_example.sh and the README's "Hyperparameters" (lines 129-146) ------------
DC = "YJiangcm/DCPCSE@22c52f9"
DC_README, DC_UNSUP, DC_SUP = f"{DC}/README.md", f"{DC}/run_unsup_example.sh", f"{DC}/run_sup_example.sh"


def dcpcse(config: str, lr: float, batch: int, prefix: int, mlm: float) -> list[Setting]:
    supervised = "_sup" in config
    script, first = (DC_SUP, 141) if supervised else (DC_UNSUP, 131)  # the table's "Batch size" line
    def line(unsup: int, sup: int) -> str:
        return f"{script}:{sup if supervised else unsup}"

    return [
        *loop(config, f"{DC}/dcpcse/trainers.py", 504, 146, line(16, 27), line(18, 29), fp16=line(26, 36)),
        *pins(
            config,
            ("data.batch_size", batch, f"{DC_README}:{first}"),
            ("model.init_args.lr", lr, f"{DC_README}:{first + 1}"),
            ("model.init_args.prefix_len", prefix, f"{DC_README}:{first + 2}"),
            # do_mlm True: train.py's mlm_weight, 0.1 (train.py:114)
            ("model.init_args.mlm_weight", mlm, f"{DC_README}:{first + 3}"),
            ("trainer.max_epochs", 10 if supervised else 1, f"{DC_README}:{first + 4}"),
            ("data.max_seq_len", 32, line(14, 25)),
            ("model.init_args.temperature", 0.05, line(23, 33)),
            ("model.init_args.pooler", "cls", line(19, 30)),
            ("model.init_args.mlp", "always" if supervised else "train", line(20, 30)),
        ),
    ]


DCPCSE_PAPER = "../shared/papers/dcpcse_jiang2022.txt"  # Jiang & Wang (2022), Appendix A
SCPCSE = [
    # App. A (:203): "other settings are the same as those in SimCSE", whose script passes --fp16
    *loop("scpcse", f"{DC}/dcpcse/trainers.py", 504, 146, f"{DCPCSE_PAPER}:179", f"{DCPCSE_PAPER}:203",
          fp16=f"{UNSUP}:25"),
    *pins(
        "scpcse",
        ("model.init_args.lr", 1e-3, f"{DCPCSE_PAPER}:203"),
        ("data.batch_size", 256, f"{DCPCSE_PAPER}:203"),
        ("trainer.max_epochs", 5, f"{DCPCSE_PAPER}:203"),
        ("data.max_seq_len", 32, f"{DCPCSE_PAPER}:179"),
        ("model.init_args.temperature", 0.05, f"{DCPCSE_PAPER}:179"),
    ),
]


# ----- ClusterNS: readme.md "Hyperparameters" (lines 60-70), run_non_prompt.sh / run_prompt.sh ----------------
CN = "djz233/ClusterNS"
CN_README = f"{CN}/readme.md"


def clusterns(config: str, values: dict[str, Any], gpus: int = 1) -> list[Setting]:
    """`values`: the readme column's batch_size, model_lr, kmeans, kmeans_lr, kmean_cosine, enable_hardneg,
    bml_weight, bml_alpha, bml_beta (lines 62-70, in that order); `gpus`: its "x k" (line 62)."""
    prompt = "prompt" in config
    script = f"{CN}/run_prompt.sh" if prompt else f"{CN}/run_non_prompt.sh"
    def line(plain: int, with_prompt: int) -> str:
        return f"{script}:{with_prompt if prompt else plain}"

    train, models = ("train_prompt.py", "prompt_bert/models.py") if prompt else ("train.py", "simcse/models.py")
    keys = ["data.batch_size", "model.init_args.lr", "model.init_args.num_clusters", "model.init_args.gamma",
            "model.init_args.sigma", "model.init_args.hard_negatives", "model.init_args.bml_weight",
            "model.init_args.bml_alpha", "model.init_args.bml_beta"]
    rows = [
        *loop(config, f"{CN}/{'prompt_bert' if prompt else 'simcse'}/trainers.py", 475 if prompt else 473, 115,
              line(18, 27), line(20, 29), (gpus, f"{CN}/{models}:{230 if prompt else 196}"), fp16=line(31, 40)),
        *pins(config, *((key, value, f"{CN_README}:{62 + i}") for i, (key, value) in enumerate(
            zip(keys, values.values(), strict=True)))),
        *pins(
            config,
            ("model.init_args.update_rule", "sum", f"{CN}/{models}:{753 if prompt else 677}"),
            ("trainer.callbacks.EarlyStopping.patience", 3, line(30, 44)),
            ("trainer.callbacks.EarlyStopping.monitor", SELECTION, line(18, 27)),
            ("trainer.callbacks.EarlyStopping.mode", "max", f"{HF_ARGS}:423"),
            ("trainer.callbacks.EarlyStopping.min_delta", 0.0,
             f"{CN}/{train}:{880 if prompt else 580}"),  # EarlyStoppingCallback(patience): threshold 0
            ("trainer.max_epochs", 1, line(11, 19)),
            ("data.max_seq_len", 32, f"{CN}/{train}:{409 if prompt else 205}"),
            ("model.init_args.temperature", 0.05, f"{CN}/{train}:91"),
            ("model.init_args.mlp", "train", line(22, 30)),
        ),
    ]
    if prompt:
        rows += pins(config,
                     ("model.init_args.denoise_train", True, f"{script}:37"),
                     ("model.init_args.denoise_val", True, f"{CN}/prompt_bert/models.py:382"),
                     ("model.init_args.denoise_test", False, f"{script}:51"))  # evaluation_prompt.py: no delta
        if "roberta" not in config:
            rows += pins(config, ("model.init_args.templates", BERT_OF_FIRST, f"{script}:8"))
    else:
        rows += pins(config, ("model.init_args.pooler", "cls", f"{script}:21"))
    return rows


def column(batch, lr, kmeans, gamma, sigma, hardneg, weight, alpha, beta) -> dict[str, Any]:
    return dict(batch=batch, lr=lr, kmeans=kmeans, gamma=gamma, sigma=sigma,
                hard_negatives="second_nearest" if hardneg else "none", weight=weight, alpha=alpha, beta=beta)


SETTINGS: list[Setting] = [
    *simcse("simcse", 3e-5, 243, 64),
    *simcse("simcse_bert_large", 1e-5, 244, 64),
    *simcse("simcse_roberta_base", 1e-5, 243, 512),
    *simcse("simcse_roberta_large", 3e-5, 244, 512),
    *simcse("simcse_sup", 5e-5, 243, 512),
    *simcse("simcse_sup_bert_large", 1e-5, 244, 512),
    *simcse("simcse_sup_roberta_base", 5e-5, 243, 512),
    *simcse("simcse_sup_roberta_large", 1e-5, 244, 512),
    *promptbert("promptbert", roberta=False),
    *promptbert("promptbert_bert_large", roberta=False),
    *promptbert("promptbert_roberta_base", roberta=True),
    *promptbert("promptbert_roberta_large", roberta=True),
    *conpvp("conpvp", 3e-5, 128, 277),
    *conpvp("conpvp_bert_large", 1e-5, 128, 278),
    *conpvp("conpvp_roberta_base", 1e-5, 128, 279),
    *conpvp("conpvp_roberta_large", 1e-5, 256, 280),
    *dcpcse("dcpcse", 3e-2, 256, 16, 0.0),
    *dcpcse("dcpcse_bert_large", 3e-2, 256, 10, 0.0),
    *dcpcse("dcpcse_roberta_base", 3e-2, 64, 14, 0.1),
    *dcpcse("dcpcse_sup", 5e-3, 256, 12, 0.0),
    *dcpcse("dcpcse_sup_bert_large", 5e-3, 256, 12, 0.0),
    *dcpcse("dcpcse_sup_roberta_base", 1e-2, 256, 10, 0.0),
    *dcpcse("dcpcse_sup_roberta_large", 5e-3, 256, 10, 0.0),
    *SCPCSE,
    # the readme's "128*4" / "256*2": one global batch of per-GPU x GPUs (the views are gathered)
    *clusterns("clusterns", column(256, 5e-5, 128, 1e-3, 0.4, True, 1e-3, 0.0, 0.3)),
    *clusterns("clusterns_bert_large", column(512, 5e-5, 128, 1e-3, 0.5, True, 5e-5, 0.25, 0.3), gpus=4),
    *clusterns("clusterns_roberta_base", column(512, 5e-5, 128, 1e-3, 0.4, True, 1e-4, 0.2, 0.5), gpus=2),
    *clusterns("clusterns_prompt", column(512, 5e-5, 96, 5e-4, 0.4, True, 1e-2, 0.0, 0.2)),
    *clusterns("clusterns_prompt_bert_large", column(256, 3e-5, 96, 1e-4, 0.2, True, 5e-4, 0.25, 0.3), gpus=4),
    *clusterns("clusterns_prompt_roberta_base", column(512, 5e-5, 128, 1e-3, 0.4, False, 1e-2, 0.2, 0.6), gpus=2),
]
