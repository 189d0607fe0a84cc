"""Times the real engine's jitted step on the device JAX finds, over a grid
of batches, for the simulated accelerator (:mod:`paged_jax.simulator`;
Vidur's profiling step, Agrawal et al., MLSys 2024).

The engine runs as it serves, after a warm-up (nothing compiles in the
timed runs), on synthetic requests of random ids, never ShareGPT's (the
validation serves ShareGPT, so the profile and the check share no data):
a grid of ``D`` requests of ``C`` prompt tokens (``--contexts``) all at
once, and staggered runs where a request of random length joins every few
engine steps (``--staggered``), so prefill chunks share calls with decodes
(:mod:`paged_jax.simulator.profile`).

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
from experiments.lib.tables import markdown_table, write_table
from paged_jax.simulator.hardware import device_key, get_device, get_model
from paged_jax.simulator.profile import profile_calls, profile_runs
from paged_jax.simulator.step_time import ProfiledStepTime, RooflineStepTime, StepWork, profile_rows

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
    p.add_argument("--staggered", type=int, nargs="+", default=[8, 2],
                   help="one staggered run each: a request joins every that many engine steps (default 8 2)")
    p.add_argument("--staggered-requests", type=int, default=32, help="requests of each staggered run (default 32)")
    add_flag(p, "out")
    add_compile_cache_args(p)
    args = p.parse_args(argv)
    online.check_serving_flags(p, args)
    for flag in ("decode_steps", "staggered_requests"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("contexts", "staggered"):
        if any(v < 1 for v in getattr(args, flag)):
            p.error(f"--{flag}: each must be >= 1, got {getattr(args, flag)}")
    args.workload_ = workloads.workload("basic")
    check_outputs(p, args)
    return args


def profile(spec: online.EngineSpec, args) -> list[dict]:
    """The profile's rows: every call of the grid and the staggered runs on
    fresh paged engines of ``spec``."""
    runs = profile_runs(vocab_size=spec.model.config.vocab_size, max_seqs=spec.max_seqs, kv_tokens=spec.kv_tokens,
                        contexts=args.contexts, decode_steps=args.decode_steps, staggered=args.staggered,
                        staggered_requests=args.staggered_requests, seed=args.seed)
    return profile_calls(lambda: spec.build("paged", call_records=None), runs,
                         progress=lambda line: print(f"  {line}", flush=True))


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    backend = jax.default_backend()
    record = provenance.collect("experiments.simulator.profile_steps", argv, seeds={"prompts": args.seed})
    print(setup_compile_cache(args))
    model_name, _, spec, setup = online.load_setup(args)
    print(setup)
    print(online.warm_up_line(spec))
    rows = profile(spec, args)
    works, seconds = profile_rows(rows)
    device = jax.devices()[0].device_kind
    fit = ProfiledStepTime.fit(works, seconds, device=device)
    buckets = sorted(fit.bucket_coef)
    coef = markdown_table([{k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items()}
                           for row in fit.table()],
                          ("feature", "seconds_per_unit", *(f"bucket_{t}" for t in buckets)),
                          headers=["feature", "every call", *(f"{t} token rows" for t in buckets)])
    text = [f"# Step profile on {device} ({model_name})",
            f"{len(rows)} calls of the real engine, timed as the seconds each added to the engine's clock "
            f"({sum(1 for r in rows if r['phase'].startswith('grid'))} from the grid, the rest staggered). "
            "Non-negative least-squares fits, seconds per unit of each feature, over every call and per "
            f"padded-token bucket (a call is predicted by its bucket's fit where the profile holds one), "
            f"{fit.name}:", coef,
            f"**The fit's own error over these calls: {fit.fit_mape:.1f}% MAPE.** Median call "
            f"{np.median(seconds) * 1e3:.1f} ms (from {min(seconds) * 1e3:.1f} to {max(seconds) * 1e3:.1f} ms)."]
    roofline = None
    key, shape = device_key(device), MODEL_SHAPES.get(args.model)
    dtype, kv_dtype = resolve_dtype(args.dtype).name, resolve_kv_dtype(args.kv_dtype).name
    kv_dtype = "float8" if kv_dtype.startswith("float8") else kv_dtype  # the roofline counts bytes, not formats
    no_peak = key is not None and dtype not in get_device(key).peak_flops
    if no_peak:
        text.append(f"No roofline fit: {key} has no {dtype} peak (paged_jax.simulator.hardware).")
    elif key is not None and shape is not None:
        roofline = RooflineStepTime(model=get_model(shape), device=get_device(key), dtype=dtype,
                                    kv_dtype=kv_dtype).fitted(works, seconds, source=f"fitted to {PROG} on {device}")
        err = 100 * np.mean([abs(roofline.seconds(w) - s) / s for w, s in zip(works, seconds)])
        text.append(f"Roofline on {key} fitted to the same calls: {roofline.flops_efficiency:.3g} of peak FLOP/s, "
                    f"{roofline.bandwidth_efficiency:.3g} of HBM bandwidth, {roofline.overhead_s * 1e3:.2f} ms "
                    f"overhead per call; its error over them {err:.1f}% MAPE.")
    if roofline is None and not no_peak:
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
