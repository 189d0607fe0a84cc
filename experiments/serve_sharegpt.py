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
default), a local Hugging Face checkpoint folder (``--model PATH``: Llama,
Mistral or Qwen2 safetensors, :mod:`models.hf_loader`), or a real
architecture with random weights (``--model llama-3-8b``, ``qwen2.5-7b``,
``smollm2-135m``: :mod:`models.presets`). A preset needs neither the GGUF nor
the ShareGPT package: it serves the packaged request lengths
(``experiments/data/sharegpt_requests.json``, :func:`packaged_requests`),
so an accelerator host with no network measures serving at real scale.
Weights in ``--dtype`` and K/V in ``--kv-dtype``: f32 on CPU, bf16 on GPU
and TPU by default.

Usage: ``python -m experiments.serve_sharegpt [--model NAME|PATH] [--num-requests N] ...``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments import provenance
from experiments.cli import add_compile_cache_args, check_compile_cache, check_out_dir, machine, require_positive
from experiments.cli import setup_compile_cache
from experiments.sharegpt import load_conversations, sample_requests
from paged_jax.checks import check_int
from paged_jax.kv_cache import default_kv_dtype
from paged_jax.engine import Engine, EngineConfig, EngineStats, Request, RequestOutput, num_traces
from paged_jax.data_parallel import merged_stats
from paged_jax.jit_stats import CompileMonitor
from models.presets import PRESETS

CSV_COLUMNS = (
    "mode",
    "requests",
    "generated_tokens",
    "wall_s",
    "tokens_per_s",
    "peak_concurrency",
    "mean_concurrency",
    "kv_token_fraction",
    "preemptions",
    "iterations",
    "model_calls",
    "model_s",
    "floor_s",
    "model_over_floor",
    "padding",
    "host_s",
    "compile_s",
    "programs",
    "compiled",
    "weights_dtype",
    "kv_dtype",
)
MODES = ("paged", "contiguous")
MAX_SEQ_LEN = 2048  # the longest request vLLM's sampling keeps: prompt + output
KV_DTYPES = ("float32", "bfloat16", "int8")
PACKAGED_LIMIT = 1000  # requests in experiments/data/sharegpt_requests.json


@dataclasses.dataclass(frozen=True)
class ServeResult:
    """One mode's row. Times in seconds; ``tokens_per_s`` counts generated
    tokens over ``wall_s`` (compilation excluded). ``model_s``: the model
    calls (page-state update, forward, sampling); ``floor_s``: the model's
    weight matmuls alone at the same calls' padded token counts, measured in
    the same run (``models.llama.weight_matmuls``); ``padding``: the share of
    token rows that were padding; ``host_s``: the engine's time outside model
    calls; ``programs``: distinct step shapes; ``compiled``: XLA
    compilations during this mode, of any jitted function (the step, the
    page-state free at the end, ...), not served by the persistent cache."""

    mode: str
    requests: int
    generated_tokens: int
    wall_s: float
    tokens_per_s: float
    peak_concurrency: int
    mean_concurrency: float
    kv_token_fraction: float
    preemptions: int
    iterations: int
    model_calls: int
    model_s: float
    floor_s: float
    model_over_floor: float
    padding: float
    host_s: float
    compile_s: float
    programs: int
    compiled: int
    weights_dtype: str
    kv_dtype: str
    prefill_tokens: int
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


PACKAGED_REQUESTS = pathlib.Path(__file__).resolve().parent / "data" / "sharegpt_requests.json"


