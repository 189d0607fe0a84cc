"""Training the decoder with optax: dense causal forward, masked next-token
loss, AdamW with warmup and cosine decay, global-norm clipping.

One module and one set of weights serve both paths: training calls
:func:`models.llama.forward_dense` (causal attention over the batch's own
K/V, packed sequences separated by segment ids), serving calls
:func:`models.llama.forward` / :func:`models.ragged.forward_ragged` over the
paged KV pool. Only the attention differs, so what is trained here decodes
identically through pages (tests/test_train.py checks it on a trained model).

Batch convention (:class:`TrainBatch`): ``tokens`` i32[B, T] and
``segment_ids`` i32[B, T]. Documents are packed into rows as contiguous runs
of one segment id; **segment id 0 is padding**. Token ``t + 1`` is a
prediction target of row ``t`` when both are in the same non-padding segment
and ``loss_mask[t + 1]`` is set (for example, only assistant turns).

The step (:class:`Trainer`) is one jitted pure function ``(state, batch) ->
(state, metrics)`` with the state donated; batches of one shape compile it
once (``Trainer.num_compilations``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.llama import Llama, forward_dense
from paged_jax.checks import check_float, check_instance, check_int, is_int

PAD_SEGMENT = 0
"""The segment id of padding tokens: never a prediction target."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Optimizer and schedule.

    Attributes:
      learning_rate: peak learning rate, reached at the end of warmup.
      warmup_steps: steps of linear warmup; step ``s < warmup_steps`` uses
        ``learning_rate * (s + 1) / warmup_steps`` (never 0, so no step is
        wasted).
      total_steps: the schedule's length; after warmup the rate follows a
        cosine from ``learning_rate`` down to ``learning_rate *
        final_lr_ratio`` at the last step (``total_steps - 1``).
      final_lr_ratio: end of the cosine as a fraction of the peak.
      weight_decay: AdamW's decoupled decay, applied to the weight matrices
        and embeddings, not to norm scales.
      b1, b2, eps: Adam moments and epsilon.
      clip_norm: gradients are rescaled to this global L2 norm when above it.

    Raises:
      ValueError: a step count that is not a positive int, ``warmup_steps
        >= total_steps`` (with warmup, the cosine needs at least one step),
        or a rate, ratio, decay, beta or norm that is not a finite number in
        range.
    """

    learning_rate: float = 3e-3
    warmup_steps: int = 20
    total_steps: int = 300
    final_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0

    def __post_init__(self):
        check_int("warmup_steps", self.warmup_steps, 0)
        check_int("total_steps", self.total_steps)
        if self.warmup_steps and self.warmup_steps >= self.total_steps:
            raise ValueError(f"warmup_steps must be < total_steps (or 0), got warmup_steps={self.warmup_steps} "
                             f"total_steps={self.total_steps}")

        for name, high in (("learning_rate", None), ("clip_norm", None), ("eps", None), ("b1", 1), ("b2", 1)):
            check_float(name, getattr(self, name), 0, high, low_open=True, high_open=True)
        for name in ("final_lr_ratio", "weight_decay"):
            check_float(name, getattr(self, name), 0, 1)

    def schedule(self) -> optax.Schedule:
        """Learning rate at step ``s`` (0-based): linear warmup, then cosine
        decay (``optax.warmup_cosine_decay_schedule``, shifted by one step so
        the first update is not made at rate 0); without warmup, a cosine
        from ``learning_rate`` at step 0 to the final rate at the last step."""
        end = self.learning_rate * self.final_lr_ratio
        if self.warmup_steps == 0:
            if self.total_steps == 1:
                return lambda step: jnp.asarray(self.learning_rate, jnp.float32)
            return optax.cosine_decay_schedule(self.learning_rate, decay_steps=self.total_steps - 1,
                                               alpha=self.final_lr_ratio)
        base = optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=self.learning_rate,
            warmup_steps=self.warmup_steps,
            decay_steps=self.total_steps,
            end_value=end,
        )
        return lambda step: base(step + 1)

    def optimizer(self) -> optax.GradientTransformation:
        """``optax.chain(clip_by_global_norm, adamw(schedule))`` with weight
        decay masked to everything but norm scales (:func:`decay_mask`)."""
        return optax.chain(
            optax.clip_by_global_norm(self.clip_norm),
            optax.adamw(self.schedule(), b1=self.b1, b2=self.b2, eps=self.eps,
                        weight_decay=self.weight_decay, mask=decay_mask),
        )


BIASES = ("bq", "bk", "bv")
"""Names of the q/k/v bias parameters (Qwen2-style ``LlamaConfig.qkv_bias``)."""


def decay_mask(params):
    """True for every parameter AdamW should decay: the weight matrices and
    embeddings, not norm scales (their path holds ``norm``) or q/k/v biases
    (:data:`BIASES`). Same tree as ``params``."""

    def decays(path, _):
        names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
        return not any("norm" in n or n in BIASES for n in names)

    return jax.tree_util.tree_map_with_path(decays, params)


@flax.struct.dataclass
class TrainBatch:
    """A batch of packed token rows.

    Attributes:
      tokens: i32[B, T] token ids.
      segment_ids: i32[B, T] document of each token (contiguous runs; 0 is
        padding, :data:`PAD_SEGMENT`).
      loss_mask: bool[B, T] tokens that may be targets (all by default).
    """

    tokens: jax.Array
    segment_ids: jax.Array
    loss_mask: jax.Array


def make_batch(tokens, segment_ids=None, loss_mask=None) -> TrainBatch:
    """A :class:`TrainBatch` from arrays, checked at the door.

    Args:
      tokens: int [B, T] token ids.
      segment_ids: int [B, T], default every token in segment 1 (one
        document per row, no padding).
      loss_mask: bool [B, T], default all True.

    Raises:
      ValueError: a non-2-D or non-integer ``tokens``, ``T < 2`` (nothing to
        predict), a ``segment_ids`` / ``loss_mask`` of another shape or
        dtype kind, a negative id or one past int32, or a segment id that
        appears in two separate runs of a row. (Token ids past the
        vocabulary are refused by :meth:`Trainer.step`, which knows it.)
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be an integer array [batch, tokens], got {tokens.dtype}{list(tokens.shape)}")
    if tokens.shape[1] < 2:
        raise ValueError(f"tokens must have at least 2 columns (a token and its target), got shape {tokens.shape}")
    segment_ids = np.ones(tokens.shape, np.int32) if segment_ids is None else np.asarray(segment_ids)
    loss_mask = np.ones(tokens.shape, bool) if loss_mask is None else np.asarray(loss_mask)
    for name, x, ok in (("segment_ids", segment_ids, np.issubdtype(segment_ids.dtype, np.integer)),
                        ("loss_mask", loss_mask, loss_mask.dtype == bool)):
        if x.shape != tokens.shape or not ok:
            raise ValueError(f"{name} must be a {'bool' if name == 'loss_mask' else 'integer'} array shaped like "
                             f"tokens {list(tokens.shape)}, got {x.dtype}{list(x.shape)}")
    limit = np.iinfo(np.int32).max
    for name, x in (("tokens", tokens), ("segment_ids", segment_ids)):
        bad = np.argwhere((x < 0) | (x > limit))
        if bad.size:
            raise ValueError(f"{name} must be in [0, 2**31), got {name}[{bad[0][0]}, {bad[0][1]}] = "
                             f"{x[tuple(bad[0])]}")
    # Segments must be contiguous runs: an id that comes back after another
    # would restart its positions yet still see its first run.
    for b, row in enumerate(segment_ids):
        starts = row[np.r_[True, row[1:] != row[:-1]]]
        if len(set(starts.tolist())) != len(starts):
            raise ValueError(f"segment_ids rows must be contiguous runs of each id, got row {b}: "
                             f"{starts.tolist()} (run order)")
    return TrainBatch(tokens=jnp.asarray(tokens, jnp.int32), segment_ids=jnp.asarray(segment_ids, jnp.int32),
                      loss_mask=jnp.asarray(loss_mask, bool))


