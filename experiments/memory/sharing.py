"""Sharing pages on SmolLM2 and ShareGPT: the paper's sharing tables.

Three parts, each serving real ShareGPT requests with SmolLM2-135M-Instruct
through the engine (PagedAttention, Kwon et al., SOSP 2023, sections 4.4
and 4.5):

* (a) prefix caching: a shared system prompt of about ``--system-tokens``
  tokens before each request, served with automatic prefix caching off and
  on: prefill tokens computed, pages held, hit rate, and whether the
  outputs are the same;
* (b) parallel sampling (n = 2, 4, 6) and beam search (width 2, 4, 6): the
  KV memory sharing saves, measured as the paper's Figures 15 and 17 do (1 -
  distinct pages held / pages the sequences would hold each on their own,
  averaged over iterations); prefix caching is off here so only the forks
  share;
* (c) the time one preemption costs, by recompute versus swap, at page
  sizes 8 to 128 (Figure 19a): recompute redoes the prefill of a
  ``--preempt-tokens``-token sequence (one model call, timed); swap copies
  its pages out of the pool and back into fresh pages (timed to completion);
  fastest of ``--repeats``;
* (d) end to end: the requests on a pool small enough to preempt and on one
  large enough not to, by recompute and by swap (Figure 19b): preemptions,
  work redone, wall time, outputs. The wall-time difference mixes the cost
  of preemption with the smaller pool's lower concurrency.

Prints the tables, writes ``sharing.md``, ``sharing.csv`` (every row, with a
``part`` column) and ``sharing.png`` to ``--out``.

Usage: ``python -m experiments.memory.sharing [--parts abc] [--num-requests N] ...``
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax
import numpy as np

from experiments.lib import provenance
from experiments.lib.cli import (
    add_compile_cache_args,
    add_flag,
    add_flags,
    check_flags,
    check_outputs,
    machine,
    require_positive,
    setup_compile_cache,
)
from experiments.lib.serving import make_engine, run_timed
from experiments.lib.sharegpt import MAX_SEQ_LEN, build_requests, load_conversations
from experiments.lib.tables import markdown_table, write_table
from models.ragged import RaggedModel
from models.smollm2 import load_smollm2
from paged_jax.engine.requests import Request
from paged_jax.engine.sampling import SamplingParams
from paged_jax.paging.swap import gather_pages, scatter_pages

# The paper's memory saving by sharing (section 6.3, Figures 15 and 17),
# over parallel sizes / beam widths 2 to 6, OPT-13B.
PAPER_SAVING = {
    "parallel sampling": "6.1–9.8% (Alpaca), 16.2–30.5% (ShareGPT)",
    "beam search": "37.6–55.2% (Alpaca), 44.3–66.3% (ShareGPT)",
}
PAGE_SIZES = (8, 16, 32, 64, 128)
SEEDS = {"sharegpt_shuffle": 0, "parallel_sampling": 0, "preempted_prompt": 0}
"""The ShareGPT sample, (b)'s parallel sampling, and (c)'s random prompt."""
NOTES = {
    "a": "Hits are whole pages, and a request's last prompt token is always computed, so a little of the system "
         "prompt is computed again by each request; the hit rate counts prompt tokens served from the cache. "
         "Requests admitted in the same call as the first miss with it (its pages are not cached yet); here the "
         "first prompt takes whole calls of 256 tokens, so the others are admitted after it. "
         "Same outputs: greedy tokens identical with caching off and on.",
    "b": "Saving = 1 - distinct pages held / pages the sequences would hold each on its own, averaged over "
         "iterations (the paper's measure). Here outputs are capped at 64 tokens while prompts run to a few hundred, "
         "so the shared prompt is most of every sequence and sharing saves more than in the paper, whose ShareGPT "
         "outputs run to the dataset's lengths; the trend (more samples or beams, more saved; beam search above "
         "parallel sampling) is the paper's.",
    "c": "On this CPU a swap is a copy within host memory (the pool already lives there); on a GPU it crosses "
         "PCIe, which is where the paper finds swap slow at small pages. Recompute is one prefill call over the "
         "sequence's tokens; the page size hardly changes either.",
    "d": "At this size preemptions are few, and the wall-time difference is mostly the small pool's lower "
         "concurrency (at page 128 nothing is preempted and the small pool is still slower). Both modes give the "
         "outputs of the large pool.",
}


def serve(paged_model, model, requests, *, page_size: int, kv_tokens: int, max_seqs: int, max_seq_len: int,
          **config):
    """Runs ``requests`` on a fresh engine (:func:`experiments.lib.serving.make_engine`,
    ``config`` its ``EngineConfig`` fields). Returns ``(stats, outputs by
    request id, wall seconds without compilation)``."""
    engine = make_engine(model, kv_tokens=kv_tokens, page_size=page_size, max_seqs=max_seqs, max_seq_len=max_seq_len,
                         paged_model=paged_model, **config)
    outputs, wall, _ = run_timed(engine, requests)
    return engine.stats, {o.request_id: o for o in outputs}, wall


def system_prompt_requests(tokenizer, requests: list[Request], prompts: list[str], system_tokens: int,
                           max_seq_len: int) -> tuple[list[Request], int]:
    """The requests again, each after one shared system prompt of about
    ``system_tokens`` tokens (ShareGPT text the requests do not use).
    Returns the requests and the system prompt's length in tokens."""
    conversations, _ = load_conversations()
    used = set(prompts)
    text, ids = "", []
    for record in conversations:
        for turn in record.get("conversations", [])[:1]:
            value = turn.get("value") if isinstance(turn, dict) else None
            if isinstance(value, str) and value not in used:
                text += value.strip() + "\n\n"
        ids = tokenizer.encode(text)
        if len(ids) >= system_tokens:
            break
    system = tokenizer.decode(ids[:system_tokens])
    out = []
    for r, p in zip(requests, prompts):
        ids = tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": p}]))
        out.append(Request(request_id=r.request_id, prompt_ids=ids,
                           max_new_tokens=min(r.max_new_tokens, max_seq_len - len(ids)), ignore_eos=True))
    return out, len(tokenizer.encode(system))


