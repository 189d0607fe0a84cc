"""The toy model and engine builder the engine tests share.

A one-layer attention LM written against the engine's model protocol, so
the engine tests exercise the engine alone (the decoder has its own engine
test in tests/test_llama.py), and ``dense_logits``, the same model without
a cache in float64 NumPy: the oracle every engine output is checked
against. Test files import from here, never from each other.
"""

import functools

import jax.numpy as jnp
import numpy as np

from paged_jax.attention.ragged import attend
from paged_jax.engine.core import Engine, EngineConfig, Request
from paged_jax.engine.sampling import SamplingParams
from paged_jax.paging.kv_cache import KVPool, init_kv_pool, write_layer_pages
from paged_jax.paging.kv_groups import kv_groups

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM = 50, 16, 2, 1, 8
PAGE = 4  # tokens per page in every engine built here unless a test says otherwise
MAX_POS = 256  # rows of the learned position table


def toy_params(seed=0):
    """The toy model's weights, f32, drawn from ``seed``."""
    r = np.random.default_rng(seed)
    return {
        "emb": jnp.asarray(r.normal(size=(VOCAB, DIM)), jnp.float32),  # [V, D]
        "pos": jnp.asarray(r.normal(size=(MAX_POS, DIM)) * 0.5, jnp.float32),  # [MAX_POS, D]
        "wq": jnp.asarray(r.normal(size=(DIM, HEADS * HEAD_DIM)), jnp.float32),  # [D, N*H]
        "wk": jnp.asarray(r.normal(size=(DIM, KV_HEADS * HEAD_DIM)), jnp.float32),  # [D, K*H]
        "wv": jnp.asarray(r.normal(size=(DIM, KV_HEADS * HEAD_DIM)), jnp.float32),  # [D, K*H]
        "wo": jnp.asarray(r.normal(size=(HEADS * HEAD_DIM, DIM)), jnp.float32),  # [N*H, D]
    }


class ToyModel:
    """A one-layer attention LM in the engine's model protocol (params and
    a pure ``apply`` over a flat ragged batch). ``traces`` records the batch
    shape of every trace, so a test can count compilations. ``window``: a
    sliding window of that many tokens (its ``kv_window``), None for
    causal attention over everything."""

    vocab_size = VOCAB

    def __init__(self, params, window=None):
        self.params = params
        self.traces = []
        self.kv_window = window

    def apply(self, params, batch, kv: KVPool):
        self.traces.append(batch.shape)  # runs at trace time only
        t = batch.tokens.shape[0]
        x = params["emb"][batch.tokens] + params["pos"][jnp.clip(batch.positions, 0, MAX_POS - 1)]  # [T, D]
        q = (x @ params["wq"]).reshape(t, HEADS, HEAD_DIM)  # [T, N, H]
        k = (x @ params["wk"]).reshape(t, KV_HEADS, HEAD_DIM)  # [T, K, H]
        v = (x @ params["wv"]).reshape(t, KV_HEADS, HEAD_DIM)  # [T, K, H]
        kv = KVPool(k=write_layer_pages(kv.k, 0, k, batch.slots), v=write_layer_pages(kv.v, 0, v, batch.slots))
        o = attend(q, kv.k, kv.v, 0, batch, sliding_window=self.kv_window)  # [T, N, H]
        h = x + o.reshape(t, -1) @ params["wo"]  # [T, D]
        return h[batch.logits_rows] @ params["emb"].T, kv  # logits [rows, V]


    def make_kv_pool(self, num_pages, page_size, dtype=jnp.float32):
        """An empty one-layer pool for this model (a draft model's, speculative decoding)."""
        return toy_pool(num_pages, page_size, dtype)


def make_toy_step(params):
    """A fresh toy model: its own traces, its own compiled programs."""
    return ToyModel(params)


def toy_pool(num_pages, page_size=PAGE, dtype=jnp.float32):
    """An empty one-layer KV pool shaped for the toy model."""
    return init_kv_pool(num_layers=1, num_kv_heads=KV_HEADS, num_pages=num_pages, page_size=page_size,
                        head_dim=HEAD_DIM, dtype=dtype)


def toy_requests(n, seed=0, max_new=(5, 30), sampling=None, prompt_len=(1, 40)):
    """``n`` requests with random prompts of ``prompt_len`` tokens and
    ``max_new`` new tokens (both [low, high) ranges); ``sampling(i)`` gives
    request i's SamplingParams (greedy if None)."""
    r = np.random.default_rng(seed)
    return [
        Request(
            request_id=i,
            prompt_ids=r.integers(0, VOCAB, size=int(r.integers(*prompt_len))).tolist(),
            max_new_tokens=int(r.integers(*max_new)),
            sampling=sampling(i) if sampling else SamplingParams(),
        )
        for i in range(n)
    ]


