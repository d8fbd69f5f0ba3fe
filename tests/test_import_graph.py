"""The import graph of src/exatrain: imports run downwards, with no circle (issue 47, item 2).

The graph is read from the source with `ast`, not by importing it: every `import` and `from ...
import` counts, at module level and inside functions alike (an import inside a function is how a
circle hides); relative imports are resolved; `from pkg import name` is an edge to the module
`pkg.name` where that is a module, else to `pkg`; imports under `if TYPE_CHECKING:` are not
imports. A package's `__init__`, which Python runs before any of its submodules, is an edge only
where the code names it. Modules named by a string (`importlib.import_module`: the workload,
benchmark and strategy registries) are not seen; each registry names modules of its own package.

Layers, lowest first. A module may import modules of its own layer and of the layers below it,
never of a layer above; within a layer, the no-circle rule alone holds:

  foundations   exatrain.errors, .plan, .version: user errors, the Plan, the version string
  comm          collectives over named axes, the ledger, halos, flight records, fault injection
  launch        launcher detection, local spawn, batch scripts, host memory, signals
  mesh          init(): the process group and the named axes of a Plan
  data, models  readers, writers and the input path; plain PyTorch models (peers)
  parallel      parallelize and every strategy, precision, activation checkpointing, compile
  optim         the optimizer factory, the learning-rate schedule, gradient norms and clipping,
                distributed K-FAC
  workloads     built-in and user workloads: model + data + loss + metrics
  population options  exatrain.population.options: the [population] section train's config reads
  observe       what a run records and shows: step meters, memory meters, the observer, console,
                summary fields, trackers, MLPerf log, report and figures, preflight, startup
  train         config, the Trainer (its step, sampling, evaluation, records, hooks),
                checkpoints/, resilience/, fit and the composition root (job)
  population    population training: partitions, pairing, model exchange, hyperparameters, plot,
                weak scaling, the member composed into each Trainer and the driver (population.run)
  run           exatrain.train.run, the run entry point: one job, or a population
  infer         prediction over a data set under any Plan (`exatrain predict`, et.predict)
  tune          the cost model, dry run, calibration, the planner and the tuner
  exatrain      the public API (`import exatrain as et`): re-exports from every layer below
  bench         benchmarks, baseline against exatrain, one module each
  cli           the `exatrain` command

The same order is in `LAYERS` below, each layer's module prefixes beside it; a module under no
prefix fails the test, so a new package is placed on purpose.
"""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "exatrain"

# lowest first: (layer, the modules it holds, by name or prefix)
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    # user errors, the Plan's arithmetic, the version string: import nothing of exatrain's
    ("foundations", ("exatrain.errors", "exatrain.plan", "exatrain.version")),
    # collectives over named axes and what they record
    ("comm", ("exatrain.comm",)),
    # how the ranks were started; knows no mesh
    ("launch", ("exatrain.launch",)),
    # a Plan's process group and named axes
    ("mesh", ("exatrain.mesh",)),
    # data sets and the input path; models, which know nothing of parallelism (peers)
    ("data, models", ("exatrain.data", "exatrain.models")),
    # strategies: act on module types, never on particular workloads
    ("parallel", ("exatrain.parallel",)),
    # how the tensors a strategy left behind are stepped: factory, schedule, norms, K-FAC
    ("optim", ("exatrain.optim",)),
    # model + data + loss + metrics, built-in or the user's
    ("workloads", ("exatrain.workloads",)),
    # the [population] options: train's config reads them
    ("population options", ("exatrain.population.options",)),
    # what a run records and shows (meters, console, trackers, report, preflight): the Trainer
    # uses it, so it imports nothing of the run; what it needs of the run is passed in
    ("observe", ("exatrain.observe",)),
    # the run: config, Trainer, checkpoints, resilience, fit, the composition root
    ("train", ("exatrain.train",)),
    # population training, above the Trainer it composes: member, driver, their pieces
    ("population", ("exatrain.population",)),
    # the run entry point (`run_job`): one job, or a population's
    ("run", ("exatrain.train.run",)),
    # prediction under any Plan: the run's checkpoints, laid out by train's composition root
    ("infer", ("exatrain.infer",)),
    # the planner and the tuner: build configs and dry runs from every layer below
    ("tune", ("exatrain.tune",)),
    # the public API, `et.*`: re-exports only
    ("exatrain", ("exatrain",)),
    # benchmarks: may use et.* as a user does
    ("bench", ("exatrain.bench",)),
    # the command line: the top
    ("cli", ("exatrain.cli",)),
]

# Upward imports that remain, each with the reason it is not fixed yet: (importer, imported) ->
# why. The test fails when one of them is no longer in the graph, so the list cannot rot.
ALLOWED_UPWARD: dict[tuple[str, str], str] = {}


# ------------------------------------------------------------------ the graph