def part_a(paged_model, model, tokenizer, requests, prompts, args) -> list[dict]:
    reqs, sys_len = system_prompt_requests(tokenizer, requests, prompts, args.system_tokens, MAX_SEQ_LEN)
    rows, outs = [], {}
    for caching in (False, True):
        st, outs[caching], wall = serve(paged_model, model, reqs, page_size=16, kv_tokens=args.kv_tokens,
                                        max_seqs=args.max_seqs, max_seq_len=MAX_SEQ_LEN, enable_prefix_caching=caching)
        rows.append({
            "part": "a", "prefix_caching": "on" if caching else "off", "requests": len(reqs),
            "system_tokens": sys_len, "prompt_tokens": sum(len(r.prompt_ids) for r in reqs),
            "prefill_tokens": st.prefill_tokens, "prefix_hit_rate": round(st.prefix_hit_rate, 3),
            "peak_pages": st.peak_pages_used, "mean_pages": round(st.used_pages_sum / st.iterations, 1),
            "preemptions": st.preemptions, "wall_s": round(wall, 1),
        })
    same = sum(outs[True][i].output_ids == outs[False][i].output_ids for i in outs[True])
    for row in rows:
        row["same_outputs"] = f"{same}/{len(reqs)}"
    return rows


def part_b(paged_model, model, requests, args) -> list[dict]:
    rows = []
    for kind in ("parallel sampling", "beam search"):
        for k in (2, 4, 6):
            sampling = (SamplingParams(temperature=1.0, seed=SEEDS["parallel_sampling"], n=k)
                        if kind == "parallel sampling" else SamplingParams(beam_width=k))
            reqs = [Request(request_id=r.request_id, prompt_ids=r.prompt_ids, max_new_tokens=r.max_new_tokens,
                            ignore_eos=True, sampling=sampling) for r in requests]
            st, _, wall = serve(paged_model, model, reqs, page_size=16, kv_tokens=args.kv_tokens,
                                max_seqs=args.max_seqs, max_seq_len=MAX_SEQ_LEN, enable_prefix_caching=False)
            rows.append({
                "part": "b", "mode": kind, "k": k, "requests": len(reqs),
                "mean_pages_unshared": round(st.seq_pages_sum / st.iterations, 1),
                "mean_pages_shared": round(st.used_pages_sum / st.iterations, 1),
                "saving": f"{100 * st.sharing_saving:.1f}%", "paper": PAPER_SAVING[kind],
                "preemptions": st.preemptions, "wall_s": round(wall, 1),
            })
    return rows


