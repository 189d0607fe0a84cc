"""Every table and figure of the memory study, in one command (CPU, minutes).

    python -m experiments.memory.reproduce [--out results] [--sim-requests 2000] [--skip-serving]

Writes to ``--out``: ``kv_sizes``, ``kv_hybrid``, ``capacity``, ``final_length_waste``,
``waste_breakdown``, ``block_size`` and ``serving`` as ``.md`` and ``.csv``;
``layout.png``, ``declared_max_sweep.png``, ``waste_breakdown.png`` and
``block_size.png``; and ``README.md`` gathering them. Every ``.md`` and
``.csv`` carries the run's provenance block (``experiments.lib.provenance``:
command, commit, versions, device, seeds, date). Each table gives the
paper's figure (Kwon et al., "Efficient Memory Management for Large Language
Model Serving with PagedAttention", SOSP 2023) beside ours where there is one.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import time
from collections.abc import Callable, Sequence

import numpy as np
from tqdm import tqdm

from experiments.lib import plots, provenance
from experiments.lib.cli import add_flag, require_positive
from experiments.lib.serving import serve
from experiments.lib.sharegpt import build_requests, load_conversations, sample_requests
from experiments.lib.tables import markdown_table, write_table
from experiments.lib.waste_sim import PAPER_TOKEN_SHARE, SCHEMES, SimConfig, simulate
from models.ragged import RaggedModel
from models.smollm2 import load_smollm2
from models.tokenizer import load_tokenizer
from paged_jax.memory import GB, PRESETS, KiB, get_preset, hybrid_capacity, paged_slots, plan_capacity

PAPER = "Kwon et al., SOSP 2023"
SHAREGPT_SEED = 0
"""Shuffle seed of the ShareGPT sample (simulation and serving)."""
ARRIVAL_SEED = 0
"""Seed of the simulation's Poisson arrivals."""
SEEDS = {"sharegpt_shuffle": SHAREGPT_SEED, "arrivals": ARRIVAL_SEED}
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
SERVE_BUDGETS = (2048, 4096, 8192)
"""KV budgets (tokens) of the serving table: 1, 2 and 4 reservations of 2,048."""

HYBRID_CONTEXTS = (8_192, 32_768, 131_072)
"""Contexts of the hybrid table, tokens ("8k", "32k", "128k")."""
HYBRID_KV_BUDGET = 40 * GB
"""The hybrid table's KV budget: a fixed 40 GB of pool, not device memory
minus weights, so every model is measured against the same pool."""
HYBRID_PAGE_SIZE = 16
HYBRID_REFERENCE = "llama-3.1-8b"
"""A model without sliding layers, shown beside the hybrid ones."""
HYBRID_TARGET = 4.0
"""Issue 21's target: a Gemma-3-style model (5 sliding layers, window 1,024,
to 1 global) at a 32k-token context holds at least this many times the
sequences hybrid-aware as with every layer's pages kept."""

CAPACITY_CASES = (
    # model, device memory (GB), devices, weight dtype
    ("llama-2-7b", 40, 1, "bfloat16"),
    ("llama-3-8b", 80, 1, "bfloat16"),
    ("qwen2.5-7b", 80, 1, "bfloat16"),
    ("mixtral-8x7b", 80, 2, "bfloat16"),
    ("llama-2-70b", 80, 4, "bfloat16"),
    ("llama-3-70b", 80, 8, "bfloat16"),
    ("deepseek-v3", 141, 8, "float8"),
    ("kimi-k2", 141, 16, "float8"),
)


@dataclasses.dataclass
class Table:
    """A table as rows of dicts, written as Markdown and CSV, each with the
    run's provenance block."""

    name: str
    title: str
    rows: list[dict]
    note: str = ""

    def markdown(self) -> str:
        body = markdown_table(self.rows, list(self.rows[0]), cell=lambda column, value: _fmt(value))
        return f"## {self.title}\n\n{body}\n" + (f"\n{self.note}\n" if self.note else "")

    def write(self, out: pathlib.Path, record: provenance.Provenance) -> None:
        """Writes ``<out>/<name>.md`` and ``<out>/<name>.csv``."""
        write_table(out, self.name, self.rows, list(self.rows[0]), self.markdown(), record)


