"""Figure 12 at the paper's scale on the simulated accelerator: OPT-13B on
one A100-40GB, OPT-66B on four, OPT-175B on eight A100-80GB, serving
ShareGPT (PagedAttention, Kwon et al., SOSP 2023, section 6.2, Figure 12a-c;
Figure 13a's batched requests beside it).

The engine is this project's (:class:`paged_jax.simulator.engine.SimulatedEngine`:
the same scheduler, KV manager, page state, reservation policies and buddy
allocator), its model calls timed by a roofline
(:class:`paged_jax.simulator.step_time.RooflineStepTime`) of the model on
its devices in tensor parallelism (``--setup``, the paper's Table 1
servers; or ``--model``, ``--device``, ``--num-devices``), with efficiencies
assumed or fitted to a step profile of that device
(``--efficiency-profile``). The requests are the 1,000 packaged
ShareGPT requests (vLLM's sampling rules: prompts <= 1,024 tokens, prompt
plus output <= 2,048), each with its true output length, EOS ignored, as the
paper's runs; Poisson arrivals, the same trace stretched to each rate.

Defaults follow the paper: the KV pool is its Table 1's K/V memory for the
setup (12 GiB for OPT-13B, 21 GiB for OPT-66B, 264 GiB for OPT-175B) over
the model's K/V bytes per token (15.7K, 9.6K and 60.1K tokens; the paper
says 15.7K, 9.7K and 60.1K), pages of 16 tokens, up to 256 sequences
and 2,560 tokens per call (vLLM's defaults of the time), and the four
policies: paged (vLLM), Orca Max, Pow2 and Oracle with the buddy allocator,
plus Orca Oracle page-backed (``oracle-pages``: the kinder Orca, without
external fragmentation or the buddy's rounding), to count what the
allocator adds. Each policy's sustained rate is where its normalized
latency crosses ``--latency-threshold`` (default 1.5x paged's lowest,
Figure 12's rule here).

Writes ``paper_fig12_<setup>.{md,csv,png}`` to ``--out`` (``paper_fig12_custom``
where ``--model``, ``--device`` or ``--num-devices`` change the setup).

Usage: ``python -m experiments.simulator.paper_fig12 [--setup 13b|66b|175b] [--rates ...]``
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
import time

from experiments.lib import online, provenance
from experiments.lib.cli import add_flag, add_flags, check_flags, check_outputs
from experiments.lib.latency import arrival_times
from experiments.lib.policies import ALL_POLICIES, PAPER_FIG12, PAPER_FIG13, POLICY_LABELS, engine_options
from experiments.lib.serving import engine_config, simulated_setup
from experiments.lib.sharegpt import MAX_SEQ_LEN, PACKAGED_LIMIT
from experiments.lib.tables import markdown_table, write_table
from paged_jax.simulator.engine import SimulatedEngine
from paged_jax.simulator.hardware import DEVICES, MODELS, kv_pool_tokens

PROG = "python -m experiments.simulator.paper_fig12"
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class PaperSetup:
    """One server of the paper's Table 1 and the rates its Figure 12 panel sweeps here."""

    model: str
    device: str
    num_devices: int
    kv_bytes: int
    paper_kv_tokens: int
    rates: tuple


PAPER_SETUPS = {
    "13b": PaperSetup("opt-13b", "a100-40gb", 1, 12 * GIB, 15_700,
                      (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)),
    "66b": PaperSetup("opt-66b", "a100-40gb", 4, 21 * GIB, 9_700,
                      (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)),
    "175b": PaperSetup("opt-175b", "a100-80gb", 8, 264 * GIB, 60_100, (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0)),
}
"""The paper's Table 1 (section 6.1): model, GPUs, K/V memory and KV cache slots."""
MEMORY_UTILIZATION = 0.9
"""Without the paper's figure: the KV pool is this share of device memory
less the weights (vLLM's ``gpu_memory_utilization``)."""
COLUMNS = ("policy", "request_rate", "normalized_latency_s", "ttft_p50_s", "tpot_p50_s", "mean_running",
           "peak_running", "preemptions", "fragmentation_blocked_requests", "external_fragmentation",
           "simulated_s", "wall_s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", choices=sorted(PAPER_SETUPS, key=len), default="13b",
                   help="the paper's server (Table 1): 13b (OPT-13B, one A100-40GB), 66b (OPT-66B, four), 175b "
                        "(OPT-175B, eight A100-80GB); default 13b")
    p.add_argument("--model", choices=sorted(MODELS), default=None, help="model shape (default the setup's)")
    p.add_argument("--device", choices=sorted(DEVICES), default=None, help="device (default the setup's)")
    p.add_argument("--num-devices", type=int, default=None,
                   help="devices in tensor parallelism (default the setup's)")
    p.add_argument("--efficiency-profile", type=pathlib.Path, default=None,
                   help="a step profile's CSV from this device (python -m experiments.simulator.profile_steps) to "
                        "fit the roofline's efficiencies to; default assumed ones (stated in the table)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV pool, tokens (default the setup's K/V memory in the paper's Table 1 over the model's "
                        f"K/V bytes per token; with --model, --device or --num-devices, {MEMORY_UTILIZATION:g} of "
                        "the devices' memory less the weights)")
    p.add_argument("--num-requests", type=int, default=PACKAGED_LIMIT,
                   help=f"ShareGPT requests per run (default and at most {PACKAGED_LIMIT})")
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="request rates, requests per second (default the setup's: 0.25 to 5 for 13b, 0.5 to 5 for 66b, "
                        "1 to 12 for 175b)")
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
    setup = PAPER_SETUPS[args.setup]
    args.custom = any(getattr(args, f) is not None for f in ("model", "device", "num_devices"))
    args.model = args.model or setup.model
    args.device = args.device or setup.device
    args.num_devices = setup.num_devices if args.num_devices is None else args.num_devices
    if args.num_devices < 1:
        p.error(f"--num-devices must be >= 1, got {args.num_devices}")
    args.name = "paper_fig12_custom" if args.custom else f"paper_fig12_{args.setup}"
    args.rates = online.check_rates(p, "--rates", list(setup.rates) if args.rates is None else args.rates)
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
    if args.max_batched_tokens < args.max_seqs:
        p.error(f"--max-batched-tokens {args.max_batched_tokens} must be >= --max-seqs {args.max_seqs} (every "
                "running sequence decodes in each call)")
    try:
        args.step_time_, args.requests_ = simulated_setup(args)
        args.tokens_ = kv_tokens(args, args.step_time_.model, args.step_time_.device)
    except ValueError as e:
        p.error(str(e))
    try:
        arrival_times(len(args.requests_), min(args.rates), seed=args.seed)
    except ValueError as e:
        p.error(f"--rates {min(args.rates):g}: {e}")
    if args.tokens_[0] // args.page_size * args.page_size < MAX_SEQ_LEN:
        p.error(f"the pool holds {args.tokens_[0]} KV tokens ({args.tokens_[1]}) in pages of {args.page_size}: "
                f"no {MAX_SEQ_LEN}-token request fits; a larger --kv-tokens or a smaller --page-size")
    check_outputs(p, args)
    return args


