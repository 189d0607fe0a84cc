"""Latent pages against GQA pages: KV bytes a token and concurrent sequences
at equal KV memory, measured in the engine beside the maths.

    python -m experiments.memory.mla_capacity --context 256 --gqa-sequences 4

DeepSeek-V3 caches one latent per token per layer (``kv_lora_rank`` 512 +
``qk_rope_head_dim`` 64 = 576 values, 61 layers); a GQA model caches K and V
per KV head (Llama-3.1-405B, the dense model DeepSeek-V3's report compares
itself with: 126 layers x 8 KV heads x 128 x 2 = 258,048 values). Two
tiny-width random decoders keep exactly those cache shapes
(:func:`models.deepseek.presets.narrow` for DeepSeek-V3: every layer, the
latent, the dense-then-MoE pattern; a Llama of 126 layers, 8 KV heads of
128 for the GQA side, 8 query heads) and are served at one KV byte budget:
the GQA pool holds ``--gqa-sequences`` sequences of ``--context`` tokens,
the latent pool the same bytes (fewer bytes where a latent page does not
divide them). Both serve requests of ``--context`` tokens (a random prompt
and ``--new-tokens`` generated, fewer than a page, so a sequence holds at
admission the pages it ends with and memory, not growth, decides how many
run), and the table reports the most sequences
running at once in each beside :mod:`paged_jax.memory`'s count: pages a
sequence holds times bytes a page. The width of the models does not change
the counts, only the time.

A second table gives the maths for the published models at full size
(:data:`paged_jax.memory.PRESETS`, bf16 pages).

Writes ``mla_capacity.md`` and ``.csv`` to ``--out`` (with provenance).
"""

from __future__ import annotations

import argparse

from flax import nnx

from experiments.lib import provenance
from experiments.lib.cli import add_flag, check_out_dir, machine, serve_for_peak
from models.config import LlamaConfig
from models.deepseek.presets import get_preset, narrow, random_deepseek
from models.llama import Llama
from models.ragged import RaggedModel
from paged_jax.engine.core import Engine, EngineConfig
from paged_jax.memory import PRESETS
from paged_jax.paging.page_state import pages_for_tokens

SEEDS = {"weights": 0, "prompts": 1}
MLA, GQA = "deepseek-v3", "llama-3.1-405b"
MATHS_PAIRS = ((MLA, "llama-3.1-405b"), (MLA, "qwen3-235b-a22b"), (MLA, "llama-3-70b"), ("kimi-k2", "llama-3.1-405b"))


def gqa_model(name: str, context: int) -> RaggedModel:
    """A tiny-width random Llama with preset ``name``'s KV shape (layers,
    KV heads, head dim) and as many query heads as KV heads."""
    p = PRESETS[name]
    config = LlamaConfig(vocab_size=256, model_dim=64, mlp_dim=64, num_layers=p.num_layers,
                         num_q_heads=p.num_kv_heads, num_kv_heads=p.num_kv_heads, head_dim=p.head_dim,
                         max_seq_len=context)
    return RaggedModel(Llama(config, rngs=nnx.Rngs(SEEDS["weights"])), impl="xla")


def page_bytes(model, page_size: int) -> int:
    """Bytes one page of ``model``'s pool takes (every layer's slice of it)."""
    return model.make_kv_pool(2, page_size).nbytes // 2


def serve(name: str, model, *, pages: int, num_requests: int, args) -> dict:
    """Serves ``num_requests`` requests on a pool of ``pages`` pages (plus
    the null page); returns the row of the table."""
    pool = model.make_kv_pool(pages + 1, args.page_size)
    engine = Engine(model, pool, EngineConfig(
        max_seqs=args.max_seqs, max_seq_len=args.context, max_num_batched_tokens=args.budget_tokens,
        enable_prefix_caching=False, async_scheduling=True), vocab_size=model.vocab_size)
    peak, seconds = serve_for_peak(engine, num_requests=num_requests, prompt_len=args.context - args.new_tokens,
                                   new_tokens=args.new_tokens, vocab_size=model.vocab_size, seed=SEEDS["prompts"])
    per_seq = pages_for_tokens(args.context, args.page_size)
    return {
        "model": name, "kv_values_per_token": PRESETS[name].kv_elements_per_token,
        "page_bytes": page_bytes(model, args.page_size), "pool_pages": pages, "kv_bytes": pool.nbytes,
        "requests": num_requests, "peak_running": peak, "maths_sequences": pages // per_seq,
        "preemptions": engine.stats.preemptions, "peak_pages_used": engine.stats.peak_pages_used,
        "seconds": round(seconds, 1),
    }


