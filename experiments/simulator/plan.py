"""Size a deployment by simulation: the request rate one replica of a
model on its devices sustains under latency SLOs, how many replicas a
target rate needs, and how the answer moves with the share of memory given
to the cache and with the page size (the two settings of a paged server
worth attention).

A replica is ``--num-devices`` chips of ``--device`` in tensor parallelism
serving ``--model`` (:mod:`paged_jax.simulator.hardware`): its KV pool is
``cache fraction x memory - weights`` (vLLM's ``gpu_memory_utilization``:
the fraction of memory the server may use, weights included), cut into
pages; its calls are timed by a roofline
(:class:`paged_jax.simulator.step_time.RooflineStepTime`, efficiencies
assumed unless ``--efficiency-profile`` fits them to a profile of that
device). The engine is this project's own
(:class:`paged_jax.simulator.engine.SimulatedEngine`): the scheduler, KV
manager and prefix cache you would deploy.

The workload is the packaged ShareGPT requests (their true output lengths,
EOS ignored; all 1,000 by default: above the sustained rate a queue grows
only as long as the trace lasts, so a shorter trace passes rates a server
could not hold), Poisson arrivals. A rate *meets* the SLOs when at least
``--attainment`` of the requests meet every one of them (DistServe's SLO
attainment; Zhong et al., OSDI 2024); the highest such rate is found by
doubling, then bisection to ``--tolerance``. A target rate of ``R`` needs
``ceil(R / sustained)`` replicas behind a balancer that splits arrivals at
random (a random split of a Poisson stream is Poisson).

What the page size moves here is only the pool: the last page of each
sequence is partly empty, so larger pages hold fewer sequences. A roofline
has no kernel, so it does not see a kernel that is faster with larger
pages; a profile of the device does (``--efficiency-profile`` fits only the
efficiencies, not per page size).

Writes ``plan_<model>_<device>.{md,csv,png}`` to ``--out``.

Usage: ``python -m experiments.simulator.plan --model opt-13b --device a100-80gb --rate 40 --slo ttft:2000,tpot:100``
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
import time

from experiments.lib import online, provenance
from experiments.lib.cli import add_flag, check_outputs
from experiments.lib.latency import MAX_TRACE_S, arrival_times, parse_goodput
from experiments.lib.plots import plot_plan
from experiments.lib.policies import ALL_POLICIES, POLICY_LABELS, engine_options
from experiments.lib.serving import SIMULATED_VOCAB_SIZE, engine_config, simulated_setup
from experiments.lib.sharegpt import MAX_SEQ_LEN, PACKAGED_LIMIT
from experiments.lib.tables import markdown_table, write_table
from paged_jax.simulator.engine import SimulatedEngine
from paged_jax.simulator.hardware import DEVICES, MODELS, get_device, get_model, kv_pool_tokens

PROG = "python -m experiments.simulator.plan"
COLUMNS = ("cache_fraction", "page_size", "kv_tokens", "sustained_rate", "at_least", "replicas", "devices",
           "ttft_p90_ms", "tpot_p90_ms", "attainment", "mean_running", "simulations")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), required=True, help="model shape")
    p.add_argument("--device", choices=sorted(DEVICES), required=True, help="device")
    p.add_argument("--num-devices", type=int, default=1, help="devices per replica, tensor parallel (default 1)")
    p.add_argument("--rate", type=float, required=True, help="target request rate, requests per second")
    p.add_argument("--slo", required=True,
                   help="latency SLOs, milliseconds, comma-separated KEY:MS with KEY ttft, tpot or e2el "
                        "(ttft:2000,tpot:100)")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="share of requests that must meet every SLO, (0, 1] (default 0.9)")
    p.add_argument("--cache-fraction", type=float, default=0.9,
                   help="memory utilization: the share of the devices' memory the server may use, weights "
                        "included; the KV pool is the rest after the weights (vLLM's gpu_memory_utilization; "
                        "default 0.9)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument("--cache-fractions", type=float, nargs="*", default=[0.5, 0.7, 0.95],
                   help="cache fractions to sweep at --page-size, besides --cache-fraction, which is always run "
                        "(default 0.5 0.7 0.95; none: no sweep)")
    p.add_argument("--page-sizes", type=int, nargs="*", default=[8, 32, 128],
                   help="page sizes to sweep at --cache-fraction, besides --page-size, which is always run "
                        "(default 8 32 128; none: no sweep)")
    p.add_argument("--num-requests", type=int, default=PACKAGED_LIMIT,
                   help=f"ShareGPT requests per simulation (default and at most {PACKAGED_LIMIT}); a shorter "
                        "trace overstates the sustained rate: above it, queues grow for longer than the trace "
                        "lasts")
    p.add_argument("--policy", choices=ALL_POLICIES, default="paged", metavar="POLICY",
                   help="the server's policy (default paged; an Orca reservation, max, pow2 or oracle, to size "
                        f"a pre-paging server; all: {', '.join(ALL_POLICIES)})"),
    add_flag(p, "max_seqs", default=256)
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="tokens per call (default 2048)")
    p.add_argument("--tolerance", type=float, default=0.03,
                   help="bisection stops when the bracket is this share of the rate (default 0.03)")
    p.add_argument("--efficiency-profile", type=pathlib.Path, default=None,
                   help="a step profile's CSV from this device (python -m experiments.simulator.profile_steps) "
                        "to fit the roofline's efficiencies to; default assumed ones (stated in the table)")
    add_flag(p, "seed", help="arrival seed (and of the packaged requests' random ids; default 0)")
    add_flag(p, "out")
    args = p.parse_args(argv)
    try:
        args.slos = parse_goodput(x for x in args.slo.split(",") if x)
    except ValueError as e:
        p.error(f"--slo {args.slo!r}: {e}")
    if not args.slos:
        p.error(f"--slo {args.slo!r}: give at least one KEY:MS")
    if not (math.isfinite(args.rate) and args.rate > 0):
        p.error(f"--rate must be a finite number > 0, got {args.rate}")
    if not 0 < args.attainment <= 1:
        p.error(f"--attainment must be in (0, 1], got {args.attainment}")
    if not 0 < args.tolerance < 1:
        p.error(f"--tolerance must be in (0, 1), got {args.tolerance}")
    for flag in ("num_devices", "page_size", "max_seqs", "max_batched_tokens"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 1 <= args.num_requests <= PACKAGED_LIMIT:
        p.error(f"--num-requests must be in [1, {PACKAGED_LIMIT}], got {args.num_requests}")
    for f in [args.cache_fraction, *args.cache_fractions]:
        if not 0 < f <= 1:
            p.error(f"--cache-fraction(s) must be in (0, 1], got {f}")
    if any(s < 1 for s in args.page_sizes):
        p.error(f"--page-sizes: each must be >= 1, got {args.page_sizes}")
    if args.efficiency_profile is not None and not args.efficiency_profile.is_file():
        p.error(f"--efficiency-profile {args.efficiency_profile}: no such file")
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.max_batched_tokens < args.max_seqs:
        p.error(f"--max-batched-tokens {args.max_batched_tokens} must be >= --max-seqs {args.max_seqs} (every "
                "running sequence decodes in each call)")
    model, device = get_model(args.model), get_device(args.device)

    def too_small(fraction, page_size):
        try:
            tokens = kv_pool_tokens(model, device, args.num_devices, fraction)
        except ValueError as e:
            return str(e)
        if tokens // page_size * page_size < MAX_SEQ_LEN:
            return f"{tokens} KV tokens in pages of {page_size} hold no {MAX_SEQ_LEN}-token request"
        return None

    problem = too_small(args.cache_fraction, args.page_size)
    if problem:
        p.error(f"--cache-fraction {args.cache_fraction:g} with --page-size {args.page_size}: {problem}")
    args.skipped = {}
    for flag, values, pair in (("--cache-fractions", args.cache_fractions, lambda v: (v, args.page_size)),
                               ("--page-sizes", args.page_sizes, lambda v: (args.cache_fraction, v))):
        for v in values:
            problem = too_small(*pair(v))
            if problem:
                args.skipped[flag, v] = problem
                print(f"{flag} {v:g} skipped: {problem}", file=sys.stderr)
    args.cache_fractions = [f for f in args.cache_fractions if ("--cache-fractions", f) not in args.skipped]
    args.page_sizes = [s for s in args.page_sizes if ("--page-sizes", s) not in args.skipped]
    try:
        args.step_time_, args.requests_ = simulated_setup(args)
    except ValueError as e:
        p.error(str(e))
    check_outputs(p, args)
    return args


@dataclasses.dataclass(frozen=True)
class Trial:
    """One simulated run at one rate."""

    rate: float
    attainment: float
    metrics: object

    def meets(self, target: float) -> bool:
        return self.attainment >= target


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The highest rate found that meets the SLOs (0: none, down to the
    floor), the run at it, how many simulations it took, and whether it is
    only a lower bound (every rate up to the ceiling met them)."""

    rate: float
    trial: Trial | None
    simulations: int
    at_least: bool = False


