"""The server's cost: the demo's requests served over HTTP and in process,
on the same model object, shapes and compiled programs, in one run.

The demo's setting (``experiments.serving.serve_sharegpt``): SmolLM2-135M, 48
ShareGPT requests with outputs capped at 48 tokens (EOS ignored, greedy),
an 8,192-token KV pool of 16-token pages, at most 64 running, 256 tokens
per model call (``--model toy``: a two-layer random decoder, for smoke
runs). The server (:mod:`server`) runs in this process, uvicorn
in a thread on a free loopback port; its engine is warmed up
(:func:`experiments.lib.online.warm_up`, on its loop's thread) before anything
is timed, and every engine below shares its compiled programs.

Two measurements, each HTTP against in process:

- ``load``: all requests at once (rate inf). Over HTTP, one streaming
  client task per request (:mod:`experiments.lib.http_backend`), in a child
  process (:class:`experiments.lib.http_backend.ClientProcess`; ``--clients
  thread`` puts them in this process, the server's, as before), whose CPU
  seconds the table reports. In process:
  :func:`experiments.lib.online.run_online` on a fresh engine, three times:
  with the server's tokenizer attached (the engine detokenizes every token,
  as the server's does: the difference to HTTP is then the HTTP layer
  alone), without (as ``bench_serving`` runs), and replayed: with the
  tokenizer, each request due at the moment the server's engine loop
  admitted it in the HTTP run just before, in that order, its TTFT counted
  from then. Throughput is output tokens over the run; TTFT counts from the
  request's due time.
- ``idle``: ``--idle-requests`` requests one at a time (4 output tokens
  each), so TTFT holds no queueing: the per-request overhead of HTTP
  (client, JSON, the loop's hand-offs) against in process. Each request is
  served in process and then over HTTP, back to back, and the overhead is
  the median of their differences: on a shared machine whose speed drifts
  by tens of percent between runs, only paired measurements show a few
  milliseconds.

Where the HTTP requests' time goes: the server records per-request
timestamps (:mod:`server.timing`) that the clients' send and receive times
join on one clock; the report gives each gap's median, mean and p90.

TTFT overhead under load, compared two ways. Raw: HTTP's p50 less the p50
of in process with every request added before the first step. Fair: against
the replayed run, which starts each request when the server admitted it,
in the server's order, so the difference is what the server adds to a
request from its send (intake before admission, the loop's hand-offs, the
stream's delivery, and the engine's slowdown beside the event loop), and
not the arrival order, which alone moves a p50 by more than a step:
requests' prompt lengths differ, and FCFS prefill serves them in the order
they came. Both are given, as the difference of p50s and, fair, as the
median over requests of each HTTP TTFT less its replayed one.

Every run starts with an empty prefix cache. Greedy outputs are compared
with the detokenizing in-process run's.

Writes ``server_vs_inprocess.md`` and ``.csv`` to ``--out``. Targets (the
issue's): HTTP at least 90% of in-process tokens/s, TTFT p50 overhead at
most 20 ms.

Usage: ``python -m experiments.serving.bench_http [--num-requests 48] [--repeats 1]``
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

from experiments.lib import http_backend, online, provenance, serving
from experiments.lib.cli import (
    add_compile_cache_args,
    add_flag,
    add_flags,
    check_flags,
    check_outputs,
    machine,
    setup_compile_cache,
)
from experiments.lib.latency import compute_metrics
from experiments.lib.sharegpt import MAX_SEQ_LEN, build_requests, packaged_requests
from experiments.lib.tables import markdown_table, write_table
from models.llm import LLM
from server import ThreadedServer, build_app, timing

KV_TOKENS = 8192
PAGE_SIZE = 16
MAX_SEQS = 64
MAX_BATCHED_TOKENS = 256
IDLE_TOKENS = 4
"""Output tokens of each ``idle`` request (TTFT is what is measured)."""

COLUMNS = ("repeat", "phase", "backend", "requests", "output_tokens", "duration_s", "tokens_per_s", "p50_ttft_ms",
           "mean_ttft_ms", "p90_ttft_ms", "p50_itl_ms", "same_outputs", "server_cpu_s", "client_cpu_s")
REPLAYED = "in-process, replayed"
"""The load row driven at the HTTP run's admission times (the fair TTFT comparison)."""

