"""Draws the layout diagram and the declared-maximum sweep (:mod:`experiments.lib.plots`).

    python -m experiments.memory.figures --declared-max 256 --out results

Writes ``layout.png`` and ``declared_max_sweep.png`` to ``--out``;
``python -m experiments.memory.reproduce`` draws them too, with the other figures.
"""

from __future__ import annotations

import argparse

from experiments.lib.cli import add_flag, check_flags, check_outputs
from experiments.lib.plots import plot_declared_max_sweep, plot_layout


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m experiments.memory.figures", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--declared-max", type=int, default=256, help="contiguous reservation per request, tokens")
    add_flag(p, "page_size")
    add_flag(p, "out")
    args = p.parse_args(argv)
    check_flags(p, args)
    check_outputs(p, args)
    plot_layout(args.out / "layout.png", declared_max=args.declared_max, page_size=args.page_size)
    plot_declared_max_sweep(args.out / "declared_max_sweep.png", page_size=args.page_size)
    print(f"wrote {args.out / 'layout.png'} and {args.out / 'declared_max_sweep.png'}")


if __name__ == "__main__":
    main()
