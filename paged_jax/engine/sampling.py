"""Token sampling: greedy, temperature and top-p (nucleus), seeded per request.

A sequence's random stream depends only on its request's seed, its index
among the request's parallel samples (``stream``) and how many tokens it has
generated (``key = fold_in(fold_in(key(seed), stream), num_generated)``),
never on batch position or on what else is running. A sequence preempted and
recomputed therefore samples exactly the tokens it would have sampled
uninterrupted, and the ``n`` samples of one request draw independently.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from paged_jax.checks import check_bool, check_choice, check_float, check_int

MAX_LOGPROBS = 20
"""Most top log-probabilities a request may ask for (OpenAI's limit), for
``logprobs`` and ``prompt_logprobs`` alike."""

MAX_STOP_STRINGS = 64
"""Most stop strings a request may give. Each is searched for in every text
delta of every sequence (:mod:`paged_jax.engine.detokenizer`), on the engine's
thread: an unbounded list would let one request slow every step of every
other request."""

OUTPUT_KINDS = ("final", "delta", "cumulative")
"""What :meth:`paged_jax.engine.core.Engine.step` reports (``SamplingParams.output_kind``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one request picks tokens.

    Attributes:
      temperature: 0 for greedy (argmax), else logits are divided by it.
      top_p: keep the smallest set of tokens whose probability mass reaches
        ``top_p`` (Holtzman et al., 2020); 1.0 keeps all.
      seed: the request's random seed.
      n: parallel samples: continuations of one prompt, which share its
        pages (forked after prefill, paper section 4.4) and draw from their
        own streams.
      beam_width: 0 for sampling; ``w >= 1`` for beam search with ``w``
        beams (:mod:`paged_jax.engine.beam_search`), which returns the ``w`` best
        hypotheses. Needs ``temperature == 0``, ``top_p == 1`` and ``n == 1``.
      length_penalty: beam search ranks finished hypotheses by
        ``cumulative_logprob / num_generated ** length_penalty``.
      stop: stop strings: a sequence whose text comes to contain one ends
        there (``finish_reason="stop"``, ``stop_reason`` the string); the
        string is not in its text and no token after the one that
        completed it is generated. Needs an engine built with a tokenizer;
        not with beam search. Duplicates are dropped (the first kept), and
        at most ``MAX_STOP_STRINGS`` remain.
      logprobs: None, or ``k >= 0``: report each output token's
        log-probability and the ``k`` most likely tokens' (vLLM's
        ``logprobs``).
      prompt_logprobs: None, or ``k >= 0``: report, for every prompt token
        after the first, its log-probability given the tokens before it
        and the ``k`` most likely tokens' at that position
        (``RequestOutput.prompt_logprobs``; vLLM's ``prompt_logprobs``):
        what scoring a text under the model needs. The request then
        computes its whole prompt, never taking it from the prefix cache
        (:mod:`paged_jax.engine.prompt_logprobs`).
      output_kind: what :meth:`Engine.step` reports for the request:
        "final" (its output once, when it finishes), "delta" (after every
        call that gave it tokens, only what is new) or "cumulative" (after
        every such call, everything so far); vLLM's ``RequestOutputKind``.
        Beam search reports once, when it finishes, whatever the kind.
      skip_special_tokens: leave special tokens out of the text.

    Raises:
      ValueError: a value of the wrong type or out of range (finite
        ``temperature >= 0``, ``top_p`` in ``(0, 1]``, ``seed`` in
        ``[0, 2**32)``, ``n >= 1``, ``beam_width >= 0``, finite
        ``length_penalty``, ``stop`` a str or a sequence of non-empty
        str, at most ``MAX_STOP_STRINGS`` of them once duplicates are
        dropped, ``logprobs`` and ``prompt_logprobs`` None or an int in
        ``[0, MAX_LOGPROBS]``, an unknown ``output_kind``), or beam search
        with sampling options, stop strings or ``logprobs``.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    n: int = 1
    beam_width: int = 0
    length_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    output_kind: str = "final"
    skip_special_tokens: bool = True

    def __post_init__(self):
        check_float("temperature", self.temperature, 0)
        check_float("top_p", self.top_p, 0, 1, low_open=True)
        check_int("seed", self.seed, 0, 2**32)
        check_int("n", self.n)
        check_int("beam_width", self.beam_width, 0)
        check_float("length_penalty", self.length_penalty)
        if self.beam_width and (self.temperature != 0 or self.top_p != 1.0 or self.n != 1):
            raise ValueError(
                "beam search is deterministic and returns beam_width hypotheses: it needs temperature=0, top_p=1 "
                f"and n=1, got temperature={self.temperature} top_p={self.top_p} n={self.n}"
            )
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(t, str) and t for t in stop):
            raise ValueError(f"stop must be a str or a list of non-empty str, got {self.stop!r}")
        stop = tuple(dict.fromkeys(stop))  # a duplicate would only be searched for twice
        if len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop must hold at most {MAX_STOP_STRINGS} distinct strings (each is searched for in "
                             f"every text delta), got len(stop)={len(stop)}")
        object.__setattr__(self, "stop", stop)
        if self.stop and self.beam_width:
            raise ValueError(f"stop strings are not supported with beam search (beam_width={self.beam_width})")
        if self.logprobs is not None and self.beam_width:
            raise ValueError(f"logprobs is not supported with beam search (beam_width={self.beam_width}): each "
                             "hypothesis reports its cumulative_logprob")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_int(name, getattr(self, name), 0, MAX_LOGPROBS + 1))
        check_choice("output_kind", self.output_kind, OUTPUT_KINDS)
        check_bool("skip_special_tokens", self.skip_special_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_seqs(self) -> int:
        """Sequences a request runs at most at once: its beams or its
        samples."""
        return self.beam_width or self.n


@jax.jit
def greedy(logits: jax.Array) -> jax.Array:
    """logits: f32[B, V] -> i32[B] argmax (lowest id on ties)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _order_key(x: jax.Array) -> jax.Array:
    """f32 -> i32 with the same order (IEEE bits, negatives flipped)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def top_p_mask(scaled: jax.Array, top_p: jax.Array) -> jax.Array:
    """bool[B, V]: the nucleus of each row, in the original token order.

    Token ``i`` is kept when the probability mass of the tokens strictly
    more likely than it is below ``top_p`` (Holtzman et al., 2020): the
    smallest set of most likely tokens whose mass reaches ``top_p``, the
    most likely token always in it, tokens tied with its last member too.
    Rows with ``top_p >= 1`` keep everything.

    No sort: the threshold is found by bisection over the 2**32 ordered
    float keys (32 steps, each one masked sum over the vocabulary), which
    on CPU takes a fraction of sorting 49,152 logits per row.

    Args:
      scaled: f32[B, V] temperature-scaled logits.
      top_p: f32[B] in (0, 1].
    """
    probs = jax.nn.softmax(scaled, axis=-1)  # [B, V]
    keys = _order_key(scaled)  # i32[B, V]

    def mass_above(k):  # f32[B]: mass of tokens whose key exceeds k[b]
        return jnp.sum(jnp.where(keys > k[:, None], probs, 0.0), axis=-1)

    def step(_, bounds):
        lo, hi = bounds  # mass_above(lo) >= top_p > mass_above(hi)
        mid = (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without overflow
        below = mass_above(mid) < top_p
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    lo = jnp.full(top_p.shape, jnp.iinfo(jnp.int32).min, jnp.int32)
    hi = jnp.max(keys, axis=-1)
    _, hi = jax.lax.fori_loop(0, 32, step, (lo, hi))
    return (keys >= hi[:, None]) | (top_p[:, None] >= 1.0)


def _scaled_nucleus(logits: jax.Array, temperature: jax.Array, top_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """f32[B, V] logits -> ``(scaled, keep)``: the temperature-scaled logits
    (shifted by each row's max first: a tiny temperature then sends the
    others to -inf, never the max to +inf) and bool[B, V] each row's
    nucleus. Rows with ``temperature == 0`` are scaled by 1 (their callers
    take the argmax of the raw logits)."""
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / safe_t[:, None]
    keep = jax.lax.cond(jnp.all(top_p >= 1.0), lambda: jnp.ones(scaled.shape, bool),
                        lambda: top_p_mask(scaled, top_p))
    return scaled, keep


def _row_keys(seeds: jax.Array, streams: jax.Array, steps: jax.Array) -> jax.Array:
    """[B] PRNG keys: ``fold_in(fold_in(key(seed), stream), step)`` per row (the module docstring)."""
    return jax.vmap(lambda seed, stream, step: jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream),
                                                                  step))(seeds, streams, steps)


def _check_rows(logits: jax.Array, *per_row: jax.Array) -> None:
    if logits.ndim != 2 or any(x.shape != logits.shape[:1] for x in per_row):
        raise ValueError(f"takes logits [B, V] and [B] per-row arrays, got {logits.shape}, "
                         f"{[x.shape for x in per_row]}")


@jax.jit
def sample(
    logits: jax.Array,  # f32[B, V]
    temperature: jax.Array,  # f32[B]
    top_p: jax.Array,  # f32[B]
    seeds: jax.Array,  # u32[B]
    streams: jax.Array,  # i32[B] index of the sequence among its request's samples
    steps: jax.Array,  # i32[B] tokens generated so far per sequence
) -> jax.Array:
    """Samples one token per row; rows with ``temperature == 0`` take the argmax.

    Gumbel-max (``argmax(logits / T + g)`` with ``g`` standard Gumbel noise
    drawn from the row's own key over the vocabulary in its original order)
    draws exactly from ``softmax(logits / T)`` restricted to the nucleus.
    Nothing is sorted: the nucleus is found by bisection
    (:func:`top_p_mask`), and only when some row of the batch has ``top_p <
    1``; a row with ``top_p = 1`` keeps every token on either path, so its
    token depends on its own logits, seed, stream and step alone, never on
    the rest of the batch.

    Returns:
      i32[B] token ids.
    """
    logits = logits.astype(jnp.float32)
    _check_rows(logits, temperature, top_p, seeds, streams, steps)
    # Gumbel-max and the nucleus do not change under the shift _scaled_nucleus makes.
    scaled, keep = _scaled_nucleus(logits, temperature, top_p)
    keys = _row_keys(seeds, streams, steps)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, scaled.shape[-1:], jnp.float32))(keys)  # [B, V]
    sampled = jnp.argmax(jnp.where(keep, scaled + gumbel, -jnp.inf), axis=-1)
    return jnp.where(temperature > 0, sampled, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


@jax.jit
def verify_proposals(
    logits: jax.Array,  # f32[B, V] the target's logits at the row before each proposal
    proposals: jax.Array,  # i32[B] the proposed token each row judges
    temperature: jax.Array,  # f32[B]
    top_p: jax.Array,  # f32[B]
    seeds: jax.Array,  # u32[B]
    streams: jax.Array,  # i32[B]
    steps: jax.Array,  # i32[B] the index, among the sequence's generated tokens, of the token the row decides
) -> tuple[jax.Array, jax.Array]:
    """Speculative decoding's verification, one proposed token per row, for
    proposers that propose deterministically (n-gram lookup, a draft's
    argmax): Leviathan et al., 2023, Algorithm 1 with the draft
    distribution ``q`` one-hot at the proposal ``x``
    (:mod:`paged_jax.speculative.verify` has the general form).

    - ``temperature == 0``: ``x`` is accepted when it is the argmax; the
      row's token is the argmax (the correction, when rejected). The
      emitted tokens are greedy decoding's, token for token.
    - sampling: with ``p`` the row's distribution after temperature and
      top-p (what :func:`sample` draws from), ``x`` is accepted with
      probability ``p(x)`` (``u < p(x)``, ``u`` uniform from the row's key
      folded with 1); the row's token is a draw from ``p`` without ``x``,
      renormalized (``norm(max(0, p - q))``), by Gumbel-max on the row's
      key, the noise :func:`sample` would use at that step.

    The caller takes the rows of a sequence in order, keeps the proposals
    up to the first rejection and emits that row's token there (or, when
    every proposal is kept, the bonus token :func:`sample` draws at the
    next step). Each emitted token is then distributed exactly as the
    target's: rows are decided independently, and only the rows up to the
    first rejection are used. Each step's randomness decides one token
    once, so seeds reproduce a run and never repeat a draw.

    Returns:
      ``(accept, token)``: bool[B] the proposal is kept, i32[B] the row's
      own token (used at a rejection).
    """
    logits = logits.astype(jnp.float32)
    _check_rows(logits, proposals, temperature, top_p, seeds, streams, steps)
    scaled, keep = _scaled_nucleus(logits, temperature, top_p)
    masked = jnp.where(keep, scaled, -jnp.inf)
    p_x = jnp.take_along_axis(jax.nn.softmax(masked, axis=-1), proposals[:, None], axis=-1)[:, 0]
    keys = _row_keys(seeds, streams, steps)
    u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, 1), (), jnp.float32))(keys)
    gumbel = jax.vmap(lambda key: jax.random.gumbel(key, scaled.shape[-1:], jnp.float32))(keys)  # [B, V]
    others = jnp.arange(scaled.shape[-1])[None, :] != proposals[:, None]
    residual = jnp.argmax(jnp.where(others, masked + gumbel, -jnp.inf), axis=-1)
    top = jnp.argmax(logits, axis=-1)
    greedy_rows = temperature <= 0
    accept = jnp.where(greedy_rows, top == proposals, u < p_x)
    return accept, jnp.where(greedy_rows, top, residual).astype(jnp.int32)