@functools.lru_cache(maxsize=None)
def shared_step():
    """One toy model for the tests that do not count compilations, so they
    share compiled programs."""
    return make_toy_step(toy_params())


def make_engine(num_pages=200, page_size=PAGE, max_seqs=8, max_seq_len=80, stop_ids=(), budget=64,
                overlap=True, prefix_caching=True, check=True, **config):
    """An engine over the shared toy model. ``budget`` is
    max_num_batched_tokens, ``overlap`` async_scheduling; other
    EngineConfig fields (``reservation``, ...) pass through ``config``.
    ``check`` compares the device page state with the host's twin after
    every call."""
    return Engine(
        shared_step(),
        toy_pool(num_pages, page_size),
        EngineConfig(max_seqs=max_seqs, max_seq_len=max_seq_len, max_num_batched_tokens=budget,
                     async_scheduling=overlap, enable_prefix_caching=prefix_caching, **config),
        stop_ids=stop_ids,
        vocab_size=VOCAB,
        check_page_state=check,
    )


def serve(requests, num_pages=200, **kwargs):
    """Runs ``requests`` to completion on a fresh ``make_engine``; returns
    ({request_id: output}, engine)."""
    engine = make_engine(num_pages, **kwargs)
    outs = engine.run(requests)
    return {o.request_id: o for o in outs}, engine


def dense_logits(params, tokens, window=None):
    """The toy model without a cache, in float64 NumPy: causal attention
    over the whole sequence (the last ``window`` tokens with a window),
    logits f64[V] at its last token."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    n = len(tokens)
    x = p["emb"][tokens] + p["pos"][np.arange(n)]  # [S, D]
    q = (x[-1] @ p["wq"]).reshape(HEADS, HEAD_DIM)  # [N, H]: only the last query matters
    seen = slice(max(n - window, 0) if window else 0, n)
    k = (x[seen] @ p["wk"]).reshape(-1, KV_HEADS, HEAD_DIM)  # [S, K, H]
    v = (x[seen] @ p["wv"]).reshape(-1, KV_HEADS, HEAD_DIM)  # [S, K, H]
    o = []
    for h in range(HEADS):
        logits = k[:, h * KV_HEADS // HEADS] @ q[h] / np.sqrt(HEAD_DIM)  # [S]
        w = np.exp(logits - logits.max())
        o.append((w / w.sum()) @ v[:, h * KV_HEADS // HEADS])
    return (x[-1] + np.concatenate(o) @ p["wo"]) @ p["emb"].T  # [V]


def greedy_reference(params, prompt, max_new, window=None):
    """``max_new`` greedy tokens of the f64 oracle after ``prompt``, each
    step recomputing the whole sequence."""
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(int(np.argmax(dense_logits(params, tokens, window))))
    return tokens[len(prompt):]


def one_sequence_steps(engine, prompt_len, chunk):
    """Steps ``engine``, which runs one request of ``prompt_len`` prompt
    tokens prefilled in chunks of ``chunk``, until it finishes; after each
    step yields ``(slot, n, computed)``: its page-state slot, the tokens it
    holds once the call just planned is done, and those it held before
    (a decode token, or a chunk, earlier)."""
    pool = engine.kv_manager.pool
    while engine.has_unfinished():
        engine.step()
        slot = next((s.slot for s in engine.running), None)
        if slot is None:
            return
        n = int(pool.seq_lens[slot])
        yield slot, n, n - 1 if n > prompt_len else (n - chunk if n > chunk else 0)


def check_accounting(engine):
    """Every page is free, cached or used, none counted twice; returns the
    engine's accounting dict."""
    acc = engine.accounting()
    assert acc["free"] + acc["cached"] + acc["used"] == acc["total"], acc
    assert min(acc.values()) >= 0, acc
    return acc


# ---------------------------------------------------------------- layered


def layered_params(num_layers, seed=0):
    """Weights of :class:`LayeredToyModel`: the toy's embeddings and, per
    layer, its own q/k/v/o projections (scaled so the residual stream stays
    near unit size over the layers)."""
    r = np.random.default_rng(seed)
    base = toy_params(seed)
    layers = [{
        "wq": jnp.asarray(r.normal(size=(DIM, HEADS * HEAD_DIM)) * DIM**-0.5 * 2, jnp.float32),  # [D, N*H]
        "wk": jnp.asarray(r.normal(size=(DIM, KV_HEADS * HEAD_DIM)) * DIM**-0.5 * 2, jnp.float32),  # [D, K*H]
        "wv": jnp.asarray(r.normal(size=(DIM, KV_HEADS * HEAD_DIM)), jnp.float32),  # [D, K*H]
        "wo": jnp.asarray(r.normal(size=(HEADS * HEAD_DIM, DIM)) * (HEADS * HEAD_DIM) ** -0.5, jnp.float32),
    } for _ in range(num_layers)]
    return {"emb": base["emb"], "pos": base["pos"], "layers": layers}