def part_c(paged_model, model, args) -> list[dict]:
    rows = []
    n = args.preempt_tokens
    prompt = list(np.random.default_rng(SEEDS["preempted_prompt"]).integers(0, model.config.vocab_size, size=n))
    for page_size in args.page_sizes:
        num_pages = -(-n // page_size)  # the pages holding its K/V
        cap = -(-(n + 1) // page_size)  # ... and the one sampled token
        recompute = []
        for _ in range(args.repeats + 1):  # the first call compiles
            # Room for the sequence twice: its pages, and fresh ones to swap them into.
            engine = make_engine(model, kv_tokens=(num_pages + cap) * page_size, page_size=page_size, max_seqs=1,
                                 max_seq_len=cap * page_size, max_batched_tokens=n, paged_model=paged_model,
                                 enable_prefix_caching=False)
            engine.run([Request(request_id=0, prompt_ids=prompt, max_new_tokens=1)])
            recompute.append(engine.stats.calls[0].seconds)
            kv = engine.kv
        pages, fresh = list(range(1, num_pages + 1)), list(range(cap + 1, cap + num_pages + 1))
        out_s, in_s = [], []
        for _ in range(args.repeats + 1):
            t = time.perf_counter()
            copied = jax.block_until_ready(gather_pages(kv, pages))
            out_s.append(time.perf_counter() - t)
            t = time.perf_counter()
            kv = scatter_pages(kv, fresh, copied)
            kv.k.block_until_ready()
            in_s.append(time.perf_counter() - t)
        r, o, i = min(recompute[1:]), min(out_s[1:]), min(in_s[1:])
        rows.append({
            "part": "c", "page_size": page_size, "tokens": n, "pages": num_pages,
            "kv_mb": round(2 * kv.k[:, :, :num_pages].nbytes / 2**20, 1),
            "recompute_ms": round(1e3 * r, 1), "swap_out_ms": round(1e3 * o, 1), "swap_in_ms": round(1e3 * i, 1),
            "swap_over_recompute": round((o + i) / r, 2),
        })
    return rows


def part_d(paged_model, model, requests, args) -> list[dict]:
    rows = []
    max_len = max(len(r.prompt_ids) + r.max_new_tokens for r in requests)
    for page_size in args.page_sizes:
        small = max(args.pressure_tokens, -(-max_len // page_size) * page_size)
        _, base_out, base = serve(paged_model, model, requests, page_size=page_size, kv_tokens=args.kv_tokens,
                                  max_seqs=args.max_seqs, max_seq_len=max_len, enable_prefix_caching=False)
        for mode in ("recompute", "swap"):
            st, out, wall = serve(paged_model, model, requests, page_size=page_size, kv_tokens=small,
                                  max_seqs=args.max_seqs, max_seq_len=max_len, preemption_mode=mode,
                                  enable_prefix_caching=False)
            same = sum(out[i].output_ids == base_out[i].output_ids for i in out)
            rows.append({
                "part": "d", "page_size": page_size, "mode": mode, "pool_tokens": small,
                "preemptions": st.preemptions, "recomputed_tokens": st.recomputed_tokens,
                "swapped_pages": st.swapped_out_pages + st.swapped_in_pages, "wall_s": round(wall, 2),
                "unpressured_s": round(base, 2), "difference_s": round(wall - base, 2),
                "same_outputs": f"{same}/{len(out)}",
            })
    return rows


def write(out: pathlib.Path, tables: dict[str, list[dict]], titles: dict[str, str], note: str,
          record: provenance.Provenance) -> None:
    """Writes ``sharing.md`` (the tables with their notes), ``sharing.csv``
    (every row, with its ``part``), both with ``record``'s provenance
    block, and, with part (b), ``sharing.png``."""
    md = "# Sharing pages: prefix caching, parallel sampling, beam search, swap\n\n" + note + "\n"
    for part, rows in tables.items():
        md += "\n## " + titles[part] + "\n\n" + markdown(rows) + "\n\n" + NOTES[part] + "\n"
    fields = list(dict.fromkeys(k for rows in tables.values() for r in rows for k in r))
    write_table(out, "sharing", [r for rows in tables.values() for r in rows], fields, md, record)
    if "b" in tables:
        plot(out / "sharing.png", tables["b"])
    print(f"wrote {out / 'sharing.md'}, sharing.csv" + (", sharing.png" if "b" in tables else ""))


def markdown(rows: list[dict]) -> str:
    """One part's table; the ``part`` column is its heading's."""
    return markdown_table(rows, [c for c in rows[0] if c != "part"])


def plot(path: pathlib.Path, rows_b: list[dict]) -> None:
    # Imported here: matplotlib is for this figure alone, and slow to import.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, kind in enumerate(("parallel sampling", "beam search")):
        sel = [r for r in rows_b if r["mode"] == kind]
        x = np.arange(len(sel)) + i * 4
        ax.bar(x, [float(r["saving"].rstrip("%")) for r in sel], color=f"C{i}", label=kind)
        for xi, r in zip(x, sel):
            ax.text(xi, 0.5, str(r["k"]), ha="center", color="white")
    ax.set_xticks([1, 5], ["parallel sampling (n)", "beam search (width)"])
    ax.set_ylabel("KV memory saved by sharing (%)")
    ax.set_title("SmolLM2-135M on ShareGPT (cf. paper Figs. 15, 17)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.memory.sharing", description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="abcd", help="which parts to run, any of a, b, c, d (default abcd)")
    add_flag(p, "num_requests", default=12, help="ShareGPT requests per run (default %(default)s)")
    add_flag(p, "max_output_len", default=64)
    p.add_argument("--system-tokens", type=int, default=1000, help="(a) system prompt length (default 1000)")
    p.add_argument("--kv-tokens", type=int, default=16384,
                   help="KV pool of (a), (b) and the unpressured runs of (d), tokens (default 16384)")
    p.add_argument("--pressure-tokens", type=int, default=2048,
                   help="(d) KV pool that forces preemption, tokens (default 2048)")
    p.add_argument("--page-sizes", type=int, nargs="+", default=list(PAGE_SIZES), help="(c, d) page sizes")
    p.add_argument("--preempt-tokens", type=int, default=1024, help="(c) tokens of the preempted sequence")
    p.add_argument("--repeats", type=int, default=3, help="(c) timed repeats; the fastest counts (default 3)")
    add_flags(p, "max_seqs", "out")
    add_compile_cache_args(p)
    args = p.parse_args(argv)
    if not args.parts or set(args.parts) - set("abcd"):
        p.error(f"--parts must be letters among a, b, c, d, got {args.parts!r}")
    check_flags(p, args)
    require_positive(p, args, "system_tokens", "kv_tokens", "pressure_tokens", "preempt_tokens", "repeats")
    if any(s < 1 for s in args.page_sizes):
        p.error(f"--page-sizes must be >= 1, got {args.page_sizes}")
    check_outputs(p, args)
    return args


def main(argv=None) -> dict[str, list[dict]]:
    args = parse_args(argv)
    record = provenance.collect("experiments.memory.sharing", argv, seeds=SEEDS)
    print(f"machine: {machine()}")
    print(setup_compile_cache(args))
    model, tokenizer = load_smollm2()
    requests, prompts, _ = build_requests(tokenizer, args.num_requests, args.max_output_len,
                                          seed=SEEDS["sharegpt_shuffle"])
    paged_model = RaggedModel(model)
    tables = {}
    titles = {
        "a": f"(a) A shared system prompt before {len(requests)} requests: prefix caching off vs on",
        "b": "(b) KV memory saved by sharing: parallel sampling and beam search (paper Figs. 15, 17)",
        "c": f"(c) The cost of one preemption of a {args.preempt_tokens}-token sequence: recompute vs swap, by "
             "page size (paper Fig. 19a)",
        "d": "(d) End to end under a pool that preempts: recompute vs swap, by page size (paper Fig. 19b)",
    }
    for part in args.parts:
        print(f"part {part} ...", flush=True)
        if part == "a":
            tables["a"] = part_a(paged_model, model, tokenizer, requests, prompts, args)
        elif part == "b":
            tables["b"] = part_b(paged_model, model, requests, args)
        elif part == "c":
            tables["c"] = part_c(paged_model, model, args)
        else:
            tables["d"] = part_d(paged_model, model, requests, args)
        print("\n" + titles[part] + "\n\n" + markdown(tables[part]) + "\n", flush=True)
    note = (f"{len(requests)} ShareGPT requests (vLLM's sampling), outputs capped at {args.max_output_len} tokens, "
            f"EOS ignored; SmolLM2-135M-Instruct, f32; {machine()}.")
    write(args.out, tables, {p: titles[p] for p in tables}, note, record)
    return tables


if __name__ == "__main__":
    main()
