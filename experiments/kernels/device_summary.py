"""The short summary ``experiments/device_check.sh`` prints last: one line
per serving run, the kernel benchmark's target lines and the simulator's
validation verdict, read back from the files the check wrote.

Usage: ``python -m experiments.kernels.device_summary DIR`` (the check's results
folder). Exits 1 when a file the check should have written is missing.
"""

from __future__ import annotations

import pathlib
import sys

from experiments.lib import provenance


def serving_lines(folder: pathlib.Path) -> list[str]:
    """One line per ``serve_*/serve_sharegpt.csv`` below ``folder``: tokens
    per second of both modes, their ratio, compile and wall seconds."""
    lines = []
    for csv in sorted(folder.glob("serve_*/serve_sharegpt.csv")):
        try:
            _, rows = provenance.read_csv(csv)
            by = {r["mode"]: r for r in rows}
            p, c = by["paged"], by["contiguous"]
            ratio = float(p["tokens_per_s"]) / float(c["tokens_per_s"])
        except (KeyError, ValueError, ZeroDivisionError) as e:
            lines.append(f"{csv.parent.name}: unreadable {csv} ({type(e).__name__}: {e}); expected a paged and a "
                         "contiguous row with tokens_per_s > 0")
            continue
        lines.append(
            f"{csv.parent.name}: paged {p['tokens_per_s']} tok/s vs contiguous {c['tokens_per_s']} ({ratio:.2f}x); "
            f"paged wall {p['wall_s']} s, compile {p['compile_s']} s, {p['programs']} programs, "
            f"model/floor {p['model_over_floor']}, host {p['host_s']} s, K/V {p['kv_dtype']}")
    return lines


def bench_lines(folder: pathlib.Path) -> list[str]:
    """The summary section of each ``kernel_bench*.md`` below ``folder``
    (the lines after its ``## Summary`` heading, provenance excluded)."""
    lines = []
    for md in sorted(folder.glob("kernel_bench*.md")):
        body = provenance.split_markdown(md.read_text())[0]
        if "## Summary" in body:
            section = body.split("## Summary", 1)[1]
            lines += [f"{md.stem}: {line.strip()}" for line in section.strip().splitlines() if line.strip()]
    return lines


def simulator_lines(folder: pathlib.Path) -> list[str]:
    """The verdict line of ``simulator_validation.md`` in ``folder`` (the
    simulator against real runs on this device), if the check wrote one."""
    md = folder / "simulator_validation.md"
    if not md.is_file():
        return []
    body = provenance.split_markdown(md.read_text())[0]
    return [f"simulator_validation: {line.strip().split(' The last column')[0]}" for line in body.splitlines()
            if "Worst MAPE" in line]


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m experiments.kernels.device_summary DIR", file=sys.stderr)
        return 2
    folder = pathlib.Path(args[0])
    if not folder.is_dir():
        print(f"{str(folder)!r} is not a folder (experiments/device_check.sh writes DIR)", file=sys.stderr)
        return 2
    serving, bench = serving_lines(folder), bench_lines(folder)
    print("== summary ==")
    for line in bench + serving + simulator_lines(folder):
        print(line)
    missing = [what for what, found in (("kernel benchmark", bench), ("serving", serving)) if not found]
    if missing or any("unreadable" in line for line in serving):
        print(f"incomplete results in {folder}: missing {', '.join(missing) or 'nothing'}; "
              f"unreadable serving files: {sum('unreadable' in line for line in serving)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
