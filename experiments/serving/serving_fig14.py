"""Figure 14 in one table: parallel sampling and beam search against the
Orca baselines, and the KV memory sharing saves (the paper's Figure 15).

Reads the sweeps :mod:`experiments.serving.serving_figures` wrote for each
workload (``serving_fig14_<workload>.csv``, ``--quick``:
``*_quick.csv``) from ``--out`` and writes ``serving_fig14.{md,csv,png}``
there (``--quick``: ``serving_fig14_quick.*``). Per workload: the highest
request rate each policy sustains below the sweep's latency threshold (read
back from the CSV, so it is the sweep's own) and paged's ratio to it; the
requests per second each served at the highest rate swept and paged's ratio
(its capacity once overloaded, less noisy than the interpolated crossing);
and the share of the pages paged's sequences held that sharing saved at
that rate (``1 - distinct pages / pages each sequence holds``, averaged over
iterations: the paper's Figure 15 measure, ``EngineStats.sharing_saving``).

The paper (PagedAttention, Kwon et al., SOSP 2023, section 6.3) gives its
ratios in words only at the ends: vLLM over Orca (Oracle), OPT-13B on
Alpaca, "goes from 1.3x in basic sampling to 2.3x in beam search with a
width of 6"; the bars of Figure 15 save 6.1-9.8% (parallel sampling) and
37.6-55.2% (beam search) on Alpaca, 16.2-30.5% and 44.3-66.3% on ShareGPT.

Usage: ``python -m experiments.serving.serving_fig14 [--quick] [--workloads parallel-2 beam-2] [--out DIR]``
"""

from __future__ import annotations

import argparse
import math
import sys

from experiments.lib import online, provenance, workloads
from experiments.lib.cli import add_flag, check_outputs
from experiments.lib.plots import plot_sharing_workloads
from experiments.lib.policies import PAPER_OVER_ORACLE, PAPER_SAVING, PAPER_SAVING_RANGE, POLICY_LABELS
from experiments.lib.tables import markdown_table, write_table

WORKLOADS = ("parallel-2", "parallel-4", "parallel-6", "beam-2", "beam-4", "beam-6")
"""Figure 14's six workloads, in the paper's order."""
COLUMNS = ("workload", "sequences", "policy", "sustained_rate", "paged_over_policy",
           "served_at_top", "paged_over_policy_served", "mean_running", "paged_over_policy_running",
           "paper_paged_over_policy", "kv_saved_by_sharing", "paper_kv_saved", "mean_pages_used",
           "mean_pages_unshared", "preemptions")


