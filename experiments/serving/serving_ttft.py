"""Time to first token at a light load against one prompt's prefill alone
(issue 19's target: TTFT p50 at a light load within 1.5x of one prompt's
prefill time alone).

One run, one model object and its compiled programs throughout (after the
warm-up of :mod:`experiments.lib.online`, nothing compiles in a timed run):

1. capacity: paged serves every request at once (as
   :mod:`experiments.serving.serving_figures` measures it), requests per second;
2. alone: each request, cut to one output token, served by itself on a
   fresh, idle paged engine: its TTFT is its prompt's prefill (in chunks of
   ``--max-batched-tokens``) plus the first token's sampling, with nothing
   else running;
3. light load: every request (its true output length) arriving as a Poisson
   process at ``--load`` times the capacity on a fresh paged engine: its
   TTFT counts from its arrival, so it adds the wait for the step in flight
   and the decodes of earlier requests batched with its prefill.

The ratio reported is TTFT p50 under the light load over the median TTFT
alone, and beside it the median of each request's own ratio. Writes
``serving_fig12_ttft.{md,csv}`` (one CSV row per request) to ``--out``.

Usage: ``python -m experiments.serving.serving_ttft [--load 0.15] [--model toy] ...``
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

import numpy as np

from experiments.lib import online, provenance, workloads
from experiments.lib.cli import add_compile_cache_args, add_flag, check_outputs, setup_compile_cache
from experiments.lib.tables import markdown_table, write_table

TARGET = 1.5
"""Issue 19: TTFT p50 at a light load at most this many times the prefill
alone."""
COLUMNS = ("request_id", "prompt_len", "output_len", "alone_ttft_ms", "light_ttft_ms", "light_over_alone",
           "arrival_s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.serving.serving_ttft", description=__doc__.split("\n\n")[0])
    online.add_serving_flags(p, num_requests=24, max_output_len=48)
    p.add_argument("--load", type=float, default=0.15,
                   help="the light load's request rate as a fraction of paged's measured capacity (default "
                        "%(default)s)")
    p.add_argument("--name", default="serving_fig12_ttft", help="stem of the files written (default %(default)s)")
    add_flag(p, "out")
    add_compile_cache_args(p)
    args = p.parse_args(argv)
    online.check_serving_flags(p, args)
    if not (math.isfinite(args.load) and 0 < args.load <= 1):
        p.error(f"--load must be a fraction of capacity in (0, 1], got {args.load}")
    args.workload_ = workloads.workload("basic")
    check_outputs(p, args)
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    record = provenance.collect("experiments.serving.serving_ttft", argv,
                                seeds={"sharegpt_shuffle": args.seed, "arrivals": args.seed})
    print(setup_compile_cache(args))
    model_name, requests, spec, setup = online.load_setup(args)
    print(setup)
    print(online.warm_up_line(spec))

    def serve(reqs, rate):
        return online.serve_online(spec.build, reqs, policy="paged", request_rate=rate, burstiness=args.burstiness,
                                   seed=args.seed, progress=True)

    capacity = serve(requests, math.inf).metrics.request_throughput
    alone = [serve([dataclasses.replace(r, max_new_tokens=1)], math.inf) for r in requests]
    alone_ttft = np.array([a.run.records[0].ttft for a in alone])
    rate = round(args.load * capacity, 4)
    light = serve(requests, rate)
    light_ttft = np.array([r.ttft for r in light.run.records])
    compiled = light.compiles.requests + sum(a.compiles.requests for a in alone)
    ratio = float(np.median(light_ttft) / np.median(alone_ttft))
    own = light_ttft / alone_ttft
    rows = [{"request_id": r.request_id, "prompt_len": r.prompt_len, "output_len": r.output_len,
             "alone_ttft_ms": round(a * 1e3, 2), "light_ttft_ms": round(t * 1e3, 2),
             "light_over_alone": round(t / a, 3), "arrival_s": round(r.arrival_s - light.run.start_s, 3)}
            for r, a, t in zip(light.run.records, alone_ttft, light_ttft)]
    stats = [{"what": what, **{k: round(float(f(v)) * 1e3, 1) for k, f in
                                (("mean", np.mean), ("p50", np.median), ("p90", lambda x: np.percentile(x, 90)))}}
             for what, v in (("prefill alone (TTFT of the request by itself)", alone_ttft),
                             (f"TTFT at {rate:g} req/s ({args.load:g}x capacity, Poisson)", light_ttft))]
    table = markdown_table(stats, ("what", "mean", "p50", "p90"),
                           headers=["", "mean (ms)", "p50 (ms)", "p90 (ms)"])
    verdict = "met" if ratio <= TARGET else "not met"
    text = (f"# Time to first token at a light load against prefill alone ({model_name})\n\n{table}\n\n"
            f"**TTFT p50 at {args.load:g}x capacity / median prefill alone: {ratio:.2f}x** (issue 19's target: "
            f"within {TARGET:g}x, {verdict}); the median of each request's own ratio: {np.median(own):.2f}x "
            f"(p90 {np.percentile(own, 90):.2f}x). Mean running sequences at the light load: "
            f"{light.metrics.mean_running:.2f} (peak {light.metrics.peak_running}).\n\n"
            f"{setup}.\n\nThe run took {time.perf_counter() - t_start:.0f} s; load average {load_start:.1f} when it "
            f"began, {os.getloadavg()[0]:.1f} at the end (on 2 cores, other work on the machine slows every step). "
            f"Paged capacity, every request at once: {capacity:.3f} req/s; light load: {rate:g} req/s, gamma "
            f"arrivals of burstiness {args.burstiness:g} (1 is Poisson), seed {args.seed}. Prefill alone: each "
            "request cut to one output token and served by itself on a fresh, idle paged engine (the same model "
            "object and compiled programs; prompts prefilled in chunks of "
            f"{max(args.max_batched_tokens, args.max_seqs)} tokens), its TTFT from its arrival (the run's start) to "
            "its first token. At the light load a request's TTFT also counts from its arrival: it waits for the "
            "step in flight and shares its prefill call with the decodes of the requests still running. "
            f"Programs compiled inside the timed runs: {compiled} (0: all in the warm-up). "
            "The CSV has every request.")
    md, csv = write_table(args.out, args.name, rows, COLUMNS, text, record)
    print(f"\n{table}\n\nratio {ratio:.2f}x ({verdict}); wrote {md}, {csv} in {time.perf_counter() - t_start:.0f} s")
    return {"ratio": ratio, "alone_ms": alone_ttft * 1e3, "light_ms": light_ttft * 1e3, "compiled": compiled}


if __name__ == "__main__":
    main(sys.argv[1:])
