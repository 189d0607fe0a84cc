"""What goes into the engine and what comes out: requests and their outputs
(vLLM's ``Request`` / ``RequestOutput`` / ``CompletionOutput``).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import jax
import numpy as np

from paged_jax.checks import check_bool, check_instance, check_int, is_int
from paged_jax.engine.config import reserved_tokens
from paged_jax.engine.sampling import SamplingParams
from paged_jax.paging.contiguous import ALLOCATORS, make_allocator
from paged_jax.paging.page_state import pages_for_tokens

INT32_TOKENS = 2**31 - 1
"""Token ids must stay below this when the vocabulary size is unknown (the
model indexes with int32)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RequestLimits:
    """What an engine can serve, for checking a request before it is added.

    Attributes:
      vocab_size: token ids must lie in ``[0, vocab_size)``; None: in int32.
      max_seq_len: most tokens per sequence, prompt plus output.
      max_seqs: most sequences running at once (a group's must fit).
      page_size: tokens per page.
      usable_pages: pages of the pool, the null page excluded.
      reservation: the engine's reservation policy
        (``EngineConfig.reservation``): each sequence holds pages for
        :func:`paged_jax.engine.config.reserved_tokens` tokens from admission on.
      allocator: the contiguous allocator placing each reservation as one
        run (``EngineConfig.allocator``): a group's runs must fit in an
        empty one; None or "pages": none.
      windows: per layer group (a block table each,
        :mod:`paged_jax.paging.kv_groups`), the sliding window whose pages it
        returns while a sequence runs, or None (it keeps every page).
      max_num_batched_tokens: tokens one call computes at most (a sliding
        group holds its window's pages and one chunk's).
    """

    vocab_size: int | None
    max_seq_len: int
    max_seqs: int
    page_size: int
    usable_pages: int
    reservation: str = "paged"
    allocator: str | None = None
    windows: tuple[int | None, ...] = (None,)
    max_num_batched_tokens: int | None = None

    def seq_pages(self, tokens: int) -> int:
        """Most pages one sequence of ``tokens`` tokens holds at once,
        summed over its layer groups: a full group's pages for all of them;
        with several groups, a sliding group of window ``W`` at most
        ``pages_for_tokens(W - 1 + chunk) + 1`` (the pages its window
        still sees, and one chunk of at most ``max_num_batched_tokens``
        tokens being computed, the window's first page partly before it;
        what :class:`paged_jax.engine.kv_manager.KVCacheManager` charges to admit
        it). One group counts its table positions, as its admission does."""
        full = pages_for_tokens(tokens, self.page_size)
        chunk = tokens if self.max_num_batched_tokens is None else self.max_num_batched_tokens
        return sum(full if w is None or len(self.windows) == 1 else
                   min(full, pages_for_tokens(w - 1 + chunk, self.page_size) + 1) for w in self.windows)


