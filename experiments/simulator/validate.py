"""The simulated accelerator against real runs, in one run: the error of the
simulation where it can be measured (Vidur's and BLIS's check).

One model object and its compiled programs throughout. First the step is
profiled in the same run (:mod:`paged_jax.simulator.profile`: synthetic
requests of random ids, so the profile and this check share no data; or
``--profile`` a CSV of ``python -m experiments.simulator.profile_steps``),
and a step time fitted to it. Then, on Figure 12's workload (ShareGPT
requests, :mod:`experiments.serving.serving_figures`):

1. every request at once (the demo's workload, and the capacity run): paged,
   really and simulated;
2. the sweep: each ``--policy`` at each of ``--loads`` times paged's measured
   capacity, Poisson arrivals, really and simulated (the same trace).

For every run: TTFT p50, TPOT p50, normalized latency and throughput, real
and simulated, and the absolute percentage error of each; the MAPE of each
over the rates below the knee (real normalized latency at most the
threshold: 1.5x paged's lowest, Figure 12's rule); each policy's sustained
rate, real and simulated. Writes ``simulator_validation.{md,csv}`` to
``--out``.

Usage: ``python -m experiments.simulator.validate [--profile results/step_profile_cpu.csv] [--model toy] ...``
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import time

import jax
import numpy as np

from experiments.lib import online, provenance, workloads
from experiments.lib.cli import add_compile_cache_args, add_flag, check_outputs, setup_compile_cache
from experiments.lib.tables import markdown_table, write_table
from paged_jax.simulator.profile import profile_calls, profile_runs
from paged_jax.simulator.step_time import ProfiledStepTime, profile_rows

PROG = "python -m experiments.simulator.validate"
THRESHOLD_OVER_BEST = 1.5
"""Figure 12's rule: the latency threshold is this many times paged's lowest."""
TARGET_MAPE = 10.0
"""Vidur's bar, percent."""
METRICS = {"ttft_p50": ("TTFT p50", "ms"), "tpot_p50": ("TPOT p50", "ms"),
           "normalized_latency": ("normalized latency", "ms/token"), "throughput": ("throughput", "req/s")}
COLUMNS = ("policy", "request_rate", "load", "below_knee",
           *(f"{m}_{side}" for m in METRICS for side in ("real", "sim", "ape")))


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    online.add_serving_flags(p, num_requests=24, max_output_len=48)
    p.add_argument("--profile", type=pathlib.Path, default=None,
                   help="a step profile's CSV (python -m experiments.simulator.profile_steps) to fit the step time "
                        "to; default: profile the step in this run, before the check, so that both see the machine "
                        "in the same state")
    p.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0],
                   help="request rates as fractions of paged's measured capacity (default 0.5 1 2 3)")
    p.add_argument("--policy", nargs="+", choices=online.ALL_POLICIES, default=["paged", "oracle"], metavar="POLICY",
                   help="policies to validate (default paged oracle); paged is always run, first")
    add_flag(p, "out")
    add_compile_cache_args(p)
    args = p.parse_args(argv)
    online.check_serving_flags(p, args)
    args.loads = online.check_rates(p, "--loads", args.loads)
    if any(math.isinf(x) for x in args.loads):
        p.error("--loads must be finite (every request at once is always run)")
    if args.profile is not None and not args.profile.is_file():
        p.error(f"--profile {args.profile}: no such file; make it with python -m experiments.simulator.profile_steps")
    args.policy = ["paged"] + [x for x in dict.fromkeys(args.policy) if x != "paged"]
    args.workload_ = workloads.workload("basic")
    check_outputs(p, args)
    return args


def load_profile(path: pathlib.Path) -> tuple[ProfiledStepTime, dict]:
    """The step time fitted to a profile's CSV, and the profile's provenance.

    Raises:
      ValueError: a CSV without the profile's columns.
    """
    meta, rows = provenance.read_csv(path)
    works, seconds = profile_rows(rows)
    return ProfiledStepTime.fit(works, seconds, device=meta.get("device_kind", "unknown")), meta


def values(result: online.OnlineResult) -> dict:
    m = result.metrics
    return {"ttft_p50": m.ttft.p50 * 1e3, "tpot_p50": m.tpot.p50 * 1e3 if m.tpot else float("nan"),
            "normalized_latency": m.normalized_latency * 1e3, "throughput": m.request_throughput}


