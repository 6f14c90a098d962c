"""A training step never waits on the host, and under DDP exchanges only what the loss needs.

Host syncs (`tests/sync_counting.py`) are counted while `sentemb fit` runs 6 steps with
`log_every_n_steps` 3, for every method, padding-free and padded, with and without gradient
caching. Steps 3 and 6 are decision points (log steps; 6 also validates and ends the fit), where
reads are expected: the divergence guard's verdict, the progress bar's loss, the loggers. On steps
1, 2, 4 and 5 our code reads nothing back outside `encoders/`, but for ClusterNS's σ decision, read
every step until clustering starts (step 1 here: σ 1.0), under DDP with a broadcast of rank 0's
decision and initial centroids (and of its centroids at log steps), and BERT-flow's check, at step 1
only, that its first batch leaves no pooled dimension constant.

Inside `encoders/` nothing is read either: the padding-free forward's token layout is built on the
CPU next to the padded batch (`pad_rows`, in `collate`) and moved with it, a gradient-cache chunk's
layout is cut with the host's row lengths, and templates give their read positions
(`pool_position`) the same way.

What Lightning and transformers still read, measured here (counted apart, never failed):
- Lightning reads nothing per step between log steps, provided nothing is logged with
  `prog_bar=True`: its logger connector converts every progress-bar value to a Python number
  after every batch, bar or no bar. So `train/loss` is logged without it, and `SentEmbProgressBar`
  reads the loss itself at log steps (and STS-B dev after validation). At log steps Lightning reads
  each logged value once (`log_metrics`).
- transformers' padded forward prepares its attention mask with reads (`masking_utils`:
  `_ignore_bidirectional_mask_sdpa` asks `bool(mask.all())`) in every forward: the padded path
  (`attn_implementation: padded`, and the MLM head) waits on the host once per forward.

Collectives are counted in 2 CPU processes (gloo): per step only DDP's gradient all-reduce and the
all-gather of the embeddings (`distributed.gather_with_grad`, with its backward) remain of ours,
and Lightning's own: since 2.5.1 (Lightning-AI/pytorch-lightning#20825) its training loop
broadcasts a SIGTERM flag from rank 0 before every batch and reads it back, a collective and a host
sync per step that no setting of 2.6 turns off (#21487; #21640 proposes
`broadcast_sigterm_every_n_steps`). Our stop handling (`SentEmbCheckpoint`) does not use it. The
same run checks that the corpus is tokenized once (by `prepare_data` on local rank 0) and that both
ranks train on the same cache file.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from functools import partialmethod
from pathlib import Path

import pytest

from lightning_sentemb.console import PlainProgress
from lightning_sentemb.lightning_cli import lightning_main
from tests.launch import fork_ranks
from tests.sync_counting import Record, StepCounter
from tests.test_resume import METHODS

MAX_STEPS, LOG_EVERY = 6, 3
QUIET_STEPS = {1, 2, 4, 5}  # not a log step, no validation, no end of fit
ENCODERS = "lightning_sentemb/encoders/"
KMEANS = "lightning_sentemb/callbacks/kmeans.py"  # reads the σ decision until clustering starts: step 1
FLOW = "lightning_sentemb/methods/flow.py"  # reads once whether the first batch leaves a dimension constant


def fit_args(method: str, backbone: str, data: Path, root: Path, padding_free: bool, grad_cache: bool) -> list[str]:
    return [
        *METHODS[method], "--model.backbone", backbone,
        "--model.attn_implementation", "null" if padding_free else "padded",
        "--model.grad_cache_chunk", "4" if grad_cache else "0", "--seed_everything", "1",
        "--data.data_dir", str(data), "--data.batch_size", "4", "--data.cache_dir", str(root / "cache"),
        "--data.val_tasks", "[STSBenchmark-dev]", "--trainer.default_root_dir", str(root / "run"),
        "--trainer.max_steps", str(MAX_STEPS), "--trainer.log_every_n_steps", str(LOG_EVERY),
        "--trainer.val_check_interval", str(MAX_STEPS), "--trainer.check_val_every_n_epoch", "null",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_model_summary", "false",
        "--trainer.accelerator", "cpu",
    ]


def case_id(case: tuple[str, bool, bool]) -> str:
    method, padding_free, grad_cache = case
    return f"{method}-{'packed' if padding_free else 'padded'}{'-gradcache' if grad_cache else ''}"


# A representative cross, not all 20 (each case is a counted fit; the full cross was the suite's
# costliest file): every method padding-free, without and with gradient caching (each method's rows
# are chunked its own way: template-bias rows, prototypes, prefixes, the MLM loss, ClusterNS's σ read);
# the padded path once per input format (plain, template, prefix with its MLM), and once cached.
# Whether the batch is padded or packed is decided in the encoders by the format, not by the method.
# SNCSE runs PromptBERT's views and adds its loss: checked once, uncached; BERT-flow's loss is per sentence: it
# refuses caching; DCLR is SimCSE's rows with another loss, which runs once a step either way, and MixCSE's rows
# are chunked as SimCSE's (its loss reads the embeddings alone): their uncached cases read them.
CASES = [*((method, True, grad_cache) for grad_cache in (False, True) for method in METHODS
           if method != "sncse" and not (grad_cache and method in ("flow", "dclr", "mixcse"))),
         ("sncse", True, False),
         *((method, False, False) for method in ("simcse", "promptbert", "dcpcse")),
         ("simcse", False, True)]


def slow_if_cached(case: tuple[str, bool, bool], marks: list) -> pytest.param:
    return pytest.param(case, marks=[*marks, *([pytest.mark.slow] if case[2] else [])], id=case_id(case))


@pytest.fixture(scope="module")
def host_syncs(tiny_bert, sts_fixture, tmp_path_factory):
    """The host reads of each case's fit (progress bar on), each fit run once."""
    done: dict[tuple, StepCounter] = {}

    def run(case: tuple[str, bool, bool]) -> StepCounter:
        if case not in done:
            counter = StepCounter()
            root = tmp_path_factory.mktemp(case_id(case))
            method, padding_free, grad_cache = case
            # the plain progress line's 30-s clock (stdout is captured) would read the loss on whichever
            # step a loaded machine has reached by then: only its step count is kept
            every_step_count = partialmethod(PlainProgress.__init__, every_seconds=float("inf"))
            with counter.counting_host_syncs(), pytest.MonkeyPatch.context() as patch:
                patch.setattr(PlainProgress, "__init__", every_step_count)
                lightning_main(["fit", *fit_args(method, tiny_bert, sts_fixture, root, padding_free, grad_cache)],
                               callbacks=[counter])
            done[case] = counter
        return done[case]

    return run


