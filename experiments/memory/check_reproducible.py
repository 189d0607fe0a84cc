"""Runs the tables twice and compares every number that is not a timing.

    python -m experiments.memory.check_reproducible [--keep DIR] [-- REPRODUCE_ARGS ...]
    python -m experiments.memory.check_reproducible --compare DIR_A DIR_B

The first form runs ``python -m experiments.memory.reproduce REPRODUCE_ARGS --out
<folder>`` twice, side by side in two fresh processes with different
``PYTHONHASHSEED``, each into its own folder (default arguments: a small
configuration, about half a minute on 2 quiet CPU cores). The second compares two folders
written before, by any of the scripts (e.g. two runs of
``experiments.memory.sharing``).

Every ``.md`` and ``.csv`` file of one folder must be in the other with the
same cells, except the columns of :data:`TIMING_COLUMNS` (declared here, for
every script, not guessed per run) and the provenance block's ``date`` and
``command`` (the ``--out`` folders differ); a changed ``dirty`` (the tree
edited between the runs) is printed as a note. Each file must carry a
provenance block. Markdown tables are compared cell by cell by header, the
prose between them line by line (after blanking :data:`TIMING_TEXT`). Each
difference is printed with its file, row and column; the exit status is 1
if there is any, 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import tempfile
from collections.abc import Sequence

from experiments.lib import provenance
from experiments.lib.cli import check_out_dir

SMALL = ("--sim-requests", "20", "--pool-tokens", "2048", "--skip-serving")
"""Default arguments of the twice-run ``experiments.memory.reproduce``: two
simulations of 20 ShareGPT requests, no SmolLM2 serving."""

TIMING_COLUMNS = frozenset({
    # experiments.memory.reproduce (Markdown headers and CSV columns are the same names)
    "sim s", "wall s", "tokens/s", "SmolLM2 tokens/s",
    # experiments.serving.serve_sharegpt, experiments.serving.hf_baseline
    "wall_s", "tokens_per_s", "ms_per_iteration", "model_s", "floor_s", "model_over_floor", "host_s", "compile_s",
    # ... and means weighted by wall time (the iterations' durations vary from run to run)
    "mean_concurrency", "kv_token_fraction",
    # ... and XLA compilations the persistent cache did not serve: its state, not the code, decides them
    "compiled",
    # experiments.memory.sharing (parts a, b and d: wall time; c: fastest of --repeats)
    "unpressured_s", "difference_s", "recompute_ms", "swap_out_ms", "swap_in_ms", "swap_over_recompute",
    # experiments.train_tiny (seconds since training began, per step)
    "seconds",
    # experiments.kernels.kernel_bench: CSV columns, then the Markdown headers of the same
    "ms", "ratio", "gbs", "pct_copy", "copy_read_gbs", "x dense", "GB/s", "% copy", "copy GB/s (read)",
    "pct_peak", "peak_read_gbs", "% peak",
})
"""Columns that measure time (or a rate or ratio of times): left out of the comparison."""

TIMING_TEXT = (
    re.compile(r"throughput:? [\d.]+x"),  # serve_sharegpt's and hf_baseline's ratio lines
    re.compile(r"XLA compiled \d+ programs"),  # serve_sharegpt's summary: the compile cache's state
    re.compile(r"load average at start [\d., ]+"),  # kernel_bench's machine line: other work on the machine
    re.compile(r"copy reads [\d.e+]+ GB/s"),  # kernel_bench's peak line
    re.compile(r"^- .*(x dense|% of peak).*$", re.M),  # kernel_bench's summary bullets: ratios and verdicts
)
"""Timings inside Markdown prose, blanked before lines are compared."""

IGNORED_PROVENANCE = frozenset({"date", "command"})
"""Provenance keys that differ between two runs of the same configuration."""
NOTED_PROVENANCE = frozenset({"dirty"})
"""Provenance keys whose difference is reported as a note, not a failure: a
working tree edited between the two runs (someone else at work in it)."""


@dataclasses.dataclass
class Comparison:
    """What :func:`compare_dirs` found: ``differences`` (one line each,
    naming file, row and column), ``notes`` (differences that do not fail
    the check), ``files`` compared, ``cells`` compared and timing cells
    ``skipped``."""

    differences: list[str] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    files: int = 0
    cells: int = 0
    skipped: int = 0


def compare_dirs(a: pathlib.Path, b: pathlib.Path) -> Comparison:
    """Compares the ``.md`` and ``.csv`` files of folders ``a`` and ``b``
    (not recursively); see the module docstring for what counts."""
    result = Comparison()
    names_a = {p.name for p in a.iterdir() if p.suffix in (".md", ".csv")}
    names_b = {p.name for p in b.iterdir() if p.suffix in (".md", ".csv")}
    for name in sorted(names_a ^ names_b):
        result.differences.append(f"{name}: only in {a if name in names_a else b}")
    for name in sorted(names_a & names_b):
        result.files += 1
        if name.endswith(".csv"):
            prov_a, rows_a = provenance.read_csv(a / name)
            prov_b, rows_b = provenance.read_csv(b / name)
            tables = [(name, *_csv_table(rows_a), *_csv_table(rows_b))]
            prose_a = prose_b = []
        else:
            body_a, prov_a = provenance.split_markdown((a / name).read_text())
            body_b, prov_b = provenance.split_markdown((b / name).read_text())
            prose_a, tables_a = _parse_markdown(body_a)
            prose_b, tables_b = _parse_markdown(body_b)
            if len(tables_a) != len(tables_b):
                result.differences.append(f"{name}: {len(tables_a)} tables != {len(tables_b)}")
                continue
            tables = [(f"{name} table {i + 1}", ha, ra, hb, rb)
                      for i, ((ha, ra), (hb, rb)) in enumerate(zip(tables_a, tables_b))]
        _compare_provenance(name, prov_a, prov_b, result)
        _compare_prose(name, prose_a, prose_b, result)
        for where, header_a, rows_a, header_b, rows_b in tables:
            _compare_table(where, header_a, rows_a, header_b, rows_b, result)
    return result


def _compare_provenance(name: str, prov_a: dict, prov_b: dict, result: Comparison) -> None:
    for prov, folder in ((prov_a, "first"), (prov_b, "second")):
        if set(prov) != set(provenance.FIELDS):
            missing = [f for f in provenance.FIELDS if f not in prov]
            result.differences.append(f"{name}: the {folder} run's provenance block lacks {', '.join(missing)}")
    for key in provenance.FIELDS:
        if key not in IGNORED_PROVENANCE and key in prov_a and key in prov_b and prov_a[key] != prov_b[key]:
            found = result.notes if key in NOTED_PROVENANCE else result.differences
            found.append(f"{name}: provenance {key}: {prov_a[key]!r} != {prov_b[key]!r}")


def _compare_prose(name: str, prose_a: list[tuple[int, str]], prose_b: list[tuple[int, str]],
                   result: Comparison) -> None:
    def blank(line: str) -> str:
        for pattern in TIMING_TEXT:
            line = pattern.sub("<timing>", line)
        return line

    if len(prose_a) != len(prose_b):
        result.differences.append(f"{name}: {len(prose_a)} lines of text outside tables != {len(prose_b)}")
        return
    for (line, la), (_, lb) in zip(prose_a, prose_b):
        if blank(la) != blank(lb):
            result.differences.append(f"{name}: line {line}: {la!r} != {lb!r}")


def _compare_table(where: str, header_a: list, rows_a: list, header_b: list, rows_b: list,
                   result: Comparison) -> None:
    if header_a != header_b:
        result.differences.append(f"{where}: columns {header_a} != {header_b}")
        return
    if len(rows_a) != len(rows_b):
        result.differences.append(f"{where}: {len(rows_a)} rows != {len(rows_b)}")
        return
    for i, (ra, rb) in enumerate(zip(rows_a, rows_b)):
        if len(ra) != len(rb):
            result.differences.append(f"{where}: row {i + 1}: {len(ra)} cells != {len(rb)}")
            continue
        for col, va, vb in zip(header_a, ra, rb):
            if col in TIMING_COLUMNS:
                result.skipped += 1
                continue
            result.cells += 1
            if va != vb:
                label = f" ({ra[0]})" if ra and ra[0] == rb[0] else ""
                result.differences.append(f"{where}: row {i + 1}{label}, column {col!r}: {va!r} != {vb!r}")


def _csv_table(rows: list[dict]) -> tuple[list[str], list[list[str]]]:
    return (list(rows[0]) if rows else []), [list(r.values()) for r in rows]


def _parse_markdown(body: str) -> tuple[list[tuple[int, str]], list[tuple[list[str], list[list[str]]]]]:
    """Splits Markdown into prose ``(line number, line)`` and tables
    ``(header, rows)``; a table is a ``|``-line followed by a ``|---|``
    line and its ``|``-rows."""
    lines = body.splitlines()
    prose, tables, i = [], [], 0
    while i < len(lines):
        if (lines[i].startswith("|") and i + 1 < len(lines)
                and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[i + 1].strip())):
            header = _cells(lines[i])
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(_cells(lines[i]))
                i += 1
            tables.append((header, rows))
        else:
            prose.append((i + 1, lines[i]))
            i += 1
    return prose, tables


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def run_twice(reproduce_args: Sequence[str], work: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Runs ``python -m experiments.memory.reproduce`` twice, side by side, into
    ``work/run1`` and ``work/run2``, in fresh processes with
    ``PYTHONHASHSEED`` 1 and 2 (each is mostly one thread: on 2 cores the
    pair takes about as long as one run).

    Raises:
      RuntimeError: a run failed (its output's tail in the message).
    """
    dirs = (work / "run1", work / "run2")
    procs = []
    for hash_seed, out in enumerate(dirs, start=1):
        cmd = [sys.executable, "-m", "experiments.memory.reproduce", *reproduce_args, "--out", str(out)]
        print(f"run {hash_seed}: {' '.join(cmd[1:])}", flush=True)
        log = tempfile.TemporaryFile(mode="w+")
        procs.append((hash_seed, log, subprocess.Popen(
            cmd, cwd=provenance.REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "PYTHONHASHSEED": str(hash_seed)})))
    failed = []
    for hash_seed, log, proc in procs:
        if proc.wait():
            log.seek(0)
            failed.append(f"run {hash_seed} exited with {proc.returncode}:\n{log.read()[-3000:]}")
        log.close()
    if failed:
        raise RuntimeError("\n".join(failed))
    return dirs


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.memory.check_reproducible", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", nargs=2, type=pathlib.Path, metavar=("DIR_A", "DIR_B"),
                   help="compare two folders written before instead of running anything")
    p.add_argument("--keep", type=pathlib.Path, default=None,
                   help="write the two runs to DIR/run1 and DIR/run2 and keep them (default: a temporary folder)")
    p.add_argument("reproduce_args", nargs=argparse.REMAINDER,
                   help=f"after --: arguments of experiments.memory.reproduce (default: {' '.join(SMALL)})")
    args = p.parse_args(argv)
    if args.reproduce_args[:1] == ["--"]:
        args.reproduce_args = args.reproduce_args[1:]
    if args.compare and (args.keep or args.reproduce_args):
        p.error("--compare takes no --keep and no reproduce arguments")
    if any(a == "--out" or a.startswith("--out=") for a in args.reproduce_args):
        p.error("the check chooses the runs' --out folders itself; use --keep DIR to keep them")
    for folder in args.compare or ():
        if not folder.is_dir():
            p.error(f"--compare: {str(folder)!r} is not a folder")
    if args.keep is not None:
        check_out_dir(p, args.keep, "--keep")
    args.reproduce_args = args.reproduce_args or list(SMALL)
    return args


def main(argv=None) -> int:
    """Returns the exit status: 0 when the two folders agree, 1 otherwise."""
    args = parse_args(argv)
    if args.compare:
        a, b = args.compare
        result = compare_dirs(a, b)
    else:
        with tempfile.TemporaryDirectory(prefix="check_reproducible_") as tmp:
            work = args.keep or pathlib.Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            a, b = run_twice(args.reproduce_args, work)
            result = compare_dirs(a, b)
    if result.files == 0 and not result.differences:  # nothing compared is not agreement
        result.differences.append(f"no .md or .csv files to compare in {a} and {b}")
    for line in result.differences:
        print(line)
    if result.notes:
        print(f"note: the working tree changed between the runs ({result.notes[0]})")
    verdict = "NOT reproducible" if result.differences else "reproducible"
    print(f"{verdict}: {result.files} files, {result.cells} cells compared, {result.skipped} timing cells "
          f"skipped, {len(result.differences)} differences ({a} vs {b})")
    return 1 if result.differences else 0


if __name__ == "__main__":
    sys.exit(main())