def pack_documents(documents: Iterable[Sequence[int]], seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Packs token documents into rows of ``seq_len`` tokens (stream packing).

    Documents are laid end to end, each with its own segment id (1, 2, ...),
    and the stream is cut every ``seq_len`` tokens; a document that crosses
    a cut continues at the start of the next row (its positions restart
    there, as in GPT-style packing). Only the last row is padded (segment 0).
    Every token appears exactly once; none is dropped.

    Args:
      documents: token id sequences (empty ones are skipped).
      seq_len: T, tokens per row (>= 2).

    Returns:
      ``(tokens i32[R, T], segment_ids i32[R, T])``.

    Raises:
      ValueError: ``seq_len`` < 2, or no tokens at all.
    """
    check_int("seq_len", seq_len, 2)
    tokens, segments = [], []
    for i, doc in enumerate(documents):
        doc = list(doc)
        bad = [t for t in doc if not is_int(t, 0, 2**31)]
        if bad:
            raise ValueError(f"documents[{i}] must hold int token ids in [0, 2**31), got {bad[0]!r}")
        tokens.extend(int(t) for t in doc)
        segments.extend([i + 1] * len(doc))
    if not tokens:
        raise ValueError("documents hold no tokens; expected at least one non-empty document")
    rows = -(-len(tokens) // seq_len)
    out_tokens = np.zeros(rows * seq_len, np.int32)
    out_segments = np.full(rows * seq_len, PAD_SEGMENT, np.int32)
    out_tokens[: len(tokens)] = tokens
    out_segments[: len(segments)] = segments
    return out_tokens.reshape(rows, seq_len), out_segments.reshape(rows, seq_len)


def next_token_loss(logits: jax.Array, batch: TrainBatch) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy of each target token given the tokens before it.

    Args:
      logits: f32[B, T, V] from :func:`models.llama.forward_dense`.
      batch: the tokens, segments and loss mask.

    Returns:
      ``(loss f32[], num_targets i32[])``: the mean over targets (token
      ``t + 1`` for row ``t`` when both share a non-padding segment and
      ``loss_mask[t + 1]``), in nats per token; 0 when there are none.
    """
    seg = batch.segment_ids
    targets = batch.tokens[:, 1:]  # [B, T - 1]
    valid = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != PAD_SEGMENT) & batch.loss_mask[:, 1:]
    nll = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1].astype(jnp.float32), targets)
    count = valid.sum()
    loss = jnp.where(valid, nll, 0.0).sum() / jnp.maximum(count, 1)
    return loss, count