def kv_tokens(args, model, device) -> tuple[int, str]:
    """The pool's tokens and where the number comes from.

    Raises:
      ValueError: the weights leave less than one 2,048-token sequence of K/V.
    """
    per_token = model.kv_bytes_per_token("bfloat16")
    if args.kv_tokens is not None:
        return args.kv_tokens, "--kv-tokens"
    if not args.custom:
        setup = PAPER_SETUPS[args.setup]
        return setup.kv_bytes // per_token, (f"the paper's Table 1: {setup.kv_bytes / GIB:g} GiB of K/V over "
                                             f"{per_token:,} bytes a token; the paper says "
                                             f"{setup.paper_kv_tokens:,} slots")
    return kv_pool_tokens(model, device, args.num_devices, MEMORY_UTILIZATION), \
        f"{MEMORY_UTILIZATION:g} of memory less the weights"


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    record = provenance.collect("experiments.simulator.paper_fig12", argv, seeds={"arrivals": args.seed})
    step_time, requests = args.step_time_, args.requests_
    model, device = step_time.model, step_time.device
    tokens, tokens_source = args.tokens_
    num_pages = tokens // args.page_size + 1
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
    where = device.name if args.num_devices == 1 else f"{args.num_devices} x {device.name}"
    threshold = args.latency_threshold or round(1.5 * min(runs["paged", r].normalized_latency for r in args.rates), 4)
    sustained = {p: online.sustained_rate(args.rates, [runs[p, r].normalized_latency for r in args.rates], threshold)
                 for p in args.policy}
    fig13_rate = min(args.rates, key=lambda r: abs(r - 2.0))
    fig13 = args.name == "paper_fig12_13b"  # the paper's Figure 13a is OPT-13B's
    summary = [{"policy": POLICY_LABELS[p], "sustained": str(sustained[p]),
                "ratio": "-" if p == "paged" else online.ratio(sustained["paged"], sustained[p]),
                "paper": "-" if p == "paged" else PAPER_FIG12.get(engine_options(p)["reservation"], "-")
                if engine_options(p)["allocator"] != "pages" else "-",
                "running": f"{runs[p, fig13_rate].mean_running:.2f}",
                "paper_running": f"{PAPER_FIG13[engine_options(p)['reservation']]:.2f}"
                if engine_options(p)["allocator"] != "pages" and fig13 else "-",
                "blocked": max(r["fragmentation_blocked_requests"] for r in rows if r["policy"] == p)}
               for p in args.policy]
    table = markdown_table(summary, ("policy", "sustained", "ratio", "paper", "running", "paper_running", "blocked"),
                           headers=["policy", "highest rate sustained (req/s)", "paged / policy",
                                    "paper: vLLM / policy", f"mean running at {fig13_rate:g} req/s",
                                    "paper Figure 13a (2 req/s)", "requests blocked by fragmentation (most, a run)"])
    curves = markdown_table(
        [{"request_rate": r, **{p: f"{runs[p, r].normalized_latency:.3f}" for p in args.policy}} for r in args.rates],
        ("request_rate", *args.policy), headers=["request rate (req/s)", *(POLICY_LABELS[p] for p in args.policy)])
    png = pathlib.Path(args.out) / f"{args.name}.png"
    online.plot_latency_vs_rate(png, {POLICY_LABELS[p]: (args.rates, [runs[p, r].normalized_latency
                                                                      for r in args.rates]) for p in args.policy},
                                threshold=threshold, title=f"Figure 12, simulated: {model.name} on {where}")
    wall = [r["wall_s"] for r in rows]
    sim_per_wall = sum(r["simulated_s"] for r in rows) / sum(wall)
    text = (f"# Figure 12 at the paper's scale, simulated: {model.name} on {where}, ShareGPT\n\n"
            f"![normalized latency against request rate]({png.name})\n\n{table}\n\n"
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
    md, csv = write_table(args.out, args.name, rows, COLUMNS, text, record)
    print(f"\n{table}\n\nwrote {md}, {csv}, {png} in {time.perf_counter() - t_start:.0f} s")
    return {"rows": rows, "sustained": sustained, "summary": summary}


if __name__ == "__main__":
    main(sys.argv[1:])
