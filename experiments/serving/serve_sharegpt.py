"""Serve ShareGPT requests: paged KV versus contiguous reservation.

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

The model is SmolLM2-135M-Instruct from its GGUF (``--model smollm2``, the
default), a local Hugging Face checkpoint folder (``--model PATH``: the
families :mod:`models.loading.hf_loader` reads), a ``.gguf`` file of those families
(:mod:`models.loading.gguf_loader`), or a real
architecture with random weights (``--model llama-3-8b``, ``qwen2.5-7b``,
``smollm2-135m``: :mod:`models.presets`). A preset needs neither the GGUF nor
the ShareGPT package: it serves the packaged request lengths
(``experiments/data/sharegpt_requests.json``,
:func:`experiments.lib.sharegpt.packaged_requests`),
so an accelerator host with no network measures serving at real scale.
Weights in ``--dtype`` and K/V in ``--kv-dtype``: f32 on CPU, bf16 on GPU
and TPU by default.

``--profile DIR`` serves paged once more, untimed, and writes a
``jax.profiler`` trace of a few of its steps (:mod:`paged_jax.profiling`).

The engine, the timing and the result row are :mod:`experiments.lib.serving`'s;
this script holds the flags and the printing.

Usage: ``python -m experiments.serving.serve_sharegpt [--model NAME|PATH] [--num-requests N] ...``
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import jax

from experiments.lib import provenance
from experiments.lib.cli import (
    add_compile_cache_args,
    add_flag,
    add_flags,
    available_memory_bytes,
    check_flags,
    check_outputs,
    machine,
    require_positive,
    resolve_dtype,
    resolve_kv_dtype,
    setup_compile_cache,
)
from experiments.lib.preflight import model_config
from experiments.lib.serving import CSV_COLUMNS, MODES, MatmulFloor, ServeResult, load_model, serve
from experiments.lib.sharegpt import MAX_SEQ_LEN, PACKAGED_LIMIT, PACKAGED_REQUESTS, build_requests, packaged_requests
from experiments.lib.tables import markdown_table, write_table
from models.deepseek.config import DeepseekConfig
from models.presets import PRESETS, bytes_to_build
from models.ragged import RaggedModel
from paged_jax.distributed.sharding import init_distributed, make_mesh, parse_mesh
from paged_jax.engine.core import num_traces
from paged_jax.profiling import ProfileSpec, add_profile_args, check_profile_args, report_trace


def ratio_line(results: list[ServeResult]) -> str:
    by = {r.mode: r for r in results}
    p, c = by["paged"], by["contiguous"]
    return (
        f"paged/contiguous: throughput {p.tokens_per_s / c.tokens_per_s:.2f}x, "
        f"peak concurrency {p.peak_concurrency / c.peak_concurrency:.2f}x, "
        f"mean concurrency {p.mean_concurrency / max(c.mean_concurrency, 1e-9):.2f}x, "
        f"KV token fraction {p.kv_token_fraction / c.kv_token_fraction:.2f}x"
    )

def stream_line(results: list[ServeResult], outputs: dict) -> str:
    """The streamed run's throughput against the two plain paged runs'."""
    by = {r.mode: r for r in results}
    plain = [by["paged"].tokens_per_s, by["paged, again"].tokens_per_s]
    streamed = by["paged, streamed"].tokens_per_s
    same = all(a.output_ids == b.output_ids for a, b in zip(outputs["paged"], outputs["paged, streamed"]))
    return (f"streaming: {streamed} tokens/s streamed vs {plain[0]} and {plain[1]} plain (spread "
            f"{abs(plain[0] - plain[1]) / max(plain):.1%}; streamed/plain mean {2 * streamed / sum(plain):.3f}x); "
            f"streamed outputs {'identical to' if same else 'DIFFERENT from'} plain")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.serving.serve_sharegpt", description=__doc__.split("\n\n")[0])
    add_flags(p, "num_requests", "max_output_len", "page_size")
    p.add_argument(
        "--kv-budget-tokens", type=int, default=8192,
        help="KV pool size in tokens, shared by both modes (default 8192: 4 contiguous reservations of 2048)",
    )
    add_flag(p, "max_seqs")
    p.add_argument(
        "--max-batched-tokens", type=int, default=256,
        help="tokens per model call, decode tokens and prefill chunks together (default 256; raised to --max-seqs)",
    )
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (SmolLM2-135M-Instruct from its GGUF, the default), the path of a Hugging Face "
                        "checkpoint folder (config.json, *.safetensors, tokenizer.json: Llama, Mistral, Qwen2/3, "
                        "Gemma 2/3, OLMo 2), the path of a .gguf file of those families, or "
                        f"a random-weight preset of a real architecture ({', '.join(sorted(PRESETS))}), which serves "
                        "the packaged ShareGPT request lengths and needs no tokenizer")
    add_flag(p, "dtype")
    add_flag(p, "kv_dtype")
    p.add_argument("--mesh", default=None,
                   help="serve over a device mesh, e.g. 'data=2,model=4': one engine per data shard, each tensor "
                        "parallel over its model devices and with its own --kv-budget-tokens pool (default: one "
                        "device). Multi-host: set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID")
    add_flag(p, "seed", help="ShareGPT shuffle seed; with a preset, the seed of the random prompt ids (default 0)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    p.add_argument("--stream", action="store_true",
                   help="also serve paged with every request streaming deltas (text detokenized as it streams, read "
                        "after every step), then paged plain once more: the streamed run against the spread of the "
                        "two plain runs")
    p.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute",
                   help="how a preempted request gives back its pages (default recompute)")
    add_flag(p, "out")
    add_compile_cache_args(p)
    add_profile_args(p)
    args = p.parse_args(argv)
    check_flags(p, args)
    check_profile_args(p, args)
    require_positive(p, args, "max_batched_tokens")
    if args.kv_budget_tokens // args.page_size * args.page_size < MAX_SEQ_LEN:
        p.error(
            f"--kv-budget-tokens rounded down to whole pages of --page-size {args.page_size} must hold one "
            f"maximum-length request ({MAX_SEQ_LEN} tokens), got {args.kv_budget_tokens}"
        )
    if args.model in PRESETS and args.num_requests > PACKAGED_LIMIT:
        p.error(f"--num-requests {args.num_requests}: a preset serves the {PACKAGED_LIMIT} packaged requests at most")
    if args.model in PRESETS:  # refuse now what would run out of memory while building the weights
        dtype = resolve_dtype(args.dtype).name
        need, have = bytes_to_build(args.model, dtype), available_memory_bytes()
        if have is not None and need > have:
            p.error(f"--model {args.model} in {dtype} needs about {need / 1e9:.1f} GB to build its weights, and "
                    f"{jax.default_backend()} has {have / 1e9:.1f} GB available (try --dtype bfloat16, a smaller "
                    "preset, or an accelerator)")
    if args.model != "smollm2" and args.model not in PRESETS:  # fail now, not after loading: reads config.json or the GGUF header only
        try:
            config = model_config(args.model)  # the loaders' readers, DeepSeek folders and GGUFs included
        except (OSError, ValueError) as e:
            p.error(f"--model {args.model!r} is neither 'smollm2', a preset ({', '.join(sorted(PRESETS))}), a "
                    f"supported .gguf file nor a supported checkpoint folder: {e}")
        if isinstance(config, DeepseekConfig):
            p.error(f"--model {args.model!r} is a DeepSeek (MLA) model: this demo compares the paged engine with a "
                    "contiguous KV cache, which has no latent form; serve it with experiments.serving.bench_serving, "
                    "the online benchmarks, the server (python -m server --model PATH) or models.llm.LLM")
    if args.mesh is not None and args.stream:
        p.error("--stream is not supported with --mesh (the data-parallel engine does not stream)")
    if args.mesh is not None:
        try:
            args.mesh_sizes = parse_mesh(args.mesh)
            init_distributed()  # before anything touches the devices
            make_mesh(**args.mesh_sizes, num_kv_heads=None)  # the sizes against the devices, before loading
        except ValueError as e:
            p.error(f"--mesh: {e}")
    check_outputs(p, args)
    return args


def main(argv=None) -> list[ServeResult]:
    args = parse_args(argv)
    mesh = None
    seeds = {"sharegpt_shuffle": args.seed} if args.model not in PRESETS else {
        "random_weights": 0, "prompt_ids": args.seed}  # packaged_requests draws prompt ids from --seed
    record = provenance.collect("experiments.serving.serve_sharegpt", argv, seeds=seeds)

    print(f"machine: {machine()}")
    print(setup_compile_cache(args))
    dtype = resolve_dtype(args.dtype)
    kv_dtype = resolve_kv_dtype(args.kv_dtype)
    t0 = time.perf_counter()
    model, tokenizer, model_name = load_model(args.model, dtype)
    print(f"loaded {model_name} in {time.perf_counter() - t0:.1f} s; weights {dtype.name}, K/V {kv_dtype.name}")
    if args.mesh is not None:
        try:
            mesh = make_mesh(**args.mesh_sizes, num_kv_heads=model.config.num_kv_heads)
        except ValueError as e:
            raise SystemExit(f"--mesh {args.mesh!r}: {e}") from e
        print(f"mesh: data={mesh.shape['data']} x model={mesh.shape['model']} over {mesh.devices.size} "
              f"{jax.devices()[0].platform} devices")
    if tokenizer is None:
        requests = packaged_requests(args.num_requests, args.max_output_len, vocab_size=model.config.vocab_size,
                                     seed=args.seed)
        prompts, source = None, f"packaged ShareGPT request lengths ({PACKAGED_REQUESTS.name}), random prompt ids"
    else:
        requests, prompts, report = build_requests(tokenizer, args.num_requests, args.max_output_len, seed=args.seed)
        source = f"ShareGPT: {report.records} complete conversations recovered" + (
            " (the shipped file is truncated mid-record)" if report.truncated else "")
    print(f"{source}; serving {len(requests)} requests, {sum(len(r.prompt_ids) for r in requests)} prompt tokens, "
          f"{sum(r.max_new_tokens for r in requests)} output tokens")
    paged_model = RaggedModel(model)
    floor = MatmulFloor(model)
    profile = ProfileSpec.from_args(args)
    results, outputs = [], {}
    for mode in MODES:
        print(f"serving: {mode}")
        result, outs = serve(
            model, requests, mode=mode, page_size=args.page_size, kv_budget_tokens=args.kv_budget_tokens,
            max_seqs=args.max_seqs, max_batched_tokens=args.max_batched_tokens, paged_model=paged_model,
            prefix_caching=not args.no_prefix_caching, preemption_mode=args.preemption_mode,
            floor=floor, mesh=mesh, kv_dtype=kv_dtype,
        )
        results.append(result)
        outputs[mode] = outs
    if args.stream:
        for label, stream in (("paged, streamed", True), ("paged, again", False)):
            print(f"serving: {label}")
            result, outs = serve(
                model, requests, mode="paged", page_size=args.page_size, kv_budget_tokens=args.kv_budget_tokens,
                max_seqs=args.max_seqs, max_batched_tokens=args.max_batched_tokens, paged_model=paged_model,
                prefix_caching=not args.no_prefix_caching, preemption_mode=args.preemption_mode, floor=floor,
                kv_dtype=kv_dtype, stream=stream, tokenizer=tokenizer if stream else None)
            results.append(dataclasses.replace(result, mode=label))
            outputs[label] = outs

    if tokenizer is not None:
        first = outputs["paged"][0]
        completion = tokenizer.decode(_until_stop(first.output_ids, tokenizer.stop_ids))
        print("\nfirst request\n  prompt:     " + _clip(prompts[0]) + "\n  completion: " + _clip(completion))
    same = sum(a.output_ids == b.output_ids for a, b in zip(outputs["paged"], outputs["contiguous"]))
    rows = [r.csv_row() for r in results]
    table = markdown_table(rows, CSV_COLUMNS)
    ratios = ratio_line(results)
    if args.stream:
        ratios += "\n\n" + stream_line(results, outputs)
    summary = (
        f"{len(requests)} ShareGPT requests{'' if tokenizer else ' (packaged lengths, random prompt ids)'}, "
        f"outputs capped at {args.max_output_len} tokens, "
        f"KV budget {results[0].kv_budget_tokens} tokens, page size {args.page_size}, max {args.max_seqs} "
        f"running, {max(args.max_batched_tokens, args.max_seqs)} tokens per model call; {machine()}; "
        f"weights {dtype.name}, K/V {kv_dtype.name}.\n"
        f"Greedy outputs identical in both modes for {same}/{len(requests)} requests. "
        f"{num_traces(paged_model) if mesh is None else sum(r.programs for r in results)} step programs traced "
        f"over both modes; XLA compiled "
        f"{sum(r.compiled for r in results)} programs of any kind (step, page-state frees, ...) that the "
        f"persistent cache did not have."
    )
    print("\n" + table + "\n\n" + ratios + "\n\n" + summary)
    md, csv = write_table(
        args.out, "serve_sharegpt", rows, CSV_COLUMNS,
        f"# Serving ShareGPT with {model_name}: paged vs contiguous\n\n" + table + "\n\n" + ratios + "\n\n" + summary,
        record,
    )
    print(f"\nwrote {md} and {csv}")
    if profile is not None:  # a run of its own: tracing slows the steps it traces, so no table row reads it
        print(f"\nserving: paged once more, tracing steps {profile.skip}-{profile.skip + profile.steps - 1}")
        started = time.time()
        serve(model, requests, mode="paged", page_size=args.page_size, kv_budget_tokens=args.kv_budget_tokens,
              max_seqs=args.max_seqs, max_batched_tokens=args.max_batched_tokens, paged_model=paged_model,
              prefix_caching=not args.no_prefix_caching, preemption_mode=args.preemption_mode, floor=False,
              mesh=mesh, kv_dtype=kv_dtype, profile=profile)
        print(report_trace(profile, started))
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