def packaged_requests(num_requests: int, max_output_len: int, *, vocab_size: int, seed: int = 0,
                      path: pathlib.Path = PACKAGED_REQUESTS) -> list[Request]:
    """Requests with the lengths of the packaged ShareGPT sample, for models
    without a tokenizer (random-weight presets).

    The file (made by ``python -m experiments.make_request_lengths``) holds
    the templated prompt length and output length of the first 1,000
    requests :func:`build_requests` samples with seed 0. Request ``i``'s
    prompt is the chat template's prefix ids, ``prompt_tokens - len(prefix)
    - len(suffix)`` random ids (``numpy.random.default_rng([seed, i])``,
    in ``[0, vocab_size)``) and the template's suffix: the lengths and the
    shared template prefix are ShareGPT's, the words are not (with random
    weights only the lengths matter). Outputs: ``min(output_tokens,
    max_output_len)`` tokens, EOS ignored.

    Raises:
      ValueError: ``num_requests`` above the file's 1,000, an argument
        below 1 (``seed`` below 0), a ``vocab_size`` that cannot hold the
        template's ids, or a malformed file (named).
    """
    for name, value, low in (("num_requests", num_requests, 1), ("max_output_len", max_output_len, 1),
                             ("vocab_size", vocab_size, 1), ("seed", seed, 0)):
        check_int(name, value, low)
    try:
        data = json.loads(pathlib.Path(path).read_text())
        rows, prefix, suffix = data["requests"], data["template_prefix_ids"], data["template_suffix_ids"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{str(path)!r} is not a packaged request file "
                         f"(python -m experiments.make_request_lengths writes one): {e!r}") from None
    if num_requests > len(rows):
        raise ValueError(f"num_requests={num_requests} exceeds the {len(rows)} packaged requests in {path}")
    if max(prefix + suffix) >= vocab_size:
        raise ValueError(f"vocab_size={vocab_size} cannot hold the chat template's token ids (up to "
                         f"{max(prefix + suffix)}) in {path}")
    for i, (prompt_len, output_len) in enumerate(rows[:num_requests]):
        if prompt_len < len(prefix) + len(suffix) or output_len < 1:
            raise ValueError(f"{path}: request {i} has prompt_tokens={prompt_len} (the template alone takes "
                             f"{len(prefix) + len(suffix)}) and output_tokens={output_len} (need >= 1)")
    requests = []
    for i, (prompt_len, output_len) in enumerate(rows[:num_requests]):
        body = np.random.default_rng([seed, i]).integers(0, vocab_size, prompt_len - len(prefix) - len(suffix))
        ids = list(prefix) + body.tolist() + list(suffix)
        requests.append(Request(request_id=i, prompt_ids=ids, max_new_tokens=min(output_len, max_output_len),
                                ignore_eos=True))
    return requests


