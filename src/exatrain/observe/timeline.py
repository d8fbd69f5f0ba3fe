"""Draw a pipeline step's timeline: stages as rows, micro-batches as coloured boxes.

Input: `pipeline_timeline.json` as the Trainer writes it (one logged step: schedule, stages,
micro-batches and every forward/backward/weight-gradient span of every stage, in seconds from
the step's start). Forward boxes are solid, backward boxes hatched, weight-gradient boxes
(zero-bubble schedules) dotted; the colour is the micro-batch. White space is the bubble.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

_HATCH = {"F": "", "B": "///", "W": "..."}
_NAME = {"F": "forward", "B": "backward", "W": "weight gradient"}


def plot_timeline(path: str | Path, out: str | Path | None = None) -> Path:
    """Write the PNG beside the JSON (or to `out`); returns its path."""
    path = Path(path)
    data = json.loads(path.read_text())
    events = data["events"]
    stages = max(e["stage"] for e in events) + 1
    m = data["microbatches"]
    colours = plt.get_cmap("tab10" if m <= 10 else "tab20")
    fig, ax = plt.subplots(figsize=(10, 0.6 * stages + 1.6), dpi=110)
    for e in events:
        start, width = 1e3 * e["start_s"], 1e3 * (e["end_s"] - e["start_s"])
        ax.barh(e["stage"], width, left=start, height=0.8, color=colours(e["microbatch"] % 20),
                edgecolor="black", linewidth=0.4, hatch=_HATCH[e["kind"]])
        if width > 0.02 * 1e3 * max(x["end_s"] for x in events):
            ax.text(start + width / 2, e["stage"], str(e["microbatch"]), ha="center",
                    va="center", fontsize=7)
    ax.set_yticks(range(stages))
    ranks = {e["stage"]: e["rank"] for e in events}
    ax.set_yticklabels([f"stage {s} (rank {ranks.get(s, '?')})" for s in range(stages)])
    ax.invert_yaxis()
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(f"{data['schedule']}: {data['stages']} ranks x {data['virtual_stages']} stage(s), "
                 f"{m} micro-batches, step {data['step']} -- bubble {data['bubble_measured']:.1%} "
                 f"measured, {data['bubble_formula']:.1%} by formula", fontsize=9)
    kinds = sorted({e["kind"] for e in events}, key="FBW".index)
    ax.legend(handles=[Patch(facecolor="white", edgecolor="black", hatch=_HATCH[k],
                             label=_NAME[k]) for k in kinds],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(out) if out else path.with_suffix(".png")
    fig.savefig(out)
    plt.close(fig)
    return out
