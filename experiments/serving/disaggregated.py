"""Prefill/decode disaggregation between two engine processes through the KV
connector (issue 38: a request prefilled in one process and decoded in
another equals the request served in one).

Three runs of the same ShareGPT requests (vLLM's sampling, greedy, every
request at once), each process this module with a ``--role``:

- ``colocated``: one engine prefills and decodes every request (the
  reference).
- ``prefill`` + ``decode``, once per transport (``host``, and
  ``jax_transfer`` where this JAX has it): a prefill process whose engine is
  a KV producer serves each request with one output token (its prompt's
  pages are cached and kept for consumers), then stays up serving pages; a
  decode process whose engine is a KV consumer then serves the requests in
  full: every prompt page the producer holds is loaded, not computed, and
  the engine computes only each prompt's last partial page and decodes.

The phases run one after the other (a router would overlap them; the
connector's lookups are per request either way). The outputs of the decode
process must equal the colocated engine's, token for token. Reported per
run: the prompt tokens the decoding engine computed, the tokens it loaded
from the producer and their MiB, the seconds its lookups took (round trips
and pulls), its TTFT p50 and its engine time, loading and compiling
excluded.

Writes ``disaggregated.{md,csv}`` to ``--out``.

Usage: ``python -m experiments.serving.disaggregated [--model toy] [--num-requests 32] ...``
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import time

import numpy as np

from experiments.lib import online, provenance
from experiments.lib.cli import (
    add_flag,
    add_flags,
    check_flags,
    check_outputs,
    machine,
)
from experiments.lib.tables import markdown_table, write_table
from paged_jax.tiers.connector import KVTransferConfig

COLUMNS = ("run", "transport", "prompt_tokens", "computed_prompt_tokens", "device_hit_tokens", "remote_tokens",
           "remote_share",
           "mib_moved", "lookup_ms_per_request", "ttft_p50_s", "engine_s", "outputs_sha", "same_as_colocated")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.serving.disaggregated",
                                description=__doc__.split("\n\n")[0])
    add_flags(p, "model", "dtype", "kv_dtype")
    add_flag(p, "num_requests", default=32, help="ShareGPT requests served (default 32)")
    add_flag(p, "max_output_len", default=32, help="cap on each request's output tokens (default 32)")
    add_flags(p, "seed", "page_size", "max_seqs")
    add_flags(p, "kv_budget_tokens", "max_seq_len")
    add_flag(p, "max_batched_tokens")
    p.add_argument("--transports", default="host,jax_transfer",
                   help="comma-separated transports to run, of host and jax_transfer (default %(default)s)")
    p.add_argument("--role", choices=("compare", "colocated", "prefill", "decode"), default="compare",
                   help="compare (default): run every process and write the table; the others: one process")
    p.add_argument("--kv-address", default="127.0.0.1:0", help="(prefill, decode) the producer's address")
    p.add_argument("--kv-transport", default="host", help="(prefill, decode) the transport")
    p.add_argument("--name", default="disaggregated", help="stem of the files written (default %(default)s)")
    add_flag(p, "out")
    args = p.parse_args(argv)
    check_flags(p, args)
    args.transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [t for t in args.transports if t not in ("host", "jax_transfer")]
    if bad or not args.transports:
        p.error(f"--transports takes host and/or jax_transfer, got {bad or 'none'}")
    if args.role == "compare":
        check_outputs(p, args)
    return args


def _report(engine, outs, engine_s: float, before: tuple[int, float]) -> dict:
    """What one serving process reports (the colocated or the decode one);
    ``before``: the bytes loaded and lookup seconds after its warm-up."""
    remote = engine.stats.remote
    connector = engine.kv_manager.offload.remote if engine.kv_manager.offload is not None else None
    ids = json.dumps([[o.request_id, o.outputs[0].output_ids] for o in sorted(outs, key=lambda o: o.request_id)])
    prompt = sum(len(o.prompt_ids) for o in outs)
    return {"prompt_tokens": prompt, "computed_prompt_tokens": prompt - sum(o.num_cached_tokens for o in outs),
            "remote_tokens": sum(o.num_remote_cached_tokens for o in outs),
            "device_hit_tokens": sum(o.num_cached_tokens - o.num_remote_cached_tokens for o in outs),
            "mib_moved": round((remote.loaded_bytes - before[0]) / 2**20, 2),
            "lookup_ms_per_request": round(1e3 * (connector.lookup_s - before[1]) / len(outs), 2) if connector else 0.0,
            "refused_lookups": remote.refused_lookups,
            "ttft_p50_s": round(float(np.median([o.first_token_s - o.arrival_s for o in outs])), 3),
            "engine_s": round(engine_s, 2), "outputs_sha": hashlib.sha256(ids.encode()).hexdigest()[:12]}


def serve(args) -> dict:
    """One process (``--role colocated``, ``decode``); ``prefill`` prints its
    address first, prefills, and serves pages until its stdin closes."""
    config = {}
    if args.role in ("prefill", "decode"):
        role = "producer" if args.role == "prefill" else "consumer"
        config["kv_transfer"] = KVTransferConfig(role, args.kv_address, args.kv_transport)
    engine, (requests, warm), model_name, source = online.sharegpt_engine(args, [args.seed, args.seed + 1], **config)
    warm = [dataclasses.replace(r, request_id=("warm", r.request_id)) for r in warm]  # a second draw, for the warm-up
    connector = engine.kv_manager.offload.remote if config else None
    # Every call shape compiled first (TTFT without compiling): the engine's own warm-up (the decode engine's
    # prompts are not the prefill engine's), then a second draw of the workload served as the run will be, so the
    # decode engine has loaded pages of every size it will load (their scatters compiled) before the clock starts.
    online.warm_up(engine, seed=1 if args.role == "decode" else 0)
    engine.run([dataclasses.replace(r, max_new_tokens=1) for r in warm] if args.role == "prefill" else warm)
    before = (engine.stats.remote.loaded_bytes, connector.lookup_s if args.role == "decode" else 0.0)
    if args.role == "prefill":
        t0 = time.perf_counter()
        engine.run([dataclasses.replace(r, max_new_tokens=1) for r in requests])  # prompt pages cached, kept
        print(json.dumps({"address": connector.address, "transport": connector.transport,
                          "prefill_s": round(time.perf_counter() - t0, 2),
                          "saved_pages": engine.stats.remote.spilled_pages}), flush=True)
        sys.stdin.read()  # serve pages until the parent is done
        return {"served_pages": connector.served_pages}
    t0 = time.perf_counter()
    outs = engine.run(requests)
    return {"model": model_name, "source": source, **_report(engine, outs, time.perf_counter() - t0, before),
            "transport": connector.transport if connector else "-"}


def _child(argv: list[str], role: str, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "experiments.serving.disaggregated", *argv, "--role", role, *extra]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _last_json(proc: subprocess.Popen, what: str) -> dict:
    """The next JSON line ``proc`` prints; its stderr if it ends first."""
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    proc.wait()
    raise RuntimeError(f"the {what} process ended ({proc.returncode}) without reporting: {proc.stderr.read()[-3000:]}")


def _run(argv: list[str], role: str, *extra: str) -> dict:
    proc = _child(argv, role, *extra)
    proc.stdin.close()
    out = _last_json(proc, role)
    proc.wait()
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.role != "compare":
        print(json.dumps(serve(args)), flush=True)
        return {}
    t_start = time.perf_counter()
    record = provenance.collect("experiments.serving.disaggregated", argv, seeds={"sharegpt_shuffle": args.seed})
    argv = list(sys.argv[1:] if argv is None else argv)
    rows = [{"run": "colocated", **_run(argv, "colocated")}]
    print(f"colocated: {rows[-1]}")
    prefill_notes = []
    for transport in args.transports:
        producer = _child(argv, "prefill", "--kv-transport", transport)
        try:
            hello = _last_json(producer, "prefill")
            prefill_notes.append(f"{transport}: {hello['saved_pages']} pages saved (warm-up's included), the "
                                 f"requests prefilled in {hello['prefill_s']} s")
            rows.append({"run": "prefill -> decode", **_run(argv, "decode", "--kv-address", hello["address"],
                                                            "--kv-transport", transport)})
        finally:
            producer.stdin.close()
            producer.wait(timeout=60)
        print(f"disaggregated ({transport}): {rows[-1]}")
    ref = rows[0]
    for r in rows:
        r["remote_share"] = round(r["remote_tokens"] / r["prompt_tokens"], 4)
        r["same_as_colocated"] = r["outputs_sha"] == ref["outputs_sha"]
    same = all(r["same_as_colocated"] for r in rows)
    table = markdown_table(rows, COLUMNS, headers=[
        "run", "transport", "prompt tokens", "prompt tokens computed", "hits in its own pool",
        "loaded from the producer", "loaded share",
        "MiB moved", "lookup ms / request", "TTFT p50 s", "engine s", "outputs (SHA-256)", "same as colocated"])
    text = (f"# Prefill/decode disaggregation through the KV connector ({ref['model']})\n\n{table}\n\n"
            f"**Outputs {'identical' if same else 'DIFFERENT'}**: every request decoded in the second process "
            "equals the request served by one engine, token for token. The decoding engine loaded "
            + " and ".join(f"{r['remote_share']:.1%} (over {r['transport']})" for r in rows[1:])
            + " of the prompt tokens from the prefill process; of the rest, prompt prefixes its requests share hit "
            "its own pool, and it computed each prompt's last partial page (the page holding the last prompt token "
            "is always computed). Against the colocated engine, the decoding engine's TTFT p50 is "
            + ", ".join(f"{r['ttft_p50_s'] / ref['ttft_p50_s']:.2f}x and its engine time "
                        f"{r['engine_s'] / ref['engine_s']:.2f}x over {r['transport']}" for r in rows[1:])
            + (" (it no longer prefills; the prefill engine did)" if all(
                r["ttft_p50_s"] < ref["ttft_p50_s"] for r in rows[1:]) else
               " (where above 1x, a prefill this model does in less time than a lookup and a load of its pages: "
               "disaggregation pays when prefill is the expensive part)")
            + f". Prefill processes: {'; '.join(prefill_notes)}.\n\n"
            f"{args.num_requests} requests ({ref['source']}), outputs capped at {args.max_output_len} tokens, every "
            f"request at once; each engine's KV pool {args.kv_budget_tokens} tokens, page size {args.page_size}, "
            f"max {args.max_seqs} running. The phases run one after the other (the decode process starts once the "
            "prefill process has prefilled every request); each engine is warmed up first (every call shape "
            "compiled, then a second draw of the workload served as the run is, so the decode engine's loads are "
            f"compiled too): TTFT and engine seconds exclude loading and compiling. {machine()}. The run took "
            f"{time.perf_counter() - t_start:.0f} s.")
    md, csv = write_table(args.out, args.name, [{c: r[c] for c in COLUMNS} for r in rows], COLUMNS, text, record)
    print(f"\n{table}\n\noutputs {'identical' if same else 'DIFFERENT'}; wrote {md}, {csv}")
    return {"rows": rows, "same": same}


if __name__ == "__main__":
    main(sys.argv[1:])