def _fmt(v) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3g}"
    if isinstance(v, (int, np.integer)):
        return f"{v:,}"
    return str(v)


def pct(x: float | None) -> str | None:
    return None if x is None else f"{100 * x:.1f}%"


@dataclasses.dataclass
class Workload:
    prompt: np.ndarray  # i64[R] tokens
    output: np.ndarray  # i64[R] tokens
    records: int
    truncated: bool

    @property
    def final(self) -> np.ndarray:
        return self.prompt + self.output


def load_workload(num_requests: int) -> Workload:
    """ShareGPT lengths, vLLM sampling, SmolLM2 tokenizer."""
    conversations, report = load_conversations()
    reqs = sample_requests(conversations, load_tokenizer().encode_batch, num_requests, seed=SHAREGPT_SEED)
    return Workload(
        prompt=np.array([r.prompt_len for r in reqs], np.int64),
        output=np.array([r.output_len for r in reqs], np.int64),
        records=report.records,
        truncated=report.truncated,
    )


def _layer_mix(p) -> str:
    if not p.is_hybrid:
        return "all full"
    return f"{p.num_sliding_layers} sliding (window {p.sliding_window:,}) + {p.num_full_layers} full"


def kv_size_table() -> Table:
    rows = []
    for p in PRESETS.values():
        per_token = p.kv_bytes_per_token("bfloat16")
        rows.append(
            {
                "model": p.name,
                "attention": "MLA" if p.is_mla else "MHA/GQA",
                "layers": p.num_layers,
                "layer mix": _layer_mix(p),
                "cached per layer": (
                    f"latent {p.kv_lora_rank} + RoPE key {p.qk_rope_head_dim}" if p.is_mla
                    else f"K, V: {p.num_kv_heads} heads x {p.head_dim}"
                ),
                "KV per token (bf16)": f"{per_token / KiB:,.1f} KiB",
                "8,000-token conversation": f"{p.kv_bytes(8000) / GB:,.2f} GB",
                "weights (bf16)": f"{p.weight_bytes() / GB:,.1f} GB",
                "source": p.source,
            }
        )
    return Table(
        "kv_sizes",
        "KV cache per token",
        rows,
        "GQA/MHA: 2 x layers x KV heads x head dim x 2 bytes; MLA: layers x (kv_lora_rank + "
        "qk_rope_head_dim) x 2 bytes. Every layer counted for every token (the sliding layers of the "
        "hybrid models too: what they hold instead is in the hybrid table). GB = 10^9 bytes. The seeds' "
        "figures: a 70B GQA model costs about 300 KB per token (Llama-2-70B: 320 KiB) and an 8,000-token "
        "conversation about 2.5 GB. Gemma 3 counts the text decoder's parameters only (no vision encoder).",
    )


def hybrid_target() -> str:
    """Issue 21's target in numbers: Gemma-3-12B (the Gemma-3 pattern) at
    32,768 tokens, hybrid-aware versus every layer's pages kept."""
    cap = hybrid_capacity(get_preset("gemma-3-12b"), context=32_768, kv_budget_bytes=HYBRID_KV_BUDGET,
                          page_size=HYBRID_PAGE_SIZE)
    verdict = "met" if cap.ratio >= HYBRID_TARGET else "NOT met"
    return (f"Target (issue 21): a Gemma-3-style model (5 sliding, window 1,024 : 1 global) at 32,768 tokens, "
            f"page {HYBRID_PAGE_SIZE}: hybrid-aware holds {cap.ratio:.2f}x the sequences of keeping every "
            f"layer's pages ({cap.hybrid_bytes / GB:.2f} vs {cap.full_bytes / GB:.2f} GB a sequence; "
            f"{cap.hybrid_sequences} vs {cap.full_sequences} sequences in {HYBRID_KV_BUDGET / GB:.0f} GB); "
            f"target >= {HYBRID_TARGET:g}x: {verdict}.")


