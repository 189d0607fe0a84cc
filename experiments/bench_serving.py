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

Usage: ``python -m experiments.bench_serving --request-rate 0.5 1 2 --policy paged max``
"""

from __future__ import annotations

import argparse
import math
import re
import sys

from experiments import latency, online, provenance
from experiments.cli import add_compile_cache_args, add_flag, check_outputs, setup_compile_cache
from experiments.tables import markdown_table, write_table


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.bench_serving", description=__doc__.split("\n\n")[0])
    online.add_serving_flags(p, num_requests=32, max_output_len=48)
    p.add_argument("--request-rate", type=float, nargs="+", default=[1.0],
                   help="requests per second, one run each; inf sends all at once (default 1)")
    p.add_argument("--policy", nargs="+", choices=online.POLICIES, default=["paged"],
                   help="KV reservation policies to compare (default paged): paged (vLLM), max, pow2, oracle "
                        "(the paper's Orca baselines)")
    p.add_argument("--goodput", nargs="+", default=[], metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:2000 tpot:200 e2el:20000 (milliseconds)")
    p.add_argument("--workload", default="basic",
                   help="basic (default), parallel-N (N samples at temperature 1) or beam-W (beam width W)")
    p.add_argument("--name", default="bench_serving", help="stem of the files written (default %(default)s)")
    add_flag(p, "out")
    add_compile_cache_args(p)
    args = p.parse_args(argv)
    online.check_serving_flags(p, args)
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
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", args.name):
        p.error(f"--name must be a file stem of letters, digits, '_', '.' and '-' (the files land in --out), "
                f"got {args.name!r}")
    check_outputs(p, args)
    return args


def main(argv=None) -> list[online.OnlineResult]:
    args = parse_args(argv)
    record = provenance.collect("experiments.bench_serving", argv,
                                seeds={"sharegpt_shuffle": args.seed, "arrivals": args.seed})
    print(setup_compile_cache(args))
    model_name, requests, spec, setup = online.load_setup(args)
    requests = args.workload_.apply(requests)
    print(setup)
    print(online.warm_up_line(spec, args.workload_))
    results = []
    for rate in args.request_rate:  # policies interleaved at each rate: they see the machine in the same state
        for policy in args.policy:
            result = online.serve_online(spec.build, requests, policy=policy, request_rate=rate,
                                         burstiness=args.burstiness, seed=args.seed, slos=args.slos, progress=True)
            print(online.report(result))
            results.append(result)

    rows = [r.row() for r in results]
    columns = [c for c in online.SUMMARY_COLUMNS if c != "goodput" or args.slos]
    table = markdown_table(rows, columns, cell=online.cell)
    slo_line = ("SLOs for goodput: " + ", ".join(f"{k} <= {v:g} ms" for k, v in args.slos.items()) + ". "
                if args.slos else "")
    notes = (f"{setup}.\n\nArrivals: gamma process, burstiness {args.burstiness:g} "
             f"({'Poisson' if args.burstiness == 1 else 'not Poisson'}), seed {args.seed}; workload: "
             f"{args.workload_.description}. Latencies count from each request's arrival in the trace; times in "
             f"ms, normalized latency in seconds per output token; mean_running: time-weighted mean of running "
             f"sequences. {slo_line}The CSV has every column (p50, p90, p99 of each latency); "
             f"`{args.name}_requests.csv` every request.\n\n"
             f"Programs compiled inside timed runs: {sum(r.compiles.requests for r in results)} (0 means "
             f"compilation stayed in the warm-up).")
    text = f"# Online serving: {model_name}\n\n{table}\n\n{notes}"
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
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