def maths_rows() -> list[dict]:
    """Bytes a token (bf16) and the ratio, for the published models."""
    rows = []
    for mla, gqa in MATHS_PAIRS:
        a, b = PRESETS[mla], PRESETS[gqa]
        rows.append({"mla": mla, "gqa": gqa, "mla_bytes_per_token": a.kv_bytes_per_token(),
                     "gqa_bytes_per_token": b.kv_bytes_per_token(),
                     "ratio": round(b.kv_bytes_per_token() / a.kv_bytes_per_token(), 3),
                     "mla_params_b": round(a.num_params / 1e9), "gqa_params_b": round(b.num_params / 1e9)})
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.memory.mla_capacity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=256, help="tokens per sequence (prompt + generated)")
    p.add_argument("--new-tokens", type=int, default=15,
                   help="generated per request; below --page-size, so a prompt holds at admission the pages its "
                        "sequence ends with (more, and the engine, paging on demand, admits more sequences than "
                        "fit at full length and preempts some later), and enough to keep the first running while "
                        "the others are prefilled")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--gqa-sequences", type=int, default=4,
                   help="the KV budget: this many GQA sequences of --context tokens")
    p.add_argument("--gqa-requests", type=int, default=6, help="requests served on the GQA pool")
    p.add_argument("--mla-requests", type=int, default=36, help="requests served on the latent pool")
    p.add_argument("--budget-tokens", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--max-seqs", type=int, default=64)
    add_flag(p, "out")
    args = p.parse_args(argv)
    for name in ("context", "new_tokens", "page_size", "gqa_sequences", "gqa_requests", "mla_requests",
                 "budget_tokens", "max_seqs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.new_tokens >= min(args.context, args.page_size):
        p.error(f"--new-tokens must be below --context and --page-size, got {args.new_tokens}")
    if args.budget_tokens < args.max_seqs:
        p.error(f"--budget-tokens must be >= --max-seqs (a call holds a token of each running sequence), "
                f"got {args.budget_tokens} and {args.max_seqs}")
    check_out_dir(p, args.out)  # now, not after the benchmark
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    mla_model = random_deepseek(narrow(get_preset(MLA)), dtype="float32", seed=SEEDS["weights"], impl="xla")
    gqa = gqa_model(GQA, args.context)
    per_seq = pages_for_tokens(args.context, args.page_size)
    budget = args.gqa_sequences * per_seq * page_bytes(gqa, args.page_size)
    rows = [serve(GQA, gqa, pages=args.gqa_sequences * per_seq, num_requests=args.gqa_requests, args=args),
            serve(MLA, mla_model, pages=budget // page_bytes(mla_model, args.page_size),
                  num_requests=args.mla_requests, args=args)]
    g, m = rows
    measured, maths = m["peak_running"] / g["peak_running"], g["page_bytes"] / m["page_bytes"]
    sums = maths_rows()
    text = "\n".join([
        f"# Latent (MLA) pages against GQA pages: concurrent sequences at equal KV memory, {args.context} tokens",
        "",
        f"In the engine: tiny-width random decoders with the published KV shapes, {MLA} (61 layers, one latent of "
        f"512 + 64 a token a layer, its 3 dense layers then MoE layers) and {GQA} (126 layers, 8 KV heads of 128, "
        f"K and V); one KV budget of {args.gqa_sequences} {GQA} sequences ({budget:,} bytes, pool dtype "
        f"{mla_model.make_kv_pool(2, 1).k.dtype}); pages of {args.page_size} tokens; requests of "
        f"{args.context - args.new_tokens} prompt + {args.new_tokens} generated tokens; max_num_batched_tokens "
        f"{args.budget_tokens:,}. Machine: {machine()}.",
        "",
        "| model | KV values a token | bytes a page | pool pages | pool bytes | requests | peak running sequences | "
        "maths: sequences | preemptions | peak pages used | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {r['model']} | {r['kv_values_per_token']:,} | {r['page_bytes']:,} | {r['pool_pages']:,} | "
          f"{r['kv_bytes']:,} | {r['requests']} | {r['peak_running']} | {r['maths_sequences']} | {r['preemptions']} | "
          f"{r['peak_pages_used']:,} | {r['seconds']} |" for r in rows],
        "",
        f"Measured: {m['peak_running']} / {g['peak_running']} = {measured:.2f}x the concurrent sequences; maths: "
        f"{g['page_bytes']:,} / {m['page_bytes']:,} = {maths:.2f}x the bytes a token "
        f"({measured / maths:.1%} of it; whole sequences only: the latent pool holds "
        f"{m['maths_sequences']} = floor({m['pool_pages']:,} / {per_seq}) of them).",
        *[f"\nThe {r['model']} run preempted {r['preemptions']} times: its peak counts sequences admitted before "
          f"they reached full length." for r in rows if r["preemptions"]],
        *[f"\nMemory did not bind the {r['model']} run: it peaked at {r['peak_pages_used']:,} of {r['pool_pages']:,} "
          f"pages. Raise --new-tokens or the requests." for r in rows if r["peak_pages_used"] < 0.9 * r["pool_pages"]],
        "",
        "## The maths at full size (bf16 pages, paged_jax.memory.PRESETS)",
        "",
        "| MLA model | params | KV bytes a token | GQA model | params | KV bytes a token | ratio |",
        "|---|---|---|---|---|---|---|",
        *[f"| {r['mla']} | {r['mla_params_b']} B | {r['mla_bytes_per_token']:,} | {r['gqa']} | {r['gqa_params_b']} B | "
          f"{r['gqa_bytes_per_token']:,} | {r['ratio']:.2f}x |" for r in sums],
    ])
    provenance.publish(args.out, "mla_capacity", "experiments.memory.mla_capacity", argv, SEEDS, text, rows)
    return {"rows": rows, "measured": measured, "maths": maths, "maths_rows": sums}


if __name__ == "__main__":
    main()
