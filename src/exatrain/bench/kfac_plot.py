"""The picture of `exatrain bench kfac --plot`: validation MAE against training seconds for every
optimizer and seed, and every run's seconds to the target beside it."""

from __future__ import annotations

from pathlib import Path

NAMES = {"kfac": "K-FAC", "adamw": "AdamW", "sgd": "SGD", "adamw_tuned": "AdamW\n(tuned lr)"}


def plot_to_target(result: dict, path) -> Path:
    """Two panels per workload: val_mae against training seconds for every optimizer (one colour)
    and seed (one line), the target dashed, each run's first evaluation at the target marked;
    beside it every run's seconds to the target, the median run's as a bar (an open marker at
    the top: a run that never reached it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({k[:-len("_target_val_mae")] for k in result
                        if k.endswith("_target_val_mae")})
    fig, axes = plt.subplots(1, 2 * len(workloads), figsize=(8.8 * len(workloads), 4.2),
                             dpi=110, squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1] * len(workloads)})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, spread, w in zip(axes[0][::2], axes[0][1::2], workloads):
        target = result[f"{w}_target_val_mae"]
        optimizers = [k[len(w) + 1:-len("_curves")] for k in result
                      if k.startswith(f"{w}_") and k.endswith("_curves")]
        for color, o in zip(colors, optimizers):
            seconds = result[f"{w}_{o}_seconds_to_target"]
            name = NAMES.get(o, o).replace("\n", " ")
            if o == "kfac" and "kfac_base" in result:
                name += f" on {NAMES.get(result['kfac_base'], result['kfac_base'])}"
            if f"{w}_{o}_lr" in result:
                name += f", lr {result[f'{w}_{o}_lr']:g}"
            name += f" ({len(result[f'{w}_{o}_curves'])} seeds)"
            label = (f"{name}: median {seconds:.1f} s, {result[f'{w}_{o}_steps_to_target']} steps"
                     if seconds else f"{name}: target not reached")
            for j, curve in enumerate(result[f"{w}_{o}_curves"]):
                t = [c[1] for c in curve]
                m = [c[2] for c in curve]
                ax.plot(t, m, "-", color=color, lw=1.1, alpha=0.75, label=label if j == 0 else None)
                hit = next((c for c in curve if c[2] <= target), None)
                if hit:
                    ax.plot([hit[1]], [hit[2]], "o", color=color, ms=5, mec="black", mew=0.5)
        ax.plot([], [], "o", color="0.6", ms=5, mec="black", mew=0.5,
                label="a run's first evaluation at the target")
        ax.axhline(target, ls="--", color="0.3", lw=1)
        ax.annotate(f"target {target:.3f} (0.5 × baseline)", (0.01, target),
                    xycoords=("axes fraction", "data"), textcoords="offset points",
                    xytext=(2, -11), fontsize=7, color="0.3")
        ax.set_xlabel("training seconds (evaluations excluded)")
        ax.set_ylabel("validation MAE")
        ax.set_title(f"{w}: {result.get('ranks', 2)} ranks, global batch {result['global_batch']}",
                     fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        _plot_spread(spread, result, w, optimizers, colors)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def _plot_spread(ax, result: dict, w: str, optimizers: list, colors: list) -> None:
    """Every run's seconds to the target per optimizer, the median run's as a bar."""
    runs = {o: result.get(f"{w}_{o}_seconds_to_target_per_seed",
                          [result[f"{w}_{o}_seconds_to_target"]]) for o in optimizers}
    top = 1.1 * max((s for r in runs.values() for s in r if s is not None), default=1.0)
    for x, (color, o) in enumerate(zip(colors, optimizers)):
        jitter = [x + 0.09 * ((j % 5) - 2) for j in range(len(runs[o]))]
        reached = [(j, s) for j, s in zip(jitter, runs[o]) if s is not None]
        ax.plot([j for j, _ in reached], [s for _, s in reached], "o", color=color, ms=5,
                mec="black", mew=0.5)
        missed = [j for j, s in zip(jitter, runs[o]) if s is None]
        ax.plot(missed, [top] * len(missed), "o", mfc="none", color=color, ms=5)
        median = result[f"{w}_{o}_seconds_to_target"]
        if median:
            ax.hlines(median, x - 0.3, x + 0.3, color=color, lw=2.5)
    ax.set_xticks(range(len(optimizers)), [NAMES.get(o, o) for o in optimizers], fontsize=8)
    ax.set_xlim(-0.6, len(optimizers) - 0.4)
    ax.set_ylim(0, top * 1.05)
    ax.set_ylabel("seconds to the target, per seed")
    lines = []
    for other in ("adamw", "adamw_tuned"):
        ratio, p = (result.get(f"{w}_kfac_vs_{other}_{k}") for k in ("seconds", "p_value"))
        if ratio:
            short = {"adamw": "AdamW", "adamw_tuned": "tuned AdamW"}[other]
            lines.append(f"K-FAC / {short}: {ratio:.2f}"
                         + (f", p {p:.2f}" if p is not None else ""))
    title = "\n".join(lines) or "bar: the median run"
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3, axis="y")
