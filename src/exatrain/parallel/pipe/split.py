"""Split a plain model's depth into contiguous stages, each an `nn.Module` with the serial names.

How: the model's `forward` is traced symbolically (torch.fx) with every element of an
`nn.Sequential` / `nn.ModuleList` -- the model's repeated blocks -- and every built-in torch layer
kept whole as a *layer*. The traced program is then a straight list of layer calls and glue
(embedding sums, reshapes, scalings), whatever the model's own `forward` does around them.
A *cut* before a layer hands every value still needed later (the "live set") to the next stage;
that set must be tensors (a stage's inputs and outputs are checked when their shapes are found).

Each stage is a `torch.fx.GraphModule` that calls the model's own layer modules (shared, not
copied) under their serial qualified names (`blocks.4.attn.q_proj.weight`), and containers keep
their types (a stage's `blocks` is an `nn.ModuleList` holding blocks "4" and "5"), so every later
step of `parallelize` (tensor, space, checkpointing, compile, shard, data) finds what it looks
for, and state dicts and checkpoints are the serial model's: a checkpoint written with p stages
loads with any other p, or without `pipe`.

Balance: contiguous layers are grouped into S stages minimising the largest stage cost. The cost
of a layer is its measured forward time on an example micro-batch when one is given (the same
cuts on every rank: the measurement is averaged over ranks), else its parameter count.
`pipe_split` (config) overrides: the layer indices at which stages 1..S-1 begin.
"""

from __future__ import annotations

import inspect
import time
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn
from torch.fx.experimental.meta_tracer import MetaTracer

from ...errors import ParallelizeError
from ..trial import leaves_no_trace


class PipeSplitError(ParallelizeError):
    """The model cannot be split into `plan.pipe` pipeline stages: too few layers for the stages,
    or a layer the split cannot cut around.

    What to do: use at most as many stages as the message says (`plan.pipe`), or give the model
    more top-level layers (an `nn.Sequential` of blocks).
    """


_CONTAINERS = (nn.Sequential, nn.ModuleList)


class _LayerTracer(MetaTracer):
    """Keeps torch's own layers and every element of a Sequential/ModuleList as one call.

    A meta tracer: values carry meta tensors of the example's shapes, so a forward that checks
    `x.dim()` or reads `x.size(1)` traces (shape checks become constants).
    """

    def __init__(self, root: nn.Module):
        super().__init__()
        self.in_container = {id(child) for module in root.modules() if isinstance(module, _CONTAINERS)
                             for child in module.children()}

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self.in_container or super().is_leaf_module(m, qualname)


@dataclass
class Layers:
    """The traced model: its graph, the layer nodes in order, and what may be cut where."""
    model: nn.Module
    graph: fx.Graph
    nodes: list[fx.Node]          # every node, in execution order
    layer_pos: list[int]          # position in `nodes` of each layer call
    layer_names: list[str]        # qualified module name of each layer

    def params(self, i: int) -> int:
        return sum(p.numel() for p in self.model.get_submodule(self.layer_names[i]).parameters())


def _drop_unused(graph: fx.Graph) -> None:
    """Remove nodes nothing uses: the meta tracer leaves its shape bookkeeping inside layers."""
    for node in reversed(list(graph.nodes)):
        if node.op not in ("placeholder", "output") and not node.users:
            graph.erase_node(node)