def module_names(root: Path, package: str) -> dict[str, Path]:
    """Every module of the package under `root`, by dotted name (a package by its own name)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every import statement of the tree, at any depth (functions, classes, try, if), except
    those under `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking(node.test):
            stack.extend(node.orelse)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, package: str) -> dict[str, dict[str, int]]:
    """module -> {module it imports: line of the first such import}, within the package."""
    modules = module_names(root, package)

    def known(name: str | None) -> str | None:  # the module itself, or the package holding it
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph.setdefault(name, {})
        for node in _import_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parts = here.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            for target in targets:
                if target != package and not target.startswith(package + "."):
                    continue  # torch, numpy, the standard library
                target = known(target)
                if target and target != name:
                    edges.setdefault(target, node.lineno)
    return graph


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth: the longest import chain, a few dozen
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, {})):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per strongly connected component, as the chain [a, b, ..., a] in which each
    module imports the next: the shortest way from the component's first module back to it."""
    cycles = []
    for component in strongly_connected(graph):
        members, start = set(component), component[0]
        came_from: dict[str, str | None] = {start: None}
        queue = deque([start])
        while queue:  # breadth first: the shortest circle through `start`
            v = queue.popleft()
            if start in graph[v]:
                path = [v]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                cycles.append([*reversed(path), start])
                break
            for w in sorted(graph[v]):
                if w in members and w not in came_from:
                    came_from[w] = v
                    queue.append(w)
    return cycles


def describe(chain: list[str], graph: dict[str, dict[str, int]]) -> str:
    """'a (line 3) -> b (line 9) -> a': each arrow at the line of the importing module."""
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(chain, chain[1:])) + \
        f" -> {chain[-1]}"


def layer_of(module: str, layers=LAYERS) -> int | None:
    """The layer holding `module`: its longest prefix in `layers` (the root package's own name
    holds only the root package)."""
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            match = module == prefix or ("." in prefix and module.startswith(prefix + "."))
            if match and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def upward_imports(graph, layers=LAYERS) -> list[tuple[str, str, int]]:
    """(importer, imported, line) for each import of a higher layer by a lower one."""
    return [(a, b, line) for a, edges in sorted(graph.items()) for b, line in sorted(edges.items())
            if layer_of(a, layers) is not None and layer_of(b, layers) is not None
            and layer_of(b, layers) > layer_of(a, layers)]


# ------------------------------------------------------------------ the rules

@pytest.fixture(scope="module")
def graph():
    return import_graph(SRC, "exatrain")


def test_the_graph_holds_the_package(graph):
    assert len(graph) > 150 and "exatrain.cli" in graph
    assert "exatrain.train.config" in graph["exatrain.train"]       # `from .config import ...`
    assert "exatrain.comm" in graph["exatrain.train.records"]       # `from ..comm import ...`


def test_every_module_has_a_layer_and_every_layer_modules(graph):
    placeless = sorted(m for m in graph if layer_of(m) is None)
    assert not placeless, (f"modules in no layer: {placeless}; add their package to LAYERS in "
                           f"{Path(__file__).name}, at the height its imports allow")
    empty = [prefix for _, prefixes in LAYERS for prefix in prefixes
             if not any(m == prefix or m.startswith(prefix + ".") for m in graph)]
    assert not empty, f"LAYERS names modules that do not exist: {empty}"


def test_no_import_circle(graph):
    lines = []
    for component, chain in zip(strongly_connected(graph), find_cycles(graph)):
        lines.append("  " + describe(chain, graph))
        if len(component) > len(chain) - 1:
            lines.append(f"    (one of the circles among {', '.join(component)})")
    assert not lines, "import circles (module (line of its import) -> the module it imports):\n" \
        + "\n".join(lines)


def test_imports_run_downwards(graph):
    names = [name for name, _ in LAYERS]
    found = upward_imports(graph)
    bad = [f"  {a} (layer {names[layer_of(a)]}, line {line}) imports {b} (layer "
           f"{names[layer_of(b)]})" for a, b, line in found if (a, b) not in ALLOWED_UPWARD]
    assert not bad, ("imports from a lower layer into a higher one; pass the value in, or move "
                     "the function down to where both can reach it:\n" + "\n".join(bad))
    stale = sorted(set(ALLOWED_UPWARD) - {(a, b) for a, b, _ in found})
    assert not stale, f"ALLOWED_UPWARD lists imports that are gone; remove them: {stale}"


# ------------------------------------------------------------------ the checker checks itself

def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_checker_reports_a_planted_circle(tmp_path):
    """a -> b at module level, b -> a hidden inside a function: the circle is reported as the
    chain of modules, with the lines of the imports."""
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "import os\n\n\ndef f():\n    from .a import g\n    return g\n",
        "c.py": "from pkg import a\n",                     # imports into the circle: not part of it
        "sub/__init__.py": "",
        "sub/d.py": "from ..c import x\n",
    })
    graph = import_graph(root, "pkg")
    assert graph["pkg.a"] == {"pkg.b": 1} and graph["pkg.b"] == {"pkg.a": 5}
    assert graph["pkg.sub.d"] == {"pkg.c": 1}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert describe(["pkg.a", "pkg.b", "pkg.a"], graph) == \
        "pkg.a (line 1) -> pkg.b (line 5) -> pkg.a"


def test_checker_reports_a_longer_circle_once(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "import pkg.b\n",
        "b.py": "from pkg.c import thing\n",
        "c.py": "def f():\n    import pkg.a\n",
    })
    assert find_cycles(import_graph(root, "pkg")) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]


def test_checker_ignores_type_checking_imports(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
                 "else:\n    from . import c\n"),
        "c.py": "",
    })
    graph = import_graph(root, "pkg")
    assert graph["pkg.b"] == {"pkg.c": 5} and find_cycles(graph) == []


def test_checker_reports_an_upward_import(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "", "low.py": "def f():\n    from .high import g\n", "high.py": "",
    })
    layers = [("low", ("pkg.low",)), ("high", ("pkg.high",))]
    assert upward_imports(import_graph(root, "pkg"), layers) == [("pkg.low", "pkg.high", 2)]