def check_token_ids(name: str, ids: Iterable, vocab_size: int | None) -> None:
    """Raises ValueError, naming ``name``, unless every id is an integer in
    ``[0, vocab_size)`` (in int32 when ``vocab_size`` is None)."""
    high = vocab_size if vocab_size is not None else INT32_TOKENS
    for t in ids:
        if not is_int(t):
            raise ValueError(f"{name}: token id {t!r} is not an integer")
        if not 0 <= t < high:
            raise ValueError(f"{name}: token id {t} outside the vocabulary [0, {high})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """One generation request.

    Attributes:
      request_id: unique among the engine's unfinished requests; a str or
        int, or any hashable value equal to itself.
      prompt_ids: prompt token ids, at least one.
      max_new_tokens: most tokens to generate, >= 1.
      sampling: greedy by default.
      ignore_eos: keep generating through stop tokens (fixed output lengths,
        as serving benchmarks do).
      cache_salt: requests with different salts never share a cached page,
        even with identical tokens (isolation between users or tenants);
        ``None`` is a salt like any other.
    """

    request_id: str | int
    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    ignore_eos: bool = False
    cache_salt: str | None = None

    def token_ids(self) -> list[int]:
        """The prompt as a list of Python ints."""
        ids = self.prompt_ids
        return [int(t) for t in (ids.tolist() if isinstance(ids, (np.ndarray, jax.Array)) else ids)]

    def check(self, limits: RequestLimits) -> None:
        """Checks the request against what an engine can serve: prompt ids
        (a non-empty sequence, in the vocabulary), ``max_new_tokens``, the
        total against ``max_seq_len``, its sampling's sequences against
        ``max_seqs`` and the pool, each holding its whole length or its
        reservation if more (a preempted group must fit whole to be
        resumed), ``ignore_eos``, ``cache_salt`` and a hashable id.

        Raises:
          ValueError: naming the request and what is wrong.
        """
        rid = self.request_id
        try:
            hash(rid)
            usable = bool(rid == rid)  # NaN is never equal to itself: it could be added twice and never found
        except (TypeError, ValueError):
            usable = False
        if not usable:
            raise ValueError(f"request_id must be hashable and equal to itself (a str or int), got {rid!r}")
        ids = self.prompt_ids
        if isinstance(ids, (np.ndarray, jax.Array)):
            ids = ids.tolist() if ids.ndim == 1 else ids
        if not isinstance(ids, (list, tuple, range)):
            raise ValueError(f"request {rid!r}: prompt_ids must be a sequence of token ids (a list, tuple or 1-D "
                             f"array), got {ids!r}")
        if len(ids) == 0:
            raise ValueError(f"request {rid!r}: prompt_ids is empty; need at least one token")
        check_token_ids(f"request {rid!r}", ids, limits.vocab_size)
        try:
            check_bool("ignore_eos", self.ignore_eos)
            n = check_int("max_new_tokens", self.max_new_tokens)
        except ValueError as e:
            raise ValueError(f"request {rid!r}: {e}") from None
        total = len(ids) + n
        if total > limits.max_seq_len:
            raise ValueError(f"request {rid!r}: prompt length {len(ids)} + max_new_tokens {n} = {total} exceeds "
                             f"max_seq_len={limits.max_seq_len}")
        try:
            check_instance("sampling", self.sampling, SamplingParams, what="paged_jax.engine.sampling.SamplingParams")
        except ValueError as e:
            raise ValueError(f"request {rid!r}: {e}") from None
        k = self.sampling.num_seqs
        if k > limits.max_seqs:
            what = "beam_width" if self.sampling.beam_width else "n"
            raise ValueError(f"request {rid!r}: sampling.{what}={k} exceeds max_seqs={limits.max_seqs}")
        held = max(total, reserved_tokens(limits.reservation, len(ids), n, limits.max_seq_len))
        group_pages = k * limits.seq_pages(held)
        if group_pages > limits.usable_pages:
            groups = f", over {len(limits.windows)} layer groups" if len(limits.windows) > 1 else ""
            raise ValueError(
                f"request {rid!r}: {k} sequences holding {held} tokens each (reservation={limits.reservation!r}) "
                f"need up to {group_pages} pages{groups}, more than the pool's {limits.usable_pages}; after a "
                f"preemption they could never be resumed together")
        if limits.reservation != "paged" and limits.allocator in ALLOCATORS:
            empty = make_allocator(limits.allocator, limits.usable_pages)
            if not empty.fits([limits.seq_pages(held)] * k):
                raise ValueError(
                    f"request {rid!r}: {k} runs of {empty.run_pages(limits.seq_pages(held))} contiguous pages "
                    f"(reservation={limits.reservation!r}, allocator={limits.allocator!r}) do not fit in the "
                    f"pool's {limits.usable_pages} pages even when it is empty")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise ValueError(f"request {rid!r}: cache_salt must be a str or None, got {self.cache_salt!r}")


@dataclasses.dataclass
class CompletionOutput:
    """One continuation of a request (``SamplingParams.n`` of them).

    With ``SamplingParams.output_kind="delta"`` each field that grows with
    the output (``output_ids``, ``text``, ``token_times``, ``logprobs``)
    holds only what is new since the request's previous report; otherwise
    everything so far.

    Attributes:
      index: its place among the request's samples (its random stream).
      output_ids: generated token ids (a stop token, if one ended it, last).
      finish_reason: "stop" (a stop token or stop string), "length"
        (max_new_tokens), "abort" (:meth:`Engine.abort`), or None while it
        runs (streamed outputs).
      cumulative_logprob: the sum of its tokens' log-probabilities (beam
        search, or when ``SamplingParams.logprobs`` is set; None otherwise).
      text: the detokenized output (an engine built with a tokenizer; None
        otherwise), never ending in a partial UTF-8 character, cut before a
        stop string that ended it.
      token_times: seconds on the engine's clock (:meth:`Engine.clock`) at
        which each of ``output_ids`` reached the host.
      logprobs: with ``SamplingParams.logprobs=k``, one dict per token of
        ``output_ids``: its log-probability and those of the ``k`` most
        likely tokens, ``{token_id: logprob}`` (log-softmax of the model's
        logits in float32, before temperature or top-p); None otherwise.
      stop_reason: the stop string (or stop token id) that ended it, None
        otherwise.
      num_proposed_tokens, num_accepted_tokens: speculative decoding
        (``EngineConfig.speculative``): tokens proposed for it and verified
        so far, and the accepted ones among them (each accepted one is in
        ``output_ids``); 0 without speculation.
    """

    index: int
    output_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    text: str | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None
    num_proposed_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    """What came of a request, or (streamed) what it has so far.

    Attributes:
      outputs: its continuations, by index (one unless ``SamplingParams.n``
        asked for more); for beam search its ``beam_width`` best
        hypotheses, best first (reported once, when finished).
      finished: every continuation has finished (always True unless
        ``SamplingParams.output_kind`` streams).
      num_preemptions: times it was preempted, by recompute or swap (all
        its sequences together).
      num_cached_tokens: prompt tokens served from the prefix cache when
        it was first admitted (always 0 for a request asking for
        ``prompt_logprobs``: it computes its whole prompt), from the
        device pool and the host tier together.
      num_host_cached_tokens, num_disk_cached_tokens,
        num_remote_cached_tokens: of ``num_cached_tokens``, those loaded
        from the host tier, the disk tier and another engine through the KV
        connector (:mod:`paged_jax.tiers`); the rest were in the pool.
      arrival_s, first_token_s, finish_s: seconds on the engine's clock
        (:meth:`Engine.clock`) when it was added, when its first token
        reached the host (None before that, or when aborted before it) and
        when it finished (None while it runs).
      prompt_logprobs: with ``SamplingParams.prompt_logprobs=k``, one entry
        per prompt token: None for the first (nothing before it), then
        ``{token_id: logprob}`` holding the ``k`` most likely tokens' and
        the prompt token's own log-probability given the tokens before it
        (log-softmax of the model's logits in float32), as
        ``CompletionOutput.logprobs``; None when not asked. They are all
        known by the first token's report; with ``output_kind="delta"`` a
        report holds only the entries new since the last (all of them in
        the first, none after). An aborted request reports those scored
        so far.
    """

    request_id: str | int
    prompt_ids: list[int]
    outputs: list[CompletionOutput]
    num_preemptions: int
    first_token_s: float | None
    finish_s: float | None
    num_cached_tokens: int = 0
    num_host_cached_tokens: int = 0
    num_disk_cached_tokens: int = 0
    num_remote_cached_tokens: int = 0
    finished: bool = True
    arrival_s: float = 0.0
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def output_ids(self) -> list[int]:
        """The first continuation's tokens."""
        return self.outputs[0].output_ids

    @property
    def finish_reason(self) -> str | None:
        """The first continuation's finish reason."""
        return self.outputs[0].finish_reason

    @property
    def text(self) -> str | None:
        """The first continuation's text."""
        return self.outputs[0].text
