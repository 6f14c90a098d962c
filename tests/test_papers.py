"""The published rows are the papers' own numbers, each paper config maps to its row, and the
comparison `sentemb reproduce` prints subtracts the right things."""

import json
import re

import pytest

from lightning_sentemb.cli import main
from lightning_sentemb.errors import SentEmbUserError
from lightning_sentemb.papers import PAPERS, TASKS, paper_for_config
from lightning_sentemb.reproduce import compare_to_paper, format_comparison, paper_row
from lightning_sentemb.seed_tables import TABLES, format_seed_table, reproduced, spread_of

from .conftest import REPO

PAPERS_DIR = REPO.parent / "shared" / "papers"
SEED_METHOD_AVERAGES = {"simcse": 76.25, "promptbert": 78.54, "conpvp": 78.85, "dcpcse": 78.49, "clusterns": 77.55}
# Published averages further than rounding from the mean of their printed tasks, as the seed text prints them:
# SBERT's average is of unrounded scores; DCPCSE's copy of sup-SimCSE-BERT-large reads STS15 86.60 (86.06
# averages to its 82.21).
OFF_THE_MEAN = {"sbert": 0.04, "simcse_sup_bert_large": 0.08}


def paper_text(file: str) -> str:
    path = PAPERS_DIR / file
    if not path.is_file():
        pytest.skip(f"{path} absent (the seed papers' text)")
    # tables are tab- or space-separated, on one line or several; ClusterNS's bolds its best scores
    return " ".join(re.sub(r"</?b>", "", path.read_text()).split())


@pytest.mark.parametrize("name", [name for name, row in PAPERS.items() if row.seed_paper_file])
def test_row_is_printed_in_the_seed_paper(name):
    """The eight numbers, in the table's order, appear together in the paper's text, and in the text of
    every seed table that lists the row."""
    row = PAPERS[name]
    numbers = " ".join(f"{row.scores[task]:.2f}" for task in TASKS)
    assert numbers in paper_text(row.seed_paper_file)
    for table in TABLES.values():
        if name in table.rows:
            assert numbers in paper_text(table.file), table.file


def test_garbled_copies_are_in_the_text_and_the_row_is_the_clean_one():
    """ClusterNS's extraction prints some rows again with other averages: each listed one follows the row's
    seven task scores somewhere in the text, and the row's own is the mean of its tasks."""
    text = re.sub(r"</?b>", "", (PAPERS_DIR / "clusterns_deng2023.txt").read_text()) if PAPERS_DIR.is_dir() else None
    if text is None:
        pytest.skip("the seed papers' text is absent")
    for row in PAPERS.values():
        tasks = r"\s*".join(re.escape(f"{row.scores[t]:.2f}") for t in TASKS[:-1])
        printed = set(re.findall(tasks + r"\s*(\d+\.\d\d)", text))
        assert set(row.disagreeing_copies) <= printed, row.name
        if row.disagreeing_copies:
            assert printed - {f"{row.scores['avg']:.2f}"} == set(row.disagreeing_copies), row.name


def test_the_five_seed_methods_average_as_their_papers_say():
    files = {"simcse": "dcpcse_jiang2022.txt", "promptbert": "conpvp_zeng2022.txt", "conpvp": "conpvp_zeng2022.txt",
             "dcpcse": "dcpcse_jiang2022.txt", "clusterns": "clusterns_deng2023.txt"}
    for name, average in SEED_METHOD_AVERAGES.items():
        assert PAPERS[name].scores["avg"] == average
        assert re.search(rf"(?<![\d.]){average:.2f}(?![\d])", paper_text(files[name])), name


def test_each_average_is_the_mean_of_its_tasks_to_rounding():
    """A typo in a copied number shows here (PromptBERT's README is 0.017 off: its averages are of
    unrounded scores)."""
    for row in PAPERS.values():
        tasks = [row.scores[t] for t in TASKS[:-1]]
        assert abs(sum(tasks) / len(tasks) - row.scores["avg"]) <= OFF_THE_MEAN.get(row.name, 0.02), row.name


