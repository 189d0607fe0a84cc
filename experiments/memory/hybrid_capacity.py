"""Concurrent sequences of a hybrid sliding-window model, measured in the
engine: a block table per layer group versus every layer's pages kept.

    python -m experiments.memory.hybrid_capacity --context 32768 --window 1024

A tiny-width random Gemma-3-style decoder (``--num-layers`` layers, layer
``i`` global iff ``(i + 1) % --global-every == 0``, the others a sliding
window of ``--window`` tokens; ``models.llama`` with ``layer_types``) is
served twice at one KV byte budget: a pool that holds ``--full-sequences``
sequences of ``--context`` tokens with every layer's pages kept. Once with
that pool laid out by layer (one block table, every page kept until the
sequence ends: the layout before layer groups), once laid out by layer group
(``RaggedModel.make_kv_pool``: a table per group, each sliding group's pages
returned once they leave its window, :mod:`paged_jax.paging.kv_groups`). Both
serve the same ``--num-requests`` requests of ``--context`` tokens each (a
prompt of ``context - new_tokens`` random tokens and ``--new-tokens``
generated), and the table reports the most sequences running at once in
each, beside what :func:`paged_jax.memory.layer_pages` counts for a
sequence at ``--context`` tokens. The width of the model does not matter
to the counts: pages per sequence depend on the layer pattern, the window,
the page size and the context only.

Writes ``hybrid_capacity.md`` and ``.csv`` to ``--out`` (with provenance).
"""

from __future__ import annotations

import argparse
import pathlib

from flax import nnx

from experiments.lib import provenance
from experiments.lib.cli import machine, serve_for_peak
from models.config import LlamaConfig
from models.llama import Llama
from models.ragged import RaggedModel
from paged_jax.engine.core import Engine, EngineConfig
from paged_jax.memory import layer_pages
from paged_jax.paging.page_state import pages_for_tokens

SEEDS = {"weights": 0, "prompts": 1}


def gemma_style_config(*, num_layers: int, global_every: int, window: int, context: int) -> LlamaConfig:
    """A tiny-width decoder with Gemma 3's layer pattern (5 sliding : 1
    global at ``global_every=6``) and its block (norms before and after,
    GeGLU, q/k norm, local RoPE base)."""
    types = tuple("full_attention" if (i + 1) % global_every == 0 else "sliding_attention" for i in range(num_layers))
    return LlamaConfig(vocab_size=128, model_dim=32, mlp_dim=64, num_layers=num_layers, num_q_heads=2,
                       num_kv_heads=1, head_dim=16, max_seq_len=context, sliding_window=window, layer_types=types,
                       local_rope_theta=10_000.0, rope_theta=1_000_000.0, qk_norm="head", norm_plus_one=True,
                       norm_placement="pre_post", mlp_activation="gelu_tanh", embed_scale=32**0.5)


