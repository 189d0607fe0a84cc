"""The server's cost: the demo's requests served over HTTP and in process,
on the same model object, shapes and compiled programs, in one run.

The demo's setting (``experiments.serve_sharegpt``): SmolLM2-135M, 48
ShareGPT requests with outputs capped at 48 tokens (EOS ignored, greedy),
an 8,192-token KV pool of 16-token pages, at most 64 running, 256 tokens
per model call. The server (:mod:`server`) runs in this process, uvicorn
in a thread on a free loopback port; its engine is warmed up
(:func:`experiments.online.warm_up`, on its loop's thread) before anything
is timed, and every engine below shares its compiled programs.

Two measurements, each HTTP against in process:

- ``load``: all requests at once (rate inf). Over HTTP, one streaming
  client task per request (:mod:`experiments.http_backend`), in this
  process too, so the clients' work is part of what is measured. In
  process: :func:`experiments.online.run_online` on a fresh engine, twice:
  with the server's tokenizer attached (the engine detokenizes every token,
  as the server's does: the difference to HTTP is then the HTTP layer
  alone) and without (as ``bench_serving`` runs). Throughput is output
  tokens over the run; TTFT counts from the request's due time.
- ``idle``: ``--idle-requests`` requests one at a time (4 output tokens
  each), so TTFT holds no queueing: the per-request overhead of HTTP
  (client, JSON, the loop's hand-offs) against in process. Each request is
  served in process and then over HTTP, back to back, and the overhead is
  the median of their differences: on a shared machine whose speed drifts
  by tens of percent between runs, only paired measurements show a few
  milliseconds.

Every run starts with an empty prefix cache. Greedy outputs are compared
with the detokenizing in-process run's.

Writes ``server_vs_inprocess.md`` and ``.csv`` to ``--out``. Targets (the
issue's): HTTP at least 90% of in-process tokens/s, TTFT p50 overhead at
most 20 ms.

Usage: ``python -m experiments.bench_http [--num-requests 48] [--repeats 1]``
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

from experiments import http_backend, online, provenance, serving
from experiments.cli import (
    add_compile_cache_args, add_flag, add_flags, check_flags, check_outputs, machine, setup_compile_cache,
)
from experiments.latency import compute_metrics
from experiments.sharegpt import MAX_SEQ_LEN, build_requests
from experiments.tables import markdown_table, write_table
from models.llm import LLM
from server import ThreadedServer, build_app

KV_TOKENS = 8192
PAGE_SIZE = 16
MAX_SEQS = 64
MAX_BATCHED_TOKENS = 256
IDLE_TOKENS = 4
"""Output tokens of each ``idle`` request (TTFT is what is measured)."""

COLUMNS = ("repeat", "phase", "backend", "requests", "output_tokens", "duration_s", "tokens_per_s", "p50_ttft_ms",
           "mean_ttft_ms", "p90_ttft_ms", "p50_itl_ms", "same_outputs")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.bench_http", description=__doc__.split("\n\n")[0])
    add_flags(p, "num_requests", "max_output_len", "seed")
    p.add_argument("--idle-requests", type=int, default=8,
                   help="requests sent one at a time for the idle TTFT (default %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="times to repeat every measurement, interleaved (default %(default)s)")
    add_flag(p, "out")
    add_compile_cache_args(p)
    args = p.parse_args(argv)
    check_flags(p, args)
    for name in ("idle_requests", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.idle_requests > args.num_requests:
        p.error(f"--idle-requests {args.idle_requests} exceeds --num-requests {args.num_requests}")
    check_outputs(p, args)
    return args


def row(repeat: int, phase: str, backend: str, run: online.OnlineRun, same: str) -> dict:
    m = compute_metrics(run.records, duration_s=run.duration_s)
    ttft = np.array([r.ttft for r in run.records]) * 1e3
    return {"repeat": repeat, "phase": phase, "backend": backend, "requests": m.completed,
            "output_tokens": m.output_tokens, "duration_s": round(m.duration_s, 3),
            "tokens_per_s": round(m.output_throughput, 2), "p50_ttft_ms": round(float(np.median(ttft)), 2),
            "mean_ttft_ms": round(float(ttft.mean()), 2), "p90_ttft_ms": round(float(np.percentile(ttft, 90)), 2),
            "p50_itl_ms": None if m.itl is None else round(m.itl.p50 * 1e3, 2), "same_outputs": same}


def joined(runs: list[online.OnlineRun]) -> online.OnlineRun:
    """Runs made one after another as one run (durations summed)."""
    records = [rec for run in runs for rec in run.records]
    return online.OnlineRun(outputs=[o for run in runs for o in run.outputs], records=records, start_s=0.0,
                            end_s=sum(run.duration_s for run in runs), running_times=[0.0], running_counts=[0])


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    record = provenance.collect("experiments.bench_http", argv, seeds={"sharegpt_shuffle": args.seed})
    print(f"machine: {machine()}")
    print(setup_compile_cache(args))
    t0 = time.perf_counter()
    model, tokenizer, model_name = serving.load_model("smollm2", jnp.float32)
    requests, _, report = build_requests(tokenizer, args.num_requests, args.max_output_len, seed=args.seed)
    idle = [dataclasses.replace(r, max_new_tokens=IDLE_TOKENS) for r in requests[: args.idle_requests]]
    llm = LLM((model, tokenizer), dtype=jnp.float32, kv_tokens=KV_TOKENS, page_size=PAGE_SIZE, max_seqs=MAX_SEQS,
              max_seq_len=MAX_SEQ_LEN, max_num_batched_tokens=MAX_BATCHED_TOKENS)
    app = build_app(llm, model_name="smollm2")
    loop = app.state.engine_loop
    setup = (f"{model_name}, f32; {len(requests)} ShareGPT requests ({report.records} conversations recovered, "
             f"seed {args.seed}): {sum(len(r.prompt_ids) for r in requests)} prompt tokens, "
             f"{sum(r.max_new_tokens for r in requests)} output tokens (capped at {args.max_output_len}, EOS "
             f"ignored, greedy); KV {KV_TOKENS} tokens, page size {PAGE_SIZE}, max {MAX_SEQS} running, "
             f"{MAX_BATCHED_TOKENS} tokens per call; {machine()}")
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {setup}")

    def fresh_engine(detokenize: bool):
        return serving.make_engine(model, kv_tokens=KV_TOKENS, page_size=PAGE_SIZE, max_seqs=MAX_SEQS,
                                   max_seq_len=MAX_SEQ_LEN, max_batched_tokens=MAX_BATCHED_TOKENS,
                                   paged_model=llm.engine.model, stop_ids=tokenizer.stop_ids,
                                   tokenizer=tokenizer if detokenize else None)

    def in_process(reqs, detokenize: bool) -> online.OnlineRun:
        return online.run_online(fresh_engine(detokenize), reqs, np.zeros(len(reqs)))

    rows = []
    load_before = os.getloadavg()[0]  # the machine is shared: say how busy it was
    with ThreadedServer(app) as srv:
        target = http_backend.Target(base_url=srv.url, model="smollm2")
        t0 = time.perf_counter()
        counts = loop.call(lambda engine: online.warm_up(engine)).result()
        print(f"warm-up: {counts.requests} programs compiled or loaded in {time.perf_counter() - t0:.1f} s; "
              f"serving at {srv.url}")

        server_ttft: dict[str, list[float]] = {"load": [], "idle": []}  # the server's own mean TTFT per run
        paired: list[float] = []  # idle: HTTP TTFT - in-process TTFT of the same request, served back to back

        def over_http(reqs, phase: str) -> online.OnlineRun:
            loop.call(lambda engine: engine.reset_prefix_cache()).result()
            # One request alone: no /metrics sampling, whose scrapes would compete with it for the 2 cores.
            run, before, after = http_backend.run_http(target, reqs, np.zeros(len(reqs)),
                                                       sample_running=phase == "load")
            if after.compilations != before.compilations:
                print(f"  note: the server compiled {after.compilations - before.compilations:g} programs in this run")
            server_ttft[phase] += [after.mean_ttft_since(before)] * len(reqs)
            return run

        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}/{args.repeats}: load (all {len(requests)} at once)")
            base = in_process(requests, detokenize=True)
            want = [o.output_ids for o in base.outputs]
            runs = {"in-process, detokenized": base, "http": over_http(requests, "load"),
                    "in-process": in_process(requests, detokenize=False)}
            for name, run in runs.items():
                same = sum(o.output_ids == w for o, w in zip(run.outputs, want))
                rows.append(row(repeat, "load", name, run, f"{same}/{len(want)}"))
                print(f"  {name}: {rows[-1]['tokens_per_s']} tokens/s, TTFT p50 {rows[-1]['p50_ttft_ms']} ms")
            print(f"repeat {repeat + 1}/{args.repeats}: idle ({len(idle)} requests one at a time)")
            engine = fresh_engine(detokenize=True)

            def alone(r):  # each request finds an empty prefix cache, as over_http resets the server's
                engine.reset_prefix_cache()
                return online.run_online(engine, [r], [0.0])

            pairs = [(alone(r), over_http([r], "idle")) for r in idle]  # interleaved: both see the same moment
            paired += [h.records[0].ttft - b.records[0].ttft for b, h in pairs]
            base, http = joined([b for b, _ in pairs]), joined([h for _, h in pairs])
            want = [o.output_ids for o in base.outputs]
            for name, run in (("in-process, detokenized", base), ("http", http)):
                same = sum(o.output_ids == w for o, w in zip(run.outputs, want))
                rows.append(row(repeat, "idle", name, run, f"{same}/{len(want)}"))
                print(f"  {name}: TTFT p50 {rows[-1]['p50_ttft_ms']} ms")

    summary = summarize(rows, server_ttft, paired)
    setup += (f"; load average (1 min) {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
              f"(2 cores; this run alone keeps about 2 busy, more means other processes shared them)")
    table = markdown_table(rows, COLUMNS)
    text = (f"# The server's cost: HTTP against in process\n\n{table}\n\n{summary}\n\n{setup}.\n\n"
            "`load`: every request at once (rate inf), one streaming HTTP client per request in the same process "
            "as the server; in process, the same engine shapes and programs driven directly, with the server's "
            "detokenizer attached (`in-process, detokenized`) and without (`in-process`, as bench_serving). "
            f"`idle`: {len(idle)} requests one at a time, {IDLE_TOKENS} output tokens each. TTFT counts from "
            "each request's due time (over HTTP, the client's send); tokens_per_s: output tokens over the run. "
            "`same_outputs`: greedy outputs equal to the detokenized in-process run's. Every run starts with an "
            "empty prefix cache.")
    print(f"\n{table}\n\n{summary}")
    md, csv = write_table(args.out, "server_vs_inprocess", rows, COLUMNS, text, record)
    print(f"wrote {md} and {csv}")
    return rows


def summarize(rows: list[dict], server_ttft: dict[str, list[float]], paired: list[float]) -> str:
    """The ratios against the targets: throughputs as the median over
    repeats of HTTP's against the in-process run's of the same repeat;
    the idle TTFT overhead as the median of ``paired`` (seconds: each idle
    request over HTTP less the same request in process, served back to
    back, so that the machine's drift cancels); and, within the HTTP runs
    themselves, the clients' mean TTFT against the server's (from admission
    by the engine: what HTTP adds, free of run-to-run noise)."""
    def mean(phase, backend, key):
        return float(np.mean([r[key] for r in rows if r["phase"] == phase and r["backend"] == backend]))

    def in_run(phase):  # ms: client mean TTFT - server mean TTFT over the same HTTP requests
        return mean(phase, "http", "mean_ttft_ms") - 1e3 * float(np.mean(server_ttft[phase]))

    def ratios(other):  # HTTP / other tokens/s, one per repeat (adjacent runs see the machine alike)
        by = {(r["repeat"], r["backend"]): r["tokens_per_s"] for r in rows if r["phase"] == "load"}
        return [by[k, "http"] / by[k, other] for k in sorted({k for k, _ in by})]

    detok, plain = ratios("in-process, detokenized"), ratios("in-process")

    def shown(xs):
        return f"{np.median(xs):.3f}x" + (f" (repeats: {', '.join(f'{x:.3f}' for x in xs)})" if len(xs) > 1 else "")

    load_over = mean("load", "http", "p50_ttft_ms") - mean("load", "in-process, detokenized", "p50_ttft_ms")  # p50s
    idle_over = 1e3 * float(np.median(paired))
    return (f"HTTP / in process (detokenized): throughput {shown(detok)}, median over repeats (target >= 0.90: "
            f"{'met' if np.median(detok) >= 0.9 else 'NOT met'}); HTTP / in process without detokenization: "
            f"{shown(plain)}. TTFT overhead: idle, the median over requests of HTTP less in process served "
            f"back to back, {idle_over:+.1f} ms (target <= 20 ms: "
            f"{'met' if idle_over <= 20 else 'NOT met'}); under load (difference of p50s) {load_over:+.1f} ms "
            "(queueing and run-to-run noise dominate there). Within the HTTP runs, the clients' mean TTFT less "
            f"the server's own (engine clock, from admission): idle {in_run('idle'):+.1f} ms, under load "
            f"{in_run('load'):+.1f} ms.")


if __name__ == "__main__":
    main(sys.argv[1:])
