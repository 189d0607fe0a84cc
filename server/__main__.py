"""``python -m server``: serve a model over the OpenAI API.

Usage::

    python -m server --model smollm2 --port 8000
    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}'

The model is built by :class:`models.llm.LLM` (``--model smollm2``, a
``.gguf`` file, a Hugging Face folder or a random-weight preset); its
engine is served by :func:`server.app.build_app` with uvicorn. Binds
127.0.0.1 unless ``--host`` says otherwise.

``--profile DIR`` writes a ``jax.profiler`` trace of ``--profile-steps``
engine steps after the first ``--profile-skip`` steps counted from the
first request (:mod:`paged_jax.profiling`; send a warm-up load first, or skip
enough steps, so that compilation stays out of the trace).

``--max-body-bytes``, ``--max-prompts``, ``--max-messages``, ``--max-stop``,
``--max-stop-chars``, ``--max-logit-bias`` and ``--max-cache-salt-chars``
bound a request (:mod:`server.limits`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import uvicorn

from models.llm import LLM
from paged_jax.jit_stats import enable_persistent_cache
from paged_jax.profiling import ProfileSpec, add_profile_args, check_profile_args
from paged_jax.speculative.config import add_speculative_flags, speculative_from_args
from paged_jax.tiers.offload import add_tier_flags, tier_options_from_args
from server.app import build_app
from server.limits import RequestLimits, add_limit_args, limit_args

API_KEY_ENV = "PAGED_JAX_API_KEY"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m server", description="Serve a model over the OpenAI API.")
    p.add_argument("--model", default="smollm2",
                   help="'smollm2' (the packaged SmolLM2-135M-Instruct GGUF, default), a .gguf file, a Hugging Face "
                        "checkpoint folder, or a random-weight preset (token-id prompts only)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' (default: --model as given)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, else none)")
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV pool size in tokens (default %(default)s)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default %(default)s)")
    p.add_argument("--max-seqs", type=int, default=32, help="most sequences running at once (default %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help="most tokens per sequence, prompt plus output (default: the model's context, at most 2048)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per model call (default 256, raised to --max-seqs)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="weight dtype (default float32 on CPU, bfloat16 on GPU and TPU)")
    p.add_argument("--kv-dtype", choices=("float32", "bfloat16", "int8", "fp8", "float8_e4m3fn", "float8_e5m2"),
                   default=None, help="K/V page dtype (default float32 on CPU, bfloat16 on GPU and TPU; fp8 is "
                   "float8_e4m3fn; int8 and fp8 pages carry per-token scales)")
    p.add_argument("--no-prefix-caching", action="store_true", help="turn automatic prefix caching off")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="JAX's persistent compilation cache folder, so a restart compiles nothing (default: off)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default %(default)s)")
    add_limit_args(p)
    add_profile_args(p)
    add_speculative_flags(p)
    add_tier_flags(p)
    args = p.parse_args(argv)
    args.speculative_config = speculative_from_args(p, args)
    args.tier_options = tier_options_from_args(p, args)
    if (args.tier_options["host_cache_bytes"] or args.disk_cache_dir or args.kv_role) and args.no_prefix_caching:
        p.error("--host-cache-gib, --disk-cache-dir and --kv-role keep or hand over the prefix cache's pages: they "
                "need prefix caching (drop --no-prefix-caching)")
    check_profile_args(p, args)
    args.limit_bounds = limit_args(p, args)
    if not 0 < args.port < 65536:
        p.error(f"--port must be in [1, 65535], got {args.port}")
    if args.api_key == "":
        p.error("--api-key must not be empty")
    return args


GRACEFUL_SHUTDOWN_S = 5.0
"""Most seconds uvicorn waits for open connections after Ctrl-C (the
requests in flight are aborted at once, so their streams end first)."""


class _Server(uvicorn.Server):
    """uvicorn's server whose first Ctrl-C (SIGINT, SIGTERM) also stops the
    engine loop: the requests in flight are aborted and their streams end
    now, with the shutdown's error, instead of uvicorn waiting for every
    stream to finish generating."""

    def __init__(self, config: uvicorn.Config, engine_loop):
        super().__init__(config)
        self.engine_loop = engine_loop

    def handle_exit(self, sig, frame) -> None:
        self.engine_loop.stop_soon()
        super().handle_exit(sig, frame)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("server").setLevel(args.log_level.upper())
    if args.compile_cache is not None:
        enable_persistent_cache(args.compile_cache)
    try:
        llm = LLM(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, kv_tokens=args.kv_tokens,
                  page_size=args.page_size, max_seqs=args.max_seqs, max_seq_len=args.max_seq_len,
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  enable_prefix_caching=not args.no_prefix_caching, speculative=args.speculative_config,
                  **args.tier_options)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"python -m server: {e}") from None
    limits = RequestLimits.for_context(llm.engine.config.max_seq_len, vocab_size=llm.engine.vocab_size,
                                       token_floor=None if llm.tokenizer is None else llm.tokenizer.token_floor,
                                       **args.limit_bounds)
    app = build_app(llm, model_name=args.served_model_name or args.model, api_key=args.api_key, limits=limits)
    log = logging.getLogger("server")
    log.info("serving %r as %r; %r; %r", llm.name, app.state.model_name, llm, limits)
    offload = llm.engine.kv_manager.offload
    if offload is not None and offload.remote is not None:
        r = offload.remote
        where = f"serving pages at {r.address}" if r.role == "producer" else f"loading pages from {r.config.address}"
        log.info("KV %s: %s over %s", r.role, where, r.transport)
    profile = ProfileSpec.from_args(args)
    profiler = None if profile is None else profile.install(llm.engine)  # before the engine loop starts
    if profile is not None:
        log.info("profiling: engine steps %d-%d after the first request go to a trace in %s", profile.skip,
                 profile.skip + profile.steps - 1, profile.out_dir)
    try:
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
        try:
            _Server(config, app.state.engine_loop).run()
        except KeyboardInterrupt:  # uvicorn.run catches the signal it re-raises; Server.run does not
            pass
    finally:
        llm.engine.close()  # a KV producer stops serving and its threads end before the interpreter does
        if profiler is not None:
            profiler.close()
            log.info("profiling: %d steps traced into %s (Perfetto: plugins/profile/*/perfetto_trace.json.gz)",
                     profiler.traced, profile.out_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
