"""Serving over 1, 2, 4 and 8 devices: memory per device, capacity, speed.

    python -m experiments.serving.scaling [--devices 1,2,4,8] [--num-requests 16] [--kv-budget-mib 32]

For every mesh ``data x model`` with ``data * model`` in ``--devices``, the
same ShareGPT requests are served by one engine per data shard, each tensor
parallel over its ``model`` devices (:mod:`paged_jax.distributed.data_parallel`,
:mod:`models.sharded`), every device holding a KV pool of the same byte
budget. Per mesh:

* the KV heads and query-head slots each device holds (SmolLM2's 3 KV heads
  and 9 query heads split evenly over no model axis but 1 and 3, so they are
  replicated and padded: :func:`paged_jax.distributed.sharding.head_layout`);
* pages per device under ``--kv-budget-mib`` and the most sequences of
  ``--capacity-len`` tokens the mesh holds at once (data shards x sequences
  per shard's pool);
* measured: the wall time of serving the requests (compilation excluded),
  iterations of the busiest shard, time per iteration, generated tokens/s,
  and whether the greedy outputs equal those of one device.

On a CPU machine the devices are faked (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
set here when absent), so they share the host's cores: the memory and
capacity columns hold on any hardware; the speed columns show overheads, not
speed-ups. On a GPU node or a TPU slice the same command uses the real
devices (``--devices`` up to ``jax.device_count()``); across hosts, start
one process per host with ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``
and ``JAX_PROCESS_ID`` set (:func:`paged_jax.distributed.sharding.init_distributed`).

Writes ``scaling.md`` and ``scaling.csv`` to ``--out`` (default ``results/``).
"""

from __future__ import annotations

import argparse
import sys
import os

# Before JAX is imported (by any module below): fake 8 CPU devices unless the caller chose otherwise.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments.lib import provenance  # noqa: E402
from experiments.lib.cli import add_flag, add_flags, check_flags, check_outputs, machine, require_positive  # noqa: E402
from experiments.lib.serving import make_engine, run_timed  # noqa: E402
from experiments.lib.sharegpt import build_requests  # noqa: E402
from experiments.lib.tables import markdown_table, write_table  # noqa: E402
from models.smollm2 import load_smollm2  # noqa: E402
from paged_jax.distributed.data_parallel import gather_outputs  # noqa: E402
from paged_jax.distributed.sharding import head_layout, init_distributed, make_mesh  # noqa: E402

COLUMNS = ["devices", "mesh", "kv_heads_per_device", "q_slots_per_device", "pages_per_device",
           "max_concurrent_seqs", "wall_s", "iterations", "ms_per_iteration", "tokens_per_s", "same_outputs"]