def serve(
    model,
    requests: list[Request],
    *,
    mode: str,
    page_size: int = 16,
    kv_budget_tokens: int = 8192,
    max_seqs: int = 64,
    max_batched_tokens: int = 256,
    paged_model=None,
    stop_ids=(),
    progress: bool = True,
    floor: "MatmulFloor | None | bool" = None,
    prefix_caching: bool = True,
    preemption_mode: str = "recompute",
    mesh=None,
    kv_dtype=None,
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
      max_batched_tokens: tokens per model call (decode and prefill chunks).
      paged_model: ``models.llama.RaggedModel(model)``; pass the same one to
        several calls to share compiled programs.
      floor: measures the weight-matmul floor of the calls made (default a
        new :class:`MatmulFloor`); False skips it (``floor_s`` 0,
        ``model_over_floor`` NaN).
      prefix_caching: automatic prefix caching (``EngineConfig``).
      preemption_mode: "recompute" or "swap".
      mesh: a ``(data, model)`` device mesh (``paged_jax.sharding.make_mesh``):
        one engine per data shard, tensor parallel over its model devices,
        each with a pool of ``kv_budget_tokens`` (the budget is per data
        shard); None for one device.
      kv_dtype: dtype of the K/V pages (default
        ``paged_jax.kv_cache.default_kv_dtype()``: f32 on CPU, bf16 on GPU
        and TPU).

    Raises:
      ValueError: unknown mode or a budget below one maximum-length sequence.
    """
    from models.llama import RaggedModel

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode=!r}")
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page_size=!r}")
    if kv_budget_tokens // page_size * page_size < MAX_SEQ_LEN:
        raise ValueError(
            f"kv_budget_tokens rounded down to whole pages must hold one maximum-length request "
            f"({MAX_SEQ_LEN} tokens), got {kv_budget_tokens=} {page_size=}"
        )
    num_pages = kv_budget_tokens // page_size + 1  # + the null page
    kv_dtype = jnp.dtype(kv_dtype or default_kv_dtype())
    config = EngineConfig(
        max_seqs=max_seqs,
        max_seq_len=MAX_SEQ_LEN,
        max_num_batched_tokens=max(max_batched_tokens, max_seqs),
        reserve_max_len=mode == "contiguous",
        enable_prefix_caching=prefix_caching,
        preemption_mode=preemption_mode,
    )
    if mesh is None:
        pool = model.config.make_kv_pool(num_pages, page_size, kv_dtype)
        engine = Engine(paged_model or RaggedModel(model), pool, config, stop_ids=stop_ids,
                        vocab_size=model.config.vocab_size)
    else:
        from models.sharded import make_data_parallel_engine

        pool = None
        engine = make_data_parallel_engine(model, mesh, config, pages_per_shard=num_pages, page_size=page_size,
                                           stop_ids=stop_ids, vocab_size=model.config.vocab_size, kv_dtype=kv_dtype)
    with CompileMonitor() as compiles:
        t0 = time.perf_counter()
        outputs = engine.run(requests, progress=progress)
        wall = time.perf_counter() - t0 - compiles.counts.seconds
    st = merged_stats(engine)
    floor_s = 0.0 if floor is False else (floor or MatmulFloor(model)).seconds(st)
    generated = sum(len(o.output_ids) for o in outputs)
    rows = sum(c.shape.num_tokens for c in st.calls)
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
        iterations=st.iterations,
        model_calls=st.model_calls,
        model_s=round(st.model_s, 2),
        floor_s=round(floor_s, 2),
        model_over_floor=round(st.model_s / floor_s, 2) if floor_s else float("nan"),
        padding=round(1 - sum(c.tokens for c in st.calls) / rows, 3) if rows else 0.0,
        host_s=round(st.host_s, 2),
        compile_s=round(compiles.counts.seconds, 1),
        programs=st.num_programs,
        compiled=compiles.counts.compiled,
        weights_dtype=jnp.dtype(model.embed[...].dtype).name,
        kv_dtype=kv_dtype.name,
        prefill_tokens=st.prefill_tokens,
        page_size=page_size,
        kv_budget_tokens=(num_pages - 1) * page_size,
    )
    del engine, pool
    return result, sorted(outputs, key=lambda o: o.request_id)


class MatmulFloor:
    """Seconds the model's weight matmuls alone take at a call's padded
    token count (``models.llama.weight_matmuls``): the floor a model call
    can approach. Each (tokens, logits rows) shape is compiled once and timed
    as the fastest of ``repeats`` runs (a floor: noise only adds time);
    results are cached per shape."""

    def __init__(self, model, repeats: int = 5):
        from models.llama import weight_matmuls

        self._fn = jax.jit(weight_matmuls, static_argnums=2)
        self._model = model
        self._repeats = repeats
        self._cache: dict[tuple[int, int], float] = {}

    def time(self, num_tokens: int, num_logits: int) -> float:
        key = (num_tokens, num_logits)
        if key not in self._cache:
            x = jnp.ones((num_tokens, self._model.config.model_dim), self._model.embed[...].dtype)
            self._fn(self._model, x, num_logits).block_until_ready()
            times = []
            for _ in range(self._repeats):
                t = time.perf_counter()
                self._fn(self._model, x, num_logits).block_until_ready()
                times.append(time.perf_counter() - t)
            self._cache[key] = min(times)
        return self._cache[key]

    def seconds(self, stats: EngineStats) -> float:
        """The floor summed over an engine's model calls."""
        return sum(self.time(c.shape.num_tokens, c.shape.num_logits) for c in stats.calls)


def markdown_table(results: list[ServeResult]) -> str:
    cols = CSV_COLUMNS
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
    p.add_argument(
        "--max-batched-tokens", type=int, default=256,
        help="tokens per model call, decode tokens and prefill chunks together (default 256; raised to --max-seqs)",
    )
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (SmolLM2-135M-Instruct from its GGUF, the default), the path of a Hugging Face "
                        "checkpoint folder (config.json, *.safetensors, tokenizer.json; llama, mistral or qwen2), or "
                        f"a random-weight preset of a real architecture ({', '.join(sorted(PRESETS))}), which serves "
                        "the packaged ShareGPT request lengths and needs no tokenizer")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weight dtype (default float32 on CPU, bfloat16 on GPU and TPU)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default=None,
                   help="K/V page dtype (default float32 on CPU, bfloat16 on GPU and TPU); int8 stores an f32 scale "
                        "per token and KV head beside the pages")
    p.add_argument("--mesh", default=None,
                   help="serve over a device mesh, e.g. 'data=2,model=4': one engine per data shard, each tensor "
                        "parallel over its model devices and with its own --kv-budget-tokens pool (default: one "
                        "device). Multi-host: set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID")
    p.add_argument("--seed", type=int, default=0,
                   help="ShareGPT shuffle seed; with a preset, the seed of the random prompt ids (default 0)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    p.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute",
                   help="how a preempted request gives back its pages (default recompute)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent / "results",
                   help="results folder (default: the repository's results/)")
    add_compile_cache_args(p)
    args = p.parse_args(argv)
    require_positive(p, args, "num_requests", "max_output_len", "page_size", "max_seqs", "max_batched_tokens")
    if args.kv_budget_tokens // args.page_size * args.page_size < MAX_SEQ_LEN:
        p.error(
            f"--kv-budget-tokens rounded down to whole pages of --page-size {args.page_size} must hold one "
            f"maximum-length request ({MAX_SEQ_LEN} tokens), got {args.kv_budget_tokens}"
        )
    if args.model in PRESETS and args.num_requests > PACKAGED_LIMIT:
        p.error(f"--num-requests {args.num_requests}: a preset serves the {PACKAGED_LIMIT} packaged requests at most")
    if args.model in PRESETS:  # refuse now what would run out of memory while building the weights
        from experiments.cli import available_memory_bytes
        from models.presets import bytes_to_build

        dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
        need, have = bytes_to_build(args.model, dtype), available_memory_bytes()
        if have is not None and need > have:
            p.error(f"--model {args.model} in {dtype} needs about {need / 1e9:.1f} GB to build its weights, and "
                    f"{jax.default_backend()} has {have / 1e9:.1f} GB available (try --dtype bfloat16, a smaller "
                    "preset, or an accelerator)")
    if args.model != "smollm2" and args.model not in PRESETS:  # fail now, not after loading: reads config.json only
        from models.hf_loader import read_hf_config

        try:
            read_hf_config(args.model)
        except (OSError, ValueError) as e:
            p.error(f"--model {args.model!r} is neither 'smollm2', a preset ({', '.join(sorted(PRESETS))}) nor "
                    f"a supported checkpoint folder: {e}")
    if args.mesh is not None and args.kv_dtype == "int8":
        p.error("--kv-dtype int8 is not supported with --mesh yet; use bfloat16 or float32")
    if args.mesh is not None:
        from paged_jax.sharding import init_distributed, make_mesh, parse_mesh

        try:
            args.mesh_sizes = parse_mesh(args.mesh)
            init_distributed()  # before anything touches the devices
            make_mesh(**args.mesh_sizes, num_kv_heads=None)  # the sizes against the devices, before loading
        except ValueError as e:
            p.error(f"--mesh: {e}")
    check_out_dir(p, args.out)
    check_compile_cache(p, args)
    return args


