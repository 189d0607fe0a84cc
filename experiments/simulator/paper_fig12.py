"""Figure 12 at the paper's scale on the simulated accelerator: OPT-13B on
an A100-40GB serving ShareGPT (PagedAttention, Kwon et al., SOSP 2023,
section 6.2, Figure 12a; Figure 13a's batched requests beside it).

The engine is this project's (:class:`paged_jax.simulator.engine.SimulatedEngine`:
the same scheduler, KV manager, page state, reservation policies and buddy
allocator), its model calls timed by a roofline
(:class:`paged_jax.simulator.step_time.RooflineStepTime`) of ``--model`` on
``--device``, with efficiencies assumed or fitted to a step profile of that
device (``--efficiency-profile``). The requests are the 1,000 packaged
ShareGPT requests (vLLM's sampling rules: prompts <= 1,024 tokens, prompt
plus output <= 2,048), each with its true output length, EOS ignored, as the
paper's runs; Poisson arrivals, the same trace stretched to each rate.

Defaults follow the paper: the KV pool of its Table 1 for OPT-13B on an
A100-40GB (12 GB, 15.7K slots), pages of 16 tokens, up to 256 sequences
and 2,560 tokens per call (vLLM's defaults of the time), and the four
policies: paged (vLLM), Orca Max, Pow2 and Oracle with the buddy allocator,
plus Orca Oracle page-backed (``oracle-pages``: the kinder Orca, without
external fragmentation or the buddy's rounding), to count what the
allocator adds. Each policy's sustained rate is where its normalized
latency crosses ``--latency-threshold`` (default 1.5x paged's lowest,
Figure 12's rule here).

Writes ``paper_fig12.{md,csv,png}`` to ``--out``.

Usage: ``python -m experiments.simulator.paper_fig12 [--device a100-40gb] [--model opt-13b] [--rates ...]``
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

from experiments.lib import online, provenance
from experiments.lib.cli import add_flag, add_flags, check_flags, check_outputs
from experiments.lib.latency import arrival_times
from experiments.lib.policies import ALL_POLICIES, PAPER_FIG12, PAPER_FIG13, POLICY_LABELS, engine_options
from experiments.lib.serving import engine_config
from experiments.lib.sharegpt import PACKAGED_LIMIT, packaged_requests
from experiments.lib.tables import markdown_table, write_table
from paged_jax.simulator.engine import SimulatedEngine
from paged_jax.simulator.hardware import DEVICES, MODELS, get_device, get_model
from paged_jax.simulator.step_time import RooflineStepTime, profile_rows

PROG = "python -m experiments.simulator.paper_fig12"
PAPER_KV_TOKENS = {("opt-13b", "a100-40gb"): 15_700}
"""The paper's Table 1: KV cache slots of its server configurations."""
MEMORY_UTILIZATION = 0.9
"""Without the paper's figure: the KV pool is this share of device memory
less the weights (vLLM's ``gpu_memory_utilization``)."""
COLUMNS = ("policy", "request_rate", "normalized_latency_s", "ttft_p50_s", "tpot_p50_s", "mean_running",
           "peak_running", "preemptions", "fragmentation_blocked_requests", "external_fragmentation",
           "simulated_s", "wall_s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="opt-13b", help="model shape (default opt-13b)")
    p.add_argument("--device", choices=sorted(DEVICES), default="a100-40gb", help="device (default a100-40gb)")
    p.add_argument("--efficiency-profile", type=pathlib.Path, default=None,
                   help="a step profile's CSV from this device (python -m experiments.simulator.profile_steps) to "
                        "fit the roofline's efficiencies to; default assumed ones (stated in the table)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV pool, tokens (default the paper's Table 1 figure where it has one, else "
                        f"{MEMORY_UTILIZATION:g} of device memory less the weights)")
    p.add_argument("--num-requests", type=int, default=PACKAGED_LIMIT,
                   help=f"ShareGPT requests per run (default and at most {PACKAGED_LIMIT})")
    p.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0],
                   help="request rates, requests per second (default 0.25 to 5)")
    p.add_argument("--policy", nargs="+", choices=ALL_POLICIES, metavar="POLICY",
                   default=["paged", "max", "pow2", "oracle", "oracle-pages"],
                   help="policies (default paged max pow2 oracle oracle-pages); paged is always run, first")
    add_flags(p, "page_size", "max_seqs")
    add_flag(p, "seed", help="arrival seed (and of the packaged requests' random ids; default 0)")
    p.set_defaults(max_seqs=256)
    p.add_argument("--max-batched-tokens", type=int, default=2560, help="tokens per call (default 2560)")
    p.add_argument("--latency-threshold", type=float, default=None,
                   help="normalized latency (s/token) a sustained rate stays under (default 1.5x paged's lowest)")
    add_flag(p, "out")
    args = p.parse_args(argv)
    check_flags(p, args)
    if not 1 <= args.num_requests <= PACKAGED_LIMIT:
        p.error(f"--num-requests must be in [1, {PACKAGED_LIMIT}], got {args.num_requests}")
    args.rates = online.check_rates(p, "--rates", args.rates)
    if any(math.isinf(r) for r in args.rates):
        p.error("--rates must be finite")
    for flag in ("kv_tokens", "max_batched_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.latency_threshold is not None and not (math.isfinite(args.latency_threshold)
                                                   and args.latency_threshold > 0):
        p.error(f"--latency-threshold must be a finite number > 0, got {args.latency_threshold}")
    if args.efficiency_profile is not None and not args.efficiency_profile.is_file():
        p.error(f"--efficiency-profile {args.efficiency_profile}: no such file")
    args.policy = ["paged"] + [x for x in dict.fromkeys(args.policy) if x != "paged"]
    check_outputs(p, args)
    return args


