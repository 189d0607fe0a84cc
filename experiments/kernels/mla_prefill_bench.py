"""MLA prefill: the absorbed form against the expanded form, time per call.

    python -m experiments.kernels.mla_prefill_bench

The absorbed form (:func:`paged_jax.attention.latent.absorbed_paged_attention`)
attends the cached latents directly, ``2 (C + R) + 2 C`` flops per (query,
key, head); the expanded form
(:func:`paged_jax.attention.latent.expanded_paged_attention`) first projects
every attended latent up to per-head keys and values (``2 S N (H + O) C``
flops for S keys, whatever the queries), then pays ``2 (H + R) + 2 O`` per
(query, key, head). By flops the expanded form wins once a sequence brings
more than about 170 query tokens to the call at DeepSeek-V3's sizes
(C 512, R 64, H = O = 128; :mod:`paged_jax.attention.latent`). This times
both on one sequence whose chunk of ``T`` query tokens ends a context of
``--context`` tokens (``T`` = the context: a whole prompt; less: a chunk
after cached pages), with ``--heads`` query heads, and reports
``expanded / absorbed`` (below 1: expanded wins), twice: on the padded
paged path, and on the engine's flat batch
(:func:`paged_jax.attention.latent.latent_ragged_attention`, the chunk as
one row: all absorbed, against the expanded pass's tiles of
:data:`paged_jax.attention.latent.EXPANDED_TILE_Q` queries), where the
engine switches at :data:`paged_jax.attention.latent.EXPANDED_MIN_TOKENS`.
Writes ``results/mla_prefill_bench.{md,csv}`` (with provenance).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import provenance
from experiments.lib.cli import add_flag, check_out_dir, machine, time_call
from paged_jax.attention.batch import RaggedBatch, Tiling, batch_shape
from paged_jax.attention.latent import (
    EXPANDED_MIN_TOKENS,
    EXPANDED_TILE_Q,
    absorbed_paged_attention,
    expanded_paged_attention,
    latent_ragged_attention,
)

C, R, H, V = 512, 64, 128, 128  # DeepSeek-V3: kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
SEEDS = {"data": 0}


def case(context: int, tokens: int, heads: int, page_size: int) -> tuple:
    """One sequence: its latent pages (shuffled), a chunk of ``tokens`` queries ending at ``context``."""
    per_seq = -(-context // page_size)
    table = np.random.default_rng(SEEDS["data"]).permutation(per_seq).astype(np.int32)[None]
    k = jax.random.split(jax.random.key(SEEDS["data"]), 5)
    latent = jax.random.normal(k[0], (1, per_seq, page_size, C + R))
    q_nope = jax.random.normal(k[1], (1, tokens, heads, H))
    q_pe = jax.random.normal(k[2], (1, tokens, heads, R))
    w_uk = 0.05 * jax.random.normal(k[3], (heads, H, C))
    w_uv = 0.05 * jax.random.normal(k[4], (heads, C, V))
    return (q_nope, q_pe, latent, jnp.asarray(table), jnp.asarray([context], jnp.int32),
            jnp.asarray([tokens], jnp.int32), w_uk, w_uv)


def flat_case(padded: tuple) -> tuple:
    """The same chunk as the engine's flat batch: ``(q_nope [T, N, H], q_pe, pool [1, 1, P, L, C + R], layer,
    batch, w_uk, w_uv)``."""
    q_nope, q_pe, latent, table, kv_lens, q_lens, w_uk, w_uv = padded
    ql = np.asarray(q_lens)
    shape = batch_shape(ql, num_seq_rows=1, tiling=Tiling())
    T = shape.num_tokens
    pad = lambda x: jnp.zeros((T,) + x.shape[2:], x.dtype).at[: x.shape[1]].set(x[0])  # noqa: E731
    z = jnp.zeros(T, jnp.int32)
    batch = RaggedBatch(tokens=z, positions=z, slots=z, block_tables=table, q_starts=jnp.zeros(1, jnp.int32),
                        q_lens=q_lens, kv_lens=kv_lens, logits_rows=jnp.zeros(1, jnp.int32), shape=shape)
    return pad(q_nope), pad(q_pe), latent[None], jnp.int32(0), batch, w_uk, w_uv


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.kernels.mla_prefill_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=1024, help="tokens in the sequence after the chunk")
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 128, 256, 512, 1024],
                   help="query tokens in the chunk (each at most --context)")
    p.add_argument("--heads", type=int, default=16, help="query heads, N")
    p.add_argument("--page-size", type=int, default=64)
    add_flag(p, "min_seconds")
    add_flag(p, "out")
    args = p.parse_args(argv)
    for name in ("context", "heads", "page_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if len(set(args.tokens)) != len(args.tokens):
        p.error(f"--tokens must not repeat a value, got {args.tokens}")
    if args.page_size > args.context:
        p.error(f"--page-size {args.page_size} is longer than --context {args.context}")
    if min(args.tokens) < 1 or max(args.tokens) > args.context:
        p.error(f"--tokens must all be in [1, --context={args.context}], got {args.tokens}")
    check_out_dir(p, args.out)  # now, not after the benchmark
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    opts = dict(kv_lora_rank=C, scale=(H + R) ** -0.5)
    absorbed = jax.jit(lambda *a: absorbed_paged_attention(*a, **opts))
    expanded = jax.jit(lambda *a: expanded_paged_attention(*a, **opts))
    # On the engine's flat batch: every row absorbed, or the chunk expanded (the split at its own length).
    flat_absorbed = jax.jit(lambda *a: latent_ragged_attention(*a, **opts, impl="xla", expanded_min_tokens=None))
    rows = []
    for tokens in args.tokens:
        flat_expanded = jax.jit(lambda *a, t=tokens: latent_ragged_attention(*a, **opts, impl="xla",
                                                                              expanded_min_tokens=t))
        a = case(args.context, tokens, args.heads, args.page_size)
        ab = time_call(absorbed, *a, min_seconds=args.min_seconds)
        ex = time_call(expanded, *a, min_seconds=args.min_seconds)
        f = flat_case(a)
        fab = time_call(flat_absorbed, *f, min_seconds=args.min_seconds)
        fex = time_call(flat_expanded, *f, min_seconds=args.min_seconds)
        rows.append({"context": args.context, "tokens": tokens, "absorbed_ms": round(ab * 1e3, 3),
                     "expanded_ms": round(ex * 1e3, 3), "expanded_over_absorbed": round(ex / ab, 2),
                     "flat_absorbed_ms": round(fab * 1e3, 3), "flat_expanded_ms": round(fex * 1e3, 3),
                     "flat_expanded_over_absorbed": round(fex / fab, 2)})
        print(rows[-1], flush=True)
    wins = [r["tokens"] for r in rows if r["expanded_over_absorbed"] < 1]
    flat_wins = [r["tokens"] for r in rows if r["flat_expanded_over_absorbed"] < 1]
    text = "\n".join([
        "# MLA prefill: absorbed against expanded",
        "",
        f"One sequence of {args.context:,} tokens, a chunk of T query tokens ending it; DeepSeek-V3's per-head "
        f"sizes (C {C}, R {R}, H {H}, O {V}), {args.heads} query heads, pages of {args.page_size}, f32, the XLA "
        f"paged path (padded) and the engine's flat batch (the chunk one row; expanded in tiles of "
        f"{EXPANDED_TILE_Q} queries). Machine: {machine()}.",
        "",
        "| context | T | absorbed ms | expanded ms | expanded / absorbed | flat absorbed ms | flat expanded ms "
        "| flat expanded / absorbed |",
        "|---|---|---|---|---|---|---|---|",
        *[f"| {r['context']:,} | {r['tokens']:,} | {r['absorbed_ms']} | {r['expanded_ms']} | "
          f"{r['expanded_over_absorbed']} | {r['flat_absorbed_ms']} | {r['flat_expanded_ms']} | "
          f"{r['flat_expanded_over_absorbed']} |" for r in rows],
        "",
        (f"Padded, the expanded form was faster at T = {', '.join(map(str, wins))}." if wins else
         "Padded, the absorbed form was faster at every T measured.") + " " +
        (f"On the flat batch, the expanded form was faster at T = {', '.join(map(str, flat_wins))}." if flat_wins else
         "On the flat batch, the absorbed form was faster at every T measured.") +
        f" The engine expands rows of {EXPANDED_MIN_TOKENS} query tokens and more.",
    ])
    provenance.publish(args.out, "mla_prefill_bench", "experiments.kernels.mla_prefill_bench", argv, SEEDS, text,
                       rows)
    return rows


if __name__ == "__main__":
    main()
