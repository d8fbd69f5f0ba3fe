"""The report's figures, one function per PNG, each drawn from RunRecords (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402

from .console import axis_label  # noqa: E402
from .units import human_bytes  # noqa: E402
from .runs import RunRecord  # noqa: E402



def _byte_axis(ax, largest: float) -> None:
    """Ticks in one binary unit chosen from the largest value (round numbers, one unit)."""
    unit, name = next(((2 ** e, n) for e, n in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB"))
                       if largest >= 2 ** e), (1, "B"))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v / unit:g}"))
    ax.yaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10]))
    ax.set_ylabel(f"{ax.get_ylabel() or 'bytes'} ({name})")
    ticks = ax.yaxis.get_major_locator().tick_values(0, largest / unit)
    ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([t * unit for t in ticks]))


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _labels(runs: list[RunRecord]) -> dict[int, str]:
    """A legend label per run: its Plan, and its directory name where Plans repeat."""
    plans = [r.plan for r in runs]
    return {id(r): r.plan if plans.count(r.plan) == 1 else f"{r.plan} ({r.name})" for r in runs}


def curves(runs: list[RunRecord], path: Path) -> Path:
    """Training loss per step (and its running mean) beside every validation metric."""
    keys = sorted({k for r in runs for e in r.evals for k in e if k != "step"})
    # a metric named after another plus a suffix (val_mae_H0 after val_mae) shares its panel
    eval_keys = [k for k in keys if not any(k.startswith(p + "_") for p in keys)][:3]
    parts = {k: [p for p in keys if p.startswith(k + "_")] if len(runs) == 1 else []
             for k in eval_keys}
    fig, axes = plt.subplots(1, 1 + len(eval_keys), figsize=(4.2 * (1 + len(eval_keys)), 3.8),
                             squeeze=False, sharex=True)  # the same steps under every panel
    loss_ax, val_axes = axes[0][0], axes[0][1:]
    labels = _labels(runs)
    for run in runs:
        steps, losses = run.step_losses()
        k = max(1, len(losses) // 20)
        if k > 1:  # each step faint, a running mean bold
            line, = loss_ax.plot(steps, losses, alpha=0.3, lw=1)
            smooth = [sum(losses[max(0, i - k + 1):i + 1]) / len(losses[max(0, i - k + 1):i + 1])
                      for i in range(len(losses))]
            loss_ax.plot(steps, smooth, color=line.get_color(), lw=2,
                         label=f"{labels[id(run)]}, mean of {k} steps")
        else:
            loss_ax.plot(steps, losses, lw=1.5, label=labels[id(run)])
        for ax, key in zip(val_axes, eval_keys):
            pts = [(e["step"], e[key]) for e in run.evals if key in e]
            if pts:
                ax.plot(*zip(*pts), marker="o", lw=2,
                        label=labels[id(run)] if not parts[key] else key)
            for part in parts[key]:
                pts = [(e["step"], e[part]) for e in run.evals if part in e]
                ax.plot(*zip(*pts), marker=".", lw=1, alpha=0.7, label=part)
    baselines = runs[0].summary
    for ax, key in zip(val_axes, eval_keys):
        base = baselines.get("baseline_" + key.removeprefix("val_"))
        if base is not None:
            ax.axhline(base, ls=":", color="grey", label=f"baseline {base:.3g} (a trivial predictor)")
        ax.set(title=key, xlabel="optimizer step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(fontsize=7)
    loss_ax.set(title="training loss (every step)", xlabel="optimizer step", ylabel="loss")
    loss_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    loss_ax.legend(fontsize=7)
    return _save(fig, path)


def throughput(runs: list[RunRecord], path: Path) -> Path:
    """Samples/s and MFU per logged interval."""
    has_mfu = any("mfu" in r for run in runs for r in run.train)
    fig, axes = plt.subplots(1, 2 if has_mfu else 1, figsize=(11 if has_mfu else 6, 4),
                             squeeze=False)
    labels = _labels(runs)
    for run in runs:
        steps = [r["step"] for r in run.train]
        axes[0][0].plot(steps, [r["samples_per_s"] for r in run.train], marker="o",
                        label=labels[id(run)])
        if has_mfu:
            axes[0][1].plot(steps, [100 * r.get("mfu", float("nan")) for r in run.train],
                            marker="o", label=labels[id(run)])
    axes[0][0].set(title="throughput (mean over each logging interval)", xlabel="optimizer step",
                   ylabel="samples/s")
    axes[0][0].set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8)
    if has_mfu:
        axes[0][1].set(title="model FLOP utilisation (vs. measured matmul rate)",
                       xlabel="optimizer step", ylabel="MFU (%)")
        axes[0][1].set_ylim(bottom=0)
    return _save(fig, path)


def step_time(runs: list[RunRecord], path: Path) -> Path | None:
    """Where each step's time went, per logged interval: waiting for input, exposed (blocked)
    communication, and the rest (compute), stacked; one panel per run (at most four)."""
    shown = [r for r in runs if any("data_wait_s" in t for t in r.train)][:4]
    if not shown:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(5.2 * len(shown), 3.8), squeeze=False,
                             sharey=True)
    labels = _labels(runs)
    for ax, run in zip(axes[0], shown):
        rows = [t for t in run.train if "data_wait_s" in t]
        steps = [t["step"] for t in rows]
        wait = [1e3 * t["data_wait_s"] for t in rows]
        comm = [1e3 * t.get("exposed_comm_s", 0.0) for t in rows]
        rest = [max(0.0, 1e3 * t["step_s"] - w - c) for t, w, c in zip(rows, wait, comm)]
        ax.stackplot(steps, wait, comm, rest, labels=["waiting for input", "exposed communication",
                                                     "compute (the rest)"],
                     colors=["tab:red", "tab:orange", "tab:blue"], alpha=0.8)
        ax.set(title=labels[id(run)], xlabel="optimizer step", ylabel="ms per step (median)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=8, loc="lower left")
    fig.suptitle("step time: input wait, exposed communication, compute", fontsize=10)
    return _save(fig, path)


def memory(run: RunRecord, path: Path) -> Path:
    """Per rank: model state (params+grads+optimizer) and peak activations, stacked; peak process."""
    ranks = run.summary.get("memory_per_rank") or [
        {"rank": 0, "state_bytes": run.summary.get("state_bytes"),
         "peak_activation_bytes": run.summary.get("peak_activation_bytes"),
         "peak_mem_bytes": None}]
    x = [r["rank"] for r in ranks]
    state = [r.get("state_bytes") or 0 for r in ranks]
    act = [r.get("peak_activation_bytes") or 0 for r in ranks]
    fig, ax = plt.subplots(figsize=(max(5, 0.8 * len(x) + 3), 4))
    ax.bar(x, state, label="model state (params + grads + optimizer)", color="#4c72b0")
    ax.bar(x, act, bottom=state, label="peak activations (above state)", color="#dd8452")
    peak = [r.get("peak_mem_bytes") for r in ranks]
    if all(p for p in peak):
        source = run.summary.get("peak_mem_source", "")
        ax.scatter(x, peak, marker="_", s=600, color="black", zorder=3,
                   label="process peak" + (" (RSS, includes the runtime)" if "rss" in source
                                           or run.summary.get("peak_activation_source", "")
                                           .startswith("cpu") else ""))
    ax.set(title=f"memory per rank — {run.plan}", xlabel="rank", ylabel="memory")
    _byte_axis(ax, max([s + a for s, a in zip(state, act)] + [p or 0 for p in peak]))
    ax.set_xticks(x)
    ax.legend(fontsize=8, loc="center")
    return _save(fig, path)


def minimum_bytes(axis: str, summary: dict) -> tuple[float, str] | None:
    """The algorithm's minimum payload per step on `axis` (ledger convention), where known.

    data: one all-reduce of this rank's gradients (bytes = gradient bytes).
    shard, ZeRO-1/2: reduce-scatter of the full gradients + all-gather of the full parameters
    (2 × full); ZeRO-3: parameters gathered for forward and again for backward (3 × full).
    """
    grads = summary.get("grad_bytes")
    params = summary.get("param_bytes")
    plan = summary.get("plan", "")
    if axis == "data" and grads and "shard" not in plan:
        return grads, "gradient all-reduce = gradient bytes"
    if axis == "shard" and params and summary.get("zero_stage"):
        degree = _degree(plan, "shard")
        if degree:
            full = params * degree
            stage = summary["zero_stage"]
            times = 3 if stage == 3 else 2
            return times * full, f"ZeRO-{stage}: {times} × full parameter bytes"
    return None


def _degree(plan: str, axis: str) -> int | None:
    import re
    m = re.search(rf"{axis}=(\d+)", plan)
    return int(m[1]) if m else None


def bytes_per_axis(runs: list[RunRecord], path: Path) -> Path | None:
    """Counted bytes per step by mesh axis, beside the algorithm's minimum where known."""
    rows = []
    for run in runs:
        for axis, value in (run.summary.get("bytes_per_step") or {}).items():
            label = axis_label(axis)   # the axis over every rank reads "all ranks"
            rows.append((f"{label}\n{run.plan}" if len(runs) > 1 else label, value,
                         minimum_bytes(axis, run.summary)))
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(5, 1.4 * len(rows) + 3), 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r[1] for r in rows], width=0.4, label="counted (ledger)",
           color="#4c72b0")
    mins = [r[2][0] if r[2] else 0 for r in rows]
    ax.bar([x + 0.2 for x in xs], mins, width=0.4, label="algorithm minimum", color="#55a868")
    for x, r in zip(xs, rows):
        ax.annotate(human_bytes(r[1]), (x - 0.2, r[1]), ha="center", va="bottom", fontsize=8)
        ax.annotate(human_bytes(r[2][0]) if r[2] else "not known", (x + 0.2, mins[x]),
                    ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs), [r[0] for r in rows])
    top = max(max(r[1] for r in rows), max(mins))
    ax.set(title="communication per step and rank, by mesh axis", ylabel="payload")
    _byte_axis(ax, top)
    ax.set_ylim(0, 1.15 * top)
    ax.legend(fontsize=8)
    return _save(fig, path)