def test_every_row_of_a_seed_table_says_how_it_is_reproduced():
    for table in TABLES.values():
        for name in table.rows:
            row = PAPERS[name]
            assert bool(row.configs) + bool(row.command) + bool(row.missing) == 1, name
    assert PAPERS["glove"].how_to_reproduce.startswith("not implemented (")
    assert PAPERS["conpvp"].how_to_reproduce == "sentemb reproduce --method conpvp --seeds 4"
    assert PAPERS["dcpcse"].how_to_reproduce == "sentemb reproduce --method dcpcse --seeds 10"
    assert PAPERS["bert_first_last_avg"].how_to_reproduce == (
        "sentemb evaluate --model bert-base-uncased --pooler avg_emb_last")
    assert PAPERS["bert_whitening"].how_to_reproduce == (
        "sentemb evaluate --model bert-base-uncased --pooler avg_first_last --whiten target")


def test_a_config_that_starts_from_an_export_says_which_stage_writes_it():
    """A row whose config's backbone is another run's export (SBERT-flow, supervised ConSERT's second stage)
    prints that run and its export first, to the folder the config reads."""
    import yaml

    staged = {}
    for row in PAPERS.values():
        for config in row.configs:
            backbone = yaml.safe_load((REPO / "experiments" / f"{config}.yaml").read_text())["model"]["init_args"]
            if str(backbone.get("backbone", "")).startswith("out/"):
                staged[row.name] = backbone["backbone"]
                assert row.first_stage and row.first_stage.endswith(f" {backbone['backbone']}"), row.name
                assert row.how_to_reproduce.startswith(f"{row.first_stage} && sentemb reproduce --method {config}")
    assert staged == {"sbert_flow": "out/reproduce/flow_sbert/stage-1-sbert_sup/export",
                      "consert_sup": "out/reproduce/consert_sup_unsup/stage-1-consert_sup/export"}


STAGE = re.compile(r"sentemb reproduce --method (\S+) --seeds 1(?: --root (\S+))? && sentemb export (\S+) (\S+)")


def test_each_first_stage_has_its_own_root_and_exports_there():
    """A stage run into the root of a row (`out/reproduce/<config>`, `reproduce`'s default) overwrites that
    row's `reproduce.json` and the checkpoint its export came from: each stage runs under its own row's root
    (`stage-1-<config>`, one a row), exports there, and the row reads that export."""
    default_roots = {f"out/reproduce/{config}" for row in PAPERS.values() for config in row.configs}
    stages = {}
    for row in PAPERS.values():
        found = STAGE.findall(row.how_to_reproduce)
        if not found:
            continue
        [(config, root, checkpoint, export)] = found
        own = row.configs[0] if row.configs else row.name
        assert root == f"out/reproduce/{own}/stage-1-{config}", row.name
        assert root not in default_roots and root not in stages.values(), row.name
        assert checkpoint == f"{root}/seed-0/checkpoints/best.ckpt" and export == f"{root}/export", row.name
        stages[row.name] = root
    assert sorted(stages) == ["consert_sup", "sbert_flow", "sbert_whitening"]
    assert PAPERS["sbert_whitening"].command.endswith(
        "sentemb evaluate --model out/reproduce/sbert_whitening/stage-1-sbert_sup/export --whiten target")


def test_a_config_root_is_written_by_one_command_and_conpvps_own_runs_read_it():
    """Two rows of one config (ConPVP's own best-of-4 runs of SimCSE and PromptBERT-large beside the rows
    the configs reproduce) would run it twice into one root: the second reads the first's runs (its best of
    the first 4 seeds), so each config's root has one command."""
    commands: dict[str, set[str]] = {}
    for row in PAPERS.values():
        for config in row.configs:
            commands.setdefault(config, set()).add(row.how_to_reproduce)
    assert {config: found for config, found in commands.items() if len(found) > 1} == {}
    readers = {"simcse_conpvp": "simcse", "simcse_bert_large_conpvp": "simcse_bert_large",
               "simcse_roberta_base_conpvp": "simcse_roberta_base",
               "promptbert_bert_large_conpvp": "promptbert_bert_large"}
    for name, system in readers.items():
        row = PAPERS[name]
        assert row.statistic.startswith("best of 4 seeds (ConPVP's own run") and row.seeds == 4, name
        assert row.runs_of is PAPERS[system] and PAPERS[system].seeds >= row.seeds, name
        assert row.how_to_reproduce == PAPERS[system].how_to_reproduce, name
        assert row.compared_seeds([0, 1, 2, 3, 4]) == [0, 1, 2, 3]
    assert sorted(name for name, row in PAPERS.items() if row.runs_of is not row) == sorted(readers)
    simcse_rows = [name for _, rows in TABLES["conpvp"].sections for label, name in rows if label == "SimCSE"]
    assert simcse_rows == ["simcse_conpvp", "simcse_bert_large_conpvp", "simcse_roberta_base_conpvp"]
    assert PAPERS["simcse"].statistic.startswith("unstated (the released checkpoint")


