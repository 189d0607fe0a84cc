"""Shared by tests/test_sharding.py and tests/distributed_worker.py: a tiny
GQA model with SmolLM2's awkward head counts, ragged prompts, and greedy
prefill-then-decode through the unsharded and the sharded paths."""

import jax
import jax.numpy as jnp
import numpy as np

from models.llama import LlamaConfig, forward
from models.sharded import ShardedLlama
from paged_jax.distributed.sharding import DATA

TINY_GQA = LlamaConfig(vocab_size=64, model_dim=32, mlp_dim=64, num_layers=2, num_q_heads=9, num_kv_heads=3,
                       head_dim=8)
"""9 query heads and 3 KV heads, as SmolLM2: they split evenly over none of 2, 4 or 8 devices."""
PAGE_SIZE = 4


def make_prompts(n: int, vocab: int, seed: int, lo: int = 1, hi: int = 14) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(0, vocab, int(rng.integers(lo, hi))))) for _ in range(n)]


def block_tables(rows: int, shards: int, pages_per_seq: int) -> np.ndarray:
    """i32[rows, pages_per_seq]: rows split evenly into ``shards`` shards;
    within a shard, local row ``i`` owns local pages ``1 + i * pages_per_seq
    ...`` listed in reverse (page 0 is each shard's null page)."""
    per = rows // shards
    local = np.arange(per)[:, None] * pages_per_seq + 1 + np.arange(pages_per_seq)[::-1][None, :]
    return np.tile(local, (shards, 1)).astype(np.int32)


def padded_rows(rows: list[list[int]]) -> np.ndarray:
    """i32[B, longest row]: the rows, zero-padded on the right."""
    tokens = np.zeros((len(rows), max(map(len, rows))), np.int32)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = row
    return tokens


def _decode(step, prompts, steps, gather, split=None):
    """Greedy: prefill, then ``steps`` decode calls. ``step(tokens, kv_lens,
    q_lens)`` closes over the pool.

    ``split`` (i32[B], default the prompt lengths): prompt tokens each row
    prefills in the first call. A row with some left finishes its prompt in
    the second call, beside the other rows' first decode token: a mixed
    batch of prefill chunks and decode rows, one call more in all.

    Returns tokens i32[B, calls] (each call's argmax; a row's argmax before
    its prompt is done is recorded, not fed) and logits f32[B, calls, V]
    (host)."""
    lens = np.array([len(p) for p in prompts], np.int32)
    kv_lens = lens.copy() if split is None else np.asarray(split, np.int32)
    calls = steps + 1 + int((kv_lens < lens).any())
    logits = gather(step(padded_rows([p[:n] for p, n in zip(prompts, kv_lens)]), kv_lens, kv_lens))
    out_tokens, out_logits = [], []
    for i in range(calls):
        next_ids = logits.argmax(-1).astype(np.int32)
        out_tokens.append(next_ids)
        out_logits.append(logits)
        if i == calls - 1:
            break
        feed = [p[n:] or [int(t)] for p, n, t in zip(prompts, kv_lens, next_ids)]  # the prompt's rest, or decode
        q_lens = np.array([len(f) for f in feed], np.int32)
        kv_lens = kv_lens + q_lens
        logits = gather(step(padded_rows(feed), kv_lens, q_lens))
    return np.stack(out_tokens, 1), np.stack(out_logits, 1)


def mixed_split(prompts) -> np.ndarray:
    """i32[B]: a ``split`` for :func:`decode_unsharded` / :func:`decode_sharded`
    that makes their second call mixed: odd rows (of two tokens or more)
    prefill half their prompt first, even rows all of it."""
    return np.array([len(p) // 2 if b % 2 and len(p) > 1 else len(p) for b, p in enumerate(prompts)], np.int32)


def decode_unsharded(model, prompts, steps, *, device=None, page_size=PAGE_SIZE, kv_dtype=jnp.float32, split=None):
    """The truth: one device, one pool of ``kv_dtype`` pages, global page
    ids. ``split``: as :func:`_decode`."""
    pages = -(-(max(map(len, prompts)) + steps + (split is not None)) // page_size)
    device = device or jax.local_devices()[0]
    kv = [jax.device_put(model.config.make_kv_pool(len(prompts) * pages + 1, page_size, kv_dtype), device)]
    tables = jax.device_put(block_tables(len(prompts), 1, pages), device)
    fn = jax.jit(lambda t, kv, k, q: forward(model, t, kv, tables, k, q))

    def step(t, k, q):
        logits, kv[0] = fn(jnp.asarray(t), kv[0], jnp.asarray(k), jnp.asarray(q))
        return logits

    return _decode(step, prompts, steps, np.asarray, split)


def decode_sharded(model, mesh, prompts, steps, *, gather=np.asarray, page_size=PAGE_SIZE, poison=None,
                   kv_dtype=jnp.float32, split=None):
    """The same through :class:`ShardedLlama` on ``mesh``: rows split over the
    data axis, each shard's block tables in its own local page ids, pages of
    ``kv_dtype``. ``poison(kv, sharded) -> kv`` may rewrite the pool after
    the prefill; ``split``: as :func:`_decode`."""
    data = mesh.shape[DATA]
    pages = -(-(max(map(len, prompts)) + steps + (split is not None)) // page_size)
    sharded = ShardedLlama(model, mesh)
    kv = [sharded.make_kv_pool(len(prompts) // data * pages + 1, page_size, kv_dtype)]
    tables = block_tables(len(prompts), data, pages)
    calls = [0]

    def step(t, k, q):
        if calls[0] == 1 and poison is not None:
            kv[0] = poison(kv[0], sharded)
        calls[0] += 1
        logits, kv[0] = sharded.forward(t, kv[0], tables, k, q)
        return logits

    return _decode(step, prompts, steps, gather, split)
