"""`exatrain data NAME --out DIR`: the data set writers, one sub-command each."""

from __future__ import annotations

import argparse


def _cosmoflow(sub):
    p = sub.add_parser("cosmoflow", help="log-normal 3D density fields whose power spectrum depends "
                                         "on four cosmological parameters (the targets)")
    p.add_argument("--samples", type=int, default=576)
    p.add_argument("--size", type=int, default=32, help="cube edge (MLPerf uses 128)")
    p.add_argument("--seed", type=int, default=1234)

    def write(args, progress):
        from .cosmoflow import write_cosmoflow
        return write_cosmoflow(args.out, samples=args.samples, size=args.size, seed=args.seed,
                               progress=progress)
    return write


WRITERS = {"cosmoflow": _cosmoflow}


def add_parsers(data_parser: argparse.ArgumentParser) -> None:
    sub = data_parser.add_subparsers(dest="name", required=True)
    for name, define in WRITERS.items():
        write = define(sub)
        parser = sub.choices[name]
        parser.add_argument("--out", required=True, help="output directory")
        parser.set_defaults(write=write)