def hybrid_table() -> Table:
    rows = []
    budget = f"{HYBRID_KV_BUDGET / GB:.0f} GB"
    models = [p for p in PRESETS.values() if p.is_hybrid] + [get_preset(HYBRID_REFERENCE)]
    for p in models:
        for context in HYBRID_CONTEXTS:
            cap = hybrid_capacity(p, context=context, kv_budget_bytes=HYBRID_KV_BUDGET, page_size=HYBRID_PAGE_SIZE)
            rows.append(
                {
                    "model": p.name,
                    "layer mix": _layer_mix(p),
                    "context": context,
                    "GB a sequence, every layer": cap.full_bytes / GB,
                    "GB a sequence, hybrid-aware": cap.hybrid_bytes / GB,
                    f"sequences in {budget}, every layer": cap.full_sequences,
                    f"sequences in {budget}, hybrid-aware": cap.hybrid_sequences,
                    "every layer / hybrid-aware": cap.ratio,
                }
            )
    return Table(
        "kv_hybrid",
        f"Hybrid sliding-window models: KV a sequence holds, and sequences in a {budget} KV pool",
        rows,
        f"K/V in bf16, pages of {HYBRID_PAGE_SIZE} tokens, a fixed KV budget of {budget} "
        "(10^9 bytes; not device memory minus weights), every sequence at the context's length (its peak). "
        f"Every layer: each layer keeps ceil(n / {HYBRID_PAGE_SIZE}) pages, as a manager that frees nothing "
        "before the sequence ends does (the engine given a pool of every layer, or under a reservation policy). "
        "Hybrid-aware (the engine given a pool laid out by layer group, `paged_jax.paging.kv_groups`, as `LLM` and the "
        "serving scripts lay it out): "
        "a sliding layer of window W keeps only the pages covering positions [max(0, n - W), n), the keys "
        "the last token attended to: min(n, W) tokens in whole pages, plus one page when the window starts "
        "far enough inside a page to end on one more (`paged_jax.memory.layer_pages`). Last column: the ratio "
        "of bytes a "
        "sequence, the factor by which a large enough pool holds more sequences (the counts are floored). "
        + hybrid_target(),
    )


def capacity_table(final: np.ndarray) -> Table:
    rows = []
    for model, mem_gb, devices, wdtype in CAPACITY_CASES:
        plan = plan_capacity(
            get_preset(model), device_memory_bytes=mem_gb * GB, num_devices=devices,
            cache_fraction=0.9, page_size=16, weight_dtype=wdtype, lengths=final, max_seq_len=2048,
        )
        rows.append(
            {
                "model": model,
                "devices": f"{devices} x {mem_gb} GB",
                "weights": f"{plan.weight_bytes / GB:,.0f} GB ({wdtype})",
                "KV budget": f"{plan.cache_bytes / GB:,.0f} GB",
                "pages (16 tokens)": plan.num_pages,
                "sequences, paged": plan.paged_concurrency,
                "sequences, contiguous 2,048": plan.contiguous_concurrency,
                "paged / contiguous": f"{plan.paged_concurrency / max(plan.contiguous_concurrency, 1):.1f}x",
            }
        )
    return Table(
        "capacity",
        "Capacity planner: concurrent ShareGPT sequences, paged vs contiguous",
        rows,
        f"Cache fraction 0.9 of all device memory (weights come out of it), KV in bf16, page 16, "
        f"lengths: {len(final)} ShareGPT requests at their final length (mean {final.mean():.1f} tokens). "
        "CLI: `python -m experiments.memory.capacity --model llama-3-70b --device-memory-gb 80 --num-devices 8 "
        "--cache-fraction 0.9`.",
    )