POINTS = ("sent", *timing.STAGES, "received")
"""A request's path, client and server: the client's send, the server's
stages (:data:`server.timing.STAGES`), the first token's arrival at the
client."""
GAP_COLUMNS = ("phase", "from", "to", "requests", "p50_ms", "mean_ms", "p90_ms")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.serving.bench_http", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("smollm2", "toy"), default="smollm2",
                   help="smollm2 (the demo's), or toy (a two-layer random decoder on the packaged ShareGPT lengths, "
                        "no tokenizer: a smoke run in seconds) (default %(default)s)")
    add_flags(p, "num_requests", "max_output_len", "seed")
    add_flag(p, "max_seqs", default=MAX_SEQS)
    p.add_argument("--max-batched-tokens", type=int, default=MAX_BATCHED_TOKENS,
                   help="tokens per model call (default %(default)s; raised to --max-seqs)")
    p.add_argument("--idle-requests", type=int, default=8,
                   help="requests sent one at a time for the idle TTFT (default %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="times to repeat every measurement, interleaved (default %(default)s)")
    p.add_argument("--clients", choices=("process", "thread"), default="process",
                   help="where the streaming clients run: a child process (default), or a thread of this process, "
                        "the server's (their CPU then counts as the server's)")
    add_flag(p, "out")
    add_compile_cache_args(p)
    args = p.parse_args(argv)
    check_flags(p, args)
    for name in ("idle_requests", "repeats", "max_batched_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.idle_requests > args.num_requests:
        p.error(f"--idle-requests {args.idle_requests} exceeds --num-requests {args.num_requests}")
    check_outputs(p, args)
    return args


def row(repeat: int, phase: str, backend: str, run: online.OnlineRun, same: str, server_cpu_s: float,
        client_cpu_s: float | None = None) -> dict:
    m = compute_metrics(run.records, duration_s=run.duration_s)
    ttft = np.array([r.ttft for r in run.records]) * 1e3
    return {"repeat": repeat, "phase": phase, "backend": backend, "requests": m.completed,
            "output_tokens": m.output_tokens, "duration_s": round(m.duration_s, 3),
            "tokens_per_s": round(m.output_throughput, 2), "p50_ttft_ms": round(float(np.median(ttft)), 2),
            "mean_ttft_ms": round(float(ttft.mean()), 2), "p90_ttft_ms": round(float(np.percentile(ttft, 90)), 2),
            "p50_itl_ms": None if m.itl is None else round(m.itl.p50 * 1e3, 2), "same_outputs": same,
            "server_cpu_s": round(server_cpu_s, 2),
            "client_cpu_s": None if client_cpu_s is None else round(client_cpu_s, 2)}


def joined(runs: list[online.OnlineRun]) -> online.OnlineRun:
    """Runs made one after another as one run (durations summed)."""
    records = [rec for run in runs for rec in run.records]
    return online.OnlineRun(outputs=[o for run in runs for o in run.outputs], records=records, start_s=0.0,
                            end_s=sum(run.duration_s for run in runs), running_times=[0.0], running_counts=[0])


def request_points(http: http_backend.HttpRun, records: list[timing.RequestTimes]) -> list[dict[str, float] | None]:
    """Each request's :data:`POINTS` (``time.perf_counter()`` seconds, one
    clock for the clients' process and the server's), in the order of the
    run's requests: the client's send and first chunk, and the server's
    stamps of the same response (matched by its id); None for a request
    whose server record is missing or incomplete."""
    by_response = {}
    for rec in records:
        if rec.complete and rec.request_ids:
            by_response[str(rec.request_ids[0]).rsplit("-", 1)[0]] = rec
    points = []
    for out, rid in zip(http.run.outputs, http.response_ids):
        rec = by_response.get(rid)
        points.append(None if rec is None else {"sent": http.t0 + out.arrival_s, **rec.stamps,
                                                "received": http.t0 + out.first_token_s})
    return points


def gap_rows(phase: str, points: list[dict[str, float] | None]) -> list[dict]:
    """Per consecutive pair of :data:`POINTS`: p50, mean and p90 over the
    requests of the time between them, ms, and the whole TTFT last (the
    means add up to its mean; medians do not add)."""
    full = [p for p in points if p is not None]
    if not full:
        return []
    rows = []
    for a, b in [*zip(POINTS, POINTS[1:]), (POINTS[0], POINTS[-1])]:
        ms = np.array([p[b] - p[a] for p in full]) * 1e3
        rows.append({"phase": phase, "from": a, "to": b, "requests": len(full),
                     "p50_ms": round(float(np.median(ms)), 2), "mean_ms": round(float(ms.mean()), 2),
                     "p90_ms": round(float(np.percentile(ms, 90)), 2)})
    return rows


def arrival_spread(points: list[dict[str, float] | None]) -> str:
    """How the requests of one run reached the server: for ``sent``,
    ``entry``, ``submitted`` and ``added``, the last request's time less the
    first's, ms; and how many were added to the engine with the first
    (before its first step)."""
    full = [p for p in points if p is not None]
    spans = {k: 1e3 * (max(p[k] for p in full) - min(p[k] for p in full)) for k in ("sent", "entry", "submitted",
                                                                                  "added")}
    first = min(p["added"] for p in full)
    together = sum(p["added"] - first < 1e-3 for p in full)  # one drain of the loop's queue stamps within µs
    return ", ".join(f"{k} {v:.0f} ms" for k, v in spans.items()) + f" ({together} added with the first)"


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    record = provenance.collect("experiments.serving.bench_http", argv, seeds={"sharegpt_shuffle": args.seed})
    print(f"machine: {machine()}")
    print(setup_compile_cache(args))
    clients = http_backend.ClientProcess() if args.clients == "process" else None  # imports while we load
    try:
        return _main(args, record, clients)
    finally:
        if clients is not None:
            clients.close()


def _main(args, record, clients: http_backend.ClientProcess | None) -> list[dict]:
    t0 = time.perf_counter()
    model, tokenizer, model_name = online.load_model(args.model, jnp.float32)
    if tokenizer is None:
        requests = packaged_requests(args.num_requests, args.max_output_len, vocab_size=model.config.vocab_size,
                                     seed=args.seed)
        source = "packaged ShareGPT lengths, random ids"
    else:
        requests, _, report = build_requests(tokenizer, args.num_requests, args.max_output_len, seed=args.seed)
        source = f"{report.records} conversations recovered, seed {args.seed}"
    idle = [dataclasses.replace(r, max_new_tokens=IDLE_TOKENS) for r in requests[: args.idle_requests]]
    max_seqs, max_tokens = args.max_seqs, max(args.max_batched_tokens, args.max_seqs)
    llm = LLM((model, tokenizer), dtype=jnp.float32, kv_tokens=KV_TOKENS, page_size=PAGE_SIZE, max_seqs=max_seqs,
              max_seq_len=MAX_SEQ_LEN, max_num_batched_tokens=max_tokens)
    timer = timing.TimingRecorder()
    app = build_app(llm, model_name=args.model, timing=timer)
    loop = app.state.engine_loop
    setup = (f"{model_name}, f32; {len(requests)} ShareGPT requests ({source}): "
             f"{sum(len(r.prompt_ids) for r in requests)} prompt tokens, "
             f"{sum(r.max_new_tokens for r in requests)} output tokens (capped at {args.max_output_len}, EOS "
             f"ignored, greedy); KV {KV_TOKENS} tokens, page size {PAGE_SIZE}, max {max_seqs} running, "
             f"{max_tokens} tokens per call; {machine()}")
    print(f"loaded in {time.perf_counter() - t0:.1f} s; {setup}")

    def fresh_engine(detokenize: bool):
        return serving.make_engine(model, kv_tokens=KV_TOKENS, page_size=PAGE_SIZE, max_seqs=max_seqs,
                                   max_seq_len=MAX_SEQ_LEN, max_batched_tokens=max_tokens,
                                   paged_model=llm.engine.model, stop_ids=tokenizer.stop_ids if tokenizer else (),
                                   tokenizer=tokenizer if detokenize else None)

    def in_process(reqs, detokenize: bool, arrivals=None) -> tuple[online.OnlineRun, float]:
        engine = fresh_engine(detokenize)
        cpu = time.process_time()
        run = online.run_online(engine, reqs, np.zeros(len(reqs)) if arrivals is None else arrivals)
        return run, time.process_time() - cpu

    rows: list[dict] = []
    spreads: list[str] = []  # per load run: how the requests reached the server
    gaps: dict[str, list] = {"load": [], "idle": []}  # each request's POINTS, per phase
    load_before = os.getloadavg()[0]  # the machine is shared: say how busy it was
    with ThreadedServer(app) as srv:
        target = http_backend.Target(base_url=srv.url, model=args.model)
        t0 = time.perf_counter()
        counts = loop.call(lambda engine: online.warm_up(engine)).result()
        print(f"warm-up: {counts.requests} programs compiled or loaded in {time.perf_counter() - t0:.1f} s; "
              f"serving at {srv.url}; clients in {'a child process' if clients else 'this process'}")

        server_ttft: dict[str, list[float]] = {"load": [], "idle": []}  # the server's own mean TTFT per run
        paired: dict[str, list[float]] = {"idle": [], "load": []}  # HTTP TTFT - in-process TTFT, same request

        def over_http(reqs, phase: str) -> tuple[http_backend.HttpRun, float, list]:
            """The run, the server process' CPU seconds in it, each request's POINTS."""
            loop.call(lambda engine: engine.reset_prefix_cache()).result()
            timer.take()
            # One request alone: no /metrics sampling, whose scrapes would compete with it for the 2 cores.
            cpu = time.process_time()
            if clients is not None:
                http = clients.run(target, reqs, np.zeros(len(reqs)), sample_running=phase == "load")
            else:
                http = asyncio.run(http_backend.measure_http_async(target, reqs, np.zeros(len(reqs)),
                                                                   sample_running=phase == "load"))
            cpu = time.process_time() - cpu
            if http.after.compilations != http.before.compilations:
                print(f"  note: the server compiled {http.after.compilations - http.before.compilations:g} programs "
                      "in this run")
            server_ttft[phase] += [http.after.mean_ttft_since(http.before)] * len(reqs)
            points = request_points(http, timer.take())
            gaps[phase] += points
            return http, cpu, points

        for repeat in range(args.repeats):
            print(f"repeat {repeat + 1}/{args.repeats}: load (all {len(requests)} at once)")
            base, base_cpu = in_process(requests, detokenize=True)
            want = [o.output_ids for o in base.outputs]
            http, http_cpu, points = over_http(requests, "load")
            spreads.append(arrival_spread(points))
            print(f"  first to last request, over HTTP: {spreads[-1]}")
            # The fair run: in process, each request due when the server admitted it (in that order).
            admitted = np.array([np.nan if p is None else p["added"] - http.t0 for p in points])
            if np.isnan(admitted).any():
                raise RuntimeError(f"the server recorded no admission for {int(np.isnan(admitted).sum())} requests")
            order = np.argsort(admitted, kind="stable")
            replay, replay_cpu = in_process([requests[i] for i in order], detokenize=True, arrivals=admitted[order])
            replay = reordered(replay, [r.request_id for r in requests])
            paired["load"] += [h.ttft - b.ttft for h, b in zip(http.run.records, replay.records)]
            plain, plain_cpu = in_process(requests, detokenize=False)
            runs = {"in-process, detokenized": (base, base_cpu, None),
                    "http": (http.run, http_cpu, http.client_cpu_s if clients else None),
                    REPLAYED: (replay, replay_cpu, None), "in-process": (plain, plain_cpu, None)}
            for name, (run, cpu, client_cpu) in runs.items():
                same = sum(o.output_ids == w for o, w in zip(run.outputs, want))
                rows.append(row(repeat, "load", name, run, f"{same}/{len(want)}", cpu, client_cpu))
                print(f"  {name}: {rows[-1]['tokens_per_s']} tokens/s, TTFT p50 {rows[-1]['p50_ttft_ms']} ms, "
                      f"CPU s: {rows[-1]['server_cpu_s']} here, {rows[-1]['client_cpu_s']} in the clients")
            print(f"repeat {repeat + 1}/{args.repeats}: idle ({len(idle)} requests one at a time)")
            engine = fresh_engine(detokenize=True)

            def alone(r):  # each request finds an empty prefix cache, as over_http resets the server's
                engine.reset_prefix_cache()
                cpu = time.process_time()
                return online.run_online(engine, [r], [0.0]), time.process_time() - cpu

            pairs = [(alone(r), over_http([r], "idle")) for r in idle]  # interleaved: both see the same moment
            paired["idle"] += [h.run.records[0].ttft - b.records[0].ttft for (b, _), (h, _, _) in pairs]
            base = joined([b for (b, _), _ in pairs])
            http_run = joined([h.run for _, (h, _, _) in pairs])
            want = [o.output_ids for o in base.outputs]
            cpus = {"in-process, detokenized": (sum(c for (_, c), _ in pairs), None),
                    "http": (sum(c for _, (_, c, _) in pairs),
                             sum(h.client_cpu_s for _, (h, _, _) in pairs) if clients else None)}
            for name, run in (("in-process, detokenized", base), ("http", http_run)):
                same = sum(o.output_ids == w for o, w in zip(run.outputs, want))
                rows.append(row(repeat, "idle", name, run, f"{same}/{len(want)}", *cpus[name]))
                print(f"  {name}: TTFT p50 {rows[-1]['p50_ttft_ms']} ms")

    breakdown = [r for phase in ("load", "idle") for r in gap_rows(phase, gaps[phase])]
    summary = summarize(rows, server_ttft, paired)
    setup += (f"; load average (1 min) {load_before:.1f} at the start, {os.getloadavg()[0]:.1f} at the end "
              f"(2 cores; this run alone keeps about 2 busy, more means other processes shared them)")
    table = markdown_table(rows, COLUMNS)
    gap_table = markdown_table(breakdown, GAP_COLUMNS)
    where = "in a child process" if clients else "in the server's process (threads)"
    text = (f"# The server's cost: HTTP against in process\n\n{table}\n\n{summary}\n\n{setup}.\n\n"
            f"`load`: every request at once (rate inf), one streaming HTTP client per request, the clients {where}; "
            "in process, the same engine shapes and programs driven directly, with the server's detokenizer "
            "attached (`in-process, detokenized`) and without (`in-process`, as bench_serving); "
            f"`{REPLAYED}`: in process with the server's detokenizer, each request due at the moment the server's "
            "engine loop admitted it in the HTTP run just before, in that order, its TTFT counted from then. "
            f"`idle`: {len(idle)} requests one at a time, {IDLE_TOKENS} output tokens each. TTFT counts from "
            "each request's due time (over HTTP, the client's send); tokens_per_s: output tokens over the run. "
            "`same_outputs`: greedy outputs equal to the detokenized in-process run's. `server_cpu_s`: CPU "
            "seconds of this process during the run (over HTTP: the server, with the clients too when they are "
            "threads); `client_cpu_s`: the clients' process. Every run starts with an empty prefix cache.\n\n"
            "## Where a request's time goes over HTTP\n\n"
            f"{gap_table}\n\n"
            "Per request, between consecutive points of its path (the last line: the whole TTFT), over every "
            "repeat: `sent` (the client's send), `entry` (the route handler starts), `parsed` (body read and "
            "validated), `submitted` (tokenized, checked, on the engine loop's queue), `added` (in the engine), "
            "`first_token` (the end of the step that made it), `delivered` (on the request's asyncio queue), "
            "`first_chunk` (its event written), `received` (the client has it). One clock "
            "(`time.perf_counter`, CLOCK_MONOTONIC) for both processes. Means add up to the TTFT's mean; "
            "medians do not add. Under load, the last request less the first, per repeat: "
            + "; ".join(spreads) + ".")
    print(f"\n{table}\n\n{gap_table}\n\n{summary}")
    md, csv = write_table(args.out, "server_vs_inprocess", rows, COLUMNS, text, record)
    print(f"wrote {md} and {csv}")
    return rows


def reordered(run: online.OnlineRun, order: list) -> online.OnlineRun:
    """``run`` with its outputs and records in the order of the request ids ``order``."""
    out_of = {o.request_id: o for o in run.outputs}
    rec_of = {r.request_id: r for r in run.records}
    return dataclasses.replace(run, outputs=[out_of[i] for i in order], records=[rec_of[i] for i in order])


def summarize(rows: list[dict], server_ttft: dict[str, list[float]], paired: dict[str, list[float]]) -> str:
    """The ratios against the targets: throughputs as the median over
    repeats of HTTP's against the in-process run's of the same repeat;
    the idle TTFT overhead as the median of ``paired["idle"]`` (seconds:
    each idle request over HTTP less the same request in process, served
    back to back, so that the machine's drift cancels); under load, the
    raw difference of p50s (HTTP against all requests added at once) and
    the fair ones, against the run replaying the server's admissions (the
    difference of p50s, and the median of ``paired["load"]``, each request
    over HTTP less itself replayed); and, within the HTTP runs themselves,
    the clients' mean TTFT against the server's (from admission by the
    engine)."""
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

    def verdict(ms):
        return "met" if ms <= 20 else "NOT met"

    raw = mean("load", "http", "p50_ttft_ms") - mean("load", "in-process, detokenized", "p50_ttft_ms")
    fair = mean("load", "http", "p50_ttft_ms") - mean("load", REPLAYED, "p50_ttft_ms")
    fair_paired = 1e3 * float(np.median(paired["load"]))
    idle_over = 1e3 * float(np.median(paired["idle"]))
    return (f"HTTP / in process (detokenized): throughput {shown(detok)}, median over repeats (target >= 0.90: "
            f"{'met' if np.median(detok) >= 0.9 else 'NOT met'}); HTTP / in process without detokenization: "
            f"{shown(plain)}. TTFT overhead: idle, the median over requests of HTTP less in process served "
            f"back to back, {idle_over:+.1f} ms (target <= 20 ms: {verdict(idle_over)}). Under load: raw, the "
            f"difference of p50s against in process with every request added at once, {raw:+.1f} ms "
            f"({verdict(raw)}); fair, against in process replaying the server's admission times and order "
            f"(`{REPLAYED}`), the difference of p50s {fair:+.1f} ms ({verdict(fair)}) and the median over "
            f"requests of HTTP less the same request replayed {fair_paired:+.1f} ms ({verdict(fair_paired)}). "
            "Within the HTTP runs, the clients' mean TTFT less the server's own (engine clock, from admission): "
            f"idle {in_run('idle'):+.1f} ms, under load {in_run('load'):+.1f} ms.")


if __name__ == "__main__":
    main(sys.argv[1:])
