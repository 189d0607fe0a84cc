"""Online serving benchmark: requests arriving over time, vLLM's ``bench serve`` in process.

ShareGPT requests arrive as a Poisson process at ``--request-rate``
requests per second (a gamma process with ``--burstiness``; ``inf`` sends
them all at once), the same arrival times on every run of a ``--seed``.
The engine is driven on its own clock in this process: add every request
whose arrival has passed, step if there is work, else sleep until the next
arrival. Per request: arrival, first token, every token's time, finish.

Reported, as vLLM reports them: throughput (requests, output tokens, all
tokens per second), TTFT, TPOT, inter-token latency and end-to-end latency
(mean, p50, p90, p99), goodput under ``--goodput`` SLOs; and the paper's
normalized latency (end-to-end latency / output tokens, averaged; Kwon et
al., SOSP 2023, section 6.1) and mean running requests (its Figure 13).

``--policy`` compares KV reservation policies on the same engine: ``paged``
(vLLM) and the paper's Orca baselines, which reserve at admission 2,048
tokens per request (``max``), its prompt plus its true output length
rounded up to a power of two (``pow2``) or plus exactly its true output
length (``oracle``). Every policy and rate runs on a
fresh engine of one model object, after a warm-up that compiles every
program they can need, so no compilation falls inside a timed run (the
``compiled`` column checks it).

The model and data are ``serve_sharegpt``'s: ``--model smollm2`` (the
default), a Hugging Face checkpoint folder, or a random-weight preset
serving the packaged ShareGPT lengths; ``--model toy`` is a two-layer
decoder for smoke runs. Requests are greedy, ignore EOS and keep their true
ShareGPT output lengths, capped at ``--max-output-len``; the KV budget is
the demo's 8,192 tokens, so memory binds.

Writes ``<name>.md`` and ``<name>.csv`` (one row per policy and rate),
``<name>_requests.csv`` (every request's times) and, with several finite
rates, ``<name>.png`` (normalized latency against rate) to ``--out``.

``--backend http`` sends the same requests, at the same arrival times, to
an OpenAI-compatible server instead (``python -m server``, at
``--base-url``): token-id prompts through streamed ``/v1/completions`` with
exact ``max_tokens`` and ``ignore_eos``, every token timed when its chunk
reaches the client (:mod:`experiments.lib.http_backend`), the same tables. The
server's engine is whatever it was started with (start it with the same
``--max-seqs``, KV budget and model, e.g. ``python -m server --model
smollm2 --max-seqs 64 --kv-tokens 8192``): ``--policy`` is ``paged`` only,
a warm-up over HTTP compiles its programs first (its ``/metrics`` count
what compiles during each timed run: the ``compiled`` column), and its
prefix cache is reset before each run (``POST /reset_prefix_cache``).

Checked before anything loads (argparse errors naming the flag;
:mod:`experiments.lib.preflight`): a ``--workload`` whose requests run more
sequences than ``--max-seqs``; a ``--kv-budget-tokens`` whose pool and
weights need more memory than the device has (from the model's config,
not its weights); with ``--backend http``, a ``--base-url`` where no server
answers ``/health`` within a few seconds (a trailing ``/v1``, as OpenAI
clients take it, is dropped), a key it refuses, a ``--served-model`` it
does not list, an empty ``--api-key``. Before the warm-up, every request:
in process against every policy's engine (its length, its sequences
against the pool), over HTTP against the server's ``max_model_len``.

``--profile DIR`` (in process) serves the requests once more after the
timed runs, untimed, at the lowest rate with the first policy, and writes a
``jax.profiler`` trace of ``--profile-steps`` steps after the first
``--profile-skip`` (:mod:`paged_jax.profiling`); with ``--backend http``
it is refused: the engine runs in the server (``python -m server --profile
DIR``).

Usage: ``python -m experiments.serving.bench_serving --request-rate 0.5 1 2 --policy paged max``;
``python -m experiments.serving.bench_serving --backend http --base-url http://127.0.0.1:8000 --request-rate 1 inf``
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import re
import sys
import time

from experiments.lib import http_backend, latency, online, preflight, provenance
from experiments.lib.cli import (
    add_compile_cache_args,
    add_flag,
    check_outputs,
    machine,
    resolve_dtype,
    resolve_kv_dtype,
    setup_compile_cache,
)
from experiments.lib.tables import markdown_table, write_table
from paged_jax.profiling import ProfileSpec, add_profile_args, check_profile_args, report_trace

PROG = "python -m experiments.serving.bench_serving"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    online.add_serving_flags(p, num_requests=32, max_output_len=48, speculative=True)
    p.add_argument("--request-rate", type=float, nargs="+", default=[1.0],
                   help="requests per second, one run each; inf sends all at once (default 1)")
    p.add_argument("--policy", nargs="+", choices=online.ALL_POLICIES, default=["paged"],
                   help="KV reservation policies to compare (default paged): paged (vLLM), max, pow2, oracle "
                        "(the paper's Orca baselines, buddy-allocated; '-firstfit' or '-pages' for another "
                        "allocator, '-nocache' without prefix caching)", metavar="POLICY")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:2000 tpot:200 e2el:20000 (milliseconds)")
    p.add_argument("--workload", default="basic",
                   help="basic (default), parallel-N (N samples at temperature 1) or beam-W (beam width W)")
    p.add_argument("--name", default="bench_serving", help="stem of the files written (default %(default)s)")
    p.add_argument("--backend", choices=("inprocess", "http"), default="inprocess",
                   help="inprocess (default): drive the engine in this process; http: send the requests to a "
                        "running OpenAI-compatible server (python -m server) at --base-url")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="the server's root URL; a trailing /v1, as OpenAI clients take it, is dropped (--backend "
                        "http; default %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("PAGED_JAX_API_KEY"),
                   help="the server's API key (--backend http; default $PAGED_JAX_API_KEY)")
    p.add_argument("--served-model", default=None,
                   help="the model name to send (--backend http; default the first of the server's /v1/models)")
    add_flag(p, "out")
    add_compile_cache_args(p)
    add_profile_args(p)
    args = p.parse_args(argv)
    online.check_serving_flags(p, args)
    check_profile_args(p, args)
    args.request_rate = online.check_rates(p, "--request-rate", args.request_rate)
    try:
        args.slos = latency.parse_goodput(args.goodput)
    except ValueError as e:
        p.error(f"--goodput: {e}")
    try:
        args.workload_ = online.workload(args.workload)
    except ValueError as e:
        p.error(f"--workload: {e}")
    if len(set(args.policy)) != len(args.policy):
        p.error(f"--policy: each policy once, got {' '.join(args.policy)}")
    preflight.check_workload_fits(p, args.workload_, args.max_seqs)
    if args.api_key == "":
        p.error("--api-key must not be empty (leave it out for a server without a key)")
    if args.backend == "http":
        if args.kv_dtype is not None:
            p.error("--backend http: the K/V dtype is the server's setting (python -m server --kv-dtype)")
        if args.profile is not None:
            p.error("--profile traces this process's engine steps, and with --backend http the engine runs in the "
                    "server: profile the server process (python -m server --profile DIR) instead")
        if args.policy != ["paged"]:
            p.error(f"--backend http: the server's engine has one policy (paged); got --policy {' '.join(args.policy)}")
        if args.workload.startswith("beam"):
            p.error("--backend http: beam search is not an OpenAI completion option; use --backend inprocess")
        if args.no_prefix_caching:
            p.error("--backend http: prefix caching is the server's setting (python -m server --no-prefix-caching)")
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", args.name):
        p.error(f"--name must be a file stem of letters, digits, '_', '.' and '-' (the files land in --out), "
                f"got {args.name!r}")
    check_outputs(p, args)
    _preflight(p, args)
    return args


def _preflight(p: argparse.ArgumentParser, args) -> None:
    """The checks that read something (a model's config, a server's
    answers), after the flags' own: an argparse error naming the flag for a
    KV pool the machine cannot hold (in process), or a server that is not
    there, refuses the key or does not serve ``--served-model`` (http; sets
    ``args.served``, a :class:`experiments.lib.preflight.ServedModel`)."""
    if args.backend == "http":
        try:
            args.base_url = preflight.server_root(args.base_url)
            args.served = preflight.probe_server(args.base_url, api_key=args.api_key, model=args.served_model)
        except ValueError as e:
            p.error(str(e))
        return
    try:
        config = preflight.model_config(args.model)
    except (OSError, ValueError) as e:
        p.error(f"--model {args.model!r}: {e}")
    preflight.check_kv_budget(p, "--kv-budget-tokens", args.kv_budget_tokens, args.page_size, config,
                              kv_dtype=resolve_kv_dtype(args.kv_dtype), weight_dtype=resolve_dtype(args.dtype))


def main(argv=None) -> list[online.OnlineResult]:
    args = parse_args(argv)
    record = provenance.collect("experiments.serving.bench_serving", argv,
                                seeds={"sharegpt_shuffle": args.seed, "arrivals": args.seed})
    if args.backend == "http":
        model_name, requests, setup, results = run_over_http(args)
    else:
        print(setup_compile_cache(args))
        model_name, requests, spec, setup = online.load_setup(args)
        requests = args.workload_.apply(requests)
        try:  # every request against every policy's engine: a refusal now, not after the warm-up
            preflight.check_requests(spec.build, args.policy, requests)
        except ValueError as e:
            raise SystemExit(f"{PROG}: error: {e}") from None
        print(setup)
        print(online.warm_up_line(spec, args.workload_))
        results = []
        for rate in args.request_rate:  # policies interleaved at each rate: they see the machine in the same state
            for policy in args.policy:
                result = online.serve_online(spec.build, requests, policy=policy, request_rate=rate,
                                             burstiness=args.burstiness, seed=args.seed, slos=args.slos,
                                             progress=True)
                print(online.report(result))
                results.append(result)
        profile_run(ProfileSpec.from_args(args), spec, requests, args)
    write_results(args, record, model_name, requests, setup, results)
    return results


def profile_run(profile: ProfileSpec | None, spec: online.EngineSpec, requests: list, args) -> int:
    """``--profile``: serves the requests once more, untimed (tracing slows
    the steps it traces, so no table row reads this run), at the lowest
    ``--request-rate`` with the first ``--policy``, tracing steps
    ``[skip, skip + steps)`` into ``--profile``. Returns the steps traced
    (0 without ``--profile``, or when the run ended first)."""
    if profile is None:
        return 0
    policy, rate = args.policy[0], args.request_rate[0]
    print(f"\nprofiling: {policy} at {rate:g} req/s once more, untimed, tracing steps {profile.skip}-"
          f"{profile.skip + profile.steps - 1}")
    arrivals = latency.arrival_times(len(requests), rate, burstiness=args.burstiness, seed=args.seed)
    started = time.time()
    with profile.wrap(spec.build(policy)) as stepper:
        online.run_online(stepper, requests, arrivals)
    print(f"{stepper.traced} steps traced; {report_trace(profile, started)}")
    return stepper.traced


def run_over_http(args) -> tuple[str, list, str, list[online.OnlineResult]]:
    """``--backend http``: ``(model name, requests, setup line, one result
    per rate)`` from the server at ``--base-url``."""
    max_len = args.served.max_model_len
    target = http_backend.Target(base_url=args.base_url, model=args.served.name, api_key=args.api_key)
    tokenizer, vocab_size, model_name = http_backend.tokenizer_for(args.model)
    requests, source = args.workload_.requests(tokenizer, vocab_size=vocab_size, num_requests=args.num_requests,
                                               max_output_len=args.max_output_len, seed=args.seed)
    requests = args.workload_.apply(requests)
    try:  # the server would refuse them in the timed run, after the warm-up
        preflight.check_lengths(requests, max_len)
    except ValueError as e:
        raise SystemExit(f"{PROG}: error: {e}") from None
    setup = (f"{model_name} served over HTTP at {args.base_url} (model {target.model!r}, max_model_len {max_len}); "
             f"{len(requests)} requests ({source}): {sum(len(r.prompt_ids) for r in requests)} prompt tokens, "
             f"{sum(r.max_new_tokens for r in requests)} output tokens (true lengths capped at "
             f"{args.max_output_len}, EOS ignored); streamed /v1/completions, one client task per request; "
             f"{machine()} (the client's)")
    print(setup)
    batches = online.warmup_batches(max_batched_tokens=max(args.max_batched_tokens, args.max_seqs),
                                    max_seqs=args.max_seqs, max_seq_len=max_len, vocab_size=vocab_size)
    counts = http_backend.warm_up_http(target, [args.workload_.apply(b) for b in batches])
    print(f"warm-up over HTTP (for --max-seqs {args.max_seqs}, --max-batched-tokens {args.max_batched_tokens}): "
          f"the server compiled or loaded {counts.requests} programs in {counts.seconds:.1f} s")
    results = []
    for rate in args.request_rate:
        asyncio.run(http_backend.reset_prefix_cache(target))
        arrivals = latency.arrival_times(len(requests), rate, burstiness=args.burstiness, seed=args.seed)
        run, before, after = http_backend.run_http(target, requests, arrivals, progress=True)
        # Preemptions are the server's to count: per request they are not visible to a client.
        metrics = dataclasses.replace(run.metrics(args.slos), preemptions=int(after.preemptions - before.preemptions))
        result = online.OnlineResult(policy="paged", request_rate=float(rate), burstiness=float(args.burstiness),
                                     metrics=metrics, run=run, compiles=after.since(before))
        print(online.report(result))
        results.append(result)
    return model_name, requests, setup, results


def write_results(args, record, model_name: str, requests: list, setup: str,
                  results: list[online.OnlineResult]) -> None:
    """The tables (and, with several finite rates, the figure) of a run."""
    rows = [r.row() for r in results]
    columns = [c for c in online.SUMMARY_COLUMNS if c != "goodput" or args.slos]
    table = markdown_table(rows, columns, cell=online.cell)
    slo_line = ("SLOs for goodput: " + ", ".join(f"{k} <= {v:g} ms" for k, v in args.slos.items()) + ". "
                if args.slos else "")
    clock = ("Times are the client's: from each request's due time to its chunks' arrival over HTTP; "
             "mean_running samples the server's running sequences from its /metrics every "
             f"{http_backend.SAMPLE_EVERY_S:g} s. " if args.backend == "http" else "")
    notes = (f"{setup}.\n\nArrivals: gamma process, burstiness {args.burstiness:g} "
             f"({'Poisson' if args.burstiness == 1 else 'not Poisson'}), seed {args.seed}; workload: "
             f"{args.workload_.description}. Latencies count from each request's arrival in the trace; times in "
             f"ms, normalized latency in seconds per output token; mean_running: time-weighted mean of running "
             f"sequences. {clock}{slo_line}The CSV has every column (p50, p90, p99 of each latency); "
             f"`{args.name}_requests.csv` every request.\n\n"
             f"Programs compiled inside timed runs: {sum(r.compiles.requests for r in results)} (0 means "
             f"compilation stayed in the warm-up).")
    title = f"# Online serving{' over HTTP' if args.backend == 'http' else ''}: {model_name}"
    text = f"{title}\n\n{table}\n\n{notes}"
    finite = [r for r in results if math.isfinite(r.request_rate)]
    if len({r.request_rate for r in finite}) > 1:
        png = args.out / f"{args.name}.png"
        series = {p: ([r.request_rate for r in finite if r.policy == p],
                      [r.metrics.normalized_latency for r in finite if r.policy == p]) for p in args.policy}
        online.plot_latency_vs_rate(png, series, threshold=None, title=f"{model_name}: {len(requests)} requests")
        text += f"\n\n![normalized latency against request rate]({png.name})"
        print(f"wrote {png}")
    md, csv = write_table(args.out, args.name, rows, online.METRIC_COLUMNS, text, record)
    provenance.write_csv(args.out / f"{args.name}_requests.csv", [row for r in results for row in r.request_rows()],
                         online.REQUEST_COLUMNS, record)
    print(f"\n{table}\n\nwrote {md}, {csv} and {args.out / (args.name + '_requests.csv')}")


if __name__ == "__main__":
    main(sys.argv[1:])
