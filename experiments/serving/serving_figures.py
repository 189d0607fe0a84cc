"""The paper's serving figures, scaled down for CPU: normalized latency
against request rate (Figure 12) and mean batched requests (Figure 13).

PagedAttention (Kwon et al., SOSP 2023) section 6.2 serves ShareGPT traces
with Poisson arrivals and compares vLLM's paged KV cache with three Orca
baselines that reserve each request's KV at admission: its maximum length
(Orca-Max), its prompt plus its true output length rounded up to a power of
two (Pow2), or plus exactly its true output length (Oracle). Here the same four policies run on
one engine (:mod:`experiments.lib.online`), only the reservation differs.

The sweep: first paged serves every request at once, which measures its
capacity (requests per second); the rates swept are ``--loads`` times that
capacity (or ``--rates`` requests per second). The rates run in increasing
order, every policy at each rate in turn (so that all policies at one rate
see the machine in the same state), each run on a fresh engine with the
same arrival trace (stretched to the rate). The highest rate a policy
sustains is where its normalized latency first rises above
``--latency-threshold`` (by default 1.5x paged's lowest over the sweep: a
minimum, because a burst of other work on the machine only ever adds
latency), interpolated linearly between the swept rates; the table sets the
ratios paged/Oracle and paged/Max beside the paper's 1.7-2.7x and 2.7-8x
(OPT-13B on ShareGPT, one A100), and beside them the requests per second
each policy served at the highest rate, its capacity once overloaded.
Figure 13 reads the time-weighted mean of running requests at one rate
(``--fig13-rate``, by default the highest swept) beside the paper's
(OPT-13B, ShareGPT, 2 requests/s).

Scaled down for 2 CPU cores: SmolLM2-135M for OPT-13B, a KV budget of
8,192 tokens (4 maximum-length reservations) for the A100's, tens of
requests for an hour of trace, outputs capped at ``--max-output-len``
tokens (ShareGPT's average is 204), rates of a few requests per second.
Short outputs shrink what Oracle and Pow2 waste (they reserve the output,
paged holds only what is written) more than what Max wastes.

Writes ``serving_fig12.{md,csv,png}`` and ``serving_fig13.{md,csv,png}``
(``--quick``: ``*_quick``) to ``--out``. ``--quick`` is a smoke run of a few
requests and two loads, meant for ``--model toy``. Every run's CSV row also
has the pages its sequences held with and without sharing and the share
sharing saved (:data:`SHARING_COLUMNS`, the paper's Figure 15 measure).

Figure 14 (``--workload parallel-N``, ``beam-W``): the same sweep with N
samples at temperature 1 or beam search of width W, paged against Orca-Max
and Orca-Oracle (:data:`experiments.lib.workloads.FIG14_POLICIES`), in a pool
where Max holds one request of width 6 (:func:`sampling_pool`); writes
``serving_fig14_<workload>*``, which :mod:`experiments.serving.serving_fig14`
summarizes.

Figure 16 (``--workload prefix-1``, ``prefix-5``): every prompt opens with
one few-shot prefix (:mod:`experiments.lib.workloads`); the policies are
``paged`` with prefix caching against ``paged-nocache`` and
``oracle-nocache`` (Orca-Oracle shares nothing), and the table shows the
prompt tokens each served from the cache; the paper's vLLM reaches 1.67x
(one shot) and 3.58x (five shots) Orca-Oracle's throughput. Figure 17
(``--workload chatbot``): conversation histories as prompts, cut to their
last ``--max-prompt-len`` tokens, against the three Orca baselines, which
the paper's vLLM serves at 2x the request rate. Each writes one figure,
``serving_fig16_<workload>*`` or ``serving_fig17*`` (no batched-requests
figure), with its own default sizes (:data:`WORKLOAD_SIZES`).

Usage: ``python -m experiments.serving.serving_figures [--quick] [--model toy] ...``
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from experiments.lib import online, provenance, workloads
from experiments.lib.cli import add_compile_cache_args, add_flag, check_outputs, setup_compile_cache
from experiments.lib.policies import PAPER_FIG12, PAPER_FIG13, PAPER_FIG16, PAPER_FIG17, split_policy
from experiments.lib.sharegpt import MAX_SEQ_LEN
from experiments.lib.tables import markdown_table, write_table
from paged_jax.engine.config import reserved_tokens

FULL = dict(num_requests=24, max_output_len=48, max_seqs=64, max_batched_tokens=256, kv_budget_tokens=8192,
            loads=(0.5, 1.0, 2.0, 3.0))
QUICK = dict(num_requests=6, max_output_len=6, max_seqs=16, max_batched_tokens=32, kv_budget_tokens=8192,
             loads=(0.5, 1.5))
"""Sizes of the full run (about 10-15 minutes with SmolLM2 on 2 CPU cores)
and of ``--quick`` (fewer step programs to compile), each used where its
flag is not given."""
WORKLOAD_SIZES = {"prefix": dict(num_requests=16, kv_budget_tokens=4096, loads=(0.5, 1.0, 2.0)),
                  "chatbot": dict(num_requests=16, loads=(0.5, 1.0, 2.0)),
                  "sampling": dict(num_requests=8, max_output_len=32, loads=(0.5, 2.0))}
"""The full run's sizes that differ for Figures 14, 16 and 17 (by
:func:`size_key`), over :data:`FULL`, each about 10 minutes with SmolLM2
on 2 busy CPU cores: fewer requests and rates, since the slowest policies
take several times paged's time to prefill prompts of hundreds of tokens,
and for Figure 14 fewer still, two rates and shorter outputs, since every
request decodes up to six sequences (six sweeps had to fit in an hour on
2 cores shared with other work). Figure 16 also serves a pool of 4,096
tokens, so that memory binds the policies holding the five-shot prefix once
per request, as it does in the paper; Figure 14's pool is
:func:`sampling_pool`'s."""
THRESHOLD_FACTOR = 1.5
"""Without ``--latency-threshold``: this many times paged's lowest
normalized latency over the sweep. With tens of requests a queue cannot
grow without bound: normalized latency saturates near its value with every
request at once, 2.5-4x the lightly loaded one with SmolLM2 (measured: 0.56
to 0.78 against 0.18 to 0.26 s/token), so a factor of 2 or more was hardly
ever crossed."""
FIG12_COLUMNS = ("policy", "sustained_rate", "paged_over_policy", "paper_paged_over_policy", "served_at_top",
                 "paged_over_policy_served", "min_normalized_latency_s", "max_normalized_latency_s", "cached_tokens",
                 "cached_share", "kv_saved_by_sharing")