def sustained(run_at, *, attainment: float, tolerance: float, start: float = 1.0, floor: float = 1e-3,
              ceiling: float = 1e4) -> Capacity:
    """The highest rate at which ``run_at(rate) -> Trial`` meets
    ``attainment``: doubling (or halving) from ``start`` to a bracket, then
    bisection until the bracket is ``tolerance`` of the rate. Assumes
    attainment falls as the rate rises. Rates stay in ``[floor, ceiling]``
    req/s: none met gives rate 0, all met the ceiling's, ``at_least``."""
    runs = 0

    def trial(rate):
        nonlocal runs
        runs += 1
        return run_at(rate)

    first = trial(start)
    if first.meets(attainment):
        good, bad = first, None
        while bad is None:
            if good.rate * 2 > ceiling:
                return Capacity(good.rate, good, runs, at_least=True)
            t = trial(good.rate * 2)
            good, bad = (t, None) if t.meets(attainment) else (good, t)
    else:
        good, bad = None, first
        while good is None:
            if bad.rate / 2 < floor:
                return Capacity(0.0, None, runs)
            t = trial(bad.rate / 2)
            good, bad = (t, bad) if t.meets(attainment) else (None, t)
    while (bad.rate - good.rate) > tolerance * good.rate:
        t = trial((good.rate + bad.rate) / 2)
        good, bad = (t, bad) if t.meets(attainment) else (good, t)
    return Capacity(good.rate, good, runs)


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    record = provenance.collect("experiments.simulator.plan", argv, seeds={"arrivals": args.seed})
    step_time, requests = args.step_time_, args.requests_
    model, device = step_time.model, step_time.device
    arrivals = arrival_times(len(requests), 1.0, seed=args.seed)  # stretched to each rate: the same trace
    floor = max(1e-3, 2 * float(arrivals[-1]) / MAX_TRACE_S)  # slower, the trace would outlast MAX_TRACE_S
    config = engine_config(max_seqs=args.max_seqs, max_batched_tokens=args.max_batched_tokens,
                           **engine_options(args.policy))

    def capacity(fraction, page_size) -> dict:
        tokens = kv_pool_tokens(model, device, args.num_devices, fraction)

        def run_at(rate):
            engine = SimulatedEngine(step_time, config, num_pages=tokens // page_size + 1, page_size=page_size,
                                     vocab_size=SIMULATED_VOCAB_SIZE)
            run = online.run_online(engine, requests, arrivals / rate)
            m = run.metrics(args.slos)
            return Trial(rate, m.goodput * m.duration_s / m.completed, m)

        t0 = time.perf_counter()
        cap = sustained(run_at, attainment=args.attainment, tolerance=args.tolerance, floor=floor)
        replicas = math.ceil(args.rate / cap.rate) if cap.rate > 0 else None
        m = cap.trial.metrics if cap.trial else None
        row = {"cache_fraction": fraction, "page_size": page_size, "kv_tokens": tokens,
               "sustained_rate": round(cap.rate, 3), "at_least": cap.at_least, "replicas": replicas,
               "devices": replicas * args.num_devices if replicas else None,
               "ttft_p90_ms": round(m.ttft.p90 * 1e3, 1) if m else None,
               "tpot_p90_ms": round(m.tpot.p90 * 1e3, 2) if m and m.tpot else None,
               "attainment": round(cap.trial.attainment, 3) if cap.trial else None,
               "mean_running": round(m.mean_running, 1) if m else None, "simulations": cap.simulations}
        print(f"  cache fraction {fraction:g}, pages of {page_size}: {tokens:,} KV tokens, sustains "
              f"{'at least ' if cap.at_least else ''}{cap.rate:.3g} req/s ({cap.simulations} simulations, "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
        return row

    answer = capacity(args.cache_fraction, args.page_size)
    by_fraction = sorted([answer] + [capacity(f, args.page_size) for f in dict.fromkeys(args.cache_fractions)
                                     if f != args.cache_fraction], key=lambda r: r["cache_fraction"])
    by_page = sorted([answer] + [capacity(args.cache_fraction, s) for s in dict.fromkeys(args.page_sizes)
                                 if s != args.page_size], key=lambda r: r["page_size"])
    where = f"{args.num_devices} x {device.name}"
    slo_text = ", ".join(f"{k} <= {ms:g} ms" for k, ms in args.slos.items())
    if answer["replicas"] is None:
        verdict = (f"**No rate down to {floor:.3g} req/s meets {slo_text} for {args.attainment:.0%} of requests** on "
                   f"{model.name} on {where}: the SLO is below what one request alone takes here.")
    else:
        bound = "at least " if answer["at_least"] else ""
        verdict = (f"**{model.name} on {where} sustains {bound}{answer['sustained_rate']:g} req/s** with "
                   f"{args.attainment:.0%} of requests meeting {slo_text} (cache fraction {args.cache_fraction:g}, "
                   f"pages of {args.page_size}, {answer['kv_tokens']:,} KV tokens); **{args.rate:g} req/s needs "
                   f"{answer['replicas']} replica{'s' if answer['replicas'] > 1 else ''}, "
                   f"{answer['devices']} x {device.name}.**")
    shown = [c for c in COLUMNS if c != "at_least"]  # the table writes a bound as ">= rate"; the CSV keeps the flag
    headers = ["cache fraction", "page size", "KV tokens", "sustained (req/s)", "replicas", "devices",
               "TTFT p90 (ms)", "TPOT p90 (ms)", "attainment", "mean running", "simulations"]

    def display(rows):
        return [{**r, "sustained_rate": f"{'>= ' if r['at_least'] else ''}{r['sustained_rate']:g}"} for r in rows]

    name = f"plan_{model.name}_{device.name}"
    png = pathlib.Path(args.out) / f"{name}.png"
    plot_plan(png, by_fraction, by_page, title=f"{model.name} on {where}, {slo_text}")
    text = (f"# Sizing {model.name} on {where} for {args.rate:g} req/s, simulated\n\n{verdict}\n\n"
            f"![sustained rate against cache fraction and page size]({png.name})\n\n"
            f"By cache fraction (pages of {args.page_size}):\n\n"
            f"{markdown_table(display(by_fraction), shown, headers=headers)}"
            f"\n\nBy page size (cache fraction {args.cache_fraction:g}):\n\n"
            f"{markdown_table(display(by_page), shown, headers=headers)}\n\n"
            f"Step time: {step_time.name} ({model.source}; {device.source}); efficiencies "
            f"{step_time.flops_efficiency:.3g} of peak FLOP/s, {step_time.bandwidth_efficiency:.3g} of HBM bandwidth, "
            f"{step_time.overhead_s * 1e3:.2f} ms per call ({step_time.efficiency_source}). Policy "
            f"{POLICY_LABELS[args.policy]}, up to {args.max_seqs} sequences and {args.max_batched_tokens} tokens a "
            f"call; {len(requests)} packaged ShareGPT requests (true output lengths, EOS ignored), Poisson arrivals "
            f"(seed {args.seed}), one trace stretched to each rate. Sustained: the highest rate at which "
            f"{args.attainment:.0%} of requests meet every SLO, to {args.tolerance:.0%} (doubling, then bisection); "
            f"TTFT, TPOT and attainment are at that rate."
            + "".join(f" {flag} {v:g} skipped: {why}." for (flag, v), why in args.skipped.items())
            + f" Took {time.perf_counter() - t_start:.0f} s.")
    md, csv = write_table(args.out, name, by_fraction + [r for r in by_page if r is not answer], COLUMNS, text,
                          record)
    print(f"\n{verdict}\n\nwrote {md}, {csv}, {png} in {time.perf_counter() - t_start:.0f} s")
    return {"answer": answer, "by_fraction": by_fraction, "by_page": by_page}


if __name__ == "__main__":
    main(sys.argv[1:])
