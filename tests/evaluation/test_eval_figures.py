"""Every figure the report and the analysis draw has a title, a legend and tick labels that do not overlap
(rendered as the PNG is), for two models whose labels differ in length and whose scores differ only in the
fourth digit (the case whose tick labels once ran together)."""

from __future__ import annotations

from pathlib import Path


def analysis_results(tmp_path: Path) -> dict[str, dict]:
    """Two models through every figure-making evaluator step: STS-pair analysis (cosine buckets,
    t-SNE), few-shot accuracies, frequent-token removal; alignment/uniformity that differ only in the
    fourth digit (the case whose tick labels ran together)."""
    import numpy as np

    from lightning_sentemb.evaluation.analysis import analyze_sts_pairs

    words = [f"word{i}" for i in range(40)]
    first = [f"{words[i % 40]} {words[(i * 7) % 40]} a" for i in range(90)]
    second = [f"{words[(i * 3) % 40]} {words[(i * 5) % 40]} b" for i in range(90)]
    gold = [float(i % 6) for i in range(90)]

    def encode(sentences: list[str]) -> np.ndarray:
        return np.stack([np.random.default_rng(abs(hash(s)) % 2**32).normal(size=8) for s in sentences])

    results = {}
    for name, shift in (("simcse/best", 0.0), ("a much longer model label/best", 0.0002)):
        analysis = analyze_sts_pairs(encode, first, second, gold, tmp_path / "report" / "figures", name=name)
        analysis.update(alignment=0.2001 + shift, uniformity=-3.8322 + shift)
        results[name] = {
            "analysis": analysis,
            "transfer": {task: {"acc": 80.0, "few_shot": {"shots": 16, "mean": 70.0, "std": 2.0,
                                                           "accs": [68.0 + i + shift for i in range(5)]}}
                         for task in ("MR", "CR", "SUBJ")},
            "frequent_tokens": {"ks": [0, 5, 10, 15, 20], "scores": [70.0, 68.0, 66.5, 65.0, 64.0]},
        }
    return results


def test_every_analysis_figure_has_a_title_a_legend_and_readable_ticks(tmp_path, monkeypatch):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from lightning_sentemb.evaluation import analysis, report
    from lightning_sentemb.evaluation import figures as report_figures

    figures = []

    def keep(fig, path):
        figures.append((Path(path).name, fig))
        return save(fig, path)

    save = report_figures.save_figure
    monkeypatch.setattr(report_figures, "save_figure", keep)
    monkeypatch.setattr(analysis, "save_figure", keep)
    report.write_report(analysis_results(tmp_path), tmp_path / "report")
    names = sorted(name for name, _ in figures)
    assert names == sorted(["simcse_best_cosine_distribution.png", "simcse_best_tsne.png",
                            "a_much_longer_model_label_best_cosine_distribution.png",
                            "a_much_longer_model_label_best_tsne.png", "few_shot.png", "alignment_uniformity.png",
                            "frequent_tokens.png"])
    for name, fig in figures:
        canvas = FigureCanvasAgg(fig)  # what save_figure renders the PNG with
        canvas.draw()
        renderer = canvas.get_renderer()
        assert fig.get_suptitle() or all(ax.get_title() for ax in fig.axes), name
        assert fig.legends or any(ax.get_legend() for ax in fig.axes), name
        # every tick label against every other one and against the titles, across all axes
        texts = [label for ax in fig.axes for label in (*ax.get_xticklabels(), *ax.get_yticklabels(), ax.title)]
        texts = [text for text in texts + [fig._suptitle]
                 if text is not None and text.get_visible() and text.get_text()]
        boxes = [(text.get_text(), text.get_window_extent(renderer)) for text in texts]
        overlapping = [(a, b) for i, (a, box) in enumerate(boxes) for b, other in boxes[i + 1:] if box.overlaps(other)]
        assert not overlapping, f"{name}: {overlapping} overlap"