def final_length_table(final: np.ndarray) -> Table:
    facts = {8: 0.992, 16: 0.983, 32: 0.966, 128: 0.879}
    rows = []
    used = int(final.sum())
    for ps in BLOCK_SIZES:
        rows.append({"layout": f"paged, page {ps}", "token states": pct(used / paged_slots(final, ps).sum()),
                     "measured before (FACTS)": pct(facts.get(ps))})
    rows.append({"layout": "contiguous, reserve 2,048", "token states": pct(used / (2048 * len(final))),
                 "measured before (FACTS)": pct(0.220)})
    return Table(
        "final_length_waste",
        f"Upper bound: token-state share at final lengths ({len(final)} ShareGPT requests)",
        rows,
        "Every request at its final length (prompt + output), no growth, no queue: the most each layout "
        "can reach. FACTS: the figures measured earlier on the same 1,000 requests.",
    )


def waste_breakdown(work: Workload, pool_tokens: int, rate: float, progress: Callable) -> tuple[Table, list]:
    rows, plot_rows = [], []
    for scheme in SCHEMES:
        r = simulate(work.prompt, work.output,
                     SimConfig(scheme=scheme, pool_tokens=pool_tokens, page_size=16, arrival_rate=rate,
                               seed=ARRIVAL_SEED))
        progress()
        rows.append(
            {
                "scheme": scheme,
                "token states": pct(r.token_share),
                "paper token states": pct(PAPER_TOKEN_SHARE[scheme]),
                "reserved": pct(r.reserved_share),
                "internal frag.": pct(r.internal_share),
                "external frag.": pct(r.external_share),
                "unused (of pool)": pct(r.unused_share),
                "mean running": round(r.mean_running, 1),
                "peak running": r.peak_running,
                "iterations": r.iterations,
                "preemptions": r.preemptions,
                "sim s": round(r.wall_s, 1),
            }
        )
        plot_rows.append(
            {
                "scheme": scheme,
                "token states": r.token_share,
                "reserved": r.reserved_share,
                "internal fragmentation": r.internal_share,
                "external fragmentation": r.external_share,
                "paper token states": PAPER_TOKEN_SHARE[scheme],
            }
        )
    note = (
        f"Simulation: {len(work.prompt)} ShareGPT requests (vLLM sampling, SmolLM2 tokenizer), Poisson arrivals "
        f"at {rate} per iteration, one token per running request per iteration, FCFS admission, a pool of "
        f"{pool_tokens:,} KV slots, the real page allocator (`paged_jax.paging.page_state`) holding every request's "
        "slots. Shares of the KV memory in use, time-averaged; `unused` is free memory no waiting request "
        "was refused for layout, as a share of the whole pool. contiguous-max reserves 2,048 tokens, "
        "-pow2 the next power of two of the final length, -oracle exactly the final length, each as one "
        "first-fit run of slots; paged takes pages of 16 as it grows (vLLM's 1% watermark, preemption by "
        f"recompute). Paper: {PAPER}, Figure 2 (Orca (Max), Orca (Pow2), Orca (Oracle), vLLM), "
        "measured on OPT-13B traces, not the same workload."
    )
    return Table("waste_breakdown", "Memory-waste breakdown (paper Figure 2)", rows, note), plot_rows


def block_size_sim(work: Workload, pool_tokens: int, rate: float, progress: Callable) -> list[dict]:
    rows = []
    for ps in BLOCK_SIZES:
        r = simulate(work.prompt, work.output,
                     SimConfig(scheme="paged", pool_tokens=pool_tokens, page_size=ps, arrival_rate=rate,
                               seed=ARRIVAL_SEED))
        progress()
        rows.append(
            {
                "page size": ps,
                "token states": r.token_share,
                "bound": float(work.final.sum() / paged_slots(work.final, ps).sum()),
                "mean running": r.mean_running,
                "preemptions": r.preemptions,
            }
        )
    return rows


