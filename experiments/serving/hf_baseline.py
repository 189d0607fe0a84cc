"""transformers ``generate()`` against the paged engine on the demo's requests.

The baseline researchers reach for first: Hugging Face transformers loading
the same SmolLM2 GGUF (f32, PyTorch on the CPU), serving the same ShareGPT
requests in static batches of ``--batch-size`` (prompts left-padded; each
batch runs until its longest output, EOS ignored so every request produces
exactly its output length, as in the demo). Then the paged engine serves the
same requests in the same process, so the ratio is measured side by side.

``tokens_per_s`` counts each request's own output tokens (not the padding
steps a static batch spends on requests that finished early) over wall
time. The engine's wall time excludes JAX compilation (reported as
``compile_s``); transformers compiles nothing.

Usage: ``python -m experiments.serving.hf_baseline [--num-requests 48] [--out DIR]``;
writes ``hf_baseline.md`` and ``hf_baseline.csv``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

from experiments.lib import provenance
from experiments.lib.cli import (
    add_compile_cache_args,
    add_flags,
    check_flags,
    check_outputs,
    machine,
    require_positive,
    setup_compile_cache,
)
from experiments.lib.serving import serve
from experiments.lib.sharegpt import build_requests
from experiments.lib.tables import markdown_table, write_table
from models.loading.gguf_loader import smollm2_gguf_path
from models.ragged import RaggedModel
from models.smollm2 import load_smollm2

CSV_COLUMNS = ("system", "requests", "generated_tokens", "wall_s", "tokens_per_s", "batch", "compile_s")


def hf_generate(requests, *, batch_size: int, pad_id: int, threads: int = 2) -> tuple[float, list[list[int]]]:
    """Serves ``requests`` with transformers in static batches.

    Returns:
      ``(wall seconds, output ids per request)``; each output has exactly
      the request's ``max_new_tokens`` tokens.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it
    # Imported here: torch and transformers are the baseline's alone, and heavy.
    import torch
    import transformers

    torch.set_num_threads(threads)
    if not sys.stderr.isatty():  # no progress bars in logs
        transformers.utils.logging.disable_progress_bar()
    path = pathlib.Path(smollm2_gguf_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():  # warm-up: first-call initialization is not serving
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, pad_token_id=pad_id)
    outputs = []
    t0 = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, r in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[j, width - len(r.prompt_ids) :] = torch.tensor(list(r.prompt_ids))
            mask[j, width - len(r.prompt_ids) :] = 1
        new = max(r.max_new_tokens for r in batch)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, pad_token_id=pad_id)
        outputs += [out[j, width : width + r.max_new_tokens].tolist() for j, r in enumerate(batch)]
    return time.perf_counter() - t0, outputs


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.serving.hf_baseline", description=__doc__.split("\n\n")[0].replace("``", ""))
    add_flags(p, "num_requests", "max_output_len")  # the demo's defaults
    p.add_argument("--batch-size", type=int, default=8, help="static batch of transformers generate() (default 8)")
    add_flags(p, "seed", "out")
    add_compile_cache_args(p)
    args = p.parse_args(argv)
    check_flags(p, args)
    require_positive(p, args, "batch_size")
    check_outputs(p, args)
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    record = provenance.collect("experiments.serving.hf_baseline", argv, seeds={"sharegpt_shuffle": args.seed})

    print(f"machine: {machine()}")
    print(setup_compile_cache(args))
    model, tokenizer = load_smollm2()
    requests, _, _ = build_requests(tokenizer, args.num_requests, args.max_output_len, seed=args.seed)
    wanted = sum(r.max_new_tokens for r in requests)
    print(f"{len(requests)} requests, {wanted} output tokens")

    print(f"transformers generate(), static batches of {args.batch_size}")
    hf_wall, hf_out = hf_generate(requests, batch_size=args.batch_size, pad_id=tokenizer.pad_id)
    print("paged engine")
    paged, outs = serve(model, requests, mode="paged", paged_model=RaggedModel(model))
    rows = [
        dict(system="transformers generate()", requests=len(requests), generated_tokens=sum(map(len, hf_out)),
             wall_s=round(hf_wall, 2), tokens_per_s=round(sum(map(len, hf_out)) / hf_wall, 1),
             batch=f"static {args.batch_size}", compile_s=0.0),
        dict(system="paged-jax engine", requests=paged.requests, generated_tokens=paged.generated_tokens,
             wall_s=paged.wall_s, tokens_per_s=paged.tokens_per_s, batch=f"continuous, peak {paged.peak_concurrency}",
             compile_s=paged.compile_s),
    ]
    same = sum(o.output_ids == h for o, h in zip(outs, hf_out))
    table = markdown_table(rows, CSV_COLUMNS)
    summary = (
        f"paged/transformers throughput: {rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x, "
        f"measured in one run on {machine()} (f32; torch {args.batch_size}-request static batches, 2 threads).\n"
        f"Greedy outputs identical for {same}/{len(requests)} requests (f32 summation order can flip a "
        f"near-tie, after which a continuation differs)."
    )
    print("\n" + table + "\n\n" + summary)
    md, csv = write_table(
        args.out, "hf_baseline", rows, CSV_COLUMNS,
        "# transformers generate() vs the paged engine (the demo's requests)\n\n" + table + "\n\n" + summary, record,
    )
    print(f"\nwrote {md} and {csv}")
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