def kv_tokens(model, device, override: int | None) -> tuple[int, str]:
    """The pool's tokens and where the number comes from."""
    if override is not None:
        return override, "--kv-tokens"
    paper = PAPER_KV_TOKENS.get((model.name, device.name))
    if paper is not None:
        return paper, "the paper's Table 1"
    free = MEMORY_UTILIZATION * device.memory_bytes - model.weight_bytes("bfloat16")
    if free < 2048 * model.kv_bytes_per_token("bfloat16"):
        raise ValueError(f"{model.name} on {device.name}: {free / 1e9:.1f} GB left for K/V after the weights, "
                         "less than one 2,048-token sequence; pick a larger device or pass --kv-tokens")
    return int(free // model.kv_bytes_per_token("bfloat16")), f"{MEMORY_UTILIZATION:g} of memory less the weights"


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    record = provenance.collect(PROG, argv, seeds={"arrivals": args.seed})
    model, device = get_model(args.model), get_device(args.device)
    step_time = RooflineStepTime(model=model, device=device)
    if args.efficiency_profile is not None:
        step_time = step_time.fitted(*profile_rows(provenance.read_csv(args.efficiency_profile)[1]),
                                     source=f"fitted to {args.efficiency_profile}")
    tokens, tokens_source = kv_tokens(model, device, args.kv_tokens)
    num_pages = tokens // args.page_size + 1
    requests = packaged_requests(args.num_requests, 2048, vocab_size=model.vocab_size, seed=args.seed)
    rows, runs = [], {}
    for policy in args.policy:
        for rate in args.rates:
            config = engine_config(max_seqs=args.max_seqs, max_batched_tokens=args.max_batched_tokens,
                                   **engine_options(policy))
            engine = SimulatedEngine(step_time, config, num_pages=num_pages, page_size=args.page_size,
                                     vocab_size=model.vocab_size)
            t0 = time.perf_counter()
            run = online.run_online(engine, requests, arrival_times(len(requests), rate, seed=args.seed))
            wall = time.perf_counter() - t0
            m = run.metrics()
            runs[policy, rate] = m
            st = engine.stats
            rows.append({"policy": policy, "request_rate": rate,
                         "normalized_latency_s": round(m.normalized_latency, 4),
                         "ttft_p50_s": round(m.ttft.p50, 3), "tpot_p50_s": round(m.tpot.p50, 4),
                         "mean_running": round(m.mean_running, 2), "peak_running": m.peak_running,
                         "preemptions": st.preemptions,
                         "fragmentation_blocked_requests": st.fragmentation_blocked_requests,
                         "external_fragmentation": round(st.external_fragmentation, 4),
                         "simulated_s": round(run.duration_s, 1), "wall_s": round(wall, 1)})
            print(f"{POLICY_LABELS[policy]:>28} at {rate:5.2f} req/s: normalized latency "
                  f"{m.normalized_latency:.3f} s/token, {m.mean_running:.1f} running; {run.duration_s:.0f} s "
                  f"simulated in {wall:.1f} s", flush=True)
    threshold = args.latency_threshold or round(1.5 * min(runs["paged", r].normalized_latency for r in args.rates), 4)
    sustained = {p: online.sustained_rate(args.rates, [runs[p, r].normalized_latency for r in args.rates], threshold)
                 for p in args.policy}
    fig13_rate = min(args.rates, key=lambda r: abs(r - 2.0))
    summary = [{"policy": POLICY_LABELS[p], "sustained": str(sustained[p]),
                "ratio": "-" if p == "paged" else online.ratio(sustained["paged"], sustained[p]),
                "paper": "-" if p == "paged" else PAPER_FIG12.get(engine_options(p)["reservation"], "-")
                if engine_options(p)["allocator"] != "pages" else "-",
                "running": f"{runs[p, fig13_rate].mean_running:.2f}",
                "paper_running": f"{PAPER_FIG13[engine_options(p)['reservation']]:.2f}"
                if engine_options(p)["allocator"] != "pages" else "-",
                "blocked": max(r["fragmentation_blocked_requests"] for r in rows if r["policy"] == p)}
               for p in args.policy]
    table = markdown_table(summary, ("policy", "sustained", "ratio", "paper", "running", "paper_running", "blocked"),
                           headers=["policy", "highest rate sustained (req/s)", "paged / policy",
                                    "paper: vLLM / policy", f"mean running at {fig13_rate:g} req/s",
                                    "paper Figure 13a (2 req/s)", "requests blocked by fragmentation (most, a run)"])
    curves = markdown_table(
        [{"request_rate": r, **{p: f"{runs[p, r].normalized_latency:.3f}" for p in args.policy}} for r in args.rates],
        ("request_rate", *args.policy), headers=["request rate (req/s)", *(POLICY_LABELS[p] for p in args.policy)])
    png = pathlib.Path(args.out) / "paper_fig12.png"
    online.plot_latency_vs_rate(png, {POLICY_LABELS[p]: (args.rates, [runs[p, r].normalized_latency
                                                                      for r in args.rates]) for p in args.policy},
                                threshold=threshold, title=f"Figure 12, simulated: {model.name} on {device.name}")
    wall = [r["wall_s"] for r in rows]
    sim_per_wall = sum(r["simulated_s"] for r in rows) / sum(wall)
    text = (f"# Figure 12 at the paper's scale, simulated: {model.name} on {device.name}, ShareGPT\n\n"
            f"![normalized latency against request rate](paper_fig12.png)\n\n{table}\n\n"
            f"Normalized latency (s/token) against request rate:\n\n{curves}\n\n"
            f"Step time: {step_time.name} ({model.source}; {device.source}); efficiencies: "
            f"{step_time.flops_efficiency:.3g} of peak FLOP/s, {step_time.bandwidth_efficiency:.3g} of HBM bandwidth, "
            f"{step_time.overhead_s * 1e3:.2f} ms per call ({step_time.efficiency_source}). KV pool "
            f"{tokens:,} tokens ({tokens_source}), pages of {args.page_size}, up to {args.max_seqs} sequences and "
            f"{args.max_batched_tokens} tokens per call. {len(requests)} packaged ShareGPT requests "
            f"({sum(len(r.prompt_ids) for r in requests) / len(requests):.0f} prompt and "
            f"{sum(r.max_new_tokens for r in requests) / len(requests):.0f} output tokens on average, SmolLM2's "
            "tokenizer: the paper's OPT tokenizer counts within a few percent of it), their true output lengths, "
            f"EOS ignored; Poisson arrivals, seed {args.seed}. Latency threshold {threshold:g} s/token. "
            f"Every point ran {len(requests)} requests: {max(wall):.1f} s of wall time at most, "
            f"{sim_per_wall:.0f} simulated seconds per wall second over the run, which took "
            f"{time.perf_counter() - t_start:.0f} s in all. The CSV has every run.")
    md, csv = write_table(args.out, "paper_fig12", rows, COLUMNS, text, record)
    print(f"\n{table}\n\nwrote {md}, {csv}, {png} in {time.perf_counter() - t_start:.0f} s")
    return {"rows": rows, "sustained": sustained, "summary": summary}


if __name__ == "__main__":
    main(sys.argv[1:])