def serving_rows(
    num_requests: int, block_requests: int, max_output_len: int, progress: Callable
) -> tuple[list, list]:
    """SmolLM2 serving: paged throughput per page size (the first
    ``block_requests`` requests, KV budget 8,192 tokens), and paged vs
    contiguous at three KV budgets (``num_requests`` requests). Returns
    ``(block_rows, budget_rows)``."""
    model, tokenizer = load_smollm2()
    requests, _, _ = build_requests(tokenizer, num_requests, max_output_len, seed=SHAREGPT_SEED)
    paged_model = RaggedModel(model)
    block_rows = []
    for ps in BLOCK_SIZES:
        r, _ = serve(model, requests[:block_requests], mode="paged", page_size=ps, kv_budget_tokens=8192,
                     paged_model=paged_model, progress=False)
        progress()
        block_rows.append(r)
    budget_rows = []
    for budget in SERVE_BUDGETS:
        for mode in ("paged", "contiguous"):
            r, _ = serve(model, requests, mode=mode, page_size=16, kv_budget_tokens=budget, paged_model=paged_model,
                         progress=False)
            progress()
            budget_rows.append(r)
    return block_rows, budget_rows


def block_size_table(sim_rows: list[dict], serve_rows: list | None, serve_note: str) -> Table:
    by_ps = {r.page_size: r for r in serve_rows or []}
    rows = []
    for s in sim_rows:
        srv = by_ps.get(s["page size"])
        rows.append(
            {
                "page size": s["page size"],
                "token states (sim)": pct(s["token states"]),
                "token states (final lengths)": pct(s["bound"]),
                "mean running (sim)": round(s["mean running"], 1),
                "preemptions (sim)": s["preemptions"],
                "SmolLM2 tokens/s": None if srv is None else srv.tokens_per_s,
                "SmolLM2 KV token fraction": None if srv is None else pct(srv.kv_token_fraction),
            }
        )
    note = (
        "Simulation as in the waste breakdown, paged at each page size. The paper (section 7.2, Figure 18b) "
        "finds block sizes 16 to 128 best on ShareGPT and makes 16 vLLM's default: too small a page costs "
        "kernel efficiency, too large one internal fragmentation. " + serve_note
    )
    return Table("block_size", "Block-size ablation", rows, note)


def serving_table(rows: list, note: str) -> Table:
    out = []
    for r in rows:
        out.append(
            {
                "KV budget (tokens)": r.kv_budget_tokens,
                "mode": r.mode,
                "tokens/s": r.tokens_per_s,
                "peak running": r.peak_concurrency,
                "mean running": r.mean_concurrency,
                "KV token fraction": pct(r.kv_token_fraction),
                "preemptions": r.preemptions,
                "wall s": r.wall_s,
            }
        )
    return Table("serving", "Throughput and concurrency on SmolLM2, paged vs contiguous", out, note)


def write_readme(out: pathlib.Path, tables: Sequence[Table], header: str, record: provenance.Provenance) -> None:
    """Writes ``<out>/README.md``: every table, the figures, one provenance block."""
    parts = [
        "# Memory study: tables and figures\n",
        header,
        "Regenerate with `make tables` (or `python -m experiments.memory.reproduce`).\n",
        "![Contiguous versus paged layout](layout.png)\n",
        "![Memory held versus declared maximum](declared_max_sweep.png)\n",
    ]
    for t in tables:
        parts.append(t.markdown())
        if t.name in ("waste_breakdown", "block_size"):
            parts.append(f"![{t.title}]({t.name}.png)\n")
    provenance.write_markdown(out / "README.md", "\n".join(parts), record)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m experiments.memory.reproduce", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_flag(p, "out")
    p.add_argument("--sim-requests", type=int, default=2000, help="ShareGPT requests in the simulation")
    p.add_argument("--pool-tokens", type=int, default=32_768, help="simulated KV pool, slots")
    p.add_argument("--arrival-rate", type=float, default=1.0, help="simulated requests per iteration")
    # Small on purpose: SmolLM2 on 2 CPU cores serves a few tokens per second.
    p.add_argument("--serve-requests", type=int, default=24, help="requests per KV-budget row")
    p.add_argument("--serve-block-requests", type=int, default=8, help="requests per page-size row")
    p.add_argument("--serve-max-output", type=int, default=32, help="cap on output tokens")
    p.add_argument("--skip-serving", action="store_true", help="leave out the SmolLM2 serving rows")
    p.add_argument("--declared-max", type=int, default=256, help="reservation drawn in layout.png")
    args = p.parse_args(argv)
    require_positive(p, args, "sim_requests", "pool_tokens", "serve_requests", "serve_block_requests", "serve_max_output")
    return args