class LayeredToyModel:
    """The toy LM with several attention layers, layer ``l`` attending the
    last ``windows[l]`` tokens (None: all of them): a hybrid model such as
    Gemma 3 when the windows mix. Its ``kv_groups`` are the layer groups
    (:mod:`paged_jax.paging.kv_groups`): given a pool of ``kv_groups.group_size``
    layers the engine keeps a block table per group, given a pool of every
    layer one table and every page; ``apply`` reads whichever the batch
    carries (one table, or one per group)."""

    vocab_size = VOCAB

    def __init__(self, params, windows):
        self.params = params
        self.windows = tuple(windows)
        self.kv_groups = kv_groups(self.windows)
        self.kv_window = self.windows[0] if len(set(self.windows)) == 1 else None

    def pool(self, num_pages, *, grouped=True, page_size=PAGE):
        """An empty pool: ``kv_groups.group_size`` layers (``grouped``) or every layer."""
        layers = self.kv_groups.group_size if grouped else len(self.windows)
        return init_kv_pool(num_layers=layers, num_kv_heads=KV_HEADS, num_pages=num_pages, page_size=page_size,
                            head_dim=HEAD_DIM)

    def check_kv_pool(self, kv):
        if kv.num_layers not in (len(self.windows), self.kv_groups.group_size):
            raise ValueError(f"kv pool must have {len(self.windows)} or {self.kv_groups.group_size} layers, "
                             f"got {kv.num_layers}")

    def apply(self, params, batch, kv: KVPool):
        t = batch.tokens.shape[0]
        x = params["emb"][batch.tokens] + params["pos"][jnp.clip(batch.positions, 0, MAX_POS - 1)]  # [T, D]
        grouped = batch.num_groups > 1
        for layer, (w, p) in enumerate(zip(self.windows, params["layers"])):
            row = self.kv_groups.layer_index[layer] if grouped else layer
            view = batch.group(self.kv_groups.layer_group[layer]) if grouped else batch
            q = (x @ p["wq"]).reshape(t, HEADS, HEAD_DIM)  # [T, N, H]
            k = (x @ p["wk"]).reshape(t, KV_HEADS, HEAD_DIM)  # [T, K, H]
            v = (x @ p["wv"]).reshape(t, KV_HEADS, HEAD_DIM)  # [T, K, H]
            kv = KVPool(k=write_layer_pages(kv.k, row, k, view.slots), v=write_layer_pages(kv.v, row, v, view.slots))
            o = attend(q, kv.k, kv.v, row, view, sliding_window=w)  # [T, N, H]
            x = x + o.reshape(t, -1) @ p["wo"]  # [T, D]
        return x[batch.logits_rows] @ params["emb"].T, kv  # logits [rows, V]


def layered_dense_logits(params, tokens, windows):
    """:class:`LayeredToyModel` without a cache, in float64 NumPy: logits
    f64[V] at the last token."""
    emb, pos = np.asarray(params["emb"], np.float64), np.asarray(params["pos"], np.float64)
    n = len(tokens)
    x = emb[tokens] + pos[np.arange(n)]  # [S, D]
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    for w, layer in zip(windows, params["layers"]):
        p = {k: np.asarray(v, np.float64) for k, v in layer.items()}
        q = (x @ p["wq"]).reshape(n, HEADS, HEAD_DIM)
        k = (x @ p["wk"]).reshape(n, KV_HEADS, HEAD_DIM)
        v = (x @ p["wv"]).reshape(n, KV_HEADS, HEAD_DIM)
        seen = (j <= i) & ((i - j < w) if w else True)  # [S, S]
        o = np.zeros((n, HEADS, HEAD_DIM))
        for h in range(HEADS):
            kh = h * KV_HEADS // HEADS
            logits = np.where(seen, q[:, h] @ k[:, kh].T / np.sqrt(HEAD_DIM), -np.inf)  # [S, S]
            e = np.exp(logits - logits.max(axis=1, keepdims=True))
            o[:, h] = (e / e.sum(axis=1, keepdims=True)) @ v[:, kh]
        x = x + o.reshape(n, -1) @ p["wo"]
    return x[-1] @ emb.T  # [V]


def layered_greedy_reference(params, prompt, max_new, windows):
    """``max_new`` greedy tokens of the f64 layered oracle after ``prompt``."""
    tokens = list(prompt)
    for _ in range(max_new):
        tokens.append(int(np.argmax(layered_dense_logits(params, tokens, windows))))
    return tokens[len(prompt):]
