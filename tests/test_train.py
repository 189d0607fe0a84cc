"""Training: the dense forward and loss, the optax step, checkpoints, and the
trained model decoding identically through the paged cache.

The tiny model here reads UTF-8 bytes (V = 256) of real ShareGPT text, so a
few dozen steps on 2 CPU cores teach it something measurable: the loss on a
fixed batch falls steeply, the loss on held-out conversations less so.
SmolLM2's dense loss against transformers' is in
tests/test_smollm2_vs_transformers.py, beside the transformers model it loads.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from experiments.lib.sharegpt import load_conversations
from models.loading.checkpoint import FORMAT, load_checkpoint, save_checkpoint
from models.llama import Llama, LlamaConfig, forward, forward_dense
from models.ragged import RaggedModel
from models.train import PAD_SEGMENT, TrainConfig, Trainer, decay_mask, make_batch, next_token_loss, pack_documents
from paged_jax.attention.paged import causal_attention, segment_positions
from paged_jax.engine.core import Engine, EngineConfig, Request
from paged_jax.paging import page_state as ps
from pallas_kernels.common import ref_sequence_attention

BYTE_CONFIG = LlamaConfig(vocab_size=256, model_dim=64, mlp_dim=128, num_layers=2, num_q_heads=4,
                          num_kv_heads=2, head_dim=16, rope_theta=10000.0)
SEQ_LEN = 128
STEPS = 40
# Paged vs dense logits of the trained model: both f32, differing only in
# summation order (measured largest difference about 1e-5 on logits of
# magnitude up to about 15).
LOGIT_ATOL = 2e-4


def byte_docs(conversations):
    return [list(turn["value"].encode()) for c in conversations for turn in c["conversations"][:2]
            if isinstance(turn, dict) and isinstance(turn.get("value"), str) and turn["value"]]


@pytest.fixture(scope="module")
def data():
    conversations, _ = load_conversations()
    train_tokens, train_segments = pack_documents(byte_docs(conversations[:60]), SEQ_LEN)
    held_tokens, held_segments = pack_documents(byte_docs(conversations[-60:]), SEQ_LEN)
    return (make_batch(train_tokens[:8], train_segments[:8]), make_batch(held_tokens[:8], held_segments[:8]))


@pytest.fixture(scope="module")
def trained(data):
    """A byte-level model after STEPS updates on one fixed batch, and the
    losses along the way."""
    train, held = data
    model = Llama(BYTE_CONFIG, rngs=nnx.Rngs(0), embed_std=BYTE_CONFIG.model_dim ** -0.5)
    trainer = Trainer(model, TrainConfig(learning_rate=1e-2, warmup_steps=5, total_steps=STEPS))
    state = trainer.init(model)
    before = (float(trainer.evaluate(state, train)), float(trainer.evaluate(state, held)))
    history = []
    for _ in range(STEPS):
        state, metrics = trainer.step(state, train)
        history.append({k: float(v) for k, v in metrics.items()})
    after = (float(trainer.evaluate(state, train)), float(trainer.evaluate(state, held)))
    return trainer, state, history, before, after


# --- the dense path ----------------------------------------------------------


def test_causal_attention_with_segments_and_window_equals_f64_oracle():
    """Packed rows with three segments and padding: each segment's rows equal
    the f64 NumPy attention of that segment alone (sliding window too)."""
    rng = np.random.default_rng(0)
    num_tokens, n, k, h = 19, 6, 2, 8
    q = rng.standard_normal((2, num_tokens, n, h)).astype(np.float32)
    kk = rng.standard_normal((2, num_tokens, k, h)).astype(np.float32)
    v = rng.standard_normal((2, num_tokens, k, h)).astype(np.float32)
    segments = np.array([[1] * 5 + [2] * 9 + [0] * 5, [7] * 1 + [3] * 18])
    for window in (None, 4):
        out = np.asarray(causal_attention(jnp.asarray(q), jnp.asarray(kk), jnp.asarray(v), jnp.asarray(segments),
                                          sliding_window=window))
        for b in range(2):
            bounds = np.flatnonzero(np.diff(segments[b])) + 1
            for run in np.split(np.arange(num_tokens), bounds):
                want = ref_sequence_attention(q[b, run].astype(np.float64), kk[b, run].astype(np.float64),
                                              v[b, run].astype(np.float64), scale=h ** -0.5, soft_cap=None,
                                              sliding_window=window)
                np.testing.assert_allclose(out[b, run], want, atol=1e-5, rtol=1e-5)


def test_segment_positions_restart_per_run():
    seg = jnp.array([[1, 1, 1, 2, 2, 0, 0], [5, 5, 5, 5, 5, 5, 5]])
    np.testing.assert_array_equal(segment_positions(seg), [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6]])


def test_packed_row_equals_its_documents_run_alone():
    """Segments isolate documents: logits of a packed row equal each document's
    own forward, and the second document does not depend on the first."""
    model = Llama(BYTE_CONFIG, rngs=nnx.Rngs(1))
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 256, 6), rng.integers(0, 256, 10)
    packed = forward_dense(model, jnp.asarray([np.concatenate([a, b])]), jnp.asarray([[1] * 6 + [2] * 10]))
    alone_a = forward_dense(model, jnp.asarray([a]))
    alone_b = forward_dense(model, jnp.asarray([b]))
    np.testing.assert_allclose(packed[0, :6], alone_a[0], atol=1e-5)
    np.testing.assert_allclose(packed[0, 6:], alone_b[0], atol=1e-5)


def test_next_token_loss_counts_only_targets_within_a_segment():
    """Targets: token t + 1 of the same non-padding segment, under the loss
    mask. Row [1 1 1 2 2 0]: targets at t = 1, 2 (segment 1) and t = 4
    (segment 2); the mask drops t = 2."""
    tokens = jnp.array([[3, 1, 4, 1, 5, 9]])
    batch = make_batch(tokens, [[1, 1, 1, 2, 2, PAD_SEGMENT]], [[True, True, False, True, True, True]])
    logits = jax.random.normal(jax.random.key(0), (1, 6, 10))
    loss, count = next_token_loss(logits, batch)
    logp = jax.nn.log_softmax(logits[0])
    want = -(logp[0, 1] + logp[3, 5]) / 2  # t = 1 (token 1 after 3) and t = 4 (token 5 after 1)
    assert int(count) == 2
    np.testing.assert_allclose(loss, want, rtol=1e-6)


def test_pack_documents_keeps_every_token_once():
    docs = [[1, 2, 3], [], [4, 5, 6, 7, 8], [9]]
    tokens, segments = pack_documents(docs, 4)
    np.testing.assert_array_equal(tokens, [[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 0, 0]])
    np.testing.assert_array_equal(segments, [[1, 1, 1, 3], [3, 3, 3, 3], [4, 0, 0, 0]])


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens=np.zeros((2, 1), np.int32)), "at least 2 columns"),
    (dict(tokens=np.zeros((4,), np.int32)), r"tokens must be an integer array \[batch, tokens\]"),
    (dict(tokens=np.zeros((2, 4)), ), "tokens must be an integer array"),
    (dict(tokens=np.zeros((2, 4), np.int32), segment_ids=np.zeros((2, 3), np.int32)), "segment_ids must be"),
    (dict(tokens=np.zeros((2, 4), np.int32), loss_mask=np.ones((2, 4), np.int32)), "loss_mask must be a bool"),
])
def test_make_batch_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_batch(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(warmup_steps=10, total_steps=5), "warmup_steps must be < total_steps"),
    (dict(warmup_steps=5, total_steps=5), "warmup_steps must be < total_steps"),
    (dict(total_steps=0), "total_steps must be an int >= 1"),
    (dict(learning_rate=0.0), "learning_rate must be a finite number in"),
    (dict(learning_rate=float("inf")), "learning_rate must be a finite number in"),
    (dict(learning_rate=True), "learning_rate must be a finite number in"),
    (dict(b2=1.0), "b2 must be a finite number in"),
    (dict(weight_decay=-0.1), "weight_decay must be a number in"),
])
def test_train_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_schedule_without_warmup_starts_at_the_peak():
    lrs = [float(TrainConfig(learning_rate=3e-3, warmup_steps=0, total_steps=3).schedule()(s)) for s in range(3)]
    np.testing.assert_allclose(lrs, [3e-3, 1.65e-3, 3e-4], rtol=1e-5)  # cosine from lr to lr / 10
    assert float(TrainConfig(learning_rate=3e-3, warmup_steps=0, total_steps=1).schedule()(0)) == pytest.approx(3e-3)


def test_batches_with_ids_out_of_range_or_broken_segments_are_refused():
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 2\*\*31\), got tokens\[0, 1\] = -1"):
        make_batch([[3, -1]])
    with pytest.raises(ValueError, match="segment_ids must be in"):
        make_batch([[3, 1]], [[1, 2**33]])
    with pytest.raises(ValueError, match=r"contiguous runs .* row 0: \[1, 2, 1\]"):
        make_batch([[1, 2, 3, 4, 5]], [[1, 1, 2, 1, 1]])


def test_trainer_refuses_foreign_ids_states_and_empty_batches():
    """Token ids past the vocabulary (the embedding would clamp them), a state
    of another model, and a batch with no target are errors, and leave the
    state usable."""
    model = Llama(BYTE_CONFIG, rngs=nnx.Rngs(0))
    trainer = Trainer(model, TrainConfig(warmup_steps=1, total_steps=4))
    state = trainer.init(model)
    with pytest.raises(ValueError, match=r"tokens must be in \[0, vocab_size=256\), got tokens\[1, 0\] = 300"):
        trainer.step(state, make_batch([[1, 2], [300, 4]]))
    with pytest.raises(ValueError, match="no prediction targets"):
        trainer.step(state, make_batch([[1, 2], [3, 4]], [[0, 0], [1, 2]]))
    other = Llama(dataclasses.replace(BYTE_CONFIG, model_dim=32, mlp_dim=64), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"model does not fit this trainer's model: weight .* is float32\[2, 32"):
        trainer.init(other)
    with pytest.raises(ValueError, match="state does not fit this trainer's model"):
        trainer.step(Trainer(other, TrainConfig(warmup_steps=1, total_steps=4)).init(other),
                     make_batch([[1, 2]]))
    state, metrics = trainer.step(state, make_batch([[1, 2, 3], [4, 5, 6]]))  # the state still works
    assert int(state.step) == 1 and np.isfinite(float(metrics["loss"]))


def test_pack_documents_rejects_bad_input():
    with pytest.raises(ValueError, match="seq_len must be an int >= 2"):
        pack_documents([[1, 2]], 1)
    with pytest.raises(ValueError, match="no tokens"):
        pack_documents([[], []], 8)
    with pytest.raises(ValueError, match=r"documents\[1\] must hold int token ids .* got 1.7"):
        pack_documents([[1], [1.7, 2]], 8)


def test_weight_decay_skips_norm_scales_and_biases():
    config = LlamaConfig(vocab_size=32, model_dim=16, mlp_dim=32, num_layers=2, num_q_heads=4, num_kv_heads=2,
                         head_dim=4, qkv_bias=True)
    _, params = nnx.split(Llama(config, rngs=nnx.Rngs(0)))
    flags = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(decay_mask(params))[0]}
    skipped = sorted(k.split("'")[-2] for k, v in flags.items() if not v)
    assert skipped == ["bk", "bq", "bv", "scale", "scale", "scale"], flags
    assert sum(flags.values()) == 8  # wq wk wv wo w_gate w_up w_down embed


# --- the train step ----------------------------------------------------------


def test_loss_falls_on_the_batch_and_less_on_held_out_text(trained):
    _, _, history, (train0, held0), (train1, held1) = trained
    assert history[0]["loss"] == pytest.approx(train0, rel=1e-5)  # metrics report the loss before the update
    assert train1 < 0.6 * train0, (train0, train1)
    assert held1 < held0, (held0, held1)
    assert held0 - held1 < train0 - train1, "held-out text should improve less than the batch trained on"


def test_step_compiles_once_and_logs_schedule_and_finite_gradients(trained):
    trainer, state, history, _, _ = trained
    assert trainer.num_compilations == 1
    assert int(state.step) == STEPS
    # Linear warmup from lr / 5 (step 0) to lr (step 4), then a cosine down to lr / 10.
    lrs = [h["lr"] for h in history]
    np.testing.assert_allclose(lrs[:5], [2e-3, 4e-3, 6e-3, 8e-3, 1e-2], rtol=1e-5)
    np.testing.assert_allclose(lrs[-1], 1e-3, rtol=1e-4)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert all(np.isfinite(h["grad_norm"]) and h["grad_norm"] > 0 for h in history)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(state.params))


# --- trained model: paged decode equals the dense forward -------------------


def test_trained_model_decodes_through_pages_as_the_dense_forward(trained):
    """Ragged prompts (lengths around the page size of 4) in one padded batch:
    prefill, then greedy decode token by token through the paged pool, pages
    handed out in reverse order. At every step the paged logits equal the
    dense forward's over the same tokens, and the greedy token is its argmax."""
    trainer, state, _, _, _ = trained
    model = trainer.model(state)
    page_size, steps = 4, 12
    prompt_lens = [3, 4, 5, 9, 1]
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(32, 127, n)) for n in prompt_lens]
    batch = len(prompts)
    width = max(prompt_lens)
    pages_per_seq = -(-(width + steps) // page_size)
    num_pages = batch * pages_per_seq + 1
    state_p = ps.init_page_state(num_pages=num_pages, max_seqs=batch, max_pages_per_seq=pages_per_seq,
                                 page_size=page_size)
    kv = model.config.make_kv_pool(num_pages, page_size)
    for b, n in enumerate(prompt_lens):
        state_p, ok = ps.allocate(state_p, b, n)
        assert bool(ok)
    tokens = jnp.asarray([p + [0] * (width - len(p)) for p in prompts], jnp.int32)
    logits, kv = forward(model, tokens, kv, state_p.block_tables, state_p.seq_lens, jnp.asarray(prompt_lens))
    seqs = [list(p) for p in prompts]
    total = width + steps
    dense = jax.jit(lambda t, s: forward_dense(model, t, s))
    for _ in range(steps):
        # Dense over each sequence so far, padded to one shape (padding is a
        # segment of its own after the real tokens, so it cannot be seen).
        rows = np.zeros((batch, total), np.int32)
        segs = np.zeros((batch, total), np.int32)
        for b, s in enumerate(seqs):
            rows[b, : len(s)], segs[b, : len(s)] = s, 1
        want = np.asarray(dense(jnp.asarray(rows), jnp.asarray(segs)))[np.arange(batch), [len(s) - 1 for s in seqs]]
        np.testing.assert_allclose(np.asarray(logits), want, atol=LOGIT_ATOL, rtol=0)
        next_ids = np.asarray(jnp.argmax(logits, axis=-1))
        np.testing.assert_array_equal(next_ids, want.argmax(-1))
        for b in range(batch):
            seqs[b].append(int(next_ids[b]))
        state_p, ok, _, _ = ps.append(state_p, jnp.ones((batch,), bool))
        assert bool(jnp.all(ok))
        logits, kv = forward(model, jnp.asarray(next_ids[:, None], jnp.int32), kv, state_p.block_tables,
                             state_p.seq_lens, jnp.ones((batch,), jnp.int32))


@pytest.mark.slow  # 50-75 s; test_trained_model_decodes_through_pages_as_the_dense_forward is its fast twin
def test_trained_model_served_by_the_engine_follows_the_dense_argmax(trained):
    """The serving engine (mixed prefill and decode, page size 4) on the
    trained model: every generated token is the dense forward's argmax over
    the tokens before it."""
    trainer, state, _, _, _ = trained
    model = trainer.model(state)
    rng = np.random.default_rng(4)
    prompts = [list(map(int, rng.integers(32, 127, n))) for n in (2, 4, 7, 13)]
    new = 10
    engine = Engine(RaggedModel(model), model.config.make_kv_pool(40, 4),
                    EngineConfig(max_seqs=4, max_seq_len=32, max_num_batched_tokens=16),
                    vocab_size=256, check_page_state=True)
    outputs = engine.run([Request(request_id=i, prompt_ids=p, max_new_tokens=new) for i, p in enumerate(prompts)])
    for out, prompt in zip(sorted(outputs, key=lambda o: o.request_id), prompts):
        seq = prompt + list(out.output_ids)
        assert len(out.output_ids) == new
        logits = np.asarray(forward_dense(model, jnp.asarray([seq], jnp.int32)))[0]
        np.testing.assert_array_equal(logits[len(prompt) - 1: len(seq) - 1].argmax(-1), out.output_ids)
    assert engine.accounting()["used"] == 0


# --- checkpoints -------------------------------------------------------------


def test_checkpoint_round_trip_gives_identical_logits(trained, tmp_path):
    trainer, state, _, _, _ = trained
    model = trainer.model(state)
    path = save_checkpoint(model, tmp_path / "m.safetensors", metadata={"steps": str(STEPS)})
    loaded, meta = load_checkpoint(path)
    assert meta["steps"] == str(STEPS) and meta["format"] == FORMAT
    assert loaded.config == model.config
    tokens = jnp.asarray(np.random.default_rng(5).integers(0, 256, (2, 24)), jnp.int32)
    assert bool(jnp.array_equal(forward_dense(model, tokens), forward_dense(loaded, tokens)))


def test_checkpoint_errors_name_the_file_and_field(trained, tmp_path):
    import safetensors
    import safetensors.numpy

    trainer, state, _, _, _ = trained
    model = trainer.model(state)
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_checkpoint(tmp_path / "nope.safetensors")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="junk.safetensors.*not a readable safetensors"):
        load_checkpoint(junk)
    good = save_checkpoint(model, tmp_path / "good.safetensors")
    weights = safetensors.numpy.load_file(str(good))
    with safetensors.safe_open(str(good), framework="numpy") as f:
        meta = f.metadata()
    other = tmp_path / "other.safetensors"
    safetensors.numpy.save_file(weights, str(other), metadata={**meta, "format": "something/9"})
    with pytest.raises(ValueError, match="other.safetensors.*'format' is 'something/9'"):
        load_checkpoint(other)
    missing = tmp_path / "missing.safetensors"
    safetensors.numpy.save_file({k: v for k, v in weights.items() if k != "blocks.mlp.w_up"}, str(missing),
                                metadata=meta)
    with pytest.raises(ValueError, match=r"missing.safetensors.*missing weights \['blocks.mlp.w_up'\]"):
        load_checkpoint(missing)
    bad = tmp_path / "bad.safetensors"
    safetensors.numpy.save_file(weights, str(bad), metadata={**meta, "paged_jax.engine.config": meta["paged_jax.engine.config"]
                                .replace('"num_kv_heads": 2', '"num_kv_heads": 3')})
    with pytest.raises(ValueError, match="bad.safetensors.*num_q_heads must be a multiple of num_kv_heads"):
        load_checkpoint(bad)
    with pytest.raises(ValueError, match="metadata key 'format' is reserved"):
        save_checkpoint(model, tmp_path / "x.safetensors", metadata={"format": "mine"})
    with pytest.raises(ValueError, match=r"is a folder; give the checkpoint file to write"):
        save_checkpoint(model, tmp_path)