SHARING_COLUMNS = ("mean_pages_unshared", "mean_pages_used", "kv_saved_by_sharing", "latency_threshold_s")
"""Columns each run's CSV row adds to :data:`experiments.lib.online.METRIC_COLUMNS`
(beside ``load``): the pages the engine's sequences held after each
iteration, each counting its own (what they would hold without sharing) and
distinct, averaged over iterations, and ``1 - used / unshared``, the
paper's Figure 15 measure (``EngineStats.sharing_saving``); and the sweep's
latency threshold (s/token), so that the Figure 14 summary
(:mod:`experiments.serving.serving_fig14`) reads each sweep's sustained rates back."""
FIG13_COLUMNS = ("policy", "request_rate", "mean_running", "peak_running", "paged_over_policy", "paper_mean_batched",
                 "paper_paged_over_policy", "request_throughput", "normalized_latency_s", "preemptions")


def size_key(workload: workloads.Workload) -> str:
    """The key of ``workload``'s sizes in :data:`WORKLOAD_SIZES`:
    ``"sampling"`` for Figure 14's parallel-N and beam-W, else its
    ``prompts`` (``"sharegpt"`` for basic, which has none there)."""
    if workload.prompts == "sharegpt" and workload.name != "basic":
        return "sampling"
    return workload.prompts


FIG14_WIDTH = 6
"""The most sequences per request of Figure 14's workloads (n, beam width)."""


def sampling_pool(num_seqs: int, page_size: int) -> int:
    """Figure 14's KV pool (tokens): the fewest whole pages, beside the null
    page, that hold one Orca-Max request of ``max(num_seqs, FIG14_WIDTH)``
    sequences reserving 2,048 tokens each (the engine refuses a group that
    could never be resumed whole): 12,304 tokens with pages of 16, for every
    width up to 6, so that only the width varies between the six sweeps
    (and they share compiled programs: the pool's shape is part of them).
    Max then holds one request of width 6, three of width 2."""
    return max(FULL["kv_budget_tokens"], max(num_seqs, FIG14_WIDTH) * MAX_SEQ_LEN + page_size)