def meshes(device_counts) -> list[tuple[int, int]]:
    """Every (data, model) with data * model in ``device_counts``, data-parallel first."""
    return [(n // m, m) for n in device_counts for m in range(1, n + 1) if n % m == 0]


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, checked before any work; ``args.device_counts`` holds ``--devices`` parsed."""
    parser = argparse.ArgumentParser(prog="python -m experiments.serving.scaling", description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", default="1,2,4,8", help="device counts, comma-separated")
    add_flag(parser, "num_requests", default=16, help="ShareGPT requests served per mesh (default %(default)s)")
    add_flag(parser, "max_output_len", default=16)
    parser.add_argument("--max-prompt-len", type=int, default=256, help="requests with longer prompts are skipped")
    parser.add_argument("--kv-budget-mib", type=float, default=32.0, help="KV pool bytes per device (MiB)")
    parser.add_argument("--capacity-len", type=int, default=512, help="sequence length of the capacity column")
    add_flag(parser, "page_size")
    add_flag(parser, "max_seqs", default=8, help="running sequences per data shard (default %(default)s)")
    add_flags(parser, "seed", "out")
    args = parser.parse_args(argv)
    try:
        counts = [int(x) for x in args.devices.split(",")]
    except ValueError:
        parser.error(f"--devices must be comma-separated integers, got {args.devices!r}")
    check_flags(parser, args)
    require_positive(parser, args, "capacity_len", "max_prompt_len")
    if not (args.kv_budget_mib > 0 and args.kv_budget_mib < float("inf")):
        parser.error(f"--kv-budget-mib must be a finite number > 0, got {args.kv_budget_mib}")
    check_outputs(parser, args)
    if min(counts) < 1:
        parser.error(f"--devices must be at least 1 each, got {args.devices!r}")
    args.device_counts = counts
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    counts = args.device_counts
    record = provenance.collect("experiments.serving.scaling", argv, seeds={"sharegpt_shuffle": args.seed})

    init_distributed()
    available = jax.device_count()
    if max(counts) > available:
        sys.exit(f"python -m experiments.serving.scaling: error: --devices must be at most the {available} devices "
                 f"here, got {args.devices!r}")
    model, tokenizer = load_smollm2()
    cfg = model.config
    requests, _, _ = build_requests(tokenizer, args.num_requests * 4, args.max_output_len, seed=args.seed)
    requests = [r for r in requests if len(r.prompt_ids) <= args.max_prompt_len][: args.num_requests]
    if not requests:
        raise SystemExit(f"no sampled request has a prompt of at most --max-prompt-len {args.max_prompt_len} tokens")
    max_seq_len = args.max_prompt_len + args.max_output_len
    print(f"machine: {machine()}, {available} devices; {len(requests)} requests, "
          f"{sum(len(r.prompt_ids) for r in requests)} prompt tokens")

    rows, reference = [], None
    for data, m in meshes(counts):
        layout = head_layout(cfg.num_q_heads, cfg.num_kv_heads, m)
        page_bytes = 2 * cfg.num_layers * layout.kv_heads_per_device * args.page_size * cfg.head_dim * 4  # f32
        pages = int(args.kv_budget_mib * 2**20 // page_bytes)  # the null page included
        per_seq = -(-args.capacity_len // args.page_size)
        if (pages - 1) * args.page_size < max_seq_len:
            print(f"mesh {data}x{m}: {pages} pages per device cannot hold one {max_seq_len}-token sequence; skipped")
            continue
        mesh = make_mesh(data, m, devices=jax.devices()[: data * m])
        if any(len({dev.process_index for dev in row}) > 1 for row in mesh.devices):
            print(f"mesh {data}x{m}: a data shard would span hosts (engines serve whole shards); skipped")
            continue
        if not any(dev.process_index == jax.process_index() for dev in mesh.devices.flat):
            print(f"mesh {data}x{m}: none of this host's devices; skipped")
            continue
        engine = make_engine(model, kv_tokens=(pages - 1) * args.page_size, page_size=args.page_size,
                             max_seqs=args.max_seqs, max_seq_len=max_seq_len, mesh=mesh, stop_ids=tokenizer.stop_ids,
                             kv_dtype=jnp.float32)
        local, wall, _ = run_timed(engine, requests)
        # every host's outputs on every host (one process: just this one's)
        outputs = gather_outputs(local, [r.request_id for r in requests], args.max_output_len)
        reference = reference or outputs
        iterations = max(e.stats.iterations for e in engine.local_engines)
        generated = sum(len(o) for o in outputs.values())
        rows.append({
            "devices": data * m, "mesh": f"{data}x{m}", "kv_heads_per_device": layout.kv_heads_per_device,
            "q_slots_per_device": layout.q_heads_per_device, "pages_per_device": pages,
            "max_concurrent_seqs": data * ((pages - 1) // per_seq), "wall_s": round(wall, 2),
            "iterations": iterations, "ms_per_iteration": round(1000 * wall / iterations, 1),
            "tokens_per_s": round(generated / wall, 1),
            "same_outputs": f"{sum(outputs[k] == reference[k] for k in reference)}/{len(reference)}",
        })
        print(" ".join(f"{k}={v}" for k, v in rows[-1].items()), flush=True)
        del engine

    table = markdown_table(rows, COLUMNS)
    note = (f"SmolLM2-135M (f32) serving {len(requests)} ShareGPT requests (prompts <= {args.max_prompt_len} "
            f"tokens, outputs <= {args.max_output_len}); {args.kv_budget_mib:g} MiB of KV per device, page size "
            f"{args.page_size}, capacity at {args.capacity_len} tokens per sequence; {machine()}, "
            f"{available} devices. Outputs compared with the first mesh (1 device).")
    print("\n" + table + "\n\n" + note)
    if jax.process_index() != 0:
        return  # process 0 writes the files
    md, csv = write_table(args.out, "scaling", rows, COLUMNS,
                          "# Serving over 1-8 devices (data x model meshes)\n\n" + table + "\n\n" + note, record)
    print(f"\nwrote {md} and {csv}")


if __name__ == "__main__":
    main()
