"""The paper's serving figures at its scale on the simulated accelerator
(PagedAttention, Kwon et al., SOSP 2023, section 6): Figure 12 (basic
sampling on ShareGPT; OPT-13B on one A100-40GB, OPT-66B on four, OPT-175B
on eight A100-80GB) with Figure 13a's batched requests, Figure 14 (parallel
sampling and beam search; Figure 15's memory saving beside it), Figure 16
(a shared few-shot prefix) and Figure 17 (chatbot).

The engine is this project's (:class:`paged_jax.simulator.engine.SimulatedEngine`:
the same scheduler, KV manager, page state, prefix cache, forks, beams,
reservation policies and buddy allocator), its model calls timed by a
roofline (:class:`paged_jax.simulator.step_time.RooflineStepTime`) of the
model on its devices in tensor parallelism (``--setup``, the paper's Table 1
servers; or ``--model``, ``--device``, ``--num-devices``), with efficiencies
assumed or fitted to a step profile of that device
(``--efficiency-profile``). Poisson arrivals, the same trace stretched to
each rate.

The requests (``--workloads``, :mod:`experiments.lib.workloads` without a
tokenizer, so at the packaged ShareGPT lengths with random ids in the
model's vocabulary) carry their true output lengths, EOS ignored, as the
paper's runs:

* ``basic`` (Figure 12): the 1,000 packaged ShareGPT requests (vLLM's
  sampling rules: prompts <= 1,024 tokens, prompt plus output <= 2,048).
* ``parallel-N``, ``beam-W`` (Figure 14): the same requests with N samples
  or beam width W. The paper ran Alpaca (short prompts and answers), which
  is not packaged here: ShareGPT's longer ones share more of each prompt
  and hold more pages per request.
* ``prefix-K`` (Figure 16): K shot examples (``K * 54`` random ids: 54 and
  270 tokens, the paper's WMT16 prefixes are 80 and 341) before each
  packaged prompt of at most 128 tokens of its own; outputs capped at
  :data:`PREFIX_OUTPUT_LEN` tokens (a translation is about as long as its
  source). The paper's model is LLaMA-13B (``--setup llama-13b``).
* ``chatbot`` (Figure 17): one to three earlier packaged rounds before each
  prompt, cut to the last 1,024 tokens as the paper cuts them.

Defaults follow the paper: the KV pool is its Table 1's K/V memory for the
setup (12 GiB for OPT-13B, 21 GiB for OPT-66B, 264 GiB for OPT-175B; for
LLaMA-13B, which Table 1 does not list, 0.9 of the A100-40GB's memory less
the weights) over the model's K/V bytes per token, pages of 16 tokens, up
to 256 sequences and 2,560 tokens per call (vLLM's defaults of the time),
and the figure's policies: for Figure 12 paged (vLLM), Orca Max, Pow2 and
Oracle with the buddy allocator, plus Orca Oracle page-backed
(``oracle-pages``: the kinder Orca, without external fragmentation or the
buddy's rounding); for Figure 14 paged, Max and Oracle; for Figure 16
paged with and without the prefix cache and Oracle without (Orca shares
nothing); for Figure 17 paged and the three Orcas. Each policy's sustained
rate is where its normalized latency crosses ``--latency-threshold``
(default 1.5x paged's lowest on that workload).

Writes ``paper_fig<N>_<setup>.{md,csv,png}`` to ``--out`` (``N`` the
figure of ``--workloads``; ``paper_fig<N>_custom`` where ``--model``,
``--device`` or ``--num-devices`` change the setup).

Usage: ``python -m experiments.simulator.paper_serving [--setup 13b|66b|175b|llama-13b] [--workloads basic]
[--rates ...]``
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
import sys
import time

from experiments.lib import online, preflight, provenance, workloads
from experiments.lib.cli import add_flag, add_flags, check_flags, check_outputs
from experiments.lib.latency import arrival_times
from experiments.lib.policies import (
    ALL_POLICIES,
    PAPER_FIG13,
    POLICY_LABELS,
    engine_options,
    paper_ratio,
)
from experiments.lib.serving import SIMULATED_VOCAB_SIZE, engine_config, simulated_requests, simulated_setup
from experiments.lib.sharegpt import MAX_SEQ_LEN, PACKAGED_LIMIT
from experiments.lib.tables import markdown_table, write_table
from paged_jax.simulator.engine import SimulatedEngine
from paged_jax.simulator.hardware import DEVICES, MODELS, kv_pool_tokens

PROG = "python -m experiments.simulator.paper_serving"
GIB = 2**30


@dataclasses.dataclass(frozen=True)
class PaperSetup:
    """One server of the paper and the rates its Figure 12 panel sweeps here.

    ``kv_bytes`` and ``paper_kv_tokens`` are its Table 1's K/V memory and
    slots, None for a server Table 1 does not list (its pool is then
    :data:`MEMORY_UTILIZATION` of memory less the weights)."""

    model: str
    device: str
    num_devices: int
    kv_bytes: int | None
    paper_kv_tokens: int | None
    rates: tuple


PAPER_SETUPS = {
    "13b": PaperSetup("opt-13b", "a100-40gb", 1, 12 * GIB, 15_700,
                      (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)),
    "66b": PaperSetup("opt-66b", "a100-40gb", 4, 21 * GIB, 9_700,
                      (0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)),
    "175b": PaperSetup("opt-175b", "a100-80gb", 8, 264 * GIB, 60_100, (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 12.0)),
    "llama-13b": PaperSetup("llama-13b", "a100-40gb", 1, None, None,
                            (0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0)),
}
"""The paper's servers: Table 1's three (section 6.1: model, GPUs, K/V
memory and KV cache slots) and LLaMA-13B on one A100-40GB (Figure 16's
model, section 6.4)."""
MEMORY_UTILIZATION = 0.9
"""Without the paper's figure: the KV pool is this share of device memory
less the weights (vLLM's ``gpu_memory_utilization``)."""
FIGURES = {"basic": 12, "parallel": 14, "beam": 14, "prefix": 16, "chatbot": 17}
"""The paper's figure of each workload kind."""
FIGURE_RATES = {
    14: (0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0),
    16: (2.0, 4.0, 6.0, 8.0, 10.0, 12.0, 14.0, 16.0, 20.0, 24.0, 28.0, 32.0),
    17: (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5),
}
"""Default ``--rates`` of Figures 14, 16, 17 (req/s; Figure 12's are the
setup's), chosen around where paged and the baselines cross on the 13B
setups: Figure 14's are divided by the sequences a request runs (so
``beam-6`` sweeps 0.125 to 0.83); a sequence of a few-shot request is short
(own prompt <= 128, output <= :data:`PREFIX_OUTPUT_LEN` tokens), a chat's
long (up to 1,024 prompt tokens)."""
PREFIX_OUTPUT_LEN = 128
"""``prefix-K``: outputs are capped at this many tokens, the own prompt's
limit (a translation is about as long as its source; the paper's WMT16
requests are sentences)."""
STOP_ABOVE = 10.0
"""``--stop-above``'s default: a policy whose normalized latency is ten times
the threshold at some rate is far past its knee, and at higher rates its
queue only grows (each such run simulates the whole backlog: the slowest
points of a sweep, and the least informative)."""
MAX_KV_TOKENS = 2**24
"""The largest pool a run simulates (16.8M tokens; the paper's largest is
60K): a simulated engine still keeps one float32 per slot as its pool's
placeholder and the page state's arrays per page."""
CHATBOT_PROMPT_LEN = 1024
"""``chatbot``: prompts keep their last this many tokens (the paper's
section 6.5)."""
COLUMNS = ("workload", "policy", "request_rate", "normalized_latency_s", "ttft_p50_s", "tpot_p50_s", "mean_running",
           "peak_running", "preemptions", "kv_saved_by_sharing", "fragmentation_blocked_requests",
           "external_fragmentation", "simulated_s", "wall_s")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--setup", choices=sorted(PAPER_SETUPS, key=len), default="13b",
                   help="the paper's server: 13b (OPT-13B, one A100-40GB), 66b (OPT-66B, four), 175b (OPT-175B, "
                        "eight A100-80GB), llama-13b (one A100-40GB, Figure 16's model); default 13b")
    p.add_argument("--workloads", nargs="+", default=["basic"], metavar="WORKLOAD",
                   help="workloads of one figure: basic (Figure 12), parallel-N and beam-W (14), prefix-K (16), "
                        "chatbot (17); default basic")
    p.add_argument("--model", choices=sorted(MODELS), default=None, help="model shape (default the setup's)")
    p.add_argument("--device", choices=sorted(DEVICES), default=None, help="device (default the setup's)")
    p.add_argument("--num-devices", type=int, default=None,
                   help="devices in tensor parallelism (default the setup's)")
    p.add_argument("--efficiency-profile", type=pathlib.Path, default=None,
                   help="a step profile's CSV from this device (python -m experiments.simulator.profile_steps) to "
                        "fit the roofline's efficiencies to; default assumed ones (stated in the table)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="KV pool, tokens (default the setup's K/V memory in the paper's Table 1 over the model's "
                        f"K/V bytes per token; for llama-13b or with --model, --device or --num-devices, "
                        f"{MEMORY_UTILIZATION:g} of the devices' memory less the weights)")
    p.add_argument("--num-requests", type=int, default=None,
                   help=f"requests per run (default and at most what the workloads make from the {PACKAGED_LIMIT} "
                        "packaged requests: all of them for basic, parallel-N and beam-W; 496 for prefix-K (the "
                        "prompts of at most 128 tokens of their own), 329 for chatbot with seed 0)")
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="request rates, requests per second (default for basic the setup's: 0.25 to 5 for 13b, 0.5 "
                        "to 5 for 66b, 1 to 12 for 175b; Figure 14 0.75 to 5 over the sequences a request runs, "
                        "Figure 16 2 to 32, Figure 17 0.25 to 2.5)")
    p.add_argument("--policy", nargs="+", choices=ALL_POLICIES, metavar="POLICY", default=None,
                   help="policies (default the figure's: basic paged max pow2 oracle oracle-pages; Figure 14 paged "
                        "max oracle; Figure 16 paged paged-nocache oracle-nocache; Figure 17 paged max pow2 "
                        "oracle); paged is always run, first")
    add_flags(p, "page_size", "max_seqs")
    add_flag(p, "seed", help="arrival seed (and of the packaged requests' random ids; default 0)")
    p.set_defaults(max_seqs=256)
    p.add_argument("--max-batched-tokens", type=int, default=2560, help="tokens per call (default 2560)")
    p.add_argument("--stop-above", type=float, default=STOP_ABOVE,
                   help="skip a policy's higher rates once its normalized latency passes this multiple of the "
                        f"threshold (far past its knee: they would only queue longer); 0 runs every rate (default "
                        f"{STOP_ABOVE:g})")
    p.add_argument("--latency-threshold", type=float, default=None,
                   help="normalized latency (s/token) a sustained rate stays under (default 1.5x paged's lowest "
                        "on each workload)")
    add_flag(p, "out")
    args = p.parse_args(argv)
    check_flags(p, args)
    try:
        args.workloads_ = {w: workloads.workload(w, **({"max_prompt_len": CHATBOT_PROMPT_LEN}
                                                       if w == "chatbot" else {})) for w in args.workloads}
    except ValueError as e:
        p.error(f"--workloads: {e}")
    if len(args.workloads_) != len(args.workloads):
        p.error(f"--workloads lists a workload twice: {' '.join(args.workloads)}")
    figures = {FIGURES[w.partition("-")[0]] for w in args.workloads}
    if len(figures) > 1:
        p.error(f"--workloads must belong to one figure (basic: 12; parallel-N, beam-W: 14; prefix-K: 16; "
                f"chatbot: 17), got {' '.join(args.workloads)}")
    args.figure = figures.pop()
    most = min(workloads.packaged_limit(w, vocab_size=SIMULATED_VOCAB_SIZE, seed=args.seed)
               for w in args.workloads_.values())
    args.num_requests = most if args.num_requests is None else args.num_requests
    if not 1 <= args.num_requests <= most:
        p.error(f"--num-requests must be in [1, {most}] ({' '.join(args.workloads)} with seed {args.seed} make "
                f"{most} of the packaged requests), got {args.num_requests}")
    setup = PAPER_SETUPS[args.setup]
    args.custom = any(getattr(args, f) is not None for f in ("model", "device", "num_devices"))
    args.model = args.model or setup.model
    args.device = args.device or setup.device
    args.num_devices = setup.num_devices if args.num_devices is None else args.num_devices
    if args.num_devices < 1:
        p.error(f"--num-devices must be >= 1, got {args.num_devices}")
    args.name = f"paper_fig{args.figure}_{'custom' if args.custom else args.setup}"
    if args.rates is not None:
        args.rates_ = {w: online.check_rates(p, "--rates", args.rates) for w in args.workloads}
    else:
        args.rates_ = {w: default_rates(args.figure, setup, args.workloads_[w]) for w in args.workloads}
    if any(math.isinf(r) for rates in args.rates_.values() for r in rates):
        p.error("--rates must be finite")
    for flag in ("kv_tokens", "max_batched_tokens"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.latency_threshold is not None and not (math.isfinite(args.latency_threshold)
                                                   and args.latency_threshold > 0):
        p.error(f"--latency-threshold must be a finite number > 0, got {args.latency_threshold}")
    if not (math.isfinite(args.stop_above) and args.stop_above >= 0):
        p.error(f"--stop-above must be a finite number >= 0, got {args.stop_above}")
    if args.efficiency_profile is not None and not args.efficiency_profile.is_file():
        p.error(f"--efficiency-profile {args.efficiency_profile}: no such file")
    default_policies = (("paged", "max", "pow2", "oracle", "oracle-pages") if args.figure == 12
                        else next(iter(args.workloads_.values())).policies)
    args.policy = ["paged"] + [x for x in dict.fromkeys(args.policy or default_policies) if x != "paged"]
    if args.max_batched_tokens < args.max_seqs:
        p.error(f"--max-batched-tokens {args.max_batched_tokens} must be >= --max-seqs {args.max_seqs} (every "
                "running sequence decodes in each call)")
    max_output_len = PREFIX_OUTPUT_LEN if args.figure == 16 else MAX_SEQ_LEN
    try:
        first, *others = args.workloads_.values()
        args.step_time_, requests = simulated_setup(args, first, max_output_len)
        args.requests_ = {first.name: requests,
                          **{w.name: simulated_requests(args, w, max_output_len) for w in others}}
        args.tokens_ = kv_tokens(args, args.step_time_.model, args.step_time_.device)
    except ValueError as e:
        p.error(str(e))
    for name, rates in args.rates_.items():
        try:
            arrival_times(len(args.requests_[name]), min(rates), seed=args.seed)
        except ValueError as e:
            p.error(f"--rates {min(rates):g} ({name}): {e}")
    model, device = args.step_time_.model, args.step_time_.device
    if args.num_devices > model.num_q_heads:
        p.error(f"--num-devices {args.num_devices}: {model.name} has {model.num_q_heads} attention heads to split "
                "across devices in tensor parallelism; at most that many devices")
    if args.tokens_[0] > MAX_KV_TOKENS:
        p.error(f"the pool holds {args.tokens_[0]:,} KV tokens ({args.tokens_[1]}), more than the simulator's "
                f"{MAX_KV_TOKENS:,}; a smaller --kv-tokens")
    need = model.weight_bytes("bfloat16") + args.tokens_[0] * model.kv_bytes_per_token("bfloat16")
    if need > args.num_devices * device.memory_bytes:
        p.error(f"--kv-tokens {args.tokens_[0]}: {model.name}'s bf16 weights and {args.tokens_[0]:,} tokens of K/V "
                f"need {need / 1e9:.1f} GB, more than {args.num_devices} x {device.name} hold "
                f"({args.num_devices * device.memory_bytes / 1e9:.1f} GB); fewer tokens or more --num-devices")
    if args.tokens_[0] // args.page_size * args.page_size < MAX_SEQ_LEN:
        p.error(f"the pool holds {args.tokens_[0]} KV tokens ({args.tokens_[1]}) in pages of {args.page_size}: "
                f"no {MAX_SEQ_LEN}-token request fits; a larger --kv-tokens or a smaller --page-size")
    for w in args.workloads_.values():
        preflight.check_workload_fits(p, w, args.max_seqs)
    for name, requests in args.requests_.items():  # each workload's runs are their own engines
        try:
            preflight.check_requests(lambda policy: build_engine(args, policy), args.policy, requests)
        except ValueError as e:
            p.error(f"--workloads {name}, {e}; a larger --kv-tokens (or fewer sequences a request)")
    check_outputs(p, args)
    return args


def build_engine(args, policy: str) -> SimulatedEngine:
    """A simulated engine of ``policy`` on the run's step time and pool (``args`` as :func:`parse_args` sets it)."""
    config = engine_config(max_seqs=args.max_seqs, max_batched_tokens=args.max_batched_tokens,
                           **engine_options(policy))
    return SimulatedEngine(args.step_time_, config, num_pages=args.tokens_[0] // args.page_size + 1,
                           page_size=args.page_size, vocab_size=SIMULATED_VOCAB_SIZE)


def default_rates(figure: int, setup: PaperSetup, workload: workloads.Workload) -> list[float]:
    """The rates a figure's workload sweeps by default (req/s, increasing):
    Figure 12's the setup's, the others' :data:`FIGURE_RATES`, Figure 14's
    divided by the sequences each request runs (3 significant digits)."""
    if figure == 12:
        return list(setup.rates)
    per_request = workload.sampling(0).num_seqs if figure == 14 else 1
    return [float(f"{r / per_request:.3g}") for r in FIGURE_RATES[figure]]


def kv_tokens(args, model, device) -> tuple[int, str]:
    """The pool's tokens and where the number comes from.

    Raises:
      ValueError: the weights leave less than one 2,048-token sequence of K/V.
    """
    per_token = model.kv_bytes_per_token("bfloat16")
    if args.kv_tokens is not None:
        return args.kv_tokens, "--kv-tokens"
    setup = PAPER_SETUPS[args.setup]
    if not args.custom and setup.kv_bytes is not None:
        return setup.kv_bytes // per_token, (f"the paper's Table 1: {setup.kv_bytes / GIB:g} GiB of K/V over "
                                             f"{per_token:,} bytes a token; the paper says "
                                             f"{setup.paper_kv_tokens:,} slots")
    return kv_pool_tokens(model, device, args.num_devices, MEMORY_UTILIZATION), \
        f"{MEMORY_UTILIZATION:g} of memory less the weights"


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    record = provenance.collect(PROG.removeprefix("python -m "), argv, seeds={"arrivals": args.seed})
    step_time = args.step_time_
    model, device = step_time.model, step_time.device
    tokens, tokens_source = args.tokens_
    rows, runs, stats = [], {}, {}
    thresholds = {}
    for name, requests in args.requests_.items():
        for policy in args.policy:
            for rate in args.rates_[name]:
                if policy != "paged" and args.stop_above and any(
                        runs[name, policy, r].normalized_latency > args.stop_above * thresholds[name]
                        for r in args.rates_[name] if (name, policy, r) in runs):
                    print(f"{name:>10} {POLICY_LABELS[policy]:>28} at {rate:6.3g} req/s: not run (past "
                          f"{args.stop_above:g}x the threshold at a lower rate)", flush=True)
                    continue
                engine = build_engine(args, policy)
                t0 = time.perf_counter()
                run = online.run_online(engine, requests, arrival_times(len(requests), rate, seed=args.seed))
                wall = time.perf_counter() - t0
                m = run.metrics()
                runs[name, policy, rate] = m
                st = stats[name, policy, rate] = engine.stats
                rows.append({"workload": name, "policy": policy, "request_rate": rate,
                             "normalized_latency_s": round(m.normalized_latency, 4),
                             "ttft_p50_s": round(m.ttft.p50, 3), "tpot_p50_s": round(m.tpot.p50, 4),
                             "mean_running": round(m.mean_running, 2), "peak_running": m.peak_running,
                             "preemptions": st.preemptions, "kv_saved_by_sharing": round(st.sharing_saving, 4),
                             "fragmentation_blocked_requests": st.fragmentation_blocked_requests,
                             "external_fragmentation": round(st.external_fragmentation, 4),
                             "simulated_s": round(run.duration_s, 1), "wall_s": round(wall, 1)})
                print(f"{name:>10} {POLICY_LABELS[policy]:>28} at {rate:6.3g} req/s: normalized latency "
                      f"{m.normalized_latency:.3f} s/token, {m.mean_running:.1f} running; {run.duration_s:.0f} s "
                      f"simulated in {wall:.1f} s", flush=True)
            if policy == "paged":  # paged runs first: its lowest latency sets the workload's threshold
                thresholds[name] = args.latency_threshold or round(
                    1.5 * min(runs[name, "paged", r].normalized_latency for r in args.rates_[name]), 4)
    where = device.name if args.num_devices == 1 else f"{args.num_devices} x {device.name}"
    summary, curves, panels = [], [], {}
    fig13 = args.name == "paper_fig12_13b"  # the paper's Figure 13a is OPT-13B's on basic ShareGPT
    for name in args.requests_:
        rates = args.rates_[name]
        threshold = thresholds[name]

        def latency(p, r):  # None: not run, past the policy's capacity
            return runs[name, p, r].normalized_latency if (name, p, r) in runs else None

        sustained = {p: online.sustained_rate(rates, [latency(p, r) for r in rates], threshold) for p in args.policy}
        # Figure 13's rate (2 req/s) for basic; elsewhere the highest rate paged sustains (its load, not idle).
        ref = (min(rates, key=lambda r: abs(r - 2.0)) if args.figure == 12 else
               max([r for r in rates if latency("paged", r) <= threshold] or rates[:1]))
        for p in args.policy:
            pages = engine_options(p)["allocator"] == "pages"
            summary.append({
                "workload": name, "policy": POLICY_LABELS[p], "sustained": str(sustained[p]),
                "ratio": "-" if p == "paged" else online.ratio(sustained["paged"], sustained[p]),
                "paper": paper_ratio(name, p), "ref": f"{ref:g}",
                "running": f"{runs[name, p, ref].mean_running:.2f}" if (name, p, ref) in runs else "not run",
                "paper_running": f"{PAPER_FIG13[engine_options(p)['reservation']]:.2f}" if fig13 and not pages
                else "-",
                "saved": f"{stats[name, p, ref].sharing_saving:.1%}" if (name, p, ref) in stats else "-",
                "blocked": max(r["fragmentation_blocked_requests"] for r in rows
                               if r["workload"] == name and r["policy"] == p)})
        curves.append(f"{name} (threshold {threshold:g} s/token):\n\n" + markdown_table(
            [{"request_rate": r, **{p: "-" if latency(p, r) is None else f"{latency(p, r):.3f}" for p in args.policy}}
             for r in rates],
            ("request_rate", *args.policy), headers=["request rate (req/s)", *(POLICY_LABELS[p] for p in args.policy)]))
        panels[name] = ({POLICY_LABELS[p]: ([r for r in rates if latency(p, r) is not None],
                                             [latency(p, r) for r in rates if latency(p, r) is not None])
                         for p in args.policy}, threshold)
    columns = ["workload", "policy", "sustained", "ratio", "paper", "ref", "running"]
    headers = ["workload", "policy", "highest rate sustained (req/s)", "paged / policy", "the paper: vLLM / policy",
               "load (req/s)", "mean running at that load"]
    if fig13:
        columns.append("paper_running"), headers.append("paper Figure 13a (2 req/s)")
    if args.figure in (14, 16):
        columns.append("saved"), headers.append("KV saved by sharing at that load (Figure 15's measure)")
    columns.append("blocked"), headers.append("requests blocked by fragmentation (most, a run)")
    if len(args.requests_) == 1:
        columns, headers = columns[1:], headers[1:]
    table = markdown_table(summary, columns, headers=headers)
    png = pathlib.Path(args.out) / f"{args.name}.png"
    online.plot_latency_panels(png, panels, title=f"Figure {args.figure}, simulated: {model.name} on {where}")
    wall = [r["wall_s"] for r in rows]
    sim_per_wall = sum(r["simulated_s"] for r in rows) / sum(wall)
    load = ("the load is Figure 13's rate (2 req/s, the nearest swept)" if args.figure == 12 else
            "the load is the highest rate swept at which paged stays under the threshold")
    what = "; ".join(("" if len(args.requests_) == 1 else f"{name}: ") + workload_line(args.workloads_[name], reqs)
                     for name, reqs in args.requests_.items())
    text = (f"# Figure {args.figure} at the paper's scale, simulated: {model.name} on {where}\n\n"
            f"![normalized latency against request rate]({png.name})\n\n{table}\n\n"
            f"Normalized latency (s/token) against request rate, {load}"
            + (f"; a policy is not run (-) at rates above one where its latency passed {args.stop_above:g}x the "
               "threshold" if args.stop_above else "") + ":\n\n" + "\n\n".join(curves) + "\n\n"
            f"Step time: {step_time.name} ({model.source}; {device.source}); efficiencies: "
            f"{step_time.flops_efficiency:.3g} of peak FLOP/s, {step_time.bandwidth_efficiency:.3g} of HBM bandwidth, "
            f"{step_time.overhead_s * 1e3:.2f} ms per call ({step_time.efficiency_source}). KV pool "
            f"{tokens:,} tokens ({tokens_source}), pages of {args.page_size}, up to {args.max_seqs} sequences and "
            f"{args.max_batched_tokens} tokens per call. Requests: {what}; token counts by SmolLM2's tokenizer (the "
            "paper's tokenizers count within a few percent of it), true output lengths, EOS ignored; Poisson "
            f"arrivals, seed {args.seed}. {len(rows)} runs, {max(wall):.1f} s of wall time at most, "
            f"{sim_per_wall:.0f} simulated seconds per wall second, {time.perf_counter() - t_start:.0f} s in all. "
            "The CSV has every run.")
    md, csv = write_table(args.out, args.name, rows, COLUMNS, text, record)
    print(f"\n{table}\n\nwrote {md}, {csv}, {png} in {time.perf_counter() - t_start:.0f} s")
    return {"rows": rows, "summary": summary, "thresholds": thresholds}


def workload_line(workload: workloads.Workload, requests) -> str:
    """A phrase for the table's text: what a workload's requests are and their mean lengths."""
    n = len(requests)
    prefix = (f", every prompt opening with the same {workloads.shared_prefix_len(requests)} tokens"
              if workload.prompts == "prefix" else "")
    prompt, output = sum(len(r.prompt_ids) for r in requests) / n, sum(r.max_new_tokens for r in requests) / n
    return (f"{n} requests, {workload.description}{prefix} ({prompt:.0f} prompt and {output:.0f} output tokens on "
            "average)")


if __name__ == "__main__":
    main(sys.argv[1:])