def test_every_paper_config_exists_and_maps_to_its_row():
    for row in PAPERS.values():
        for config in row.configs:
            assert (REPO / "experiments" / f"{config}.yaml").is_file(), config
            assert paper_for_config(config) is (PAPERS[row.system] if row.system else row)
    assert paper_for_config("demo/simcse") is None
    assert paper_for_config("llm/prompteol_nli") is None  # Qwen2-0.5B: no published row


def test_paper_row_by_name_by_config_or_none(monkeypatch):
    monkeypatch.chdir(REPO)
    assert paper_row(None, ["experiments/dcpcse.yaml", "experiments/trainer/a100.yaml"]) is PAPERS["dcpcse"]
    assert paper_row(None, ["experiments/demo/simcse.yaml"]) is None
    assert paper_row("simcse", ["experiments/demo/simcse.yaml"]) is PAPERS["simcse"]
    with pytest.raises(SentEmbUserError, match="--paper nope: no such published row .`sentemb reproduce --list-papers"):
        paper_row("nope", ["experiments/demo/simcse.yaml"])
    with pytest.raises(SentEmbUserError,
                       match="--paper simcse_larg: no such published row; did you mean simcse_bert_large, "):
        paper_row("simcse_larg", ["experiments/demo/simcse.yaml"])


def reproduced_runs(offset_0: float, offset_1: float) -> dict[int, dict[str, float]]:
    base = PAPERS["simcse"].scores
    return {0: {t: base[t] + offset_0 for t in TASKS}, 1: {t: base[t] + offset_1 for t in TASKS}}


def test_comparison_of_a_mean_row_uses_the_mean_and_the_default_spread():
    row = PAPERS["simcse"]
    comparison = compare_to_paper(row, reproduced_runs(-1.0, 0.0))  # mean −0.5, best +0.0
    stsb = comparison["tasks"]["STSBenchmark"]
    assert stsb["paper"] == 76.85
    assert stsb["mean"] == pytest.approx(76.35) and stsb["mean_minus_paper"] == pytest.approx(-0.5)
    assert stsb["std"] == pytest.approx(2 ** -0.5)  # sample std of (x−1, x)
    assert stsb["best_minus_paper"] == pytest.approx(0.0)
    assert spread_of(row)[0] == 0.5 and comparison["within_spread"]  # |−0.5| ≤ 0.5
    assert not compare_to_paper(row, reproduced_runs(-1.2, 0.0))["within_spread"]
    text = format_comparison(row, comparison, 2)
    assert "| STS-B | 76.85 | 76.35 ± 0.71 | -0.50 | 76.85 | +0.00 |" in text
    assert "Avg.: reproduced mean 75.75 is within the paper's 76.25 ± 0.50 (no std published" in text


def test_comparison_of_a_best_of_seeds_row_uses_the_best_and_a_published_std_is_the_spread():
    conpvp = PAPERS["conpvp"]
    results = {0: {t: conpvp.scores[t] - 2.0 for t in TASKS}, 1: {t: conpvp.scores[t] - 0.3 for t in TASKS}}
    comparison = compare_to_paper(conpvp, results)
    assert comparison["compared"] == "best" and comparison["within_spread"]  # best −0.3 within 0.5
    promptbert = PAPERS["promptbert"]
    near = {0: {t: promptbert.scores[t] + 0.1 for t in TASKS}, 1: {t: promptbert.scores[t] + 0.1 for t in TASKS}}
    assert spread_of(promptbert)[0] == 0.15 and compare_to_paper(promptbert, near)["within_spread"]
    far = {0: {t: promptbert.scores[t] + 0.2 for t in TASKS}, 1: {t: promptbert.scores[t] + 0.2 for t in TASKS}}
    assert not compare_to_paper(promptbert, far)["within_spread"]
    assert "| STS12 | 71.56 ± 0.18 |" in format_comparison(promptbert, compare_to_paper(promptbert, far), 2)