def ape(sim: float, real: float) -> float:
    return 100 * abs(sim - real) / real if real > 0 else float("nan")


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    record = provenance.collect("experiments.simulator.validate", argv,
                                seeds={"sharegpt_shuffle": args.seed, "arrivals": args.seed, "profile": args.seed})
    print(setup_compile_cache(args))
    model_name, requests, spec, setup = online.load_setup(args)
    print(setup)
    print(online.warm_up_line(spec))
    if args.profile is not None:
        step_time, profile_record = load_profile(args.profile)
        profiled = (f"fitted to {step_time.num_calls} calls of `{args.profile}` (profiled at commit "
                    f"{profile_record.get('commit', '?')[:12]} on {profile_record.get('date', '?')})")
    else:  # in this run, on this model object, just before the check: the machine as it is now
        t0 = time.perf_counter()
        runs = profile_runs(vocab_size=spec.model.config.vocab_size, max_seqs=spec.max_seqs,
                            kv_tokens=spec.kv_tokens, seed=args.seed)
        rows = profile_calls(lambda: spec.build("paged", call_records=None), runs,
                             progress=lambda line: print(f"  profile: {line}", flush=True))
        step_time = ProfiledStepTime.fit(*profile_rows(rows), device=jax.devices()[0].device_kind)
        profiled = (f"fitted to {step_time.num_calls} calls profiled in this run, before the check, on synthetic "
                    f"requests (paged_jax.simulator.profile: {len(runs)} runs, "
                    f"{time.perf_counter() - t0:.0f} s)")

    def both(policy, rate):
        kw = dict(policy=policy, request_rate=rate, burstiness=args.burstiness, seed=args.seed)
        real = online.serve_online(lambda p: spec.build(p, call_records=None), requests, progress=True, **kw)
        t0 = time.perf_counter()
        sim = online.serve_online(lambda p: spec.simulate(p, step_time, call_records=None), requests, **kw)
        return real, sim, time.perf_counter() - t0

    runs = {}
    real, sim, _ = both("paged", math.inf)
    capacity = real.metrics.request_throughput
    runs["paged", math.inf] = (real, sim)
    rates = [round(x * capacity, 4) for x in args.loads]
    sim_wall = 0.0
    for rate in rates:  # policies interleaved at each rate: they see the machine in the same state
        for policy in args.policy:
            real, sim, wall = both(policy, rate)
            sim_wall += wall
            runs[policy, rate] = (real, sim)
            r, s = values(real), values(sim)
            print(f"{online.POLICY_LABELS[policy]:>14} at {rate:7.3f} req/s: normalized latency real "
                  f"{r['normalized_latency']:.1f} ms/token, simulated {s['normalized_latency']:.1f}", flush=True)
    threshold = THRESHOLD_OVER_BEST * min(values(runs["paged", r][0])["normalized_latency"] for r in rates)
    rows = []
    for (policy, rate), (real, sim) in runs.items():
        r, s = values(real), values(sim)
        rows.append({"policy": policy, "request_rate": rate, "load": round(rate / capacity, 3),
                     "below_knee": math.isfinite(rate) and r["normalized_latency"] <= threshold,
                     **{f"{m}_{side}": round(v, 3) for m in METRICS
                        for side, v in (("real", r[m]), ("sim", s[m]), ("ape", ape(s[m], r[m])))}})
    below = [row for row in rows if row["below_knee"]]
    errors = [{"what": METRICS[m][0] + f" ({METRICS[m][1]})",
               "mape_below_knee": round(float(np.nanmean([row[f"{m}_ape"] for row in below])), 1) if below else None,
               "max_ape_below_knee": round(float(np.nanmax([row[f"{m}_ape"] for row in below])), 1) if below else None,
               "all_at_once_ape": round(rows[0][f"{m}_ape"], 1)} for m in METRICS]
    sustained = []
    for policy in args.policy:
        lat = {side: [values(runs[policy, r][side == "sim"])["normalized_latency"] / 1e3 for r in rates]
               for side in ("real", "sim")}
        sr, ss = (online.sustained_rate(rates, lat[side], threshold / 1e3) for side in ("real", "sim"))
        sustained.append({"policy": online.POLICY_LABELS[policy], "real": str(sr), "sim": str(ss),
                          "error": f"{ape(ss.rate, sr.rate):.1f}%" if not (sr.bound or ss.bound) else "(a bound)"})
    # Where the simulation makes the same decisions for two policies (the same metrics to the bit), their two
    # real runs differ only by the machine: that spread is the floor under any simulator's error here.
    twins = [(values(runs["paged", r][0]), values(runs[p, r][0])) for p in args.policy[1:] for r in rates
             if values(runs[p, r][1]) == values(runs["paged", r][1])]
    for e, m in zip(errors, METRICS):
        e["real_spread"] = round(float(np.nanmean([ape(b[m], a[m]) for a, b in twins])), 1) if twins else None
    worst = max((e["mape_below_knee"] or 0) for e in errors[:3])
    verdict = "met" if worst <= TARGET_MAPE else "not met"
    per_run = markdown_table(
        [{**row, "policy": online.POLICY_LABELS[row["policy"]],
          "request_rate": "inf" if math.isinf(row["request_rate"]) else row["request_rate"]} for row in rows],
        ("policy", "request_rate", *(f"{m}_{side}" for m in ("ttft_p50", "tpot_p50", "normalized_latency")
                                     for side in ("real", "sim", "ape"))),
        headers=["policy", "rate (req/s)", *(f"{METRICS[m][0]} {side}" for m in ("ttft_p50", "tpot_p50",
                                                                                 "normalized_latency")
                                             for side in ("real", "sim", "APE %"))])
    err_table = markdown_table(errors, ("what", "mape_below_knee", "max_ape_below_knee", "all_at_once_ape",
                                        "real_spread"),
                               headers=["metric", "MAPE below the knee (%)", "worst below the knee (%)",
                                        "every request at once (%)",
                                        f"real against real, {len(twins)} pairs the simulation finds identical (%)"])
    sus_table = markdown_table(sustained, ("policy", "real", "sim", "error"),
                               headers=["policy", "sustained, real (req/s)", "sustained, simulated (req/s)", "error"])
    text = (f"# The simulated accelerator against real runs ({model_name}, {jax.devices()[0].device_kind})\n\n"
            f"Step time: {step_time.name}, {profiled}; the fit's own error over them {step_time.fit_mape:.1f}% "
            f"MAPE.\n\n{err_table}\n\n"
            "**Worst MAPE below the knee of TTFT p50, "
            f"TPOT p50 and normalized latency: {worst:.1f}%** (target {TARGET_MAPE:g}%, Vidur's bar: {verdict}). "
            "The last column is the machine's own noise: two policies that make the same decisions at a rate (the "
            "simulation's runs of both identical) served really, one against the other (mean APE over such "
            "pairs at every rate swept); no model of the step can be closer to one real run than the real runs "
            "are to each other.\n\n"
            f"{sus_table}\n\n{per_run}\n\n{setup}.\n\nThe run took {time.perf_counter() - t_start:.0f} s "
            f"(the simulations {sim_wall:.1f} s of it); load average {load_start:.1f} when it began, "
            f"{os.getloadavg()[0]:.1f} at the end (a busy machine slows the real runs, not the simulated ones). "
            f"Paged capacity, every request at once: {capacity:.3f} req/s (real); rates swept: "
            f"{', '.join(f'{r:g}' for r in rates)} req/s (loads {', '.join(f'{x:g}' for x in args.loads)}); "
            f"latency threshold {threshold:.1f} ms/token ({THRESHOLD_OVER_BEST:g}x paged's lowest, real). "
            "APE: |simulated - real| / real. Both runs of a row serve the same requests on the same arrival "
            "trace with the same engine configuration; the simulated one runs no model and reads its clock from "
            "the step-time model (paged_jax.simulator). The CSV has every run.")
    md, csv = write_table(args.out, "simulator_validation", rows, COLUMNS, text, record)
    print(f"\n{err_table}\n\n{sus_table}\n\nworst MAPE below the knee {worst:.1f}% ({verdict}); wrote {md}, {csv} "
          f"in {time.perf_counter() - t_start:.0f} s")
    return {"rows": rows, "errors": errors, "sustained": sustained, "worst": worst, "twins": len(twins)}


if __name__ == "__main__":
    main(sys.argv[1:])
