"""`exatrain data NAME --out DIR`: the data set writers, one sub-command each."""

from __future__ import annotations

import argparse


def _cosmoflow(sub):
    p = sub.add_parser("cosmoflow", help="log-normal 3D density fields whose power spectrum depends "
                                         "on four cosmological parameters (the targets)")
    # the defaults write the default job's data set (workloads/cosmoflow.py, DataOptions)
    p.add_argument("--samples", type=int, default=4608, help="train + validation (1/8)")
    p.add_argument("--size", type=int, default=32, help="cube edge (MLPerf uses 128)")
    p.add_argument("--seed", type=int, default=1234)

    def write(args, progress):
        from .cosmoflow_synth import write_cosmoflow
        return write_cosmoflow(args.out, samples=args.samples, size=args.size, seed=args.seed,
                               progress=progress)
    return write


def _deepcam(sub):
    p = sub.add_parser("deepcam", help="2D atmospheric fields with labelled cyclones and "
                                       "atmospheric rivers, in the DeepCAM HDF5 layout")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--height", type=int, default=96)
    p.add_argument("--width", type=int, default=144)
    p.add_argument("--channels", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)

    def write(args, progress):
        from .deepcam_write import write_deepcam
        return write_deepcam(args.out, samples=args.samples, height=args.height, width=args.width,
                             channels=args.channels, seed=args.seed)
    return write


def _text(sub):
    p = sub.add_parser("text", help="the Python standard library's source as a byte-level corpus")
    p.add_argument("--max-bytes", type=int, default=None, help="cut the corpus to this many bytes")

    def write(args, progress):
        from .text import write_text_corpus
        return write_text_corpus(args.out, max_bytes=args.max_bytes)
    return write


def _forecast(sub):
    p = sub.add_parser("forecast", help="rotating shallow-water simulation trajectories (h, u, v)")
    p.add_argument("--trajectories", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="saved time steps per trajectory")
    p.add_argument("--height", type=int, default=64)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)

    def write(args, progress):
        from .forecast_synth import write_forecast
        return write_forecast(args.out, trajectories=args.trajectories, steps=args.steps,
                              height=args.height, width=args.width, seed=args.seed)
    return write


def _graph(sub):
    p = sub.add_parser("graph", help="a power-law graph with community labels (graph.npz)")
    p.add_argument("--nodes", type=int, default=20000)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--features", type=int, default=64)
    p.add_argument("--avg-degree", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)

    def write(args, progress):
        from .graph import write_graph
        return write_graph(args.out, nodes=args.nodes, classes=args.classes,
                           features=args.features, avg_degree=args.avg_degree, seed=args.seed)
    return write


def _qm9(sub):
    sub.add_parser("qm9", help="the QM9 molecules (from the installed qm9pack CSVs) as qm9.npz")

    def write(args, progress):
        from .qm9 import convert_qm9
        return convert_qm9(args.out)
    return write


def _catalysis(sub):
    p = sub.add_parser("catalysis", help="adsorbates on metal surfaces relaxed with ASE's EMT "
                                         "potential: positions, energies, forces (OC20's S2EF)")
    # the defaults write the catalysis workload's data set (workloads/catalysis.py, DataOptions)
    p.add_argument("--systems", type=int, default=256, help="relaxations")
    p.add_argument("--frames", type=int, default=10, help="frames kept of each relaxation")
    p.add_argument("--seed", type=int, default=0)

    def write(args, progress):
        from .catalysis import write_catalysis
        return write_catalysis(args.out, systems=args.systems, frames=args.frames,
                               seed=args.seed, progress=progress)
    return write


WRITERS = {"cosmoflow": _cosmoflow, "deepcam": _deepcam, "text": _text, "forecast": _forecast,
           "graph": _graph, "qm9": _qm9, "catalysis": _catalysis}


def add_parsers(data_parser: argparse.ArgumentParser) -> None:
    sub = data_parser.add_subparsers(dest="name", required=True)
    for name, define in WRITERS.items():
        write = define(sub)
        parser = sub.choices[name]
        parser.add_argument("--out", required=True, help="output directory")
        parser.set_defaults(write=write)