def test_list_papers_prints_every_row_and_its_source(capsys):
    main(["reproduce", "--list-papers"])
    out = capsys.readouterr().out
    for row in PAPERS.values():
        assert f"| {row.name} | " in out and row.source in out
    assert "| conpvp | 71.72 | 84.95 | 77.68 | 83.64 | 79.76 | 80.82 | 73.38 | 78.85 | best of 4 seeds" in out


def test_an_unknown_paper_fails_before_any_fit(capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as exit_info:
        main(["reproduce", "-c", "experiments/demo/simcse.yaml", "--paper", "simcse_large"])
    assert exit_info.value.code == 2
    assert "no such published row" in capsys.readouterr().err


def test_a_run_on_other_tasks_is_not_judged_on_its_average():
    row = PAPERS["simcse"]
    partial = {seed: {"STSBenchmark": 76.0, "SICKRelatedness": 74.0, "avg": 75.0} for seed in (0, 1)}
    comparison = compare_to_paper(row, partial)
    assert list(comparison["tasks"]) == ["STSBenchmark", "SICKRelatedness"] and comparison["within_spread"] is None
    text = format_comparison(row, comparison, 2)
    assert "| Avg. |" not in text  # a 2-task average is not printed beside the paper's 7-task Avg.
    assert "Avg.: not compared: the run tested 2/7 tasks (STS-B, SICK-R), not the paper's seven." in text


def test_seed_table_in_the_papers_order_with_runs_commands_and_other_quotes(tmp_path, capsys):
    """`sentemb reproduce --table`: ours beside a row where a run is, its command where none is, "not
    implemented" for GloVe, and PromptBERT-large's other figures (ConPVP's run) below ClusterNS's."""
    for config in ("clusterns", "conpvp"):  # a single-run row and a best-of-4 row
        run = tmp_path / "runs" / config
        run.mkdir(parents=True)
        run.joinpath("reproduce.json").write_text(json.dumps({
            "seeds": {"0": dict.fromkeys(TASKS, 77.0), "1": dict.fromkeys(TASKS, 77.5)},
            "mean": dict.fromkeys(TASKS, 77.25), "std": dict.fromkeys(TASKS, 0.35355), "best_seed": 1}))
    main(["reproduce", "--table", "clusterns", "--runs", str(tmp_path / "runs")])
    out = capsys.readouterr().out
    labels = [line.split(" | ")[0][2:] for line in out.splitlines() if line.startswith("| ") and "↳" not in line]
    table = TABLES["clusterns"]
    assert labels == ["Model", *(label for heading, rows in table.sections
                                 for label in (f"**{heading}**", *(label for label, _ in rows)))]
    assert (f"| *ClusterNS-BERT-base | 69.93 | 83.57 | 76.00 | 82.44 | 80.01 | 78.85 | 72.03 | 77.55 | "
            f"77.25 ± 0.35 (2 seeds; {tmp_path / 'runs' / 'clusterns'}) |") in out
    assert f"| 78.85 | 77.25 ± 0.35 (2 seeds, best 77.50; {tmp_path / 'runs' / 'conpvp'}) |" in out
    assert "| GloVe embeddings | 55.14 |" in out and "not implemented (averaged static GloVe" in out
    assert "| 81.58 | 69.53 | 78.72 | `sentemb reproduce --method clusterns_prompt --seeds 5` |" in out
    assert "| 56.70 | `sentemb evaluate --model bert-base-uncased --pooler avg_emb_last` |" in out
    assert "| ↳ PromptBERT-BERT-large (ConPVP's run), as Zeng et al. (2022), ConPVP, Table 3 | 71.55 |" in out
    assert "ClusterNS's garbled copies also print Avg. 76.23" in out
    conpvp = format_seed_table("conpvp")
    assert "| ↳ PromptBERT-BERT-large, as Deng et al. (2023)" in conpvp
    assert "↳ unsup-SimCSE" not in conpvp and "↳ unsup-SimCSE" not in out  # the same figures, no second line


def test_seed_table_says_in_place_when_a_run_tested_other_tasks(tmp_path, capsys):
    """A run of two tasks (or one: no 'avg' at all) is not the row's 7-task Avg.: the table says which
    tasks it tested instead of printing its average beside the paper's."""
    two = {"STSBenchmark": 80.0, "SICKRelatedness": 70.0, "avg": 75.0}
    for config, scores in (("clusterns", two), ("conpvp", {"STSBenchmark": 81.0})):
        run = tmp_path / config
        run.mkdir()
        run.joinpath("reproduce.json").write_text(json.dumps({
            "seeds": {"0": scores, "1": scores}, "mean": scores, "std": dict.fromkeys(scores, 0.0), "best_seed": 0}))
    table = format_seed_table("clusterns", tmp_path)
    line = next(line for line in table.splitlines() if line.startswith("| *ClusterNS-BERT-base |"))
    where = tmp_path / "clusterns"
    assert line.endswith(f"| 2/7 tasks (STS-B, SICK-R) tested: no Avg. to compare (2 seeds; {where}) |")
    assert "75.00" not in line
    line = next(line for line in table.splitlines() if line.startswith("| ConPVP-BERT-base |"))
    assert line.endswith(f"| 1/7 tasks (STS-B) tested: no Avg. to compare (2 seeds; {tmp_path / 'conpvp'}) |")


def test_a_best_of_4_row_reads_the_best_of_the_first_4_seeds_of_a_longer_run(tmp_path):
    """ConPVP's own SimCSE run (best of 4) beside the row of the released checkpoint (mean of 5), from the
    one run of 5 seeds: seed 4's better Avg. is not ConPVP's best of 4."""
    averages = [76.0, 77.0, 75.0, 76.5, 79.0]
    run = tmp_path / "simcse"
    run.mkdir()
    seeds = {str(seed): {t: avg for t in TASKS} for seed, avg in enumerate(averages)}
    mean = {t: sum(averages) / 5 for t in TASKS}
    run.joinpath("reproduce.json").write_text(json.dumps({
        "seeds": seeds, "mean": mean, "std": dict.fromkeys(TASKS, 1.5), "best_seed": 4}))
    assert reproduced(PAPERS["simcse"], tmp_path) == f"76.70 ± 1.50 (5 seeds; {run})"
    assert reproduced(PAPERS["simcse_conpvp"], tmp_path) == f"76.70 ± 1.50 (5 seeds, best of seeds 0-3 77.00; {run})"
    conpvp = {seed: {t: avg for t in TASKS} for seed, avg in enumerate(averages)}
    assert compare_to_paper(PAPERS["simcse_conpvp"], conpvp)["tasks"]["avg"]["best"] == 77.0


def test_seed_table_prints_without_importing_torch():
    """What makes `sentemb reproduce --table clusterns` print in well under 5 s offline: no torch, no model."""
    from tests.test_conventions import IMPORTS_AFTER, run_python

    result = run_python(IMPORTS_AFTER.format(args=["reproduce", "--table", "clusterns"]))
    assert result.stdout.startswith("ClusterNS Table 1 (Deng et al., 2023)")
    assert result.stdout.splitlines()[-1] == "torch imported: False"



def test_reproduce_compares_a_run_with_every_row_that_reads_it(tmp_path, capsys):
    """`sentemb reproduce --method simcse --seeds 5` is the run behind two rows: the released checkpoint's (mean
    of 5) and ConPVP's own (best of 4, its first 4 seeds): the report compares it with both."""
    from lightning_sentemb.reproduce import report

    results = {seed: {t: PAPERS["simcse"].scores[t] + offset for t in TASKS}
               for seed, offset in enumerate([-1.0, 0.2, -0.5, -0.4, 2.0])}
    report("simcse", results, tmp_path, PAPERS["simcse"])
    out = capsys.readouterr().out
    assert "Paper: simcse, " in out and "Paper: simcse_conpvp, " in out
    assert "| task | paper | reproduced mean ± std (5 seeds) | Δ mean | best of 4 | Δ best |" in out
    saved = json.loads((tmp_path / "reproduce.json").read_text())
    also = saved["also"]["simcse_conpvp"]
    assert also["compared"] == "best" and also["tasks"]["avg"]["best_minus_paper"] == pytest.approx(0.2)
    assert also["within_spread"] and saved["paper"]["tasks"]["avg"]["mean_minus_paper"] == pytest.approx(0.06)