def load_model(spec: str, dtype=jnp.float32):
    """``(model, tokenizer, name)`` for ``--model``: ``"smollm2"`` (the GGUF),
    a random-weight preset (tokenizer None) or a Hugging Face checkpoint
    folder, weights in ``dtype``.

    Raises:
      FileNotFoundError, ValueError: from the loaders, naming the file.
    """
    if spec in PRESETS:
        from models.presets import random_model

        return random_model(spec, param_dtype=dtype), None, f"{spec} (random weights)"
    if spec == "smollm2":
        from models.smollm2 import load_smollm2

        return (*load_smollm2(param_dtype=dtype), "SmolLM2-135M-Instruct")
    from models.hf_loader import load_hf

    return (*load_hf(spec, param_dtype=dtype), pathlib.Path(spec).resolve().name)


def main(argv=None) -> list[ServeResult]:
    args = parse_args(argv)
    mesh = None
    seeds = {"sharegpt_shuffle": args.seed} if args.model not in PRESETS else {
        "random_weights": 0, "prompt_ids": args.seed}  # packaged_requests draws prompt ids from --seed
    record = provenance.collect("experiments.serve_sharegpt", argv, seeds=seeds)
    from models.llama import RaggedModel

    print(f"machine: {machine()}")
    print(setup_compile_cache(args))
    accelerator = jax.default_backend() != "cpu"
    dtype = jnp.dtype(args.dtype or ("bfloat16" if accelerator else "float32"))
    kv_dtype = jnp.dtype(args.kv_dtype or default_kv_dtype())
    t0 = time.perf_counter()
    model, tokenizer, model_name = load_model(args.model, dtype)
    print(f"loaded {model_name} in {time.perf_counter() - t0:.1f} s; weights {dtype.name}, K/V {kv_dtype.name}")
    if args.mesh is not None:
        from paged_jax.sharding import make_mesh

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

    if tokenizer is not None:
        first = outputs["paged"][0]
        completion = tokenizer.decode(_until_stop(first.output_ids, tokenizer.stop_ids))
        print("\nfirst request\n  prompt:     " + _clip(prompts[0]) + "\n  completion: " + _clip(completion))
    same = sum(a.output_ids == b.output_ids for a, b in zip(outputs["paged"], outputs["contiguous"]))
    table = markdown_table(results)
    ratios = ratio_line(results)
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
    args.out.mkdir(parents=True, exist_ok=True)
    provenance.write_csv(args.out / "serve_sharegpt.csv", [r.csv_row() for r in results], CSV_COLUMNS, record)
    provenance.write_markdown(
        args.out / "serve_sharegpt.md",
        f"# Serving ShareGPT with {model_name}: paged vs contiguous\n\n" + table + "\n\n" + ratios + "\n\n" + summary + "\n",
        record,
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
