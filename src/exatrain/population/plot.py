"""One picture of a population: every trainer's validation curve, with its adoptions marked."""

from __future__ import annotations

from pathlib import Path


def plot_curves(curves: dict[int, list[tuple[int, float]]],
                adoptions: dict[int, list[tuple[int, int]]], metric: str, path: Path,
                title: str = "") -> Path:
    """`curves[k]`: (step, value) of trainer k; `adoptions[k]`: (step, donor) where trainer k took
    another trainer's model. Each adoption is drawn as a triangle on k's curve at that step
    (the value just before the exchange) with the donor's id beside it."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k in sorted(curves):
        color = colors[k % len(colors)]
        steps = [s for s, _ in curves[k]]
        values = [v for _, v in curves[k]]
        ax.plot(steps, values, "-", color=color, lw=1.4, label=f"trainer {k}")
        for step, donor in adoptions.get(k, []):
            before = [v for s, v in curves[k] if s <= step]
            if not before:
                continue
            ax.plot([step], [before[-1]], "v", color=color, ms=7, mec="black", mew=0.6)
            ax.annotate(str(donor), (step, before[-1]), textcoords="offset points",
                        xytext=(4, 4), fontsize=7, color=color)
    if any(adoptions.values()):
        ax.plot([], [], "v", color="0.6", ms=7, mec="black", mew=0.6,
                label="took the model of trainer (number)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"validation {metric}")
    if all(v > 0 for c in curves.values() for _, v in c):
        from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 3.0, 5.0)))
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title or "population", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
