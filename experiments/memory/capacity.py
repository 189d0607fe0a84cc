"""Capacity planner: how many pages and sequences a deployment's KV budget holds.

    python -m experiments.memory.capacity --model llama-3-70b --device-memory-gb 80 \\
        --num-devices 8 --cache-fraction 0.9

Lengths default to ShareGPT requests sampled with vLLM's rules and the
SmolLM2 tokenizer (their final lengths, prompt + output); ``--fixed-length``
uses one length for every request instead.
"""

from __future__ import annotations

import argparse
import math

import numpy as np

from experiments.lib.cli import add_flag, check_flags, require_positive
from experiments.lib.sharegpt import load_conversations, sample_requests
from models.tokenizer import load_tokenizer
from paged_jax.memory import DTYPE_BYTES, GB, PRESETS, CapacityPlan, KiB, get_preset, plan_capacity


def sharegpt_final_lengths(num_requests: int = 1000, *, seed: int = 0) -> np.ndarray:
    """Final lengths (prompt + output tokens) of ``num_requests`` ShareGPT
    requests sampled with vLLM's rules and the SmolLM2 tokenizer: i64[R]."""
    conversations, _ = load_conversations()
    requests = sample_requests(conversations, load_tokenizer().encode_batch, num_requests, seed=seed)
    return np.array([r.prompt_len + r.output_len for r in requests], np.int64)


def format_plan(plan: CapacityPlan) -> str:
    """A two-column markdown table of a plan."""
    rows = [
        ("model", plan.model),
        ("memory, all devices", f"{plan.total_memory_bytes / GB:,.1f} GB"),
        ("weights", f"{plan.weight_bytes / GB:,.1f} GB"),
        ("KV budget", f"{plan.cache_bytes / GB:,.1f} GB"),
        ("KV per token", f"{plan.kv_bytes_per_token / KiB:,.1f} KiB ({plan.kv_bytes_per_token:,} B)"),
        ("page size", f"{plan.page_size} tokens ({plan.page_size * plan.kv_bytes_per_token / 2**20:,.2f} MiB)"),
        ("pages in the pool", f"{plan.num_pages:,}"),
        ("tokens in the pool", f"{plan.pool_tokens:,}"),
        ("mean final length", f"{plan.mean_length:,.1f} tokens"),
        ("concurrent sequences, paged", f"{plan.paged_concurrency:,}"),
        (f"concurrent sequences, contiguous ({plan.max_seq_len:,} reserved)", f"{plan.contiguous_concurrency:,}"),
        ("token-state share, paged", f"{plan.paged_token_share:.1%}"),
        ("token-state share, contiguous", f"{plan.contiguous_token_share:.1%}"),
    ]
    lines = ["| quantity | value |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m experiments.memory.capacity", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="llama-3-70b", choices=sorted(PRESETS))
    p.add_argument("--device-memory-gb", type=float, default=80.0, help="memory per device, GB (10**9 bytes)")
    p.add_argument("--num-devices", type=int, default=1)
    p.add_argument("--cache-fraction", type=float, default=0.9,
                   help="share of all device memory for weights + KV (vLLM's gpu_memory_utilization)")
    add_flag(p, "page_size")
    p.add_argument("--kv-dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--weight-dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    p.add_argument("--max-seq-len", type=int, default=2048, help="contiguous reservation, tokens")
    p.add_argument("--fixed-length", type=int, default=None,
                   help="every request has this final length (default: ShareGPT lengths)")
    add_flag(p, "num_requests", default=1000, help="ShareGPT requests to sample (default %(default)s)")
    args = p.parse_args(argv)
    # Named as flags, before any data is loaded.
    if not 0 < args.device_memory_gb < math.inf:
        p.error(f"--device-memory-gb must be a positive finite number, got {args.device_memory_gb}")
    if not 0 < args.cache_fraction <= 1:
        p.error(f"--cache-fraction must be in (0, 1], got {args.cache_fraction}")
    check_flags(p, args)
    require_positive(p, args, "num_devices", "max_seq_len")
    if args.fixed_length is not None and args.fixed_length < 1:
        p.error(f"--fixed-length must be >= 1, got {args.fixed_length}")
    if args.kv_dtype == "int4":
        p.error("--kv-dtype int4 is not a KV cache format here (int4 is for weights)")
    return args


def main(argv=None) -> CapacityPlan:
    args = parse_args(argv)
    if args.fixed_length is not None:
        lengths = np.array([args.fixed_length], np.int64)
        source = f"fixed length {args.fixed_length}"
    else:
        lengths = sharegpt_final_lengths(args.num_requests)
        source = f"{args.num_requests} ShareGPT requests (vLLM sampling, SmolLM2 tokenizer)"
    if args.fixed_length is not None and args.fixed_length > args.max_seq_len:
        raise SystemExit(f"error: --fixed-length {args.fixed_length} exceeds --max-seq-len {args.max_seq_len}")
    try:
        plan = _plan(args, lengths)
    except ValueError as e:  # weights that do not fit, and the like: a usage error, not a traceback
        raise SystemExit(f"error: {e}") from None
    if plan.num_pages == 0:
        raise SystemExit(
            f"error: the KV budget ({plan.cache_bytes} bytes) holds no page of {args.page_size} tokens "
            f"({plan.kv_bytes_per_token} bytes per token)"
        )
    print(f"Lengths: {source}.\n")
    print(format_plan(plan))
    return plan


def _plan(args, lengths) -> CapacityPlan:
    return plan_capacity(
        get_preset(args.model),
        device_memory_bytes=int(args.device_memory_gb * GB),
        num_devices=args.num_devices,
        cache_fraction=args.cache_fraction,
        page_size=args.page_size,
        kv_dtype=args.kv_dtype,
        weight_dtype=args.weight_dtype,
        lengths=lengths,
        max_seq_len=args.max_seq_len,
    )


if __name__ == "__main__":
    main()
