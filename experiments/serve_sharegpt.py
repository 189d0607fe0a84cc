"""Serve ShareGPT requests with SmolLM2: paged KV versus contiguous reservation.

The same requests are served twice in one process, on the same KV budget
(tokens of K/V the pool can hold):

* ``paged``: pages of ``--page-size`` tokens handed out as sequences grow
  (PagedAttention, Kwon et al., SOSP 2023);
* ``contiguous``: each request reserves its maximum length (2,048 tokens)
  when admitted, as pre-paging servers did (paper section 3).

Both run the same engine, model, kernels and buckets; only the allocation
policy differs. Prints a Markdown table and writes ``serve_sharegpt.md`` and
``serve_sharegpt.csv`` to ``--out``.

``wall_s`` excludes jit compilation (measured through ``jax.monitoring`` and
reported separately), so that the mode that runs second is not favoured by
programs the first one compiled.

Usage: ``python -m experiments.serve_sharegpt [--num-requests N] ...``
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import pathlib
import platform
import sys
import time

import jax
import jax.monitoring

from experiments.sharegpt import load_conversations, sample_requests
from paged_jax.engine import Engine, EngineConfig, Request, RequestOutput

CSV_COLUMNS = (
    "mode",
    "requests",
    "generated_tokens",
    "wall_s",
    "tokens_per_s",
    "peak_concurrency",
    "mean_concurrency",
    "kv_token_fraction",
)
MODES = ("paged", "contiguous")
MAX_SEQ_LEN = 2048  # the longest request vLLM's sampling keeps: prompt + output


class CompileTimer:
    """Seconds JAX spends tracing, lowering and compiling, from its
    ``/jax/core/compile/*`` monitoring events."""

    def __init__(self):
        self.seconds = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_):
        if event.startswith("/jax/core/compile/"):
            self.seconds += duration

    def close(self):
        jax.monitoring.unregister_event_duration_listener(self._on_event)


@dataclasses.dataclass(frozen=True)
class ServeResult:
    """One mode's row. Times in seconds; ``tokens_per_s`` counts generated
    tokens over ``wall_s``."""

    mode: str
    requests: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float
    peak_concurrency: int
    mean_concurrency: float
    kv_token_fraction: float
    preemptions: int
    prefill_tokens: int
    compile_s: float
    programs: int
    page_size: int
    kv_budget_tokens: int

    def csv_row(self) -> dict:
        return {k: getattr(self, k) for k in CSV_COLUMNS}


def build_requests(tokenizer, num_requests: int, max_output_len: int, *, seed: int = 0):
    """ShareGPT requests sampled the way vLLM's benchmark samples them,
    prompts wrapped in the model's chat template.

    Returns:
      ``(requests, prompts, load_report)``: engine requests (greedy, fixed
      output length ``min(dataset output length, max_output_len)``, EOS
      ignored as serving benchmarks do), the raw prompt texts, and the
      ShareGPT load report.

    Raises:
      ValueError: ``num_requests`` or ``max_output_len`` below 1.
    """
    if max_output_len < 1:
        raise ValueError(f"max_output_len must be >= 1, got {max_output_len=}")
    conversations, report = load_conversations()
    sampled = sample_requests(conversations, tokenizer.encode_batch, num_requests, seed=seed)
    prompts = [s.prompt for s in sampled]
    templated = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    requests = []
    for i, (s, ids) in enumerate(zip(sampled, tokenizer.encode_batch(templated))):
        out_len = min(s.output_len, max_output_len, MAX_SEQ_LEN - len(ids))
        requests.append(Request(request_id=i, prompt_ids=ids, max_new_tokens=out_len, ignore_eos=True))
    return requests, prompts, report


def serve(
    model,
    requests: list[Request],
    *,
    mode: str,
    page_size: int = 16,
    kv_budget_tokens: int = 8192,
    max_seqs: int = 64,
    step_fn=None,
    stop_ids=(),
    progress: bool = True,
) -> tuple[ServeResult, list[RequestOutput]]:
    """Serves ``requests`` in one mode and measures it.

    Args:
      model: a ``models.llama.Llama`` (its config builds the KV pool).
      requests: engine requests.
      mode: "paged" or "contiguous" (reserve ``MAX_SEQ_LEN`` per request).
      page_size: tokens per page (both modes allocate in pages).
      kv_budget_tokens: K/V slots in the pool, tokens; rounded down to whole
        pages; must hold at least one ``MAX_SEQ_LEN`` sequence.
      max_seqs: most sequences running at once.
      step_fn: a step from ``models.llama.make_step_fn(model)``; pass the
        same one to several calls to share compiled programs.

    Raises:
      ValueError: unknown mode or a budget below one maximum-length sequence.
    """
    from models.llama import make_step_fn

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode=!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size=!r}")
    if kv_budget_tokens // page_size * page_size < MAX_SEQ_LEN:
        raise ValueError(
            f"kv_budget_tokens rounded down to whole pages must hold one maximum-length request "
            f"({MAX_SEQ_LEN} tokens), got {kv_budget_tokens=} {page_size=}"
        )
    step_fn = step_fn or make_step_fn(model)
    num_pages = kv_budget_tokens // page_size + 1  # + the null page
    pool = model.config.make_kv_pool(num_pages, page_size)
    engine = Engine(
        step_fn,
        pool,
        EngineConfig(
            max_seqs=max_seqs,
            max_seq_len=MAX_SEQ_LEN,
            reserve_max_len=mode == "contiguous",
            # The XLA attention on CPU pads each decode row to the longest;
            # splitting long from short rows pays there (see EngineConfig).
            decode_split_overhead=128 if jax.default_backend() == "cpu" else None,
        ),
        stop_ids=stop_ids,
        vocab_size=model.config.vocab_size,
    )
    timer = CompileTimer()
    try:
        t0 = time.perf_counter()
        outputs = engine.run(requests, progress=progress)
        wall = time.perf_counter() - t0 - timer.seconds
    finally:
        timer.close()
    st = engine.stats
    generated = sum(len(o.output_ids) for o in outputs)
    result = ServeResult(
        mode=mode,
        requests=len(outputs),
        generated_tokens=generated,
        wall_s=round(wall, 2),
        tokens_per_s=round(generated / wall, 1),
        peak_concurrency=st.peak_concurrency,
        mean_concurrency=round(st.mean_concurrency, 2),
        kv_token_fraction=round(st.kv_token_fraction, 4),
        preemptions=st.preemptions,
        prefill_tokens=st.prefill_tokens,
        compile_s=round(timer.seconds, 1),
        programs=st.num_programs,
        page_size=page_size,
        kv_budget_tokens=(num_pages - 1) * page_size,
    )
    del engine, pool
    return result, sorted(outputs, key=lambda o: o.request_id)


def markdown_table(results: list[ServeResult]) -> str:
    cols = CSV_COLUMNS + ("preemptions", "compile_s", "programs")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join(str(getattr(r, c)) for c in cols) + " |")
    return "\n".join(lines)


def ratio_line(results: list[ServeResult]) -> str:
    by = {r.mode: r for r in results}
    p, c = by["paged"], by["contiguous"]
    return (
        f"paged/contiguous: throughput {p.tokens_per_s / c.tokens_per_s:.2f}x, "
        f"peak concurrency {p.peak_concurrency / c.peak_concurrency:.2f}x, "
        f"mean concurrency {p.mean_concurrency / max(c.mean_concurrency, 1e-9):.2f}x, "
        f"KV token fraction {p.kv_token_fraction / c.kv_token_fraction:.2f}x"
    )


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import os

    return f"{cpu}, {os.cpu_count()} cores, JAX {jax.__version__} on {jax.default_backend()}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.serve_sharegpt", description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=48, help="ShareGPT requests to serve (default 48)")
    p.add_argument("--max-output-len", type=int, default=48, help="cap on each request's output tokens (default 48)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument(
        "--kv-budget-tokens", type=int, default=8192,
        help="KV pool size in tokens, shared by both modes (default 8192: 4 contiguous reservations of 2048)",
    )
    p.add_argument("--max-seqs", type=int, default=64, help="most sequences running at once (default 64)")
    p.add_argument("--seed", type=int, default=0, help="ShareGPT shuffle seed (default 0)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("results"), help="results folder (default results/)")
    args = p.parse_args(argv)
    for name in ("num_requests", "max_output_len", "page_size", "max_seqs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.kv_budget_tokens // args.page_size * args.page_size < MAX_SEQ_LEN:
        p.error(
            f"--kv-budget-tokens rounded down to whole pages of --page-size {args.page_size} must hold one "
            f"maximum-length request ({MAX_SEQ_LEN} tokens), got {args.kv_budget_tokens}"
        )
    # Fail now, not after minutes of serving.
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        probe = args.out / ".write_test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        p.error(f"--out {str(args.out)!r} is not a writable folder: {e}")
    return args


def main(argv=None) -> list[ServeResult]:
    args = parse_args(argv)
    from models.llama import make_step_fn
    from models.smollm2 import load_smollm2

    print(f"machine: {machine()}")
    t0 = time.perf_counter()
    model, tokenizer = load_smollm2()
    print(f"loaded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f} s")
    requests, prompts, report = build_requests(tokenizer, args.num_requests, args.max_output_len, seed=args.seed)
    print(
        f"ShareGPT: {report.records} complete conversations recovered"
        + (" (the shipped file is truncated mid-record)" if report.truncated else "")
        + f"; serving {len(requests)} requests, "
        f"{sum(len(r.prompt_ids) for r in requests)} prompt tokens, "
        f"{sum(r.max_new_tokens for r in requests)} output tokens"
    )
    step_fn = make_step_fn(model)
    results, outputs = [], {}
    for mode in MODES:
        print(f"serving: {mode}")
        result, outs = serve(
            model, requests, mode=mode, page_size=args.page_size,
            kv_budget_tokens=args.kv_budget_tokens, max_seqs=args.max_seqs, step_fn=step_fn,
        )
        results.append(result)
        outputs[mode] = outs

    first = outputs["paged"][0]
    completion = tokenizer.decode(_until_stop(first.output_ids, tokenizer.stop_ids))
    print("\nfirst request\n  prompt:     " + _clip(prompts[0]) + "\n  completion: " + _clip(completion))
    same = sum(a.output_ids == b.output_ids for a, b in zip(outputs["paged"], outputs["contiguous"]))
    table = markdown_table(results)
    ratios = ratio_line(results)
    compilations = getattr(step_fn, "num_compilations", None)
    compilations = compilations() if callable(compilations) else compilations
    summary = (
        f"{len(requests)} ShareGPT requests, outputs capped at {args.max_output_len} tokens, "
        f"KV budget {results[0].kv_budget_tokens} tokens, page size {args.page_size}, max {args.max_seqs} "
        f"running; {machine()}.\n"
        f"Greedy outputs identical in both modes for {same}/{len(requests)} requests. "
        f"Model step compiled {compilations} times over both modes."
    )
    print("\n" + table + "\n\n" + ratios + "\n\n" + summary)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "serve_sharegpt.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for r in results:
            w.writerow(r.csv_row())
    (args.out / "serve_sharegpt.md").write_text(
        "# Serving ShareGPT with SmolLM2: paged vs contiguous\n\n" + table + "\n\n" + ratios + "\n\n" + summary + "\n"
    )
    print(f"\nwrote {args.out / 'serve_sharegpt.md'} and {args.out / 'serve_sharegpt.csv'}")
    return results


def _until_stop(ids, stop_ids):
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[:i]
    return ids


def _clip(text: str, n: int = 400) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


if __name__ == "__main__":
    main(sys.argv[1:])