def trace_layers(model: nn.Module, example: torch.Tensor) -> Layers:
    """Trace `model` on `example`'s shape into a list of layers; errors name what would work."""
    tracer = _LayerTracer(model)
    name = next(iter(inspect.signature(model.forward).parameters))
    try:
        # the meta tracer runs the layers for their shapes: a spectral norm's iteration too
        with warnings.catch_warnings(), leaves_no_trace([model]):
            warnings.filterwarnings("ignore", message="Could not compute metadata")
            graph = tracer.trace(model, meta_args={name: example.to("meta")})
        _drop_unused(graph)
    except Exception as exc:
        raise PipeSplitError(
            f"pipe: cannot trace {type(model).__name__}.forward into a sequence of layers "
            f"({type(exc).__name__}: {exc}). Pipeline stages need a forward whose control flow does "
            "not depend on tensor values; put the repeated blocks in an nn.ModuleList or "
            "nn.Sequential, or give plan.pipe=1.") from exc
    nodes = list(graph.nodes)
    layer_pos = [i for i, n in enumerate(nodes) if n.op == "call_module"]
    if len(layer_pos) < 2:
        raise PipeSplitError(
            f"pipe: {type(model).__name__} has {len(layer_pos)} layer(s) to split between stages; "
            "pipeline parallelism needs a model built of several layers or blocks (an "
            "nn.Sequential, or blocks in an nn.ModuleList).")
    return Layers(model, graph, nodes, layer_pos, [nodes[i].target for i in layer_pos])


def live_across(layers: Layers, pos: int) -> list[fx.Node]:
    """Values computed before node `pos` and used at or after it (what a cut there sends).

    Attributes (`get_attr`: buffers, constants) are not sent: the stage that uses one reads it.
    """
    later = set(layers.nodes[pos:])
    return [n for n in layers.nodes[:pos]
            if n.op not in ("output", "get_attr") and any(u in later for u in n.users)]


def layer_costs(layers: Layers, example: torch.Tensor | None, repeats: int = 3) -> list[float]:
    """Per-layer cost: measured forward seconds on `example`, or parameter counts."""
    if example is None:
        return [float(max(1, layers.params(i))) for i in range(len(layers.layer_names))]
    times = {}

    class Timer(fx.Interpreter):
        def call_module(self, target, args, kwargs):
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = super().call_module(target, args, kwargs)
                best = min(best, time.perf_counter() - t0)
            times[target] = best
            return out

    gm = fx.GraphModule(layers.model, layers.graph)
    with torch.no_grad(), leaves_no_trace([layers.model]):   # timed 3 times, trained never
        Timer(gm).run(example)
    return [times[name] for name in layers.layer_names]


def balanced_starts(costs: list[float], stages: int) -> list[int]:
    """Layer indices where stages 1..stages-1 begin, minimising the largest stage's cost.

    Exact dynamic programme over contiguous partitions (layers <= a few hundred).
    """
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[s][i]: the smallest max-cost splitting layers[:i] into s stages; arg: last start
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    arg = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for i in range(s, n + 1):
            for j in range(s - 1, i):
                value = max(best[s - 1][j], prefix[i] - prefix[j])
                if value < best[s][i]:
                    best[s][i], arg[s][i] = value, j
    if best[stages][n] == inf:
        raise PipeSplitError(f"pipe: cannot cut {n} layers into {stages} stages; use fewer stages.")
    starts, i = [], n
    for s in range(stages, 0, -1):
        i = arg[s][i]
        starts.append(i)
    return sorted(starts)[1:]


def _mirror_containers(model: nn.Module, stage: fx.GraphModule) -> None:
    """Give the stage's intermediate modules the types of the model's (ModuleList, Sequential)."""
    def visit(src: nn.Module, dst: nn.Module) -> None:
        for name, child in list(dst.named_children()):
            original = getattr(src, name, None)
            if original is None or original is child:
                continue
            if isinstance(original, _CONTAINERS) and type(child) is nn.Module:
                mirror = nn.ModuleList()  # (not called: the stage's graph calls its elements)
                for key, grandchild in child.named_children():
                    mirror.add_module(key, grandchild)
                setattr(dst, name, mirror)
                child = mirror
            visit(original, child)
    visit(model, stage)


