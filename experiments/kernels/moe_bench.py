"""Routed experts as grouped matmuls against a one-hot dispatch: time per call.

    python -m experiments.kernels.moe_bench

:func:`models.layers.moe.routed_experts_ragged` sorts the ``tokens x top_k``
assignments by expert and runs three ``jax.lax.ragged_dot`` grouped matmuls
(work proportional to the assignments);
:func:`models.layers.moe.routed_experts_dense` runs every expert on every
token and combines with a one-hot ``[T, E]`` weight matrix (``E / top_k``
times the work, in plain dense matmuls). Which is faster depends on the
tokens in the call (decode steps are a few; prefill chunks thousands), the
experts and the backend: this times both (best of 5 loops,
:func:`experiments.lib.cli.time_call`) on random routing over
``--experts`` experts, top ``--top-k``, at ``--model-dim`` and
``--expert-dim``, for each token count, and reports ``dense / ragged``
(above 1: the grouped matmuls win). Writes ``results/moe_bench.{md,csv}``
(with provenance).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from experiments.lib import provenance
from experiments.lib.cli import add_flag, check_out_dir, machine, time_call
from models.layers.moe import RouterConfig, route, routed_experts_dense, routed_experts_ragged

SEEDS = {"data": 0}


def case(tokens: int, experts: int, top_k: int, model_dim: int, expert_dim: int, dtype) -> tuple:
    """Random tokens, softmax top-k routing and expert weights."""
    k = jax.random.split(jax.random.key(SEEDS["data"]), 5)
    x = jax.random.normal(k[0], (tokens, model_dim), dtype)
    logits = jax.random.normal(k[1], (tokens, experts), jnp.float32)
    weights, ids = route(logits, RouterConfig(num_experts=experts, top_k=top_k, norm_topk_prob=True))
    w_gate = (model_dim ** -0.5 * jax.random.normal(k[2], (experts, model_dim, expert_dim))).astype(dtype)
    w_up = (model_dim ** -0.5 * jax.random.normal(k[3], (experts, model_dim, expert_dim))).astype(dtype)
    w_down = (expert_dim ** -0.5 * jax.random.normal(k[4], (experts, expert_dim, model_dim))).astype(dtype)
    return x, ids, weights, w_gate, w_up, w_down


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.kernels.moe_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 512, 2048], help="tokens a call")
    p.add_argument("--experts", type=int, nargs="+", default=[8, 64], help="routed experts, E")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--model-dim", type=int, default=512)
    p.add_argument("--expert-dim", type=int, default=256, help="each expert's SwiGLU width")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    add_flag(p, "min_seconds")
    add_flag(p, "out")
    args = p.parse_args(argv)
    for name in ("tokens", "experts"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name} must all be >= 1, got {getattr(args, name)}")
    for name in ("top_k", "model_dim", "expert_dim"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.top_k > min(args.experts):
        p.error(f"--top-k must be at most every --experts, got {args.top_k} > {min(args.experts)}")
    check_out_dir(p, args.out)  # now, not after the benchmark
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    ragged, dense = jax.jit(routed_experts_ragged), jax.jit(routed_experts_dense)
    rows = []
    for experts in args.experts:
        for tokens in args.tokens:
            a = case(tokens, experts, args.top_k, args.model_dim, args.expert_dim, jnp.dtype(args.dtype))
            r = time_call(ragged, *a, min_seconds=args.min_seconds)
            d = time_call(dense, *a, min_seconds=args.min_seconds)
            rows.append({"experts": experts, "tokens": tokens, "ragged_ms": round(r * 1e3, 3),
                         "dense_ms": round(d * 1e3, 3), "dense_over_ragged": round(d / r, 2)})
            print(rows[-1], flush=True)
    text = "\n".join([
        "# Routed experts: grouped matmuls (ragged_dot) against a one-hot dispatch",
        "",
        f"Top-{args.top_k} routing, model dim {args.model_dim}, expert width {args.expert_dim}, {args.dtype}. "
        f"Machine: {machine()}.",
        "",
        "| experts | tokens | ragged_dot ms | one-hot ms | one-hot / ragged_dot |",
        "|---|---|---|---|---|",
        *[f"| {r['experts']} | {r['tokens']:,} | {r['ragged_ms']} | {r['dense_ms']} | {r['dense_over_ragged']} |"
          for r in rows],
    ])
    provenance.publish(args.out, "moe_bench", "experiments.kernels.moe_bench", argv, SEEDS, text, rows)
    return rows


if __name__ == "__main__":
    main()