def summarize(name: str, runs: list[dict[str, str]]) -> list[dict]:
    """One row per policy of one workload's sweep.

    Args:
      name: the workload (``parallel-4``).
      runs: its CSV's rows (:mod:`experiments.serving.serving_figures`): the
        capacity run (rate ``inf``) first, then every (policy, rate).

    Raises:
      ValueError: rows without the sharing columns (a sweep written before
        they existed) or without paged.
    """
    if not runs or "latency_threshold_s" not in runs[0] or not runs[0]["latency_threshold_s"]:
        raise ValueError(f"{name}: the sweep's CSV has no latency_threshold_s column; rerun "
                         f"python -m experiments.serving.serving_figures --workload {name}")
    threshold = float(runs[0]["latency_threshold_s"])
    swept = [r for r in runs if math.isfinite(float(r["request_rate"]))]
    policies = list(dict.fromkeys(r["policy"] for r in swept))
    if "paged" not in policies:
        raise ValueError(f"{name}: the sweep has no paged runs, got policies {policies}")
    rates = sorted({float(r["request_rate"]) for r in swept})
    top = rates[-1]
    by = {(r["policy"], float(r["request_rate"])): r for r in swept}
    sustained = {p: online.sustained_rate(
        rates, [float(by[p, x]["normalized_latency_s"]) if (p, x) in by else None for x in rates], threshold)
        for p in policies}
    served = {p: float(by[p, top]["request_throughput"]) for p in policies}
    running = {p: float(by[p, top]["mean_running"]) for p in policies}
    kind = name.partition("-")[0]
    workload = workloads.workload(name)
    rows = []
    for p in policies:
        r = by[p, top]
        paper = PAPER_OVER_ORACLE.get(name) if p == "oracle" else None
        rows.append({"workload": name, "sequences": workload.sampling(0).num_seqs, "policy": p,
                     "sustained_rate": str(sustained[p]),
                     "paged_over_policy": "-" if p == "paged" else online.ratio(sustained["paged"], sustained[p]),
                     "served_at_top": round(served[p], 3),
                     "paged_over_policy_served": "-" if p == "paged" else f"{served['paged'] / served[p]:.2f}x",
                     "mean_running": running[p],
                     "paged_over_policy_running": "-" if p == "paged" else f"{running['paged'] / running[p]:.2f}x",
                     "paper_paged_over_policy": f"{paper:g}x" if paper else "-",
                     "kv_saved_by_sharing": f"{float(r['kv_saved_by_sharing']):.1%}",
                     "paper_kv_saved": PAPER_SAVING[kind] if p == "paged" else "-",
                     "mean_pages_used": r["mean_pages_used"], "mean_pages_unshared": r["mean_pages_unshared"],
                     "preemptions": r["preemptions"]})
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.serving.serving_fig14", description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS),
                   help=f"the sweeps to read (default {' '.join(WORKLOADS)})")
    p.add_argument("--quick", action="store_true", help="read the *_quick sweeps, write serving_fig14_quick.*")
    add_flag(p, "out", help="the folder holding the sweeps, where the summary is written (default results/)")
    args = p.parse_args(argv)
    for name in args.workloads:
        kind = name.partition("-")[0]
        try:
            workloads.workload(name)
        except ValueError as e:
            p.error(f"--workloads: {e}")
        if kind not in ("parallel", "beam"):
            p.error(f"--workloads: Figure 14's workloads are parallel-N and beam-W, got {name!r}")
    if len(set(args.workloads)) != len(args.workloads):
        p.error(f"--workloads: each workload once, got {' '.join(args.workloads)}")
    suffix = "_quick" if args.quick else ""
    args.sources = {w: args.out / f"serving_fig14_{w}{suffix}.csv" for w in args.workloads}
    missing = [str(path) for path in args.sources.values() if not path.is_file()]
    if missing:
        p.error(f"--workloads: no sweep at {', '.join(missing)}; run python -m experiments.serving.serving_figures "
                "--workload <name> first")
    args.stem = f"serving_fig14{suffix}"
    check_outputs(p, args)
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    record = provenance.collect("experiments.serving.serving_fig14", argv, seeds={})
    rows, sources = [], []
    for name, path in args.sources.items():
        meta, runs = provenance.read_csv(path)
        workload_rows = summarize(name, runs)
        rows += workload_rows
        sources.append(f"`{path.name}` (commit {meta.get('commit', '?')[:10]}, dirty: {meta.get('dirty', '?')}, "
                       f"{meta.get('date', '?')})")
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    pivot = []
    for name in args.workloads:
        mine = {r["policy"]: r for r in rows if r["workload"] == name}
        paged = mine["paged"]
        pivot.append({"workload": name, "paged_rate": paged["sustained_rate"],
                      **{f"over_{p}": mine[p]["paged_over_policy"] if p in mine else "-"
                         for p in policies if p != "paged"},
                      **{f"served_{p}": mine[p]["paged_over_policy_served"] if p in mine else "-"
                         for p in policies if p != "paged"},
                      **{f"running_{p}": mine[p]["paged_over_policy_running"] if p in mine else "-"
                         for p in policies if p != "paged"},
                      "paper_oracle": f"{PAPER_OVER_ORACLE[name]:g}x" if name in PAPER_OVER_ORACLE else "-",
                      "saved": paged["kv_saved_by_sharing"],
                      "paper_saved": PAPER_SAVING[name.partition("-")[0]]})
    others = [p for p in policies if p != "paged"]
    columns = ["workload", "paged_rate", *(f"over_{p}" for p in others), *(f"served_{p}" for p in others),
               *(f"running_{p}" for p in others), "paper_oracle", "saved", "paper_saved"]
    headers = ["workload", "paged: highest rate sustained (req/s)",
               *(f"paged / {POLICY_LABELS[p]}, sustained" for p in others),
               *(f"paged / {POLICY_LABELS[p]}, served at the top rate" for p in others),
               *(f"paged / {POLICY_LABELS[p]}, mean running sequences" for p in others),
               "paper: vLLM / Orca (Oracle)", "KV saved by sharing, paged", "paper: KV saved (Fig. 15)"]
    table = markdown_table(pivot, columns, headers=headers)
    detail = markdown_table(rows, COLUMNS, cell=online.cell,
                            headers=["workload", "sequences / request", "policy", "highest rate sustained (req/s)",
                                     "paged / policy", "served at the top rate (req/s)", "paged / policy, served",
                                     "mean running sequences", "paged / policy, running",
                                     "paper: vLLM / policy", "KV saved by sharing", "paper: KV saved",
                                     "mean pages held", "mean pages without sharing", "preemptions"])
    png = args.out / f"{args.stem}.png"
    plot_sharing_workloads(png, rows, paper_over_oracle=PAPER_OVER_ORACLE, paper_saving=PAPER_SAVING_RANGE)
    text = (f"# Figure 14: parallel sampling and beam search against request rate (summary)\n\n"
            f"![paged over the Orca baselines and KV saved by sharing]({png.name})\n\n{table}\n\n"
            "Every policy and rate of each workload, at the highest rate swept:\n\n"
            f"{detail}\n\n"
            "Sustained: the highest request rate at which a policy's normalized latency stays at or below the "
            "sweep's threshold (1.5x paged's lowest, interpolated; `>=`: never crossed, `<`: crossed at the lowest "
            "rate). Served: requests per second completed at the highest rate swept, each policy's capacity once "
            "overloaded. Mean running sequences: time-weighted, at the highest rate swept (the paper's Figure 13 "
            "measure, here counting every sample or beam): how many sequences memory let each policy batch, which "
            "the machine's speed changes far less than the timings. KV saved by sharing: 1 - distinct pages / pages "
            "each sequence holds, averaged over iterations (the paper's Figure 15 measure). Paper: PagedAttention "
            "(Kwon et al., SOSP 2023) section 6.3 and Figure 15, OPT-13B on Alpaca; its text gives vLLM over Orca "
            "(Oracle) at the two ends only, \"from 1.3x in basic sampling to 2.3x in beam search with a width of "
            "6\" (the 1.3x is for basic sampling, one sequence per request, not parallel-2).\n\nSweeps read: "
            + "; ".join(sources) + ". Each sweep's own file says its sizes, machine load and how it is scaled down.")
    md, csv = write_table(args.out, args.stem, rows, COLUMNS, text, record)
    print(f"\n{table}\n\nwrote {md}, {csv}, {png}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
