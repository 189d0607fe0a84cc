"""Speculative decoding on the packaged model: tokens per second with and
without proposals (n-gram prompt lookup, or the model's own first layers
as an early-exit draft), side by side in one run, outputs compared token
for token.

Two workloads, greedy:

1. **repetitive, batch 1**: ShareGPT user turns (vLLM's sampling rules,
   :func:`experiments.lib.sharegpt.sample_requests`; those of
   ``--min-text-tokens`` to ``--max-text-tokens`` tokens) wrapped in an
   edit instruction, ``Repeat the following text exactly, fixing only
   spelling mistakes:``, and the chat template: the answer copies its
   prompt, which is what prompt lookup exploits (vLLM's ngram method is
   meant for such edits and extractions). Each request runs alone
   (``max_seqs=1``), EOS ends it, at most ``--max-output-len`` tokens.
2. **the demo's**: the main experiment's ShareGPT requests
   (``experiments.serving.serve_sharegpt``'s defaults: 48 requests, outputs
   capped at 48 tokens, EOS ignored, 64 sequences at once), where little
   repeats.

For each workload both engines share one model object and its compiled
programs; each runs the workload once to compile (its outputs are the ones
compared), then the timed runs alternate (no speculation, the method,
``--repeats`` times) on fresh engines (no prefix cache carried over), and
the table gives each run's tokens per second and the ratio of the medians;
with a draft model, also the seconds its engine took.
Writes ``speculative_<method>.{md,csv}`` to ``--out``.

Usage: ``python -m experiments.serving.speculative [--num-requests 8] [--repeats 2]``;
the early-exit draft: ``--speculative early-exit --draft-layers 8``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from experiments.lib import provenance, serving, sharegpt
from experiments.lib.cli import (
    add_compile_cache_args,
    add_flag,
    check_flags,
    check_outputs,
    machine,
    require_positive,
    setup_compile_cache,
)
from experiments.lib.tables import markdown_table, write_table
from models.ragged import RaggedModel
from paged_jax.engine import Request
from paged_jax.speculative.config import add_speculative_flags, speculative_from_args

INSTRUCTION = "Repeat the following text exactly, fixing only spelling mistakes:\n\n"
"""What wraps each ShareGPT text of the repetitive workload."""
COLUMNS = ("workload", "speculation", "run", "tokens", "seconds", "tokens_per_s", "acceptance_rate",
           "mean_accepted_length", "draft_seconds", "same_outputs")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.serving.speculative",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", dest="num_texts", type=int, default=8, metavar="N",
                   help="requests of the repetitive workload (default %(default)s); 0 skips it")
    add_flag(p, "max_output_len", default=256, help="cap on each repetitive request's output (default %(default)s)")
    p.add_argument("--min-text-tokens", type=int, default=64, help="shortest ShareGPT text repeated (default "
                   "%(default)s)")
    p.add_argument("--max-text-tokens", type=int, default=256, help="longest ShareGPT text repeated (default "
                   "%(default)s)")
    p.add_argument("--demo-requests", type=int, default=48,
                   help="requests of the demo's workload (default %(default)s, the demo's); 0 skips it")
    add_speculative_flags(p)
    p.set_defaults(speculative="ngram")  # the method compared against none
    p.add_argument("--repeats", type=int, default=2, help="timed runs of each configuration (default %(default)s)")
    add_flag(p, "seed")
    add_flag(p, "out")
    p.add_argument("--name", default=None, help="stem of the files written (default speculative_<method>)")
    add_compile_cache_args(p)
    args = p.parse_args(argv)
    check_flags(p, args)
    if args.num_texts < 0:
        p.error(f"--num-requests must be >= 0 (0 skips the repetitive workload), got {args.num_texts}")
    require_positive(p, args, "min_text_tokens", "max_text_tokens", "repeats")
    if not (args.num_texts or args.demo_requests):
        p.error("--num-requests 0 and --demo-requests 0: nothing to run")
    if args.max_text_tokens < args.min_text_tokens:
        p.error(f"--max-text-tokens ({args.max_text_tokens}) must be >= --min-text-tokens ({args.min_text_tokens})")
    if args.demo_requests < 0:
        p.error(f"--demo-requests must be >= 0, got {args.demo_requests}")
    args.spec = speculative_from_args(p, args)
    if args.spec is None:
        p.error("--speculative none: this benchmark compares a method (ngram, early-exit) against none")
    args.method = args.speculative
    if args.name is None:
        args.name = "speculative_" + args.method.replace("-", "_")
    check_outputs(p, args)
    return args


def repetitive_requests(tokenizer, args) -> list[Request]:
    """The repetitive workload (module docstring): ``--num-requests`` texts of
    ``--min-text-tokens`` to ``--max-text-tokens`` tokens, in ShareGPT's
    shuffled order."""
    conversations, _ = sharegpt.load_conversations()
    pool = sharegpt.sample_requests(conversations, tokenizer.encode_batch, 40 * args.num_texts, seed=args.seed)
    texts = [s.prompt for s in pool if args.min_text_tokens <= s.prompt_len <= args.max_text_tokens]
    if len(texts) < args.num_texts:
        raise SystemExit(f"only {len(texts)} ShareGPT texts of {args.min_text_tokens}-{args.max_text_tokens} tokens "
                         f"among {len(pool)} sampled; ask for fewer --num-requests or widen the range")
    texts = texts[: args.num_texts]
    ids = tokenizer.encode_batch([tokenizer.apply_chat_template([{"role": "user", "content": INSTRUCTION + t}])
                                  for t in texts])
    return [Request(request_id=i, prompt_ids=p, max_new_tokens=min(args.max_output_len, serving.MAX_SEQ_LEN - len(p)))
            for i, p in enumerate(ids)]


def _span(values) -> str:
    return f"{min(values)}" if min(values) == max(values) else f"{min(values)}-{max(values)}"


def bench(name: str, build, requests, args) -> tuple[list[dict], float, bool]:
    """Runs ``requests`` on ``build(spec)`` engines (spec None, then
    ``--speculative``'s config): a compiling run of each, then ``--repeats``
    alternating timed runs. Returns the rows, the ratio of median tokens per
    second (method / none) and whether the outputs were equal."""
    method = args.method
    outputs, rows, rates = {}, [], {"none": [], method: []}
    for label, spec in (("none", None), (method, args.spec)):
        outs = build(spec).run(requests, progress=True)
        outputs[label] = {o.request_id: o.outputs[0].output_ids for o in outs}
    same = outputs["none"] == outputs[method]
    for run in range(args.repeats):
        for label, spec in (("none", None), (method, args.spec)):
            engine = build(spec)
            t0 = time.perf_counter()
            outs = engine.run(requests)
            seconds = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].output_ids) for o in outs)
            st = engine.stats
            draft_s = getattr(engine.speculator.proposer, "seconds", None) if spec else None
            rates[label].append(tokens / seconds)
            rows.append({"workload": name, "speculation": label, "run": run + 1, "tokens": tokens,
                         "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 2),
                         "acceptance_rate": round(st.acceptance_rate, 3) if spec else "-",
                         "mean_accepted_length": round(st.mean_accepted_length, 2) if spec else "-",
                         "draft_seconds": "-" if draft_s is None else round(draft_s, 2),
                         "same_outputs": same, "_positions": st.acceptance_by_position if spec else None,
                         "_compile_s": round(st.compile_s, 1)})
            print(f"{name:10s} {label:5s} run {run + 1}: {tokens} tokens in {seconds:.1f} s, "
                  f"{tokens / seconds:.1f} tokens/s" + (f", acceptance {st.acceptance_rate:.3f}" if spec else ""))
    return rows, statistics.median(rates[method]) / statistics.median(rates["none"]), same


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    record = provenance.collect("experiments.serving.speculative", argv, seeds={"sharegpt_shuffle": args.seed})
    print(setup_compile_cache(args))
    model, tokenizer, model_name = serving.load_model("smollm2")
    paged = RaggedModel(model)

    def builder(max_seqs: int):
        def build(spec):
            return serving.make_engine(model, kv_tokens=8192, page_size=16, max_seqs=max_seqs, max_batched_tokens=256,
                                       paged_model=paged, stop_ids=tokenizer.stop_ids, speculative=spec)
        return build

    results = {}
    all_rows = []
    reqs = repetitive_requests(tokenizer, args) if args.num_texts else []
    if reqs:
        rows, ratio, same = bench("repetitive", builder(1), reqs, args)
        results["repetitive"] = (ratio, same, rows)
        all_rows += rows
    if args.demo_requests:
        demo, _, _ = sharegpt.build_requests(tokenizer, args.demo_requests, 48, seed=args.seed)
        rows, ratio, same = bench("demo", builder(64), demo, args)
        results["demo"] = (ratio, same, rows)
        all_rows += rows
    summary = []
    for name, (ratio, same, rows) in results.items():
        spec_rows = [r for r in rows if r["speculation"] == args.method]
        summary.append({"workload": name, "ratio": f"{ratio:.2f}x", "same": "yes" if same else "NO",
                        "acceptance": spec_rows[-1]["acceptance_rate"],
                        "length": spec_rows[-1]["mean_accepted_length"],
                        "by_position": ", ".join(f"{a:.2f}" for a in spec_rows[-1]["_positions"])})
    title, what = {
        "ngram": ("n-gram prompt lookup", f"n-gram: k = {args.num_speculative_tokens} tokens proposed at most, "
                  f"n-grams of {args.ngram_min} to {args.ngram_max} tokens (`SpeculativeConfig.ngram`)"),
        "early-exit": (f"early-exit draft of the first {args.draft_layers} layers",
                       f"early exit: the model's first {args.draft_layers} of {model.config.num_layers} layers, its "
                       f"final norm and head propose k = {args.num_speculative_tokens} greedy tokens, run in an "
                       "engine of their own (`SpeculativeConfig.draft(num_layers=...)`: its pool as many tokens as "
                       f"the target's in pages of {args.draft_page_size or 16}, prefix caching on). draft_seconds: "
                       "the seconds of the run spent in that engine"),
    }[args.method]
    table = markdown_table(summary, ("workload", "ratio", "same", "acceptance", "length", "by_position"),
                           headers=["workload", f"{args.method} / none, tokens/s (median runs)",
                                    "greedy outputs identical",
                                    "acceptance rate", "mean accepted length (tokens a call)",
                                    "acceptance by position"])
    runs = markdown_table(all_rows, COLUMNS[:6] + ("acceptance_rate", "mean_accepted_length")
                          + (("draft_seconds",) if args.method == "early-exit" else ()))
    lens = [len(r.prompt_ids) for r in reqs] or [0]
    cap = args.speculative_disable_by_batch_size
    batching = "proposing at any batch size" if cap is None else f"no proposals while {cap} or more sequences run"
    text = (f"# Speculative decoding, {title} ({model_name})\n\n{table}\n\nAcceptance rate, mean accepted "
            "length and acceptance by position (of the proposals at each position, the share kept) are the last "
            f"timed run's (every run's are below; greedy runs repeat them).\n\nEvery timed run:\n\n{runs}\n\n"
            f"{what}. Proposals: {batching}. "
            + (f"Repetitive: {len(reqs)} ShareGPT text{'s' if len(reqs) > 1 else ''} of {args.min_text_tokens}-"
               f"{args.max_text_tokens} tokens (seed {args.seed}), prompts of {_span(lens)} tokens, each alone "
               f"(max_seqs=1), greedy, EOS ends it, at most {args.max_output_len} tokens. " if reqs else "")
            + (f"Demo: {args.demo_requests} ShareGPT requests built as `serve_sharegpt` builds them (outputs capped "
               "at 48 tokens, EOS ignored, 64 sequences at once). " if args.demo_requests else "")
            + "Every target engine: 8,192-token pool, pages of 16, 256 tokens a call; the one without speculation "
            "runs its default async scheduling, the speculating one reads each call before the next while "
            "sequences may propose. Timed runs alternate on fresh engines after a "
            f"compiling run of each (whose outputs are compared).\n\n{machine()}. The run took "
            f"{time.perf_counter() - t_start:.0f} s; load average {load_start:.1f} when it began, "
            f"{os.getloadavg()[0]:.1f} at the end.")
    md, csv = write_table(args.out, args.name, [{k: v for k, v in r.items() if not k.startswith("_")}
                                                 for r in all_rows], COLUMNS, text, record)
    print(f"\n{table}\n\nwrote {md}, {csv} in {time.perf_counter() - t_start:.0f} s")
    return {name: ratio for name, (ratio, _, _) in results.items()}


if __name__ == "__main__":
    main(sys.argv[1:])
