"""Train a small GQA decoder on ShareGPT, then serve it through pages.

    python -m experiments.train_tiny [--steps 150] [--batch 8] [--seq-len 256]
    python -m experiments.train_tiny --init smollm2 [--steps 10]

From scratch (default): a 4-layer decoder with 8 query heads and 2 KV heads
(D = 96, H = 16, F = 256, the SmolLM2 vocabulary of 49,152 tied to the
output; about 5.1 M parameters, 4.7 M of them the embedding) learns ShareGPT
conversations rendered with SmolLM2's chat template and tokenized with its
tokenizer. ``--init smollm2`` fine-tunes SmolLM2-135M-Instruct from its GGUF
instead.

Conversations are split before packing (the last ``--held-out`` fraction of
those loaded never trains) and packed into rows of ``--seq-len`` tokens
(:func:`models.train.pack_documents`). Training runs
:class:`models.train.Trainer` (AdamW, linear warmup then cosine decay,
global-norm clipping), with a progress bar; the held-out loss is measured on
a fixed set of rows every ``--eval-every`` steps.

Writes (``train_tiny_smollm2.*`` with ``--init smollm2``):
  ``<out>/train_tiny.csv``  per step: loss, gradient norm, learning rate,
                            held-out loss (where measured), seconds.
  ``<out>/train_tiny.md``   the run's summary and the served samples.
  ``<out>/train_tiny.png``  the loss curves.
  ``--checkpoint``          the trained weights (safetensors,
                            :mod:`models.loading.checkpoint`); by default
                            ``checkpoints/train_tiny[_smollm2].safetensors``
                            (git-ignored: weights are not results; 21 MB,
                            or 538 MB for SmolLM2).
Then it reloads the checkpoint, checks that its logits equal the trained
model's bit for bit, and serves ``--prompts`` held-out prompts through the
paged engine, each greedy and sampled, printing them.
"""

from __future__ import annotations

import argparse
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from experiments.lib import provenance
from experiments.lib.cli import REPO, add_flag, check_out_dir
from experiments.lib.serving import make_engine
from experiments.lib.sharegpt import load_conversations
from experiments.lib.tables import markdown_table, write_table
from models.loading.checkpoint import load_checkpoint, save_checkpoint
from models.llama import Llama, LlamaConfig, forward_dense
from models.smollm2 import load_llama_gguf
from models.tokenizer import load_tokenizer
from models.train import TrainConfig, Trainer, make_batch, pack_documents
from paged_jax.engine.requests import Request
from paged_jax.engine.sampling import SamplingParams

CHECKPOINTS = REPO / "checkpoints"

TINY = dict(model_dim=96, mlp_dim=256, num_layers=4, num_q_heads=8, num_kv_heads=2, head_dim=16)
"""The from-scratch architecture (with the tokenizer's vocabulary)."""

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


def render_conversations(conversations, tokenizer) -> list[str]:
    """ShareGPT records as chat-template text (ChatML for SmolLM2), one per
    conversation with at least one turn; turns with an unknown speaker or a
    non-text value are skipped."""
    texts = []
    for record in conversations:
        messages = []
        for turn in record.get("conversations") or []:
            role = ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
            if role is not None and isinstance(turn.get("value"), str) and turn["value"].strip():
                messages.append({"role": role, "content": turn["value"]})
        if messages:
            texts.append(tokenizer.apply_chat_template(messages, add_generation_prompt=False))
    return texts


def first_user_prompt(record, tokenizer) -> str | None:
    """The record's first human turn as a chat prompt awaiting the answer."""
    for turn in record.get("conversations") or []:
        if isinstance(turn, dict) and ROLES.get(str(turn.get("from", "")).lower()) == "user":
            if isinstance(turn.get("value"), str) and turn["value"].strip():
                return tokenizer.apply_chat_template(turn["value"])
    return None


def make_model(init: str, tokenizer, seed: int):
    """The model to train: a fresh :data:`TINY` decoder or SmolLM2-135M."""
    if init == "smollm2":
        return load_llama_gguf()
    config = LlamaConfig(vocab_size=tokenizer.vocab_size, **TINY)
    # Embeddings at std D^-1/2: the tied output starts at unit-variance
    # logits, so the first loss is near ln V instead of tens of nats.
    return Llama(config, rngs=nnx.Rngs(seed), embed_std=config.model_dim ** -0.5)


