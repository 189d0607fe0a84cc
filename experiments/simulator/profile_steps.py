"""Times the real engine's jitted step on the device JAX finds, over a grid
of batches, for the simulated accelerator (:mod:`paged_jax.simulator`;
Vidur's profiling step, Agrawal et al., MLSys 2024).

The engine runs as it serves (the same model object, compiled programs,
page state and scheduler; after a warm-up, so nothing compiles in the timed
runs), on synthetic requests of random ids, never ShareGPT's (the
validation serves ShareGPT, so the profile and the check share no data):

1. a grid: ``D`` requests of ``C`` prompt tokens each, all at once, for ``D``
   in 1, 2, 4, ... ``--max-seqs`` and ``C`` in ``--contexts`` where they fit
   the pool; each prefills in chunks, then decodes ``--decode-steps`` tokens
   with ``D`` rows over ``C`` cached tokens;
2. mixed calls: ``--mixed-requests`` requests of random prompt (16 to 768)
   and output (8 to 64) lengths arriving as a Poisson process at each of
   ``--mixed-rates`` requests per second, so prefill chunks share calls with
   decodes.

Every call the engine reads is a row of the CSV: its work
(:class:`paged_jax.simulator.step_time.StepWork`) and the seconds it added
to the engine's clock (:func:`paged_jax.simulator.step_time.call_seconds`);
calls that compiled are left out. The Markdown gives the non-negative
least-squares fit (:class:`paged_jax.simulator.step_time.ProfiledStepTime`)
and its own error, and on a GPU or TPU the roofline's efficiencies fitted to
the same calls. Writes ``step_profile_<backend>.{md,csv}`` to ``--out``.

Usage: ``python -m experiments.simulator.profile_steps [--model toy] [--out results]``
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax
import numpy as np

from experiments.lib import online, provenance, workloads
from experiments.lib.cli import (
    add_compile_cache_args,
    add_flag,
    check_outputs,
    resolve_dtype,
    resolve_kv_dtype,
    setup_compile_cache,
)
from experiments.lib.latency import arrival_times
from experiments.lib.tables import markdown_table, write_table
from paged_jax.engine.requests import Request
from paged_jax.simulator.hardware import device_key, get_device, get_model
from paged_jax.simulator.step_time import ProfiledStepTime, RooflineStepTime, StepWork, call_seconds, profile_rows

PROG = "python -m experiments.simulator.profile_steps"
COLUMNS = (*(f.name for f in dataclasses.fields(StepWork)), "seconds", "phase")
MODEL_SHAPES = {"smollm2": "smollm2-135m", "smollm2-135m": "smollm2-135m"}
"""``--model`` values whose shape the roofline knows (:data:`paged_jax.simulator.hardware.MODELS`)."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    online.add_serving_flags(p, num_requests=24, max_output_len=48)
    p.add_argument("--contexts", type=int, nargs="+", default=[32, 256, 1024],
                   help="prompt tokens of the grid's requests (default 32 256 1024)")
    p.add_argument("--decode-steps", type=int, default=12, help="tokens each grid request decodes (default 12)")
    p.add_argument("--mixed-requests", type=int, default=32, help="requests of each mixed run (default 32)")
    p.add_argument("--mixed-rates", type=float, nargs="+", default=[0.5, 2.0],
                   help="request rates of the mixed runs, requests per second (default 0.5 2)")
    add_flag(p, "out")
    add_compile_cache_args(p)
    args = p.parse_args(argv)
    online.check_serving_flags(p, args)
    for flag in ("decode_steps", "mixed_requests"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for c in args.contexts:
        if not 1 <= c <= args.kv_budget_tokens - args.decode_steps:
            p.error(f"--contexts: each must be in [1, {args.kv_budget_tokens - args.decode_steps}] (the pool less "
                    f"the decode steps), got {c}")
    args.mixed_rates = online.check_rates(p, "--mixed-rates", args.mixed_rates)
    args.workload_ = workloads.workload("basic")
    check_outputs(p, args)
    return args


def grid(args, vocab_size: int, rng: np.random.Generator) -> list[list[Request]]:
    """The grid's runs: ``D`` requests of ``C`` prompt tokens, where they fit."""
    runs, d = [], 1
    while d <= args.max_seqs:
        for c in args.contexts:
            if d * (c + args.decode_steps) <= args.kv_budget_tokens:
                runs.append([Request(request_id=i, prompt_ids=rng.integers(0, vocab_size, c).tolist(),
                                     max_new_tokens=args.decode_steps, ignore_eos=True) for i in range(d)])
        d *= 2
    return runs


def mixed(args, vocab_size: int, rng: np.random.Generator) -> list[Request]:
    return [Request(request_id=i, prompt_ids=rng.integers(0, vocab_size, int(rng.integers(16, 769))).tolist(),
                    max_new_tokens=int(rng.integers(8, 65)), ignore_eos=True) for i in range(args.mixed_requests)]


def profile(spec: online.EngineSpec, args, vocab_size: int, *, progress: bool = True) -> list[dict]:
    """Runs the grid and the mixed runs on fresh engines of ``spec``; one row
    per call read, its work and seconds (calls that compiled left out)."""
    rng = np.random.default_rng(args.seed)
    runs = [("grid", reqs, np.zeros(len(reqs))) for reqs in grid(args, vocab_size, rng)]
    for rate in args.mixed_rates:
        reqs = mixed(args, vocab_size, rng)
        runs.append((f"mixed {rate:g}/s", reqs, arrival_times(len(reqs), rate, seed=args.seed)))
    rows = []
    for i, (phase, reqs, arrivals) in enumerate(runs):
        engine = spec.build("paged", call_records=None)
        online.run_online(engine, reqs, arrivals)
        records = list(engine.stats.calls)
        for rec, seconds in zip(records, call_seconds(records)):
            if rec.compile_s == 0 and seconds > 0:
                rows.append({**dataclasses.asdict(StepWork.from_record(rec)), "seconds": seconds, "phase": phase})
        if progress:
            print(f"  run {i + 1}/{len(runs)} ({phase}, {len(reqs)} requests): {len(records)} calls", flush=True)
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    backend = jax.default_backend()
    record = provenance.collect(PROG, argv, seeds={"prompts": args.seed, "arrivals": args.seed})
    print(setup_compile_cache(args))
    model_name, _, spec, setup = online.load_setup(args)
    print(setup)
    print(online.warm_up_line(spec))
    rows = profile(spec, args, spec.model.config.vocab_size)
    works, seconds = profile_rows(rows)
    device = jax.devices()[0].device_kind
    fit = ProfiledStepTime.fit(works, seconds, device=device)
    coef = markdown_table(fit.table(), ("feature", "seconds_per_unit"), headers=["feature", "seconds per unit"])
    text = [f"# Step profile on {device} ({model_name})",
            f"{len(rows)} calls of the real engine, timed as the seconds each added to the engine's clock "
            f"({sum(1 for r in rows if r['phase'] == 'grid')} from the grid, the rest mixed). Non-negative "
            f"least-squares fit (relative error), {fit.name}:", coef,
            f"**The fit's own error over these calls: {fit.fit_mape:.1f}% MAPE.** Median call "
            f"{np.median(seconds) * 1e3:.1f} ms (from {min(seconds) * 1e3:.1f} to {max(seconds) * 1e3:.1f} ms)."]
    roofline = None
    key, shape = device_key(device), MODEL_SHAPES.get(args.model)
    if key is not None and shape is not None:
        roofline = RooflineStepTime(
            model=get_model(shape), device=get_device(key), dtype=resolve_dtype(args.dtype).name,
            kv_dtype=resolve_kv_dtype(args.kv_dtype).name,
        ).fitted(works, seconds, source=f"fitted to {PROG} on {device}")
        err = 100 * np.mean([abs(roofline.seconds(w) - s) / s for w, s in zip(works, seconds)])
        text.append(f"Roofline on {key} fitted to the same calls: {roofline.flops_efficiency:.3g} of peak FLOP/s, "
                    f"{roofline.bandwidth_efficiency:.3g} of HBM bandwidth, {roofline.overhead_s * 1e3:.2f} ms "
                    f"overhead per call; its error over them {err:.1f}% MAPE.")
    else:
        text.append(f"No roofline fit: {'no device spec for ' + repr(device) if key is None else ''}"
                    f"{' and ' if key is None and shape is None else ''}"
                    f"{'no model shape for --model ' + args.model if shape is None else ''} "
                    "(paged_jax.simulator.hardware).")
    text.append(f"{setup}.\n\nThe run took {time.perf_counter() - t_start:.0f} s. The CSV has every call.")
    md, csv = write_table(args.out, f"step_profile_{backend}", rows, COLUMNS, "\n\n".join(text), record)
    print(f"\n{coef}\n\nfit {fit.fit_mape:.1f}% MAPE over {len(rows)} calls; wrote {md}, {csv} in "
          f"{time.perf_counter() - t_start:.0f} s")
    return {"fit": fit, "rows": rows, "roofline": roofline}


if __name__ == "__main__":
    main(sys.argv[1:])