def build_stage(layers: Layers, begin: int, end: int) -> fx.GraphModule:
    """The stage running nodes[begin:end]: inputs = live set at `begin`, outputs = at `end`."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in live_across(layers, begin):
        env[node] = graph.placeholder(node.name)

    def lookup(node: fx.Node) -> fx.Node:
        if node not in env and node.op == "get_attr":  # an attribute an earlier stage read too
            env[node] = graph.node_copy(node)
        return env[node]

    for node in layers.nodes[begin:end]:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
        elif node.op != "output":
            env[node] = graph.node_copy(node, lookup)
    if end >= len(layers.nodes) - 1:  # the last stage returns what the model returns
        graph.output(fx.map_arg(layers.nodes[-1].args[0], lookup))
    else:
        outs = [env[n] for n in live_across(layers, end)]
        graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    for node in list(graph.nodes):   # an attribute read here but used only by a later stage
        if node.op == "get_attr" and not node.users:   # (which reads it itself): not this one's
            graph.erase_node(node)
    stage = fx.GraphModule(layers.model, graph)
    _mirror_containers(layers.model, stage)
    return stage


def split_model(model: nn.Module, stages: int, example: torch.Tensor,
                starts: list[int] | None = None, balance: str = "params",
                check_shared: bool = True) -> tuple[list[fx.GraphModule], list[int]]:
    """Cut `model` into `stages` stage modules, traced for inputs shaped like `example`.

    `balance`: "params" (parameter counts) or "time" (measured forward time of each layer on
    `example`). `check_shared`: refuse a trained parameter two stages use (off for cuts that are
    not final yet: a rank's own measured ones, before the ranks agree). Returns (stage modules,
    the layer indices where stages 1.. begin).
    """
    layers = trace_layers(model, example)
    n = len(layers.layer_names)
    if stages > n:
        raise PipeSplitError(
            f"pipe: {type(model).__name__} has {n} layers ({', '.join(layers.layer_names)}), "
            f"too few for {stages} stages; use at most {n} stages (plan.pipe x virtual stages).")
    if starts is None:
        starts = balanced_starts(layer_costs(layers, example if balance == "time" else None), stages)
    else:
        starts = list(starts)
        bad = [s for s in starts if not 0 < s < n]
        if len(starts) != stages - 1 or bad or starts != sorted(set(starts)):
            raise PipeSplitError(
                f"parallel.pipe_split={starts}: give {stages - 1} increasing layer indices in "
                f"1..{n - 1} where a stage may begin (the layers: "
                f"{', '.join(f'{i}={name}' for i, name in enumerate(layers.layer_names))}).")
    bounds = [0] + [layers.layer_pos[s] for s in starts] + [len(layers.nodes) - 1]
    # the first stage also takes the nodes before the first layer (inputs, glue)
    modules = [build_stage(layers, b, e) for b, e in zip(bounds[:-1], bounds[1:])]
    if check_shared:
        refuse_shared_across_stages(modules, layers, starts)
    return modules, starts


def refuse_shared_across_stages(modules: list[fx.GraphModule], layers: Layers,
                                starts: list[int]) -> None:
    """Refuse a trained parameter that two stages use (a tied weight: an output layer sharing
    the embedding's, a decoder using the encoder's weight transposed): each stage's ranks would
    train a copy of their own, and the model would silently train differently from serial."""
    first_user: dict[int, tuple[int, str]] = {}
    for i, stage in enumerate(modules):
        for name, p in stage.named_parameters(remove_duplicate=False):
            if not p.requires_grad:   # a frozen copy never changes
                continue
            seen = first_user.setdefault(id(p), (i, name))
            if seen[0] != i:
                where = ", ".join(f"{k}={layer}" for k, layer in enumerate(layers.layer_names))
                raise PipeSplitError(
                    f"pipe: the trained parameter {seen[1]!r} is used by stage {seen[0]} and, as "
                    f"{name!r}, by stage {i} (a tied weight, or a layer's weight used outside "
                    f"it): each stage would train its own copy. Keep its users in one stage "
                    f"(parallel.pipe_split={starts} are the stage starts now; the layers: "
                    f"{where}), untie it (its own nn.Parameter), or train without pipe.")