def dense_loss(model: Llama, batch: TrainBatch) -> tuple[jax.Array, jax.Array]:
    """:func:`next_token_loss` of ``model``'s dense forward on ``batch``."""
    return next_token_loss(forward_dense(model, batch.tokens, batch.segment_ids), batch)


@flax.struct.dataclass
class TrainState:
    """What changes from step to step.

    Attributes:
      step: i32[] updates made so far.
      params: the model's parameters (an ``nnx.State``).
      opt_state: optax state of :meth:`TrainConfig.optimizer`.
    """

    step: jax.Array
    params: nnx.State
    opt_state: optax.OptState


def _describe(x) -> str:
    """``"float32[2, 64, 4, 16]"``: a weight's dtype and shape, as one leaf."""
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


class Trainer:
    """A jitted train step for one model structure and :class:`TrainConfig`.

    ``init(model) -> TrainState``; ``step(state, batch) -> (state,
    metrics)`` where metrics holds ``loss`` (f32, the batch's mean next-token
    loss before this update), ``grad_norm`` (global L2 norm before
    clipping), ``lr`` (the rate this update used) and ``num_targets``. The
    state argument is donated: use the returned one. ``evaluate(state,
    batch)`` is the loss without an update. ``model(state)`` is a
    :class:`models.llama.Llama` with the state's weights, ready for serving.
    ``num_compilations`` counts traces of the step (one per batch shape).
    """

    def __init__(self, model: Llama, config: TrainConfig = TrainConfig()):
        check_instance("model", model, Llama, what="models.llama.Llama")
        check_instance("config", config, TrainConfig)
        self.config = config
        self.optimizer = config.optimizer()
        self.schedule = config.schedule()
        self.num_compilations = 0
        self.vocab_size = model.config.vocab_size
        self._graphdef, params = nnx.split(model)
        self._shapes = jax.tree.map(_describe, params)
        graphdef = self._graphdef

        def loss_of(params, batch):
            return dense_loss(nnx.merge(graphdef, params), batch)

        def step(state: TrainState, batch: TrainBatch):
            self.num_compilations += 1  # runs at trace time only
            (loss, count), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params, batch)
            updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
            params = optax.apply_updates(state.params, updates)
            metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": self.schedule(state.step),
                       "num_targets": count}
            return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

        self._step = jax.jit(step, donate_argnums=(0,))
        self._evaluate = jax.jit(lambda state, batch: loss_of(state.params, batch)[0])

    def _check_params(self, params, what: str) -> None:
        shapes = jax.tree.map(_describe, params)
        if jax.tree.structure(shapes) != jax.tree.structure(self._shapes) or shapes != self._shapes:
            mine = dict(jax.tree_util.tree_flatten_with_path(self._shapes)[0])
            for path, got in jax.tree_util.tree_flatten_with_path(shapes)[0]:
                if mine.get(path) != got:
                    raise ValueError(f"{what} does not fit this trainer's model: weight "
                                     f"{jax.tree_util.keystr(path)} is {got}, expected {mine.get(path)}")
            raise ValueError(f"{what} does not fit this trainer's model (different weights)")

    def _check_batch(self, batch: TrainBatch) -> None:
        """Host-side checks the jitted step cannot make: ids inside the
        vocabulary (the embedding lookup would clamp them, a silent wrong
        answer) and at least one target."""
        check_instance("batch", batch, TrainBatch, what="TrainBatch (models.train.make_batch)")
        tokens = np.asarray(batch.tokens)
        bad = np.argwhere((tokens < 0) | (tokens >= self.vocab_size))
        if bad.size:
            raise ValueError(f"batch.tokens must be in [0, vocab_size={self.vocab_size}), got "
                             f"tokens[{bad[0][0]}, {bad[0][1]}] = {tokens[tuple(bad[0])]}")
        seg, mask = np.asarray(batch.segment_ids), np.asarray(batch.loss_mask)
        if seg.shape != tokens.shape or mask.shape != tokens.shape or mask.dtype != bool:
            raise ValueError(f"batch.segment_ids and batch.loss_mask (bool) must be shaped like tokens "
                             f"{tokens.shape}, got {seg.shape} and {mask.dtype}{list(mask.shape)}")
        if not np.any((seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != PAD_SEGMENT) & mask[:, 1:]):
            raise ValueError("batch has no prediction targets (all padding, single-token segments or masked): "
                             "an update would only apply weight decay")

    def init(self, model: Llama) -> TrainState:
        """Step 0: ``model``'s weights (copied) and fresh optimizer moments.

        Raises:
          ValueError: ``model``'s weights differ in name, shape or dtype from
            the model the trainer was built for.
        """
        _, params = nnx.split(model)
        self._check_params(params, "model")
        params = jax.tree.map(jnp.array, params)  # the step donates the state; keep the model's own arrays
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=self.optimizer.init(params))

    def step(self, state: TrainState, batch: TrainBatch) -> tuple[TrainState, dict]:
        """One update; see the class docstring.

        Raises:
          ValueError: a state of another model, a token id outside the
            vocabulary, or a batch with no prediction target (the state is
            then left as it was).
        """
        self._check_params(state.params, "state")
        self._check_batch(batch)
        return self._step(state, batch)

    def evaluate(self, state: TrainState, batch: TrainBatch) -> jax.Array:
        """f32[] mean next-token loss of ``batch`` under ``state``'s weights.

        Raises:
          ValueError: as :meth:`step`.
        """
        self._check_params(state.params, "state")
        self._check_batch(batch)
        return self._evaluate(state, batch)

    def model(self, state: TrainState) -> Llama:
        """A :class:`Llama` holding ``state``'s weights (shared, not copied)."""
        return nnx.merge(self._graphdef, state.params)
