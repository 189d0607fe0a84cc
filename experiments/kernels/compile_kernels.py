"""Every Pallas kernel compiled for TPU v5e / v6e (libtpu) and sm80 / sm90
(Triton to PTX), and the engine's whole step at Llama-3-8B shapes, with no
device: ``results/kernel_compile.{md,csv}`` and
``results/engine_step_compile.csv``.

Usage: ``python -m experiments.kernels.compile_kernels [--full]
[--chips v5e sm90] [--jobs 2] [--no-step | --step-only] [--out DIR]``
(needs ``.venv-aot``, which ``make setup`` builds; see
:mod:`experiments.lib.aot`). Default: the test suite's kernel matrix (124
cases, a few minutes on 2 cores) and the step for v5e, v6e and sm90
(about 5 minutes); ``--full``: the kernels' product (1,056 cases, 12
minutes and more). Exits 1 when a case fails to compile or is over its chip's
on-chip memory, or the step does not fit its chip's HBM.
"""

from __future__ import annotations

import argparse
import collections
import sys

from experiments.lib import aot, aot_step, provenance
from experiments.lib.cli import add_flag, check_outputs


def summary(results: list[aot.Result]) -> list[str]:
    """One line per kernel and chip: cases by status, the largest on-chip
    bytes against the limit, compile seconds."""
    by = collections.defaultdict(list)
    for r in results:
        by[(r.case.kernel, r.case.chip)].append(r)
    lines = ["| kernel | chip | cases | ok | refused by name | failed | largest on-chip bytes / limit | "
             "compile s (max) |", "|---|---|---|---|---|---|---|---|"]
    for (kernel, chip), rs in sorted(by.items()):
        counts = collections.Counter(r.status for r in rs)
        used = max((r.on_chip_bytes or 0) for r in rs)
        limit = next((r.limit_bytes for r in rs if r.limit_bytes), None)
        failed = len(rs) - counts["ok"] - counts["refused"]
        lines.append(f"| {kernel} | {chip} | {len(rs)} | {counts['ok']} | {counts['refused']} | {failed} | "
                     f"{used:,} / {limit:,} | {max(r.seconds for r in rs):.1f} |" if limit else
                     f"| {kernel} | {chip} | {len(rs)} | {counts['ok']} | {counts['refused']} | {failed} | - | "
                     f"{max(r.seconds for r in rs):.1f} |")
    return lines


STEP_CASES = tuple(aot_step.StepCase(chip=chip) for chip in ("v5e", "v6e", "sm90"))
"""The engine's step: Llama-3-8B in bfloat16, pages of 16, a bf16 pool of
the rest of the chip's memory, a call of one 448-token prefill chunk and 63
decodes, sampling."""