def memory_line(requests, spec: online.EngineSpec) -> str:
    """What every request at once would hold under each policy, against the pool."""
    held = {p: sum(r.sampling.num_seqs * max(len(r.prompt_ids) + r.max_new_tokens,
                                             reserved_tokens(p, len(r.prompt_ids), r.max_new_tokens, MAX_SEQ_LEN))
                   for r in requests)
            for p in online.POLICIES}
    if any(r.sampling.num_seqs > 1 for r in requests):
        # Paged forks a request's samples or beams from its first sequence once its prompt is prefilled: they
        # share the prompt's full pages. The Orca baselines count a copy per sequence (paged_jax.engine.kv_manager).
        forked = held["paged"] - sum((r.sampling.num_seqs - 1) * (len(r.prompt_ids) // spec.page_size * spec.page_size)
                                     for r in requests)
        return (f"Every request at once, at its final length, would hold {held['paged']:,} tokens paged without "
                f"sharing, {forked:,} with each prompt's full pages held once per request (beams share more); "
                f"reserved with a prompt copy per sequence, as the paper's Orca: {held['oracle']:,} Oracle, "
                f"{held['pow2']:,} Pow2, {held['max']:,} Max; the pool holds {spec.kv_tokens:,}.")
    # The full pages of the prefix every prompt shares, held once by paged with the prefix cache.
    shared = workloads.shared_prefix_len(requests) // spec.page_size * spec.page_size
    once = held["paged"] - (sum(r.sampling.num_seqs for r in requests) - 1) * shared
    return (f"Every request at once, at its final length, would hold {held['paged']:,} tokens paged without "
            f"sharing, {once:,} with the {shared} tokens of shared prefix pages held once; reserved: "
            f"{held['oracle']:,} Oracle, {held['pow2']:,} Pow2, {held['max']:,} Max; the pool holds "
            f"{spec.kv_tokens:,}.")


def scale_note(args, model_name: str, requests, spec: online.EngineSpec) -> str:
    """How the run is scaled down from the paper's, for its workload."""
    w = args.workload_
    k = w.sampling(0).num_seqs
    max_holds = spec.kv_tokens // MAX_SEQ_LEN // k
    where = (f"{model_name} on {os.cpu_count()} CPU cores, a KV budget of {spec.kv_tokens:,} tokens"
             + ("" if w.prompts == "prefix" else f" (Max holds {max_holds} request{'s' * (max_holds > 1)}"
               + (f" of {k} sequences)" if k > 1 else ")"))
             + f", {len(requests)} requests, outputs capped at {args.max_output_len} tokens")
    if w.prompts == "prefix":
        shared = workloads.shared_prefix_len(requests)
        return ("Scaled down from the paper (LLaMA-13B on an A100, WMT16 English-to-German translation after a "
                f"one-shot prefix of 80 tokens or a five-shot one of 341): {where}. Translations become ShareGPT "
                f"rounds: the prefix is the first {w.shots} round{'s' * (w.shots > 1)} vLLM's sampling accepts, "
                f"each side cut to {w.shot_tokens} tokens, after the chat template's system prompt (every prompt "
                f"opens with the same {shared} tokens); the requests are the rounds accepted after them among "
                f"prompts of at most {w.max_prompt_len} tokens. Paged keeps the prefix cache (the "
                "cached prompt tokens show its hits); paged without it and Orca-Oracle compute and hold the prefix "
                "once per request. On a CPU, prefill compute binds as much as memory, and the cache saves both: "
                "paged against paged without the cache shows what sharing gains, paged without the cache against "
                "Oracle what paging alone gains. The paper's ratios are of throughput: compare them with "
                "'paged / policy, served'.")
    if w.prompts == "chatbot":
        return ("Scaled down from the paper (OPT-13B on an A100, ShareGPT conversations as prompts cut to their "
                f"last 1,024 tokens, outputs up to 1,024): {where}, prompts cut to their last {w.max_prompt_len} "
                "tokens. The paper's 2x comes from its Orca baselines' buddy allocator, which reserves 1,024 "
                "output tokens for each request whatever the predicted length, with most prompts at the 1,024 "
                "cap; here Oracle and Pow2 reserve the capped true output, little more than paged holds at the "
                "end, so memory binds Max first and most, and the others stay close to paged. Expect smaller "
                "ratios than the paper's.")
    if size_key(w) == "sampling":
        return ("Scaled down from the paper (Figure 14: OPT-13B on an A100 serving the Alpaca dataset; section 6.3: "
                f"\"The improvement of vLLM over Orca (Oracle) on OPT-13B and the Alpaca dataset goes from 1.3x in "
                f"basic sampling to 2.3x in beam search with a width of 6\"): {where}, ShareGPT lengths as in "
                f"Figures 12 and 13 here, {k} sequences per request. As the paper's Orca baselines, each sample "
                "or beam holds a reservation of its own, prompt included, from the request's admission on "
                f"(the prompt plus the true output under Oracle, {k} x 2,048 tokens a request under Max); paged "
                "shares the prompt's pages between the samples and a beam's ancestors' between beams. The "
                "prompts are long and the outputs capped, so most of what Orca holds beyond paged is the "
                "prompt copies.")
    return ("Scaled down from the paper (OPT-13B on an A100, hour-long traces, ShareGPT outputs of 204 tokens on "
            f"average): {where}. Two things shrink the gaps: capped outputs leave Oracle and Pow2 little to reserve "
            "beyond what paged holds, so that memory binds Max alone; and with prompts longer than outputs, "
            "prefill compute rather than memory limits paged (a CPU step also slows with the batch far more than "
            "a GPU's). Expect smaller ratios than the paper's.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.serving.serving_figures", description=__doc__.split("\n\n")[0])
    online.add_serving_flags(p, num_requests=FULL["num_requests"], max_output_len=FULL["max_output_len"])
    p.set_defaults(**{k: None for k in FULL if k != "loads"})  # resolved below: --quick's or the full run's
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: {QUICK['num_requests']} requests, outputs <= {QUICK['max_output_len']}, "
                        f"max {QUICK['max_seqs']} running, {QUICK['max_batched_tokens']} tokens per call, loads "
                        f"{' '.join(map(str, QUICK['loads']))} (each unless given); files named *_quick")
    p.add_argument("--policy", nargs="+", choices=online.ALL_POLICIES, default=None, metavar="POLICY",
                   help="policies to compare: a reservation (paged, max, pow2, oracle; Orca buddy-allocated, "
                        "'-firstfit' or '-pages' appended for another allocator), '-nocache' appended for "
                        "no prefix caching (default the workload's: all four reservations, or for prefix-K "
                        "paged, paged-nocache, oracle-nocache; paged is always run, first)")
    p.add_argument("--loads", type=float, nargs="+", default=None,
                   help="request rates as fractions of paged's measured capacity (default "
                        f"{' '.join(map(str, FULL['loads']))}; prefix-K "
                        f"{' '.join(map(str, WORKLOAD_SIZES['prefix']['loads']))}; chatbot "
                        f"{' '.join(map(str, WORKLOAD_SIZES['chatbot']['loads']))})")
    p.add_argument("--rates", type=float, nargs="+", default=None,
                   help="request rates in requests/s, instead of --loads")
    p.add_argument("--latency-threshold", type=float, default=None,
                   help="normalized latency (s/token) a policy must stay at or below to sustain a rate (default "
                        f"{THRESHOLD_FACTOR:g}x paged's lowest over the sweep)")
    p.add_argument("--workload", default="basic",
                   help="basic (default: Figures 12 and 13), parallel-N / beam-W (N samples at temperature 1, "
                        "beam width W: Figure 14's workloads, written as serving_fig14_<workload>*), prefix-K "
                        "(a shared K-shot prefix: Figure 16, serving_fig16_<workload>*) or chatbot (conversation "
                        "histories: Figure 17, serving_fig17*); without --quick, prefix-K serves 16 requests from "
                        "a 4096-token pool and chatbot 16 requests unless given")
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="prefix-K: the longest own prompt a request may have (default "
                        f"{workloads.PREFIX_PROMPT_LEN}); chatbot: the tokens a conversation keeps, its last "
                        f"(default {workloads.CHATBOT_PROMPT_LEN}; the paper's 1024)")
    p.add_argument("--fig13-rate", type=float, default=None,
                   help="request rate of Figure 13 (default: the highest swept)")
    add_flag(p, "out")
    add_compile_cache_args(p)
    args = p.parse_args(argv)
    try:
        args.workload_ = workloads.workload(args.workload, max_prompt_len=args.max_prompt_len)
    except ValueError as e:
        p.error(f"--workload / --max-prompt-len: {e}")
    sizes = QUICK if args.quick else {**FULL, **WORKLOAD_SIZES.get(size_key(args.workload_), {})}
    pool_given = args.kv_budget_tokens is not None
    for name, value in sizes.items():
        if name != "loads" and getattr(args, name) is None:
            setattr(args, name, value)
    num_seqs = args.workload_.sampling(0).num_seqs
    if size_key(args.workload_) == "sampling" and not pool_given and args.page_size >= 1:
        args.kv_budget_tokens = max(args.kv_budget_tokens, sampling_pool(num_seqs, args.page_size))
    online.check_serving_flags(p, args)
    if args.rates is not None and args.loads is not None:
        p.error("give --rates or --loads, not both")
    if args.rates is not None:
        args.rates = online.check_rates(p, "--rates", args.rates)
        if math.isinf(args.rates[-1]):
            p.error("--rates must be finite (the capacity run serves everything at once already)")
    else:
        args.loads = online.check_rates(p, "--loads", args.loads or sizes["loads"])
        if math.isinf(args.loads[-1]):
            p.error("--loads must be finite")
    for flag in ("latency_threshold", "fig13_rate"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):
            p.error(f"--{flag.replace('_', '-')} must be a finite number > 0, got {value}")
    args.policy = ["paged"] + [x for x in dict.fromkeys(args.policy or args.workload_.policies) if x != "paged"]
    max_pages = -(-MAX_SEQ_LEN // args.page_size)
    if any(split_policy(x)[0] == "max" for x in args.policy) and \
            num_seqs * max_pages > args.kv_budget_tokens // args.page_size - 1:
        p.error(f"--kv-budget-tokens {args.kv_budget_tokens}: one Orca-Max request of the {args.workload} workload "
                f"reserves {num_seqs} x {MAX_SEQ_LEN} tokens, more than the pool's pages hold beside the null page; "
                f"give at least {(num_seqs * max_pages + 1) * args.page_size} or leave max out of --policy")
    quick = "_quick" if args.quick else ""
    kind = args.workload_.prompts
    if args.fig13_rate is not None and kind != "sharegpt":
        p.error(f"--fig13-rate: the {args.workload} workload's figure has no batched-requests figure")
    args.stems = ((f"serving_fig16_{args.workload}{quick}", None) if kind == "prefix" else
                  (f"serving_fig17{quick}", None) if kind == "chatbot" else
                  (f"serving_fig12{quick}", f"serving_fig13{quick}") if args.workload == "basic" else
                  (f"serving_fig14_{args.workload}{quick}", f"serving_fig14_{args.workload}_batched{quick}"))
    check_outputs(p, args)
    return args


def main(argv=None):
    args = parse_args(argv)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    record = provenance.collect("experiments.serving.serving_figures", argv,
                                seeds={"sharegpt_shuffle": args.seed, "arrivals": args.seed})
    print(setup_compile_cache(args))
    model_name, requests, spec, setup = online.load_setup(args)
    requests = args.workload_.apply(requests)
    basic, kind = args.workload == "basic", args.workload_.prompts
    paper12, paper13 = (PAPER_FIG12, PAPER_FIG13) if basic else ({}, {})
    fig = "Figure 12" if basic else f"Figure 14 ({args.workload_.description})"
    if kind == "prefix":
        paper12 = {"oracle-nocache": PAPER_FIG16.get(args.workload_.shots, "-")}
        fig = f"Figure 16 ({args.workload_.description})"
    elif kind == "chatbot":
        paper12, fig = PAPER_FIG17, "Figure 17 (chatbot)"
    print(setup)
    print(online.warm_up_line(spec, args.workload_))

    built = []  # the engine of each run, for its page counts (EngineStats)
    sharing: dict[tuple[str, float], dict] = {}

    def build(policy):
        built.append(spec.build(policy))
        return built[-1]

    def serve(policy, rate):
        result = online.serve_online(build, requests, policy=policy, request_rate=rate,
                                     burstiness=args.burstiness, seed=args.seed, progress=True)
        st = built[-1].stats
        sharing[policy, rate] = {"mean_pages_unshared": round(st.seq_pages_sum / max(st.iterations, 1), 1),
                                 "mean_pages_used": round(st.used_pages_sum / max(st.iterations, 1), 1),
                                 "kv_saved_by_sharing": round(st.sharing_saving, 4)}
        m = result.metrics
        print(f"{online.POLICY_LABELS[policy]:>14} at {rate:7.3f} req/s: normalized latency "
              f"{m.normalized_latency:.4f} s/token, {m.request_throughput:.3f} req/s served, mean running "
              f"{m.mean_running:.2f}, {m.preemptions} preemptions ({time.perf_counter() - t_start:.0f} s so far)")
        return result

    capacity_run = serve("paged", math.inf)
    capacity = capacity_run.metrics.request_throughput
    rates = args.rates or [round(f * capacity, 4) for f in args.loads]
    print(f"paged capacity: {capacity:.3f} req/s (every request at once); rates: {rates}")

    runs: dict[str, dict[float, online.OnlineResult]] = {p: {} for p in args.policy}
    for rate in rates:  # policies interleaved at each rate: they see the machine in the same state
        for policy in args.policy:
            runs[policy][rate] = serve(policy, rate)
    threshold = args.latency_threshold or round(
        THRESHOLD_FACTOR * min(runs["paged"][r].metrics.normalized_latency for r in rates), 4)
    sustained = {p: online.sustained_rate(rates, [runs[p][r].metrics.normalized_latency for r in rates], threshold)
                 for p in args.policy}
    fig13_rate = args.fig13_rate or rates[-1]
    for policy in args.policy if args.stems[1] else ():
        if fig13_rate not in runs[policy]:
            runs[policy][fig13_rate] = serve(policy, fig13_rate)

    # Figure 12: every run, the sustained rates, the curves.
    all_runs = [capacity_run] + [runs[p][r] for p in args.policy for r in sorted(runs[p])]
    rows12 = [dict(r.row(), load=round(r.request_rate / capacity, 3), **sharing[r.policy, r.request_rate],
                   latency_threshold_s=threshold) for r in all_runs]
    pivot = [{"request_rate": r, "load": round(r / capacity, 3),
              **{p: runs[p][r].metrics.normalized_latency if r in runs[p] else None for p in args.policy}}
             for r in sorted({r for p in args.policy for r in runs[p]})]
    pivot_table = markdown_table(
        pivot, ["request_rate", "load", *args.policy],
        headers=["request rate (req/s)", "load", *(online.POLICY_LABELS[p] for p in args.policy)],
        cell=lambda c, v: "-" if v is None else f"{v:.4f}" if c in args.policy else str(v))
    mean_prompt = sum(len(r.prompt_ids) for r in requests) / len(requests)
    summary = []
    top = {p: runs[p][rates[-1]] for p in args.policy}
    served = {p: top[p].metrics.request_throughput for p in args.policy}
    for p in args.policy:
        lats = [runs[p][r].metrics.normalized_latency for r in sorted(runs[p])]
        summary.append({"policy": p, "sustained_rate": str(sustained[p]),
                        "paged_over_policy": "-" if p == "paged" else online.ratio(sustained["paged"], sustained[p]),
                        "paper_paged_over_policy": paper12.get(p, "-"), "served_at_top": round(served[p], 3),
                        "paged_over_policy_served": "-" if p == "paged" else f"{served['paged'] / served[p]:.2f}x",
                        "min_normalized_latency_s": round(min(lats), 4),
                        "max_normalized_latency_s": round(max(lats), 4),
                        "cached_tokens": round(top[p].mean_cached_tokens, 1),
                        "cached_share": f"{top[p].mean_cached_tokens / mean_prompt:.0%}",
                        "kv_saved_by_sharing": f"{sharing[p, rates[-1]]['kv_saved_by_sharing']:.1%}"})
    summary_table = markdown_table(
        summary, FIG12_COLUMNS, cell=online.cell,
        headers=["policy", "highest rate sustained (req/s)", "paged / policy", "paper: vLLM / policy",
                 f"served at {rates[-1]:g} req/s", "paged / policy, served", "min normalized latency (s/token)",
                 "max normalized latency (s/token)", "cached prompt tokens / request", "share of prompt cached",
                 f"KV saved by sharing at {rates[-1]:g} req/s"])
    png12 = args.out / f"{args.stems[0]}.png"
    online.plot_latency_vs_rate(
        png12, {p: (sorted(runs[p]), [runs[p][r].metrics.normalized_latency for r in sorted(runs[p])])
                for p in args.policy},
        threshold=threshold, title=f"{fig}: {model_name}, {len(requests)} requests")
    took = (f"The run took {time.perf_counter() - t_start:.0f} s; load average {load_start:.1f} when it began, "
            f"{os.getloadavg()[0]:.1f} at the end (on 2 cores, other work on the machine slows every run and "
            "blurs the curves).")
    scaled = (f"{setup}.\n\n{took}\n\nArrivals: gamma process, burstiness {args.burstiness:g} (1 is Poisson), seed "
              f"{args.seed}, the same trace stretched to each rate. Paged capacity, every request at once: "
              f"{capacity:.3f} req/s; rates swept: {', '.join(f'{r:g}' for r in rates)} req/s "
              f"({'given' if args.rates else 'loads ' + ', '.join(f'{f:g}' for f in args.loads) + ' of it'}). "
              f"Latency threshold: {threshold:g} s/token"
              f"{'' if args.latency_threshold else f' ({THRESHOLD_FACTOR:g}x paged at its best)'}.\n\n"
              f"{scale_note(args, model_name, requests, spec)} {memory_line(requests, spec)}")
    text12 = (f"# {fig}: normalized latency against request rate ({model_name})\n\n"
              f"![normalized latency against request rate]({png12.name})\n\n"
              f"Normalized latency (s/token: end-to-end latency / output tokens, averaged over requests):\n\n"
              f"{pivot_table}\n\n{summary_table}\n\n{scaled}\n\nThe CSV has every run's metrics (the first row: "
              f"paged with every request at once, the capacity run).")
    md12, csv12 = write_table(args.out, args.stems[0], rows12, ("load", *online.METRIC_COLUMNS, *SHARING_COLUMNS),
                              text12, record)
    if args.stems[1] is None:
        print(f"\n{pivot_table}\n\n{summary_table}\n")
        print(f"wrote {md12}, {csv12}, {png12} in {time.perf_counter() - t_start:.0f} s")
        return summary, None

    # Figure 13: mean batched requests at one rate.
    paged13 = runs["paged"][fig13_rate].metrics.mean_running
    rows13 = []
    for p in args.policy:
        m = runs[p][fig13_rate].metrics
        paper = paper13.get(p)
        rows13.append({"policy": p, "request_rate": fig13_rate, "mean_running": round(m.mean_running, 2),
                       "peak_running": m.peak_running,
                       "paged_over_policy": "-" if p == "paged" else f"{paged13 / m.mean_running:.2f}x",
                       "paper_mean_batched": paper,
                       "paper_paged_over_policy": "-" if p == "paged" or paper is None else
                       f"{paper13['paged'] / paper:.2f}x",
                       "request_throughput": round(m.request_throughput, 4),
                       "normalized_latency_s": round(m.normalized_latency, 4), "preemptions": m.preemptions})
    table13 = markdown_table(
        rows13, FIG13_COLUMNS, cell=online.cell,
        headers=["policy", "request rate (req/s)", "mean batched requests", "peak", "paged / policy",
                 "paper: mean batched", "paper: vLLM / policy", "served (req/s)", "normalized latency (s/token)",
                 "preemptions"])
    png13 = args.out / f"{args.stems[1]}.png"
    online.plot_batched_requests(png13, {p: runs[p][fig13_rate].metrics.mean_running for p in args.policy},
                                 {p: paper13[p] for p in args.policy if p in paper13} if basic else None,
                                 title=f"{model_name} at {fig13_rate:g} req/s ({args.workload})"
                                       + ("; paper: OPT-13B at 2 req/s" if basic else ""))
    text13 = (f"# {'Figure 13' if basic else fig}: mean batched requests ({model_name}, {fig13_rate:g} req/s)\n\n"
              f"![mean batched requests]({png13.name})\n\n{table13}\n\n"
              f"Mean batched requests: running sequences after each engine step, averaged over the run weighted "
              f"by time (idle time counts 0). "
              + ("Paper: OPT-13B serving ShareGPT at 2 requests/s (its Figure 13, values read from the bars). "
                 if basic else "") + f"Rate {fig13_rate:g} req/s: "
              f"{'given' if args.fig13_rate else 'the highest swept'}.\n\n{scaled}")
    md13, csv13 = write_table(args.out, args.stems[1], rows13, FIG13_COLUMNS, text13, record)

    print(f"\n{pivot_table}\n\n{summary_table}\n\n{table13}\n")
    print(f"wrote {md12}, {csv12}, {png12}, {md13}, {csv13}, {png13} in {time.perf_counter() - t_start:.0f} s")
    return summary, rows13


if __name__ == "__main__":
    main(sys.argv[1:])