def quiet_reads(counter: StepCounter, owner: str) -> list[Record]:
    return [r for r in counter.records if r.step in QUIET_STEPS and r.owner.startswith(owner)]


@pytest.mark.parametrize("case", [slow_if_cached(case, []) for case in CASES])
def test_no_host_sync_per_step_outside_the_encoders(case, host_syncs):
    counter = host_syncs(case)
    print(f"\n{case_id(case)}: reads on steps {sorted(QUIET_STEPS)} by others than us:")
    others = sorted({r for r in quiet_reads(counter, "") if not r.owner.startswith("lightning_sentemb/")}, key=str)
    print("\n".join(f"  {r}" for r in others))
    ours = [r for r in quiet_reads(counter, "lightning_sentemb/") if not r.owner.startswith(ENCODERS)
            and not (r.owner in (KMEANS, FLOW) and r.step == 1)]
    unattributed = quiet_reads(counter, "autograd")  # a backward read whose forward could be ours
    assert not ours and not unattributed, counter.table()
    # the counter does see our reads: the guard's verdict at the log step
    assert any(r.step == LOG_EVERY and r.owner == "lightning_sentemb/callbacks/checkpointing.py"
               for r in counter.records)


@pytest.mark.parametrize("case", [slow_if_cached(case, []) for case in CASES])
def test_no_host_sync_per_step_in_the_encoders(case, host_syncs):
    reads = quiet_reads(host_syncs(case), ENCODERS)
    assert not reads, "\n".join(sorted({f"{r.owner} {r.what} {r.where}" for r in reads}))


# ----- 2-process DDP: collectives per step, the corpus tokenized once ---------------------------