def scaling(runs: list[RunRecord], path: Path) -> Path:
    """Throughput and parallel efficiency against ranks, relative to the smallest run."""
    runs = sorted(runs, key=lambda r: r.world_size)
    n = [r.world_size for r in runs]
    sps = [r.summary.get("samples_per_s", float("nan")) for r in runs]
    base = sps[0] / n[0]
    eff = [100 * s / (base * k) for s, k in zip(sps, n)]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(n, sps, marker="o", label="measured")
    a.plot(n, [base * k for k in n], ls="--", color="grey", label=f"linear from {n[0]} rank(s)")
    for k, s, run in zip(n, sps, runs):
        a.annotate(run.plan, (k, s), fontsize=7, textcoords="offset points", xytext=(4, -10))
    a.set(title="throughput", xlabel="ranks", ylabel="samples/s")
    a.set_ylim(bottom=0)
    a.legend(fontsize=8)
    b.plot(n, eff, marker="o")
    b.axhline(100, ls="--", color="grey")
    b.set(title="parallel efficiency", xlabel="ranks", ylabel=f"% of linear from {n[0]} rank(s)")
    b.set_ylim(0, max(110, max(eff) * 1.1))
    for ax in (a, b):
        ax.set_xticks(n)
    return _save(fig, path)


def table(rows: list[tuple[str, str]], title: str, path: Path) -> Path:
    """A two-column table as a picture (benchmark JSON)."""
    fig, ax = plt.subplots(figsize=(8, 0.28 * len(rows) + 0.8))
    ax.axis("off")
    t = ax.table(cellText=[list(r) for r in rows], colLabels=["figure", "value"], loc="center",
                 cellLoc="left", colLoc="left", colWidths=[0.6, 0.4])
    t.auto_set_font_size(False)
    t.set_fontsize(8)
    t.scale(1, 1.2)
    ax.set_title(title)
    return _save(fig, path)
