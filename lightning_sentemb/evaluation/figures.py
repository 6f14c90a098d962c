"""The report's figures (ConPVP's and ClusterNS's plots), drawn with matplotlib's object API (no pyplot
state) and written atomically; `report` places them beside its tables, `analysis` draws its own."""

from __future__ import annotations

import io
import os
import re
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from ..atomic_io import atomic_write_bytes


def save_figure(fig: Figure, path: str | os.PathLike) -> Path:
    """Render a matplotlib figure to PNG (Agg, no pyplot state) and write it atomically."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    return atomic_write_bytes(path, buffer.getvalue())


def safe_filename(name: str) -> str:
    """``name`` reduced to characters that are safe in a file name (model names may hold '/')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "model"


def few_shot_figure(results: dict[str, dict], columns: Sequence[tuple[str, str]], path: Path) -> Path:
    """One box per model for each task's per-seed accuracies (ConPVP Fig. 7 shows violins); models
    by colour, named in the legend."""
    models = list(results)
    colors = {model: f"C{i % 10}" for i, model in enumerate(models)}
    fig = Figure(figsize=(1.8 * len(columns) + 1.2, 3.8), layout="constrained")
    axes = fig.subplots(1, len(columns), sharey=True, squeeze=False)[0]
    for ax, (key, title) in zip(axes, columns, strict=True):
        names = [m for m in models if "few_shot" in results[m].get("transfer", {}).get(key, {})]
        boxes = ax.boxplot([results[m]["transfer"][key]["few_shot"]["accs"] for m in names],
                           positions=range(len(names)), patch_artist=True)
        for box, name in zip(boxes["boxes"], names, strict=True):
            box.set_facecolor(colors[name])
        ax.set_xticks([])
        ax.set_title(title)
    axes[0].set_ylabel("accuracy (%)")
    fig.suptitle("Few-shot transfer accuracy over seeds")
    fig.legend(handles=[Patch(facecolor=colors[m], label=m) for m in models], loc="outside lower center",
               ncol=min(len(models), 3), fontsize=8)
    return save_figure(fig, path)


def span(values: Sequence[float], minimum: float) -> tuple[float, float]:
    """Axis limits around `values`, at least `minimum` wide: scores that differ in the fourth digit
    would otherwise get a tick every 0.0001, labels running into each other."""
    low, high = min(values), max(values)
    half = max((high - low) * 0.6, minimum / 2)
    return (low + high) / 2 - half, (low + high) / 2 + half


def alignment_uniformity_figure(results: dict[str, dict], path: Path) -> Path:
    """ClusterNS Fig. 6: uniformity on x, alignment on y, lower-left is better."""
    points = {model: (r["analysis"]["uniformity"], r["analysis"]["alignment"])
              for model, r in results.items() if "alignment" in r.get("analysis", {})}
    fig = Figure(figsize=(4.8, 4), layout="constrained")
    ax = fig.add_subplot()
    for model, (x, y) in points.items():
        ax.scatter([x], [y], label=model)
    ax.set_xlim(*span([x for x, _ in points.values()], 0.1))
    ax.set_ylim(*span([y for _, y in points.values()], 0.1))
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(4))
    ax.set_xlabel("uniformity")
    ax.set_ylabel("alignment")
    ax.set_title("Alignment and uniformity (lower is better)")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def frequent_tokens_figure(results: dict[str, dict], path: Path) -> Path:
    fig = Figure(figsize=(4.8, 3.6), layout="constrained")
    ax = fig.add_subplot()
    ks = set()
    for model, result in results.items():
        if "frequent_tokens" in result:
            ax.plot(result["frequent_tokens"]["ks"], result["frequent_tokens"]["scores"], marker="o", label=model)
            ks.update(result["frequent_tokens"]["ks"])
    ax.set_xticks(sorted(ks))
    ax.set_xlabel("most frequent tokens removed (k)")
    ax.set_ylabel("average STS")
    ax.set_title("STS without the most frequent tokens")
    ax.legend(fontsize=8)
    return save_figure(fig, path)


def place_figure(source: str | os.PathLike, figure_dir: Path, key: str) -> Path:
    """A figure already in the report's figures folder is linked where it is (each figure is written
    once); one from elsewhere is copied in as `{key}.png`."""
    source = Path(source)
    if not source.is_file():
        raise FileNotFoundError(f"figure {source} listed in the results does not exist")
    if source.parent.resolve() == figure_dir.resolve():
        return source
    return atomic_write_bytes(figure_dir / f"{key}.png", source.read_bytes())