DDP_CASES = {"clusterns": ("clusterns", False), "simcse-gradcache": ("simcse", True)}


RANK_ZERO_STATE = "ClusterNS: rank 0's decision or centroids"


def kind(owner: str, where: str) -> str:
    """What a collective is for: DDP's gradient all-reduce, the all-gather of the embeddings (and its
    backward: scatters on gloo), Lightning's own SIGTERM broadcast, or something else."""
    if owner == "DDP":
        return "gradient all-reduce"
    if owner == "lightning_sentemb/distributed.py":
        return RANK_ZERO_STATE if "broadcast_from_rank_zero" in where else "embedding all-gather"
    if "_broadcast_sigterm_tensor" in where:
        return "Lightning's SIGTERM broadcast"
    return f"{owner} {where}"


def ddp_fit(cases: str, backbone: str, data: str, out: str) -> None:
    """Each of the comma-separated DDP_CASES under `strategy: ddp` on each of 2 CPU processes (forked ranks,
    tests/launch.py), one after the other; each rank writes its collectives, the cache file it trains on and
    every tokenization it ran."""
    from lightning.pytorch import Callback

    from lightning_sentemb.data import corpus

    rank = os.environ.get("LOCAL_RANK", "0")
    write_arrow = corpus._write_arrow
    running = {}

    def counted(*args, **kwargs):
        with open(Path(out) / "tokenized.log", "a") as log:
            log.write(f"{running['case']} rank {rank}\n")
        return write_arrow(*args, **kwargs)

    corpus._write_arrow = counted

    class RecordCacheFile(Callback):
        def on_train_start(self, trainer, pl_module) -> None:
            path = trainer.datamodule.train_dataset.cache_files[0]["filename"]
            self.cache = [path, os.stat(path).st_ino]

    for case in cases.split(","):
        running["case"] = case
        method, grad_cache = DDP_CASES[case]
        counter, cache_file = StepCounter(), RecordCacheFile()
        root = Path(out) / case
        args = fit_args(method, backbone, Path(data), root, True, grad_cache)
        args += ["--data.cache_dir", str(Path(out) / "cache"), "--trainer.strategy", "ddp", "--trainer.devices", "2",
                 "--trainer.enable_progress_bar", "false", "--trainer.logger", "false"]
        with counter.counting_collectives():
            lightning_main(["fit", *args], callbacks=[counter, cache_file])
        records = [[r.step, r.owner, r.where, r.what] for r in counter.records]
        (Path(out) / f"{case}-rank{rank}.json").write_text(json.dumps({"records": records, "cache": cache_file.cache}))

@pytest.mark.slow
def test_ddp_steps_exchange_only_gradients_and_embeddings_and_the_corpus_is_tokenized_once(tiny_bert, sts_fixture,
                                                                                           tmp_path):
    fork_ranks(ddp_fit, ",".join(DDP_CASES), tiny_bert, str(sts_fixture), str(tmp_path))
    for case in DDP_CASES:
        ranks = [json.loads((tmp_path / f"{case}-rank{rank}.json").read_text()) for rank in (0, 1)]
        assert ranks[0]["cache"] == ranks[1]["cache"]  # the same file (path and inode) on both ranks
        for rank in ranks:
            per_step: dict = {}
            for step, owner, where, _what in rank["records"]:
                per_step.setdefault(step, Counter())[kind(owner, where)] += 1
            print(f"\n{case}: collectives per step\n" + "\n".join(f"  {s}: {dict(c)}" for s, c in per_step.items()))
            expected = {"gradient all-reduce", "embedding all-gather", "Lightning's SIGTERM broadcast"}
            for step in QUIET_STEPS:
                starts_clustering = case == "clusterns" and step == 1
                wanted = expected | ({RANK_ZERO_STATE} if starts_clustering else set())
                assert set(per_step[step]) == wanted, per_step[step]
            assert set(per_step[LOG_EVERY]) - expected, "the decisions of the log step went unseen"
            assert (RANK_ZERO_STATE in per_step[LOG_EVERY]) == (case == "clusterns")
    # tokenized in the first case by one process; the second case found the cache
    assert (tmp_path / "tokenized.log").read_text().splitlines() == ["clusterns rank 0"]