def plot(rows: list[dict], held_before: float, path: pathlib.Path, title: str) -> None:
    # Imported here: matplotlib is for this figure alone, and slow to import.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train (batch)", lw=1)
    held = [(0, held_before)] + [(r["step"] + 1, r["held_out_loss"]) for r in rows if r["held_out_loss"] != ""]
    ax.plot(*zip(*held), "o-", label="held out (after the step)", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("next-token loss (nats)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.train_tiny", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--init", choices=("scratch", "smollm2"), default="scratch",
                        help="train the tiny decoder from scratch, or fine-tune SmolLM2-135M from its GGUF")
    parser.add_argument("--steps", type=int, default=None, help="updates (default 150 from scratch, 10 for smollm2)")
    parser.add_argument("--batch", type=int, default=None, help="rows per step (default 8, 2 for smollm2)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per packed row")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-2; 2e-5 for smollm2)")
    parser.add_argument("--warmup", type=int, default=None, help="warmup steps (default 10%% of --steps)")
    parser.add_argument("--conversations", type=int, default=3000, help="ShareGPT conversations to load")
    parser.add_argument("--held-out", type=float, default=0.05, help="fraction of conversations kept out of training")
    parser.add_argument("--eval-every", type=int, default=25, help="steps between held-out evaluations")
    parser.add_argument("--eval-rows", type=int, default=16, help="held-out rows evaluated")
    parser.add_argument("--prompts", type=int, default=4, help="held-out prompts served after training")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per served prompt")
    add_flag(parser, "seed", help="initialization and data order (default %(default)s)")
    add_flag(parser, "out")
    parser.add_argument("--checkpoint", type=pathlib.Path, default=None,
                        help="weights file (default checkpoints/train_tiny[_smollm2].safetensors)")
    args = parser.parse_args(argv)
    fine_tune = args.init == "smollm2"
    steps = args.steps if args.steps is not None else (10 if fine_tune else 150)
    batch_rows = args.batch if args.batch is not None else (2 if fine_tune else 8)
    lr = args.lr if args.lr is not None else (2e-5 if fine_tune else 1e-2)
    warmup = args.warmup if args.warmup is not None else min(max(1, steps // 10), steps - 1)
    for name, value, low in (("--steps", steps, 1), ("--batch", batch_rows, 1), ("--seq-len", args.seq_len, 2),
                             ("--conversations", args.conversations, 2), ("--eval-every", args.eval_every, 1),
                             ("--eval-rows", args.eval_rows, 1), ("--prompts", args.prompts, 0),
                             ("--max-new-tokens", args.max_new_tokens, 1)):
        if value < low:
            parser.error(f"{name} must be >= {low}, got {value}")
    if not 0.0 < args.held_out < 1.0:
        parser.error(f"--held-out must be in (0, 1), got {args.held_out}")
    stem = "train_tiny_smollm2" if fine_tune else "train_tiny"
    record = provenance.collect("experiments.train_tiny", argv, seeds={"init": args.seed, "data_order": args.seed})
    checkpoint = args.checkpoint or CHECKPOINTS / f"{stem}.safetensors"
    # Fail now, not after minutes of training: the optimizer settings and
    # both output places.
    try:
        config = TrainConfig(learning_rate=lr, warmup_steps=warmup, total_steps=steps)
    except ValueError as e:
        parser.error(f"--lr / --warmup / --steps: {e}")
    check_out_dir(parser, args.out)
    check_out_dir(parser, checkpoint.parent, "--checkpoint")

    t_start = time.perf_counter()
    tokenizer = load_tokenizer()
    conversations, _ = load_conversations()
    conversations = conversations[: args.conversations]
    num_held = max(1, int(len(conversations) * args.held_out))
    train_convs, held_convs = conversations[:-num_held], conversations[-num_held:]
    train_docs = tokenizer.encode_batch(render_conversations(train_convs, tokenizer))
    held_docs = tokenizer.encode_batch(render_conversations(held_convs, tokenizer))
    train_tokens, train_segments = pack_documents(train_docs, args.seq_len)
    held_tokens, held_segments = pack_documents(held_docs, args.seq_len)
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(train_tokens))
    eval_batch = make_batch(held_tokens[: args.eval_rows], held_segments[: args.eval_rows])
    print(f"data: {len(train_convs)} training conversations -> {len(train_tokens)} rows of {args.seq_len} tokens "
          f"({int((train_segments > 0).sum()):,} tokens); {len(held_convs)} held out -> {len(held_tokens)} rows")
    epochs = steps * batch_rows / len(train_tokens)
    if epochs > 1:
        print(f"note: {steps} steps of {batch_rows} rows go {epochs:.1f} times over the training rows")

    model = make_model(args.init, tokenizer, args.seed)
    trainer = Trainer(model, config)
    state = trainer.init(model)
    del model
    print(f"model: {trainer.model(state).config.num_params / 1e6:.2f} M parameters "
          f"({'SmolLM2-135M from its GGUF' if fine_tune else 'from scratch'}); "
          f"AdamW lr {lr:g}, warmup {config.warmup_steps}, cosine to {lr * config.final_lr_ratio:g}, clip "
          f"{config.clip_norm}")

    rows: list[dict] = []
    held0 = float(trainer.evaluate(state, eval_batch))
    t_train = time.perf_counter()
    bar = tqdm(range(steps), desc="train", unit="step")
    for step in bar:
        pick = order[np.arange(step * batch_rows, (step + 1) * batch_rows) % len(order)]
        state, metrics = trainer.step(state, make_batch(train_tokens[pick], train_segments[pick]))
        metrics = {k: float(v) for k, v in metrics.items()}
        held = ""
        if (step + 1) % args.eval_every == 0 or step == steps - 1:
            held = float(trainer.evaluate(state, eval_batch))
        rows.append({"step": step, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"],
                     "lr": metrics["lr"], "held_out_loss": held,
                     "seconds": time.perf_counter() - t_train})
        bar.set_postfix(loss=f"{metrics['loss']:.3f}", gnorm=f"{metrics['grad_norm']:.2f}",
                        lr=f"{metrics['lr']:.2e}")
    bar.close()
    train_s = time.perf_counter() - t_train
    tokens_seen = steps * batch_rows * args.seq_len
    assert trainer.num_compilations == 1, f"the train step compiled {trainer.num_compilations} times"

    trained = trainer.model(state)
    save_checkpoint(trained, checkpoint, metadata={"steps": str(steps), "init": args.init})
    loaded, _ = load_checkpoint(checkpoint)
    probe = eval_batch.tokens[:2]
    same = bool(jnp.array_equal(forward_dense(trained, probe), forward_dense(loaded, probe), equal_nan=True))
    print(f"checkpoint: {checkpoint} ({checkpoint.stat().st_size / 1e6:.1f} MB); reloaded logits identical: {same}")
    if not same:
        raise SystemExit("the reloaded checkpoint's logits differ from the trained model's")

    # Serve held-out prompts from the reloaded checkpoint through the paged engine.
    prompts = [p for p in (first_user_prompt(r, tokenizer) for r in held_convs) if p is not None]
    max_prompt = 192
    prompts = [p for p in prompts if len(tokenizer.encode(p)) <= max_prompt][: args.prompts]
    samples = []
    if prompts:
        max_seq_len = max_prompt + args.max_new_tokens
        page_size = 16
        # Room for every sequence (each prompt greedy and sampled) at its longest.
        engine = make_engine(loaded, kv_tokens=2 * len(prompts) * -(-max_seq_len // page_size) * page_size,
                             page_size=page_size, max_seqs=2 * len(prompts), max_seq_len=max_seq_len,
                             stop_ids=tokenizer.stop_ids)
        # Each prompt twice: greedy, and sampled (temperature 0.8, top-p 0.95),
        # which shows more of what a small model has learned than its argmax.
        sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=args.seed)
        requests = [Request(request_id=f"{i}-{kind}", prompt_ids=tokenizer.encode(p), max_new_tokens=args.max_new_tokens,
                            sampling=sampled if kind == "sampled" else SamplingParams())
                    for i, p in enumerate(prompts) for kind in ("greedy", "sampled")]
        outputs = {o.request_id: o for o in engine.run(requests)}
        for i, prompt in enumerate(prompts):
            user = prompt.split("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0].strip()
            samples.append((user, *(tokenizer.decode(outputs[f"{i}-{kind}"].output_ids) for kind in ("greedy", "sampled"))))
    wall = time.perf_counter() - t_start

    first, last = rows[0], rows[-1]
    held_rows = [r for r in rows if r["held_out_loss"] != ""]
    summary = [
        ("init", "SmolLM2-135M-Instruct (GGUF)" if fine_tune else "from scratch"),
        ("parameters", f"{trained.config.num_params:,}"),
        ("steps x rows x tokens", f"{steps} x {batch_rows} x {args.seq_len} = {tokens_seen:,} tokens"),
        ("train loss, first step (nats)", f"{first['loss']:.3f}"),
        ("train loss, last step (nats)", f"{last['loss']:.3f}"),
        ("held-out loss before / after (nats)", f"{held0:.3f} / {held_rows[-1]['held_out_loss']:.3f}"),
        ("training time (s)", f"{train_s:.1f}"),
        ("tokens / s (training)", f"{tokens_seen / train_s:,.0f}"),
        ("whole run, data and serving included (s)", f"{wall:.1f}"),
        ("backend", f"{jax.default_backend()} ({jax.devices()[0].device_kind}, {jax.device_count()} devices)"),
    ]
    md = [f"# Training: {stem}", "", f"`python -m experiments.train_tiny --init {args.init} --steps {steps} "
          f"--batch {batch_rows} --seq-len {args.seq_len}`", "",
          markdown_table([{"quantity": k, "value": v} for k, v in summary], ["quantity", "value"])]
    md += ["", f"![loss curves]({stem}.png)", "", "## Served from the reloaded checkpoint (paged engine; greedy, and sampled at temperature 0.8, top-p 0.95)", ""]
    for user, greedy, sample in samples:
        md += [f"- **prompt:** {user[:200]!r}", f"  - greedy: {greedy!r}", f"  - sampled: {sample!r}"]
    write_table(args.out, stem, rows, list(rows[0]), "\n".join(md), record)
    plot(rows, held0, args.out / f"{stem}.png",
         f"{stem}: {trained.config.num_params / 1e6:.1f} M params, {tokens_seen:,} tokens")
    print()
    for k, v in summary:
        print(f"{k:>44}: {v}")
    for user, greedy, sample in samples:
        print(f"\nprompt:  {user[:200]!r}\ngreedy:  {greedy!r}\nsampled: {sample!r}")
    print(f"\nwrote {args.out / (stem + '.md')}, .csv and .png")


if __name__ == "__main__":
    main()