def serve(model: RaggedModel, *, grouped: bool, full_pages: int, num_requests: int, args) -> dict:
    """Serves ``num_requests`` requests on a pool of ``full_pages``
    every-layer pages' bytes (laid out by group or by layer); returns the
    row of the table."""
    config = model.config
    pool = model.make_budget_kv_pool(full_pages + 1, args.page_size, grouped=grouped)  # the same bytes
    engine = Engine(model, pool, EngineConfig(
        max_seqs=args.max_seqs, max_seq_len=args.context, max_num_batched_tokens=args.budget_tokens,
        enable_prefix_caching=False, async_scheduling=True), vocab_size=config.vocab_size)
    peak, seconds = serve_for_peak(engine, num_requests=num_requests, prompt_len=args.context - args.new_tokens,
                                   new_tokens=args.new_tokens, vocab_size=config.vocab_size, seed=SEEDS["prompts"])
    st = engine.stats
    layers_per_page = pool.num_layers
    return {
        "layout": "a table per layer group" if grouped else "every layer's pages kept",
        "pool_pages": pool.num_pages - 1,
        "layers_per_page": layers_per_page,
        "requests": num_requests,
        "kv_bytes": pool.nbytes,
        "peak_running": peak,
        "preemptions": st.preemptions,
        "window_dropped_pages": st.window_dropped_pages,
        "peak_layer_pages_used": st.peak_pages_used * layers_per_page,
        "generated_tokens": st.generated_tokens,
        "seconds": round(seconds, 1),
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.memory.hybrid_capacity", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=32_768, help="tokens per sequence (prompt + generated)")
    p.add_argument("--window", type=int, default=1024, help="sliding layers' window, tokens")
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--global-every", type=int, default=6, help="layer i global iff (i + 1) %% this == 0")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--full-sequences", type=int, default=2,
                   help="the KV budget: this many sequences of --context tokens, every layer's pages kept")
    p.add_argument("--num-requests", type=int, default=11, help="requests served with a table per layer group")
    p.add_argument("--baseline-requests", type=int, default=3,
                   help="requests served with every page kept (its peak is --full-sequences; more only cost time)")
    p.add_argument("--new-tokens", type=int, default=160,
                   help="generated per request: keeps the first running while the others are prefilled (too few, "
                        "and the schedule, not memory, caps the sequences; the table then says so)")
    p.add_argument("--budget-tokens", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--max-seqs", type=int, default=16)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"))
    args = p.parse_args(argv)
    for name in ("context", "window", "num_layers", "global_every", "page_size", "full_sequences", "num_requests",
                 "baseline_requests", "new_tokens", "budget_tokens", "max_seqs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.new_tokens >= args.context:
        p.error(f"--new-tokens must be below --context, got {args.new_tokens} >= {args.context}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    config = gemma_style_config(num_layers=args.num_layers, global_every=args.global_every, window=args.window,
                                context=args.context)
    model = RaggedModel(Llama(config, rngs=nnx.Rngs(SEEDS["weights"])), impl="xla")
    L, n = args.page_size, args.context
    full_pages = args.full_sequences * pages_for_tokens(n, L)  # every-layer pages of the budget
    every = config.num_layers * pages_for_tokens(n, L)  # page-layers a sequence holds, every page kept
    hybrid = sum(layer_pages(n, L, args.window if s else None) for s in config.sliding_layers)
    budget = full_pages * config.num_layers
    rows = [serve(model, grouped=g, full_pages=full_pages, num_requests=k, args=args)
            for g, k in ((False, args.baseline_requests), (True, args.num_requests))]
    for row, per_seq in zip(rows, (every, hybrid)):
        row["maths_page_layers_per_seq"] = per_seq
        row["maths_sequences"] = budget // per_seq
    gain, maths_gain = rows[1]["peak_running"] / rows[0]["peak_running"], every / hybrid
    groups = model.kv_groups
    text = "\n".join([
        f"# Hybrid KV in the engine: concurrent sequences at {n:,} tokens",
        "",
        f"Tiny-width random Gemma-3-style decoder: {config.num_layers} layers, "
        f"{sum(config.sliding_layers)} sliding (window {args.window:,}) + "
        f"{config.num_layers - sum(config.sliding_layers)} full; {groups.num_groups} layer groups of "
        f"{groups.group_size}; pages of {L} tokens; a KV budget of {args.full_sequences} sequences with every "
        f"layer's pages kept ({budget:,} page-layers, {rows[0]['kv_bytes']:,} bytes); requests "
        f"of {n - args.new_tokens:,} prompt + {args.new_tokens} generated tokens; "
        f"max_num_batched_tokens {args.budget_tokens:,}. Machine: {machine()}.",
        "",
        "| layout | pool pages x layers a page | requests | peak running sequences | maths: page-layers a sequence | maths: "
        "sequences | preemptions | pages dropped by windows | peak page-layers used | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *[f"| {r['layout']} | {r['pool_pages']:,} x {r['layers_per_page']} | {r['requests']} | {r['peak_running']} | "
          f"{r['maths_page_layers_per_seq']:,} | {r['maths_sequences']} | {r['preemptions']} | "
          f"{r['window_dropped_pages']:,} | {r['peak_layer_pages_used']:,} | {r['seconds']} |" for r in rows],
        "",
        f"Measured gain: {rows[1]['peak_running']} / {rows[0]['peak_running']} = {gain:.2f}x concurrent sequences "
        f"(maths: {every:,} / {hybrid:,} = {maths_gain:.2f}x the bytes a sequence; target >= 4x).",
        *[f"\nMemory did not bind the {r['layout']} run: its peak used {r['peak_layer_pages_used']:,} of the pool's "
          f"{budget:,} page-layers ({r['peak_layer_pages_used'] / budget:.0%}), so the schedule, not the pool, "
          f"capped its sequences: early requests finished before later ones were prefilled. Raise --new-tokens "
          f"(each request must still run while about {r['maths_sequences']} prompts of "
          f"{n - args.new_tokens:,} tokens are prefilled, {args.budget_tokens:,} tokens a call) or "
          f"--num-requests." for r in rows if r["peak_layer_pages_used"] < 0.9 * budget],
    ])
    provenance.publish(args.out, "hybrid_capacity", "experiments.memory.hybrid_capacity", argv, SEEDS, text, rows)
    return rows


if __name__ == "__main__":
    main()