def main(argv=None) -> list[Table]:
    args = parse_args(argv)
    record = provenance.collect("experiments.memory.reproduce", argv, seeds=SEEDS)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    serve_steps = 0 if args.skip_serving else len(BLOCK_SIZES) + 2 * len(SERVE_BUDGETS)
    total = 3 + len(SCHEMES) + len(BLOCK_SIZES) + serve_steps + 2
    bar = tqdm(total=total, desc="reproduce", unit="step")

    def step(desc: str):
        bar.set_postfix_str(desc)
        return lambda: bar.update(1)

    step("ShareGPT lengths")
    work = load_workload(args.sim_requests)
    bar.update(1)
    kv = kv_size_table()
    hybrid = hybrid_table()
    bar.update(1)
    first_1000 = work.final[:1000]
    cap = capacity_table(first_1000)
    bound = final_length_table(first_1000)
    bar.update(1)

    waste, waste_plot = waste_breakdown(work, args.pool_tokens, args.arrival_rate, step("waste breakdown"))
    plots.plot_waste_breakdown(out / "waste_breakdown.png", waste_plot)
    sim_rows = block_size_sim(work, args.pool_tokens, args.arrival_rate, step("block sizes (simulation)"))

    serve_block, serve_budget = None, None
    if args.skip_serving:
        serve_note = "SmolLM2 serving rows skipped (--skip-serving)."
    else:
        advance = step("SmolLM2 serving")
        serve_block, serve_budget = serving_rows(
            args.serve_requests, args.serve_block_requests, args.serve_max_output, advance
        )
        serve_note = (
            f"SmolLM2 throughput: {args.serve_block_requests} ShareGPT requests, outputs capped at "
            f"{args.serve_max_output} tokens, KV budget 8,192 tokens, paged, on this machine's CPU "
            "(compile time excluded)."
        )
    block = block_size_table(sim_rows, serve_block, serve_note)
    plots.plot_block_size(
        out / "block_size.png",
        [{**s, "tokens/s": (None if serve_block is None else serve_block[i].tokens_per_s)}
         for i, s in enumerate(sim_rows)],
    )
    step("figures")
    plots.plot_layout(out / "layout.png", declared_max=args.declared_max)
    bar.update(1)
    plots.plot_declared_max_sweep(out / "declared_max_sweep.png")
    bar.update(1)
    bar.close()

    tables = [kv, hybrid, cap, bound, waste, block]
    if serve_budget is not None:
        tables.append(
            serving_table(
                serve_budget,
                f"{args.serve_requests} ShareGPT requests, outputs capped at {args.serve_max_output} tokens, "
                "page 16; contiguous reserves 2,048 tokens per request. The paper (abstract, section 6.2) reports "
                "2-4x the throughput of Orca and FasterTransformer at the same latency on GPUs; "
                "these are CPU runs of a 135M model, where compute, not KV memory, bounds throughput "
                "once the batch is large.",
            )
        )
    for t in tables:
        t.write(out, record)
    header = (
        f"ShareGPT: {work.records:,} complete conversations recovered from the shipped file"
        + (" (truncated mid-record)" if work.truncated else "")
        + f"; {len(work.prompt):,} requests sampled with vLLM's rules (SmolLM2 tokenizer): mean prompt "
        f"{work.prompt[:1000].mean():.1f}, mean output {work.output[:1000].mean():.1f} tokens for the first 1,000.\n"
    )
    write_readme(out, tables, header, record)
    for t in tables:
        print("\n" + t.markdown())
    print(f"\nwrote {len(tables)} tables and 4 figures to {out}/ in {time.perf_counter() - t_start:.0f} s")
    return tables


if __name__ == "__main__":
    main()
