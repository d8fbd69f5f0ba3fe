"""What torch.compile did in a run: graphs compiled, graph breaks and their reasons.

A graph break is silent: Dynamo runs the rest of the frame eagerly and compiles what follows as
another graph, and a frame it cannot trace at all runs wholly eager. A run with
`parallel.compile = true` therefore reports, from Dynamo's own counters
(`torch._dynamo.utils.counters`, process-wide; the difference over the run is taken):

  compiled_frames   Python frames Dynamo compiled (each recompilation counts again)
  compiled_graphs   FX graphs handed to the backend (an earlier run in the same process that
                    compiled the same model leaves nothing new to compile: 0 then)
  graph_breaks      breaks, with `graph_break_reasons`: the first line of each distinct reason

so that a step that fell back to eager can never pass unseen (the summary and the first log
line carry them). Nothing here communicates.
"""

from __future__ import annotations

from collections import Counter


def _counters() -> dict:
    from torch._dynamo.utils import counters
    return {"frames": counters["frames"].get("ok", 0),
            "graphs": counters["stats"].get("unique_graphs", 0),
            "breaks": Counter(dict(counters["graph_break"]))}


class CompileCounter:
    """Dynamo's counters from construction on."""

    def __init__(self):
        self._start = _counters()

    def figures(self) -> dict:
        now, start = _counters(), self._start
        breaks = now["breaks"] - start["breaks"]
        reasons = sorted({reason.strip().splitlines()[0] for reason in breaks})
        return {"compiled_frames": now["frames"] - start["frames"],
                "compiled_graphs": now["graphs"] - start["graphs"],
                "graph_breaks": sum(breaks.values()),
                "graph_break_reasons": reasons[:10]}


__all__ = ["CompileCounter"]
