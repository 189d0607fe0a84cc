"""One decode step of MLA attention against a GQA step that reads the same bytes.

    python -m experiments.kernels.mla_decode_bench

MLA in the absorbed form as the engine runs it
(:func:`paged_jax.attention.latent.absorbed_ragged_attention` on the
engine's flat batch: ``W_UK`` folded into each head's query, multi-query
attention over the latent pages, each latent gathered once as key and
value, ``W_UV`` after) at DeepSeek-V3's per-head sizes (C = 512,
R = 64, H_nope = H_v = 128) with ``N`` query heads (16: DeepSeek-V3's 128
heads over 8-way tensor parallelism, as vLLM and SGLang serve it; 128: one
device), against GQA attention on the same flat batch
(:func:`paged_jax.attention.ragged.attend`, the same XLA work list
underneath) with each of ``--gqa-kv-heads`` KV heads of a head dim chosen
so K and V together are C + R = 576 values a token (1 head of 288: MQA, 2
heads of 144), and 16 query heads. Both read the same pages a token, the same tokens, in the same
dtype; the MLA step also pays the two absorption matmuls, which belong to
its decode step. Each row times one call per layer (best of 5 loops,
:func:`experiments.lib.cli.time_call`) on uniform batches, and
gives ``x GQA`` = MLA time / GQA time.

Per key token MLA needs ``N (2 (C + R) + 2 C)`` flops on one 576-value read
(the XLA path weighs all C + R columns for the values and keeps C: ``N x 2 x
2 (C + R)`` as run); GQA does ``2 N (2 D)`` on the same read (D = 576 / (2 x
KV heads)). At N = 16 that is 34,816 (36,864 as run) against 18,432 (one KV
head of 288) or 9,216 (two of 144) flops a token: all light enough to stay
near memory speed on an accelerator; on a CPU, where a core's flops per
byte are fewer, the ratio shows how much the extra work costs. Writes
``results/mla_decode_bench.{md,csv}`` (with provenance).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from experiments.lib import provenance
from experiments.lib.cli import add_flag, check_out_dir, machine, time_call
from paged_jax.attention import ragged as ragged_attention
from paged_jax.attention.batch import RaggedBatch, Tiling, batch_shape
from paged_jax.attention.latent import absorbed_ragged_attention

C, R, H, V = 512, 64, 128, 128  # DeepSeek-V3: kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim
SEEDS = {"data": 0}
TARGET = 1.5


def _batch(batch: int, context: int, page_size: int) -> tuple[RaggedBatch, int]:
    """The engine's flat batch of ``batch`` decoding sequences of ``context``
    tokens (one query token each, block tables of shuffled pages) and the
    pages the pool needs."""
    per_seq = -(-context // page_size)
    rng = np.random.default_rng(SEEDS["data"])
    pages = rng.permutation(batch * per_seq).reshape(batch, per_seq).astype(np.int32)
    q_lens = np.ones(batch, np.int32)
    shape = batch_shape(q_lens, num_seq_rows=batch, tiling=Tiling())
    z = jnp.zeros(shape.num_tokens, jnp.int32)
    ragged = RaggedBatch(tokens=z, positions=z, slots=z, block_tables=jnp.asarray(pages),
                         q_starts=jnp.arange(batch, dtype=jnp.int32), q_lens=jnp.asarray(q_lens),
                         kv_lens=jnp.full((batch,), context, jnp.int32), logits_rows=jnp.zeros(1, jnp.int32),
                         shape=shape)
    return ragged, batch * per_seq


def mla_call(batch: int, context: int, heads: int, page_size: int, dtype) -> tuple:
    """The jitted absorbed decode step (the engine's:
    :func:`absorbed_ragged_attention` on its flat batch) and its arguments."""
    ragged, num_pages = _batch(batch, context, page_size)
    T = ragged.shape.num_tokens  # noqa: N806
    k = jax.random.split(jax.random.key(SEEDS["data"]), 5)
    latent = jax.random.normal(k[0], (1, 1, num_pages, page_size, C + R), dtype)
    q_nope = jax.random.normal(k[1], (T, heads, H), jnp.float32)
    q_pe = jax.random.normal(k[2], (T, heads, R), jnp.float32)
    w_uk = 0.05 * jax.random.normal(k[3], (heads, H, C), jnp.float32)
    w_uv = 0.05 * jax.random.normal(k[4], (heads, C, V), jnp.float32)

    def step(q_nope, q_pe, latent, ragged, w_uk, w_uv):
        return absorbed_ragged_attention(q_nope, q_pe, latent, jnp.int32(0), ragged, w_uk, w_uv, kv_lora_rank=C,
                                         scale=(H + R) ** -0.5, impl="xla")
    return jax.jit(step), (q_nope, q_pe, latent, ragged, w_uk, w_uv)


def mla_core_call(batch: int, context: int, heads: int, page_size: int, dtype) -> tuple:
    """The attention of :func:`mla_call` alone: the absorbed queries (C + R
    values a head) over the latent pages, keys and values the same pages
    (:func:`paged_jax.attention.ragged.attend`'s latent mode), as
    :func:`absorbed_ragged_attention` calls it."""
    ragged, num_pages = _batch(batch, context, page_size)
    k = jax.random.split(jax.random.key(SEEDS["data"]), 2)
    latent = jax.random.normal(k[0], (1, 1, num_pages, page_size, C + R), dtype)
    q = jax.random.normal(k[1], (ragged.shape.num_tokens, heads, C + R), jnp.float32)

    def step(q, latent, ragged):
        return ragged_attention.attend(q, latent, latent, jnp.int32(0), ragged, impl="xla", scale=(H + R) ** -0.5,
                                       latent_dim=C)
    return jax.jit(step), (q, latent, ragged)


def gqa_call(batch: int, context: int, heads: int, kv_heads: int, page_size: int, dtype) -> tuple:
    """The jitted GQA decode step (head dim ``(C + R) / (2 kv_heads)``; the
    engine's: :func:`paged_jax.attention.ragged.attend` on its flat batch)
    and its arguments."""
    head_dim = (C + R) // (2 * kv_heads)
    ragged, num_pages = _batch(batch, context, page_size)
    k = jax.random.split(jax.random.key(SEEDS["data"] + 1), 3)
    kp = jax.random.normal(k[0], (1, kv_heads, num_pages, page_size, head_dim), dtype)
    vp = jax.random.normal(k[1], (1, kv_heads, num_pages, page_size, head_dim), dtype)
    q = jax.random.normal(k[2], (ragged.shape.num_tokens, heads, head_dim), jnp.float32)

    def step(q, kp, vp, ragged):
        return ragged_attention.attend(q, kp, vp, jnp.int32(0), ragged, impl="xla")
    return jax.jit(step), (q, kp, vp, ragged)


def target_line(rows: list[dict], heads: int, kv_heads: int) -> str:
    """The target's verdict for MLA at ``heads`` against GQA with ``kv_heads``: the worst ratio of its rows."""
    mine = [r for r in rows if (r["mla_heads"], r["gqa_kv_heads"]) == (heads, kv_heads)]
    worst = max(r["x_gqa"] for r in mine)
    return (f"Target (issue 36): the MLA step at {heads} heads within {TARGET}x the GQA step with {kv_heads} KV "
            f"head{'s' if kv_heads > 1 else ''}: {worst:.2f}x at worst ({'met' if worst <= TARGET else 'NOT met'}); "
            f"its attention alone {max(r['core_x_gqa'] for r in mine):.2f}x at worst.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.kernels.mla_decode_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[8, 32], help="sequences a step")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048], help="tokens a sequence")
    p.add_argument("--mla-heads", type=int, nargs="+", default=[16, 128], help="MLA query heads, N")
    p.add_argument("--gqa-heads", type=int, default=16, help="GQA query heads")
    p.add_argument("--gqa-kv-heads", type=int, nargs="+", default=[1, 2], choices=[1, 2, 3, 4, 6, 8, 9, 12],
                   help="GQA KV heads, one GQA step for each; the head dim is 576 / (2 x this)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the pages' dtype")
    add_flag(p, "min_seconds")
    add_flag(p, "out")
    args = p.parse_args(argv)
    for name in ("batches", "contexts", "mla_heads"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')} must all be >= 1, got {getattr(args, name)}")
    for name in ("gqa_heads", "page_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("batches", "contexts", "mla_heads", "gqa_kv_heads"):
        values = getattr(args, name)
        if len(set(values)) != len(values):
            p.error(f"--{name.replace('_', '-')} must not repeat a value, got {values}")
    if args.page_size > max(args.contexts):
        p.error(f"--page-size {args.page_size} is longer than every --contexts {args.contexts}: a page past the "
                "longest sequence holds nothing")
    if any(args.gqa_heads % kv for kv in args.gqa_kv_heads):
        p.error(f"--gqa-heads must be a multiple of every --gqa-kv-heads, got {args.gqa_heads} and "
                f"{args.gqa_kv_heads}")
    check_out_dir(p, args.out)  # now, not after the benchmark
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            gqa = {}
            for kv_heads in args.gqa_kv_heads:
                fn, a = gqa_call(batch, context, args.gqa_heads, kv_heads, args.page_size, dtype)
                gqa[kv_heads] = time_call(fn, *a, min_seconds=args.min_seconds)
            kv_bytes = batch * context * (C + R) * dtype.itemsize
            for heads in args.mla_heads:
                fn, a = mla_call(batch, context, heads, args.page_size, dtype)
                mla_s = time_call(fn, *a, min_seconds=args.min_seconds)
                fn, a = mla_core_call(batch, context, heads, args.page_size, dtype)
                core_s = time_call(fn, *a, min_seconds=args.min_seconds)
                for kv_heads, gqa_s in gqa.items():
                    rows.append({"batch": batch, "context": context, "mla_heads": heads, "gqa_kv_heads": kv_heads,
                                 "kv_mb": round(kv_bytes / 1e6, 1), "gqa_ms": round(gqa_s * 1e3, 3),
                                 "mla_core_ms": round(core_s * 1e3, 3), "mla_ms": round(mla_s * 1e3, 3),
                                 "core_x_gqa": round(core_s / gqa_s, 2), "x_gqa": round(mla_s / gqa_s, 2)})
                    print(rows[-1], flush=True)
    dims = {kv: (C + R) // (2 * kv) for kv in args.gqa_kv_heads}
    text = "\n".join([
        "# MLA decode step against a GQA step reading the same bytes",
        "",
        f"One layer's decode attention, one query token a sequence; pages of {args.page_size} tokens in "
        f"{args.dtype}, 576 values a token on both sides. MLA: absorbed form, DeepSeek-V3's per-head sizes "
        f"(C {C}, R {R}, H {H}, O {V}), N query heads, the absorption matmuls included. GQA: "
        + ", ".join(f"{kv} KV head{'s' if kv > 1 else ''} of {d}" for kv, d in dims.items())
        + f" (K and V: 576 values a token), {args.gqa_heads} query heads. Both as the engine runs them: its flat "
        f"batch of one-token rows through the XLA ragged path (paged_jax.attention.ragged.attend). "
        f"Machine: {machine()}.",
        "",
        "| batch | context | KV MB | MLA heads | GQA KV heads | GQA ms | MLA attention ms | x GQA | MLA step ms "
        "(with W_UK, W_UV) | x GQA |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {r['batch']} | {r['context']:,} | {r['kv_mb']:,} | {r['mla_heads']} | {r['gqa_kv_heads']} | "
          f"{r['gqa_ms']} | {r['mla_core_ms']} | {r['core_x_gqa']} | {r['mla_ms']} | {r['x_gqa']} |" for r in rows],
        "",
        "Flops a key token and query token: "
        + "; ".join(f"GQA with {kv} KV head{'s' if kv > 1 else ''} {2 * 2 * d * args.gqa_heads:,} "
                    f"({args.gqa_heads} heads x 2 x 2 x {d})" for kv, d in dims.items())
        + f"; MLA {2 * (2 * (C + R)):,} a head ({2 * (C + R)} for the scores, as many for the values, 576 columns "
        "of which 512 are kept), times N.",
        "",
        *[target_line(rows, n, kv) for n in args.mla_heads for kv in args.gqa_kv_heads],
    ])
    provenance.publish(args.out, "mla_decode_bench", "experiments.kernels.mla_decode_bench", argv, SEEDS, text, rows)
    return rows


if __name__ == "__main__":
    main()