def step_summary(results: list[aot_step.StepResult]) -> list[str]:
    """One line per chip: the step's status, pool, memory and cost analyses."""
    gb = 1e9
    lines = ["| chip | status | compile s | weights GB | pool GB (tokens) | arguments GB | temporaries GB | "
             "peak GB / usable | GFLOP | GB accessed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.peak_bytes:
            lines.append(f"| {r.case.chip} | {r.status} | {r.seconds:.0f} | {r.weight_bytes / gb:.2f} | "
                         f"{r.pool_bytes / gb:.2f} ({r.tokens:,}) | {r.argument_bytes / gb:.2f} | "
                         f"{r.temp_bytes / gb:.3f} | {r.peak_bytes / gb:.2f} / {r.hbm_bytes / gb:.2f} | "
                         f"{r.flops / 1e9:,.0f} | {r.bytes_accessed / gb:.2f} |")
        else:
            lines.append(f"| {r.case.chip} | {r.status} | {r.seconds:.0f} | {r.weight_bytes / gb:.2f} | "
                         f"{r.pool_bytes / gb:.2f} ({r.tokens:,}) | - | - | - | - | - |")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked before any compile (``--chips`` narrows both the kernels and the step)."""
    from pallas_kernels.chips import CHIPS

    parser = argparse.ArgumentParser(prog="python -m experiments.kernels.compile_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--full", action="store_true", help="every kernel x chip x preset x page size x dtype")
    parser.add_argument("--chips", nargs="+", choices=sorted(CHIPS), default=sorted(CHIPS),
                        help="the chips to compile for (default: all of them)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    steps = parser.add_mutually_exclusive_group()
    steps.add_argument("--no-step", action="store_true", help="the kernels only, not the engine's step")
    steps.add_argument("--step-only", action="store_true", help="the engine's step only, not the kernels")
    add_flag(parser, "out")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    check_outputs(parser, args)
    step_chips = sorted({c.chip for c in STEP_CASES} & set(args.chips))
    if args.step_only and not step_chips:
        parser.error(f"--step-only compiles the engine's step for {sorted(c.chip for c in STEP_CASES)} only, "
                     f"got --chips {' '.join(args.chips)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = [] if args.step_only else [c for c in aot.matrix(full=args.full) if c.chip in args.chips]
    step_cases = [] if args.no_step else [c for c in STEP_CASES if c.chip in args.chips]
    print(f"compiling {len(cases)} kernel cases in {args.jobs} worker processes and the engine's step for "
          f"{len(step_cases)} chips; tables at the end", flush=True)
    try:
        results = aot.run_cases(cases, jobs=args.jobs, timeout=3600) if cases else []
        print(f"kernels: {collections.Counter(r.status for r in results)}", flush=True)
        steps = []
        for case in step_cases:
            steps.append(aot_step.run_step(case))
            print(f"step for {case.chip}: {steps[-1].status}", flush=True)
    except FileNotFoundError as e:  # no .venv-aot
        sys.exit(f"python -m experiments.kernels.compile_kernels: error: {e}")
    step_notes = sorted({f"{r.case.chip}: {r.message}" for r in steps if r.message})
    rows = [r.row() for r in results]
    refused = sorted({r.message for r in results if r.status == "refused"})
    text = "\n".join([
        "# Kernels compiled for real chips, with no device",
        "",
        f"{'The full product' if args.full else 'The test suite matrix'}: {len(results)} cases. TPU: libtpu's "
        "whole compiler (Mosaic included) for a v5e / v6e topology; on-chip bytes are the kernel's VMEM "
        "(double-buffered blocks and scratch, tile-padded) against the scoped VMEM. GPU: the Triton IR of each "
        "kernel compiled to PTX for the compute capability; on-chip bytes are Triton's shared memory per block "
        "against the architecture's limit. Static sizes: `experiments/lib/aot.py`.",
        "",
        *(summary(results) if results else ["(no kernel compiled: --step-only)"]),
        "",
        *(f"Refused by name: {m}" for m in refused),
        "",
        *(["Per case: `kernel_compile.csv`."] if results else []),
        *(["", "## The engine's whole step", "",
            "`paged_jax.engine.step.device_step` (page-state updates, the forward with the flat kernel writing K/V, "
            "sampling) at Llama-3-8B in bfloat16, pages of 16, a bfloat16 pool of the rest of the chip's usable "
            "memory, one 448-token prefill chunk and 63 decodes, 64 sequence slots. TPU: compiled by libtpu; "
            "memory and cost from the compiled program's analyses (peak = arguments + outputs - aliased + "
            "temporaries); GFLOP and GB accessed are XLA's cost analysis, which counts the layer scan's body once. GPU: lowered for CUDA and its Triton kernels compiled to PTX; XLA's GPU compile of "
            "the rest needs a GPU.", "", *step_summary(steps), "", *step_notes, "",
            "Per chip: `engine_step_compile.csv`."] if steps else []),
    ])
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    record = provenance.collect("experiments.kernels.compile_kernels", argv)
    provenance.write_markdown(args.out / "kernel_compile.md", text, record)
    if rows:
        provenance.write_csv(args.out / "kernel_compile.csv", rows, list(rows[0]), record)
    if steps:
        step_rows = [r.row() for r in steps]
        provenance.write_csv(args.out / "engine_step_compile.csv", step_rows, list(step_rows[0]), record)
    return 0 if all(r.status in ("ok", "refused") for r in results) and all(r.status == "ok" for r in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
