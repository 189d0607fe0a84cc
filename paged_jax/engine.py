"""A continuous-batching serving engine over the paged KV cache.

Data path, one direction: request -> scheduler (this module) -> page state
(:mod:`paged_jax.page_state`) -> model (an object the caller passes in; this
module never imports a model) -> sampler -> request.

Each iteration (iteration-level scheduling, Orca, OSDI 2022; PagedAttention,
Kwon et al., SOSP 2023, section 4.5; chunked prefill as in Sarathi-Serve,
OSDI 2024, and vLLM v1):

1. Schedule under a token budget (``max_num_batched_tokens``): every running
   sequence gets the tokens it still has to compute, oldest first (one for a
   decoding sequence, a chunk of its prompt for one still prefilling); then
   waiting requests are admitted first come, first served, while pages,
   sequence slots and budget last, the last of them with a partial chunk.
   A request's sequences (its parallel samples or beams: a *sequence group*,
   paper section 4.5) are admitted, preempted and resumed together. If the
   pool is short, the newest running group is preempted, by *recompute*
   (its pages are freed; its sequences are prefilled again when readmitted)
   or by *swap* (its pages are copied to host memory first and back into
   fresh pages then, :mod:`paged_jax.swap`). With prefix caching
   (:mod:`paged_jax.prefix_cache`) an admitted sequence takes the cached
   pages that hold its first tokens and skips their prefill.
2. One jitted call does the rest on device: free the pages of sequences that
   finished or were preempted, give admitted sequences their cached or
   swapped-in pages (:func:`paged_jax.page_state.unchecked_share`), fork new
   beams, grow each scheduled sequence's pages
   (:func:`paged_jax.page_state.unchecked_extend`, copy-on-write included),
   fork parallel samples from a prompt that just finished prefilling, run the
   model over the flat batch of every scheduled token
   (:mod:`paged_jax.batch`), and sample one token for each sequence whose
   chunk reached its end (for beams: its top log-probabilities, from which
   the host picks the next beams, :mod:`paged_jax.beam_search`). The host
   gets back the sampled tokens, ``ok`` and the free-page count in one
   transfer.

Running out of pages is never an error here: it is what preemption is for.
The engine refuses, at construction, a pool too small to hold one sequence of
``max_seq_len`` tokens, and at admission a group whose sequences could not
all fit in the pool, so the oldest running group can always proceed.

The host plans with an exact twin of the page state
(:class:`paged_jax.block_pool.BlockPool`: block tables, reference counts,
the free queue); it does what the device will do, in the same order, and
the device's ``ok`` and free count are checked against it after each call
(the whole state with ``check_page_state=True``).

Shapes are bucketed (:func:`paged_jax.batch.batch_shape`: tokens by powers of
two, and which phases a call has; lengths are not part of a shape) so
``jit`` compiles a handful of programs, shared by every engine of the same
model object.

With ``async_scheduling`` the next iteration is dispatched before the
current one's tokens are read (see :class:`EngineConfig`).

Contiguous baseline: with ``reserve_max_len=True`` every request reserves
``max_seq_len`` slots when admitted, as pre-paging servers reserved a
request's maximum length (paper section 3). The reservation is backed by
pages, which removes external fragmentation, so the comparison *understates*
what paging gains over a truly contiguous allocator. Attention work is
the same in both modes: it is bounded by each sequence's length, not by its
reservation.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import beam_search
from paged_jax import page_state as ps
from paged_jax.batch import BatchShape, Tiling, batch_shape
from paged_jax.block_pool import BlockPool
from paged_jax.checks import check_int
from paged_jax.jit_stats import CompileMonitor
from paged_jax.kv_cache import KVPool
from paged_jax.prefix_cache import PrefixCache, chain_keys
from paged_jax.requests import CompletionOutput, Request, RequestOutput
from paged_jax.sampling import SamplingParams
from paged_jax.stats import CallRecord, EngineStats
from paged_jax.step import PagedModel, StepInputs, device_step, num_traces
from paged_jax.swap import SwapSpace, SwappedGroup, gather_pages, scatter_pages

__all__ = [  # the engine's API; the types live in their own modules and are re-exported here
    "CallRecord", "CompletionOutput", "Engine", "EngineConfig", "EngineStats", "PagedModel", "Request",
    "RequestOutput", "SamplingParams", "drain", "num_traces",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Scheduler limits.

    Attributes:
      max_seqs: most sequences running at once, >= 1.
      max_seq_len: most tokens per sequence, prompt plus output, >= 1.
      max_num_batched_tokens: tokens per model call, decode tokens and
        prefill chunks together (the token budget of chunked prefill);
        >= ``max_seqs`` so every running sequence can decode in one call.
      reserve_max_len: reserve ``max_seq_len`` slots per request at admission
        (the contiguous baseline) instead of paging on demand.
      tiling: how attention cuts a call into work, and how many prefill
        chunks one call carries (:class:`paged_jax.batch.Tiling`).
      async_scheduling: schedule and dispatch iteration ``i + 1`` before
        reading iteration ``i``'s sampled tokens (they reach ``i + 1``'s
        input on device), so the host's work overlaps the device's, as in
        vLLM's async scheduling. A sequence that stops on a stop token then
        computes one token more, which is discarded. Outputs are the same
        either way.
      enable_prefix_caching: keep full pages keyed by their tokens after
        their sequence ends, and let a new (or recomputed) sequence whose
        first pages equal them take them instead of prefilling
        (:mod:`paged_jax.prefix_cache`).
      preemption_mode: "recompute" (free a preempted group's pages and
        prefill its tokens again when resumed) or "swap" (copy its pages to
        host memory and back, :mod:`paged_jax.swap`; paper section 4.5). A
        group that does not fit in the swap space is recomputed.
      swap_space_pages: pages the swap space holds; default as many as the
        KV pool's usable pages.
    """

    max_seqs: int = 64
    max_seq_len: int = 2048
    max_num_batched_tokens: int = 256
    reserve_max_len: bool = False
    tiling: Tiling = Tiling()
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_space_pages: int | None = None

    def __post_init__(self):
        for name in ("max_seqs", "max_seq_len", "max_num_batched_tokens"):
            check_int(name, getattr(self, name))
        if not isinstance(self.tiling, Tiling):
            raise ValueError(f"tiling must be a paged_jax.batch.Tiling, got tiling={self.tiling!r}")
        if self.max_num_batched_tokens < self.max_seqs:
            raise ValueError(
                "max_num_batched_tokens must be >= max_seqs (every running sequence decodes in each call), "
                f"got max_num_batched_tokens={self.max_num_batched_tokens} max_seqs={self.max_seqs}"
            )
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got preemption_mode={self.preemption_mode!r}")
        if self.swap_space_pages is not None:
            check_int("swap_space_pages", self.swap_space_pages, 0)
        for name in ("reserve_max_len", "async_scheduling", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {name}={getattr(self, name)!r}")


@dataclasses.dataclass(eq=False)
class _Seq:
    """One sequence: a request's prompt and one continuation of it."""

    group: "_Group"
    index: int  # among the group's samples: its random stream
    tokens: list[int]  # prompt + generated
    num_prompt: int
    slot: int = -1
    num_computed: int = 0  # tokens whose K/V are in the cache (or being computed)
    pending: int = 0  # tokens sampled on device, not yet read by the host (0 or 1)
    done: bool = False  # finished: anything still in flight for it is discarded
    finish_reason: str = ""
    keys: list = dataclasses.field(default_factory=list)  # prefix-cache key per full page of tokens
    num_keyed: int = 0  # leading pages offered to the prefix cache
    cum_logprob: float = 0.0  # beam search
    fork_pre: "_Seq | None" = None  # beam search: forks from this beam's pages in the next call

    @property
    def request(self) -> Request:
        return self.group.request

    @property
    def extra_key(self):
        return (self.request.cache_salt,)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def num_tokens(self) -> int:
        """Tokens it has, the one in flight included."""
        return len(self.tokens) + self.pending


@dataclasses.dataclass(eq=False)
class _Group:
    """A request's sequences (the paper's sequence group, section 4.5):
    scheduled, preempted and resumed together.

    Parallel sampling: until its prompt is prefilled a group has one
    sequence and holds ``child_slots`` for the others; the call that samples
    the first token forks them from it (they share its pages). Beam search:
    the group holds a slot for each of its ``beam_width`` beams; beams that
    die give theirs back to ``child_slots``, forks take from it."""

    request: Request
    seqs: list[_Seq] = dataclasses.field(default_factory=list)
    child_slots: list[int] = dataclasses.field(default_factory=list)
    num_preemptions: int = 0
    first_token_s: float = float("nan")
    num_cached_tokens: int = -1  # prompt tokens hit at first admission (-1: not admitted yet)
    reported: bool = False
    results: dict = dataclasses.field(default_factory=dict)  # beam index -> (top ids, top log-probs)
    hyps: list = dataclasses.field(default_factory=list)  # finished beams: (score, tokens, cum_logprob, reason)
    beam_done: bool = False

    @property
    def beam(self) -> bool:
        return self.request.sampling.beam_width > 0

    @property
    def spare_slots(self) -> int:
        """Slots it needs beyond its live sequences' (children to fork,
        beams to come)."""
        if self.beam:
            return 0 if self.beam_done else self.request.sampling.beam_width - len(self.live)
        return self.request.sampling.n - len(self.seqs)

    @property
    def live(self) -> list[_Seq]:
        return [s for s in self.seqs if not s.done]

    @property
    def finished(self) -> bool:
        if self.beam:
            return self.beam_done and not self.live
        return len(self.seqs) == self.request.sampling.n and not self.live


@dataclasses.dataclass
class _InFlight:
    """A dispatched call whose results the host has not read yet."""

    sampled: jax.Array  # i32[S] sampled token per page-state row (device)
    top: tuple  # (i32[S, K] ids, f32[S, K] log-probs) per row, K = 0 without beam search (device)
    ok: jax.Array  # bool[] the page-state update succeeded (device)
    num_free: jax.Array  # i32[] free pages after it (device)
    samplers: list  # the _Seq that sample in it
    sampler_slots: list  # their rows at dispatch
    expected_free: int  # the host's free-page count right after it
    record: CallRecord


_MONITOR: CompileMonitor | None = None


def _compile_seconds() -> float:
    """Seconds JAX has spent compiling in this process (since the first
    engine call)."""
    global _MONITOR
    if _MONITOR is None:
        _MONITOR = CompileMonitor()
    return _MONITOR.counts.seconds


def drain(engine, total: int, progress: bool, postfix=None) -> list[RequestOutput]:
    """Steps ``engine`` (an :class:`Engine` or anything with ``step()`` and
    ``has_unfinished()``) until it has no work; returns the outputs in the
    order they finished. ``progress`` shows a bar of ``total`` requests
    (none when stderr is not a terminal), with ``postfix()``'s fields."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=total, unit="req", leave=False, disable=None)
    outputs: list[RequestOutput] = []
    while engine.has_unfinished():
        done = engine.step()
        outputs.extend(done)
        if bar is not None:
            bar.update(len(done))
            if postfix is not None:
                bar.set_postfix(**postfix())
    if bar is not None:
        bar.close()
    return outputs


class Engine:
    """Continuous batching with paged KV, chunked prefill in mixed batches,
    and preemption by recompute.

    Args:
      model: a :class:`PagedModel` (``models.llama.RaggedModel``). Engines
        of the same model object share compiled programs. If it has
        ``check_kv_pool(pool)``, the pool is checked against it here.
      kv_pool: the KV pool the model reads and writes; its ``num_pages`` and
        ``page_size`` define the page state. The engine owns it from now on
        (the step donates it).
      config: scheduler limits.
      stop_ids: token ids that end a request (unless it ignores EOS).
      vocab_size: prompt ids are checked against it; default the model's
        ``vocab_size``.
      check_page_state: after every call, read the device's whole page
        state back and compare it with the host's twin
        (:class:`paged_jax.block_pool.BlockPool`); slow, for tests.

    Raises:
      ValueError: the pool cannot hold one sequence of ``config.max_seq_len``
        tokens (then no schedule could finish a long request), or does not
        fit the model; a bad ``vocab_size`` (or one above the model's) or
        ``stop_ids``; a model without ``params`` and ``apply``.
      RuntimeError: (from :meth:`step`) the engine failed in an earlier step.
    """

    def __init__(
        self,
        model: PagedModel,
        kv_pool: KVPool,
        config: EngineConfig,
        *,
        stop_ids: Iterable[int] = (),
        vocab_size: int | None = None,
        check_page_state: bool = False,
    ):
        if not (hasattr(model, "params") and callable(getattr(model, "apply", None))):
            raise ValueError(
                f"model must have params and apply(params, batch, kv) (a PagedModel such as "
                f"models.llama.RaggedModel), got a {type(model).__name__}"
            )
        if not isinstance(kv_pool, KVPool):
            raise ValueError(f"kv_pool must be a paged_jax.kv_cache.KVPool, got a {type(kv_pool).__name__}")
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got a {type(config).__name__}")
        page_size = kv_pool.page_size
        usable = (kv_pool.num_pages - 1) * page_size
        if usable < config.max_seq_len:
            raise ValueError(
                f"the KV pool holds {usable} tokens ({kv_pool.num_pages - 1} usable pages x "
                f"page_size={page_size}), fewer than one sequence of max_seq_len={config.max_seq_len}"
            )
        self.model = model
        self.kv = kv_pool
        self.config = config
        model_vocab = getattr(model, "vocab_size", None)
        if vocab_size is None:
            vocab_size = model_vocab
        if vocab_size is not None:
            if isinstance(vocab_size, bool) or not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
                raise ValueError(f"vocab_size must be None or an int >= 1, got vocab_size={vocab_size!r}")
            vocab_size = int(vocab_size)
            if model_vocab is not None and vocab_size > model_vocab:
                # An id past the embedding would be clamped by the lookup: a silent wrong token.
                raise ValueError(f"vocab_size={vocab_size} exceeds the model's vocabulary of {model_vocab} tokens")
        check_pool = getattr(model, "check_kv_pool", None)
        if check_pool is not None:
            check_pool(kv_pool)
        self.vocab_size = vocab_size
        stop_ids = list(stop_ids) if isinstance(stop_ids, (list, tuple, set, frozenset, range)) else stop_ids
        if not isinstance(stop_ids, list):
            raise ValueError(f"stop_ids must be a list, tuple or set of token ids, got {stop_ids!r}")
        self._check_token_ids("stop_ids", stop_ids)
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.page_size = page_size
        self.max_pages_per_seq = ps.pages_for_tokens(config.max_seq_len, page_size)
        self._reserve_pages = self.max_pages_per_seq if config.reserve_max_len else 0
        self.state = ps.init_page_state(
            num_pages=kv_pool.num_pages,
            max_seqs=config.max_seqs,
            max_pages_per_seq=self.max_pages_per_seq,
            page_size=page_size,
        )
        if not isinstance(check_page_state, bool):
            raise ValueError(f"check_page_state must be a bool, got {check_page_state!r}")
        self.check_page_state = check_page_state
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.running: list[_Seq] = []  # admission order, oldest first
        self.free_slots = list(range(config.max_seqs - 1, -1, -1))  # pop() gives 0 first
        self._live: dict = {}  # request_id -> _Seq, until it finishes or is aborted
        self.prefix_cache = PrefixCache(page_size) if config.enable_prefix_caching else None
        # The host's twin of the page state (exact: see paged_jax.block_pool).
        self.pool = BlockPool(
            num_pages=kv_pool.num_pages, max_seqs=config.max_seqs, max_pages_per_seq=self.max_pages_per_seq,
            page_size=page_size, on_evict=self.prefix_cache.evict if self.prefix_cache is not None else None,
        )
        self._num_free = kv_pool.num_pages - 1  # free pages once this round's plan is done
        self._held = np.zeros(config.max_seqs, np.int64)  # pages per slot once this round's plan is done
        self._to_free = np.zeros(config.max_seqs, bool)  # freed by the next call
        self._hits: dict[int, tuple[list[int], int]] = {}  # slot -> (pages, tokens) it takes in the next call
        swap_pages = config.swap_space_pages if config.swap_space_pages is not None else kv_pool.num_pages - 1
        self.swap = SwapSpace(swap_pages)
        self._inflight: _InFlight | None = None  # the dispatched call not yet read
        self._no_prev = jnp.zeros(config.max_seqs, jnp.int32)
        self._failed: BaseException | None = None
        self.stats = EngineStats()
        self._ids: set = set()
        self._t0: float | None = None

    # ------------------------------------------------------------------ API

    def add_request(self, request: Request) -> None:
        """Queues a request.

        Raises:
          ValueError: not a :class:`Request`; empty prompt, a prompt id that
            is not an integer or is outside the vocabulary, a non-bool
            ``ignore_eos``, ``max_new_tokens`` not an integer >= 1,
            prompt plus ``max_new_tokens`` above ``max_seq_len``, sampling
            that is not a :class:`SamplingParams`, ``sampling.n`` above
            ``max_seqs`` or with ``n`` sequences of the request's full length
            needing more pages than the pool has (a preempted group could
            never be resumed together), or a duplicate ``request_id``. The
            engine is then unchanged.
          RuntimeError: the engine failed in an earlier step.
        """
        self._raise_if_failed()
        self._check(request, self._ids)
        self._ids.add(request.request_id)
        ids = request.prompt_ids
        prompt = [int(t) for t in (ids.tolist() if isinstance(ids, (np.ndarray, jax.Array)) else ids)]
        group = _Group(request=request)
        seq = _Seq(group=group, index=0, tokens=prompt, num_prompt=len(prompt))
        group.seqs.append(seq)
        self.waiting.append(seq)
        self._live[request.request_id] = group

    def abort(self, request_id) -> RequestOutput:
        """Ends a request now, waiting or running; its pages are freed (full
        ones stay in the prefix cache) and the other requests go on as if
        it had never been there.

        Returns:
          its output so far, with ``finish_reason="abort"``.

        Raises:
          ValueError: no unfinished request has this id (never added, or
            already finished or aborted). The engine is then unchanged.
          RuntimeError: the engine failed in an earlier step.
        """
        self._raise_if_failed()
        try:
            group = self._live.get(request_id)
        except TypeError:
            raise ValueError(f"request_id must be hashable, got {request_id!r}") from None
        if group is None:
            state = "already finished or aborted" if request_id in self._ids else "never added"
            raise ValueError(f"request_id {request_id!r} is not an unfinished request ({state})")
        for seq in group.live:
            seq.done = True  # a token of it still in flight is discarded when read
            seq.finish_reason = "abort"
            if seq.slot >= 0:
                self._release(seq)
            else:
                self.waiting.remove(seq)
        self._return_child_slots(group)
        if group in self.swap:
            self.swap.pop(group)
        self.stats.aborted += 1
        out = self._finish(group)
        if not self.has_unfinished():
            self._flush_frees()
        return out

    def accounting(self) -> dict[str, int]:
        """Pages by state, after the pending frees: ``free`` (no content
        worth keeping), ``cached`` (no holder, kept for the prefix cache),
        ``used`` (held by a sequence; a page shared by k sequences counts
        once) and ``total`` (usable pages, the null page excluded). Free +
        cached + used = total always."""
        refs = self.pool.ref_counts
        used = int(np.count_nonzero(refs[1:]))
        cached = sum(1 for p in self.prefix_cache.pages if refs[p] == 0) if self.prefix_cache is not None else 0
        return {"free": self.pool.num_free - cached, "cached": cached, "used": used, "total": len(refs) - 1}

    def _check_token_ids(self, name: str, ids) -> None:
        """Every id an integer in [0, vocab_size) (or in int32 when the
        vocabulary size is unknown: the model indexes with int32)."""
        high = self.vocab_size if self.vocab_size is not None else 2**31 - 1
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"{name}: token id {t!r} is not an integer")
            if not 0 <= t < high:
                raise ValueError(f"{name}: token id {t} outside the vocabulary [0, {high})")

    def check_request(self, request: Request, taken: Iterable = ()) -> None:
        """Checks ``request`` as :meth:`add_request` would, without adding
        it: its type, prompt ids (non-empty, in the vocabulary), lengths
        against ``max_seq_len``, sampling against ``max_seqs`` and the pool,
        and that its id is not among ``taken``.

        Raises:
          ValueError: naming the request and what is wrong.
        """
        self._check(request, set(taken))

    def _check(self, request: Request, taken: set) -> None:
        if not isinstance(request, Request):
            raise ValueError(f"expected a Request, got {request!r}")
        rid = request.request_id
        ids = request.prompt_ids
        if isinstance(ids, (np.ndarray, jax.Array)):
            ids = ids.tolist() if ids.ndim == 1 else ids
        if not isinstance(ids, (list, tuple, range)):
            raise ValueError(f"request {rid!r}: prompt_ids must be a sequence of token ids (a list, tuple or 1-D array), got {ids!r}")
        if len(ids) == 0:
            raise ValueError(f"request {rid!r}: prompt_ids is empty; need at least one token")
        self._check_token_ids(f"request {rid!r}", ids)
        if not isinstance(request.ignore_eos, bool):
            raise ValueError(f"request {rid!r}: ignore_eos must be a bool, got {request.ignore_eos!r}")
        try:
            n = check_int("max_new_tokens", request.max_new_tokens)
        except ValueError as e:
            raise ValueError(f"request {rid!r}: {e}") from None
        total = len(ids) + n
        if total > self.config.max_seq_len:
            raise ValueError(
                f"request {rid!r}: prompt length {len(ids)} + max_new_tokens "
                f"{n} = {total} exceeds max_seq_len={self.config.max_seq_len}"
            )
        if not isinstance(request.sampling, SamplingParams):
            raise ValueError(f"request {rid!r}: sampling must be a SamplingParams, got {request.sampling!r}")
        k = request.sampling.num_seqs
        if k > self.config.max_seqs:
            what = "beam_width" if request.sampling.beam_width else "n"
            raise ValueError(f"request {rid!r}: sampling.{what}={k} exceeds max_seqs={self.config.max_seqs}")
        group_pages = k * max(ps.pages_for_tokens(total, self.page_size), self._reserve_pages)
        if group_pages > self.kv.num_pages - 1:
            raise ValueError(
                f"request {rid!r}: {k} sequences of {total} tokens need up to {group_pages} pages, more than the "
                f"pool's {self.kv.num_pages - 1}; after a preemption they could never be resumed together"
            )
        if request.cache_salt is not None and not isinstance(request.cache_salt, str):
            raise ValueError(f"request {rid!r}: cache_salt must be a str or None, got {request.cache_salt!r}")
        try:
            duplicate = rid in taken
        except TypeError:
            raise ValueError(f"request_id must be hashable, got {rid!r}") from None
        if duplicate:
            raise ValueError(f"request_id {rid!r} was already added")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._inflight)

    def run(self, requests: Iterable[Request] = (), *, progress: bool = False) -> list[RequestOutput]:
        """Adds ``requests`` and steps until every request has finished.

        Returns the outputs in the order the requests finished.
        """
        requests = list(requests)
        taken = set(self._ids)
        for r in requests:  # all or nothing: check every request before adding any
            self._check(r, taken)
            taken.add(r.request_id)
        for r in requests:
            self.add_request(r)
        return drain(self, len(self.waiting) + len(self.running), progress,
                     lambda: dict(running=len(self.running), free_pages=self.num_free_pages))

    @property
    def num_free_pages(self) -> int:
        """Free pages once the pending frees are done (the scheduler's view)."""
        return self._num_free

    # ------------------------------------------------------------ iteration

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: schedule and dispatch one device call,
        then read the previous call's tokens (with ``async_scheduling``) or
        this one's, and do the bookkeeping.

        Returns the requests that finished in it.

        Raises:
          FloatingPointError: the model's logits for a request were NaN or
            inf (no token is drawn from them; the engine is then failed).
          RuntimeError: an earlier step failed (an exception, or an
            interrupt, inside a device call leaves the host's plan and the
            device's state apart, and tokens in flight lost): the engine
            refuses to go on rather than compute wrong answers or spin.
            Make a new one.
        """
        self._raise_if_failed()
        try:
            return self._step()
        except BaseException as e:
            self._failed = e
            raise

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            first = str(self._failed).splitlines()[0] if str(self._failed) else ""
            raise RuntimeError(
                f"this engine failed in an earlier step ({type(self._failed).__name__}: {first}); "
                "its state is no longer consistent, make a new Engine"
            ) from self._failed

    def _step(self) -> list[RequestOutput]:
        if not self.has_unfinished():
            return []
        if self._t0 is None:
            self._t0 = time.perf_counter()
        t_start, c_start = time.perf_counter(), _compile_seconds()
        scheduled = self._schedule()
        prev, self._inflight = self._inflight, None
        current = self._dispatch(scheduled, prev) if scheduled else None
        finished: list[_Seq] = []
        if prev is not None:
            self._complete(prev, finished)
        if current is not None:
            if self.config.async_scheduling:
                self._inflight = current
            else:
                self._complete(current, finished)

        held = int(self.pool.num_seq_pages.sum())
        used = int(np.count_nonzero(self.pool.ref_counts))
        tokens = sum(s.num_computed for s in self.running)
        outputs = []
        for s in finished:
            if s.slot >= 0:
                self._release(s)
            else:  # preempted while its last token was in flight
                self.waiting.remove(s)
            if s.group.finished and not s.group.reported:
                self._return_child_slots(s.group)
                if s.group in self.swap:  # a beam group that finished while swapped out
                    self.swap.pop(s.group)
                outputs.append(self._finish(s.group))
        if not self.has_unfinished():
            self._flush_frees()
        dt = time.perf_counter() - t_start
        st = self.stats
        st.iterations += 1
        st.seq_pages_sum += held
        st.used_pages_sum += used
        st.peak_pages_used = max(st.peak_pages_used, used)
        st.busy_s += dt
        st.compile_s += _compile_seconds() - c_start  # in the model call or not: host_s must exclude it all
        st.peak_concurrency = max(st.peak_concurrency, len(self.running) + len(finished))
        st.concurrency_s += (len(self.running) + len(finished)) * dt
        if held:
            st.token_fraction_s += tokens / (held * self.page_size) * dt
        return outputs

    # --------------------------------------------------------- scheduling

    def _pages_after(self, seq: _Seq, n: int) -> int:
        """Pages ``seq`` holds once ``n`` more of its tokens are computed."""
        return max(ps.pages_for_tokens(seq.num_computed + n, self.page_size), self._reserve_pages)

    def _schedule(self) -> list[tuple[_Seq, int]]:
        """Who runs this iteration and how many tokens each computes."""
        budget = self.config.max_num_batched_tokens
        chunks = self.config.tiling.max_prefill_chunks  # chunks of 2+ tokens left for this call
        scheduled: list[tuple[_Seq, int, int]] = []  # (sequence, tokens, pages planned)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if (seq.num_generated + seq.pending >= seq.request.max_new_tokens or n == 0 or (n > 1 and not chunks)
                    or (seq.pending and seq.group.beam)):
                i += 1  # finishes when its token in flight is read; waits for the next call; or (a beam)
                continue  # waits for the host to choose its next token
            need = self._pages_after(seq, n) - self._held[seq.slot] + self.pool.cow_needed(seq.slot)
            while need > self._num_free:  # preempt the newest group until it fits
                victim = self.running[-1].group
                if victim is seq.group:  # nothing newer left: its own group goes, planned members too
                    for entry in [e for e in scheduled if e[0].group is victim]:
                        scheduled.remove(entry)
                        budget += entry[1]
                        chunks += entry[1] > 1
                        self._num_free += entry[2]
                        self._held[entry[0].slot] -= entry[2]
                self._preempt(victim)
                if victim is seq.group:
                    break
            if seq.slot < 0:
                break
            self._num_free -= need
            self._held[seq.slot] += need
            scheduled.append((seq, n, need))
            budget -= n
            chunks -= n > 1
            i += 1

        # Pages that running sequences will need for their next token soon:
        # keep one for each whose pages are full, so admission does not cause
        # preemption on the very next step.
        watermark = sum(1 for s, n, _ in scheduled if (s.num_computed + n) >= self._held[s.slot] * self.page_size)
        while self.waiting and budget > 0:
            group = self.waiting[0].group
            members = group.live  # waiting together at the queue's head (gang scheduling)
            if any(s.pending for s in members) or len(members) + group.spare_slots > len(self.free_slots):
                break  # a preempted group waits for its tokens in flight
            swapped = self.swap.get(group)
            if swapped is not None:
                rows = [swapped.tables[s.index] for s in members]
                # The pages to copy back, growth to the tokens still to
                # compute, and a copy-on-write copy each at most.
                cost = len(set().union(*rows)) + sum(
                    max(ps.pages_for_tokens(s.num_tokens, self.page_size), self._reserve_pages) - len(r) + 1
                    for s, r in zip(members, rows)
                )
                first_chunk = members[0].num_tokens - swapped.num_tokens[members[0].index]
            else:
                hits = [self._lookup(s) for s in members]
                new_pages = sum(
                    max(ps.pages_for_tokens(len(s.tokens), self.page_size), self._reserve_pages) - len(h)
                    for s, h in zip(members, hits)
                )
                cost = new_pages + sum(1 for p in set().union(*hits) if self.pool.ref_counts[p] == 0)
                first_chunk = len(members[0].tokens) - len(hits[0]) * self.page_size
            if (min(first_chunk, budget) > 1 and not chunks) or cost + watermark > self._num_free:
                break
            for seq in members:
                self.waiting.popleft()
                seq.slot = self.free_slots.pop()
                self.running.append(seq)
            if swapped is not None:
                self._swap_in(group, members, self.swap.pop(group))
            else:
                for seq, seq_hits in zip(members, hits):
                    self._admit_hits(seq, seq_hits)
            for seq in members:
                n = min(seq.num_tokens - seq.num_computed, budget)
                if n > 1 and not chunks:
                    n = 0  # admitted; computes from the next call on
                held = int(self.pool.num_seq_pages[seq.slot])
                need = self._pages_after(seq, n) - held + (self.pool.cow_needed(seq.slot) if n else 0)
                self._num_free -= need
                self._held[seq.slot] = held + need
                if n:
                    scheduled.append((seq, n, need))
                    budget -= n
                    chunks -= n > 1
            group.child_slots = [self.free_slots.pop() for _ in range(group.spare_slots)]
        return [(s, n) for s, n, _ in scheduled]

    def _lookup(self, seq: _Seq) -> list[int]:
        """Cached pages holding ``seq``'s first tokens (none without prefix
        caching), never all of them: its last token is always computed, so
        there are logits to sample from."""
        if self.prefix_cache is None:
            return []
        chain_keys(seq.tokens, self.page_size, seq.extra_key, seq.keys)
        return self.prefix_cache.lookup(seq.tokens, seq.keys, seq.extra_key, (len(seq.tokens) - 1) // self.page_size)

    def _admit_hits(self, seq: _Seq, hits: list[int]) -> None:
        st = self.stats
        hit_tokens = len(hits) * self.page_size
        if seq.group.num_cached_tokens < 0:  # first admission
            seq.group.num_cached_tokens = hit_tokens
            st.prompt_tokens += seq.num_prompt
            st.prefix_hit_tokens += hit_tokens
        else:
            st.recompute_hit_tokens += hit_tokens
            st.recomputed_tokens += len(seq.tokens) - hit_tokens
        if not hits:
            return
        st.prefix_hit_pages += len(hits)
        st.pages_saved += sum(1 for p in hits if self.pool.ref_counts[p] > 0)
        self._num_free -= self.pool.share(seq.slot, hits)
        self._hits[seq.slot] = (hits, hit_tokens)
        seq.num_computed = hit_tokens

    def _swap_out(self, group: _Group, members: list[_Seq]) -> bool:
        """Copies the pages holding ``members``' computed tokens to the swap
        space (a page they share, once). Returns False, copying nothing,
        when the swap space cannot take them."""
        unique: dict[int, int] = {}  # page id -> index among the copied pages
        tables, num_tokens = {}, {}
        for seq in members:
            holder = seq.fork_pre or seq  # a beam not forked yet holds its parent's pages
            pages = self.pool.pages(holder.slot)[: ps.pages_for_tokens(seq.num_computed, self.page_size)]
            tables[seq.index] = [unique.setdefault(p, len(unique)) for p in pages]
            num_tokens[seq.index] = seq.num_computed
        if not unique or not self.swap.fits(len(unique)):
            return False
        # Dispatched now, so it runs after the calls that wrote these pages
        # and before the next call, which frees them.
        copied = gather_pages(self.kv, list(unique))
        self.swap.put(group, SwappedGroup(pages=copied, num_pages=len(unique), tables=tables, num_tokens=num_tokens))
        self.stats.swap_outs += 1
        self.stats.swapped_out_pages += len(unique)
        return True

    def _swap_in(self, group: _Group, members: list[_Seq], swapped: SwappedGroup) -> None:
        """Copies a swapped group's pages into fresh pages (taken off the
        free queue now, so the next call's growth does not take them) and
        gives each member its pages back, shared as before."""
        needed = sorted(set().union(*(swapped.tables[s.index] for s in members)))  # a finished member's drop out
        fresh = self.pool.take_free(len(needed))
        self._num_free -= len(needed)
        new_page = dict(zip(needed, fresh))
        if fresh:
            self.kv = scatter_pages(self.kv, fresh, swapped.pages, source=needed)
        for seq in members:
            table = [new_page[i] for i in swapped.tables[seq.index]]
            seq.num_computed = swapped.num_tokens[seq.index]
            self.pool.share(seq.slot, table, seq.num_computed)
            self._hits[seq.slot] = (table, seq.num_computed)
        self.stats.swapped_in_pages += len(needed)

    def _preempt(self, group: _Group) -> None:
        """Frees every running sequence of the group. By recompute, each
        prefills its prompt + generated tokens again when the group is
        readmitted (pages still in the prefix cache are taken back); by
        swap, their pages are copied out first and back in then."""
        members = [s for s in group.live if s.slot >= 0]
        swapped = self.config.preemption_mode == "swap" and self._swap_out(group, members)
        for seq in members:
            self._release(seq)
            if not swapped:
                seq.num_computed = 0
            seq.num_keyed = 0  # its pages come anew (or from the cache) when readmitted
            seq.fork_pre = None  # a beam not forked yet: gets its own pages back
        self._return_child_slots(group)
        group.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.extendleft(reversed(members))

    def _return_child_slots(self, group: _Group) -> None:
        self.free_slots.extend(reversed(group.child_slots))
        group.child_slots = []

    def _release(self, seq: _Seq) -> None:
        """Gives back ``seq``'s slot and pages (freed on device by the next
        call, or by :meth:`_flush_frees`); a page another sequence shares
        stays held."""
        if seq.slot in self._hits:  # its pages were given to it in this round, but no call has taken them yet
            raise RuntimeError(f"internal: slot {seq.slot} released before the call that shares its pages")
        self.running.remove(seq)
        self._num_free += self.pool.release(seq.slot)  # it is not scheduled in this round: no planned growth
        self._held[seq.slot] = 0
        self._to_free[seq.slot] = True
        self.free_slots.append(seq.slot)
        seq.slot = -1

    def _flush_frees(self) -> None:
        if self._to_free.any():
            self.state = ps.free(self.state, jnp.asarray(self._to_free))
            self._to_free[:] = False
        self.pool.flush()

    # ------------------------------------------------------------- device

    def _build(self, scheduled: list[tuple[_Seq, int]]) -> tuple[StepInputs, BatchShape, list[_Seq]]:
        """The call's inputs, and the sequences that sample in it in row
        order: the scheduled ones whose chunk reaches their end, and the
        children forked in it (new ``_Seq`` objects, not yet running)."""
        S = self.config.max_seqs
        num_new = np.zeros(S, np.int32)
        q_starts = np.zeros(S, np.int32)
        fork_src = np.full(S, -1, np.int32)
        fork_pre = np.full(S, -1, np.int32)
        for seq in self.running:  # beams chosen since the last call: fork before anything grows
            if seq.fork_pre is not None:
                fork_pre[seq.slot] = seq.fork_pre.slot
        samplers: list[tuple[_Seq, int]] = []  # (sequence, flat row of its logits)
        offset = 0
        for seq, n in scheduled:
            num_new[seq.slot] = n
            q_starts[seq.slot] = offset
            offset += n
            if seq.num_computed + n < seq.num_tokens:
                continue  # a prefill chunk short of the end: nothing to sample
            samplers.append((seq, offset - 1))
            if seq.group.child_slots and not seq.group.beam and seq.num_generated + seq.pending == 0:
                # Parallel sampling: the prompt is in; fork the other samples
                # from it after growing, each drawing its first token from
                # the same logits with its own stream.
                for k, slot in enumerate(seq.group.child_slots, start=1):
                    child = _Seq(group=seq.group, index=k, tokens=list(seq.tokens), num_prompt=seq.num_prompt,
                                 slot=slot, keys=list(seq.keys))
                    fork_src[slot] = seq.slot
                    samplers.append((child, offset - 1))
        shape = batch_shape(num_new, num_seq_rows=S, tiling=self.config.tiling, num_samples=len(samplers))
        T, R = shape.num_tokens, shape.num_logits
        tokens = np.zeros(T, np.int32)
        from_prev = np.zeros(T, bool)
        positions = np.zeros(T, np.int32)
        token_rows = np.full(T, -1, np.int32)
        for seq, n in scheduled:
            start, o = seq.num_computed, q_starts[seq.slot]
            known = min(start + n, len(seq.tokens))  # the rest is the token in flight
            tokens[o : o + known - start] = seq.tokens[start:known]
            from_prev[o + known - start : o + n] = True
            positions[o : o + n] = np.arange(start, start + n)
            token_rows[o : o + n] = seq.slot
        logits_rows = np.zeros(R, np.int32)
        logits_slots = np.full(R, -1, np.int32)
        temperature = np.zeros(R, np.float32)
        top_p = np.ones(R, np.float32)
        seeds = np.zeros(R, np.uint32)
        streams = np.zeros(R, np.int32)
        steps = np.zeros(R, np.int32)
        for r, (seq, row) in enumerate(samplers):
            p = seq.request.sampling
            logits_rows[r], logits_slots[r] = row, seq.slot
            temperature[r], top_p[r], seeds[r] = p.temperature, p.top_p, p.seed
            streams[r], steps[r] = seq.index, seq.num_generated + seq.pending
        num_hit = np.zeros(S, np.int32)
        hit_pages = np.zeros((S, self.max_pages_per_seq), np.int32)
        hit_tokens = np.zeros(S, np.int32)
        for slot, (pages, num_tokens) in self._hits.items():
            num_hit[slot], hit_tokens[slot] = len(pages), num_tokens
            hit_pages[slot, : len(pages)] = pages
        inputs = StepInputs(
            free_mask=self._to_free.copy(), num_hit=num_hit, hit_pages=hit_pages, hit_tokens=hit_tokens, num_new=num_new,
            min_pages=np.full(S, self._reserve_pages, np.int32), fork_pre=fork_pre, fork_src=fork_src, tokens=tokens,
            from_prev=from_prev, positions=positions, token_rows=token_rows, q_starts=q_starts,
            logits_rows=logits_rows, logits_slots=logits_slots, temperature=temperature, top_p=top_p, seeds=seeds,
            streams=streams, steps=steps,
        )
        return inputs, shape, [seq for seq, _ in samplers]

    def _dispatch(self, scheduled: list[tuple[_Seq, int]], prev: "_InFlight | None") -> "_InFlight":
        """Builds and launches one call (JAX dispatch returns before the
        device is done). Sequences that sample in it hold a token in flight
        until :meth:`_complete` reads it."""
        inputs, shape, samplers = self._build(scheduled)
        # The twin takes the same steps as the device call: free, share (done
        # at admission), fork (beams), extend, fork (parallel samples).
        for seq in self.running:
            if seq.fork_pre is not None:
                self.pool.fork(seq.fork_pre.slot, seq.slot)
                seq.fork_pre = None
        if self.pool.extend(inputs.num_new, self._reserve_pages) is None:  # the plan is exact: a bug
            raise RuntimeError(f"the scheduler planned growth the pool cannot give ({self.pool.num_free} free pages)")
        children = [s for s in samplers if s.slot >= 0 and inputs.fork_src[s.slot] >= 0]
        for child in children:
            self.pool.fork(int(inputs.fork_src[child.slot]), child.slot)
        self._hits.clear()
        self._num_free = self.pool.num_free  # the plan counted a copy for every shared page; now exact
        self._held[:] = self.pool.num_seq_pages
        greedy_only = all(s.request.sampling.greedy for s in samplers)
        width = max((s.request.sampling.beam_width for s in samplers), default=0)
        top_k = 1 << (2 * width - 1).bit_length() if width else 0  # 2 * width, bucketed to a power of two
        self.stats.programs.add((shape, greedy_only, top_k))
        c0, t0 = _compile_seconds(), time.perf_counter()
        self.state, self.kv, new, top, ok, num_free = device_step(
            self.model, self.model.params, self.state, self.kv, self._no_prev if prev is None else prev.sampled,
            inputs, shape=shape, greedy_only=greedy_only, top_k=top_k,
        )
        compile_s = _compile_seconds() - c0
        self._to_free[:] = False
        if self.check_page_state:
            self.pool.check(self.state)
        decode = sum(1 for s, n in scheduled if n == 1 and s.num_computed >= s.num_prompt)
        total = sum(n for _, n in scheduled)
        for seq, n in scheduled:
            seq.num_computed += n
        for child in children:  # they join the group, right after its first sequence
            parent = child.group.seqs[0]
            child.num_computed = parent.num_computed
            child.group.seqs.append(child)
            child.group.child_slots = []
            self.running.insert(self.running.index(parent) + len(child.group.seqs) - 1, child)
        for seq in samplers:
            seq.pending += 1
        if self.prefix_cache is not None:
            for seq in self.running:
                self._offer_pages(seq)
        return _InFlight(
            sampled=new, top=top, ok=ok, num_free=num_free, samplers=samplers,
            sampler_slots=[seq.slot for seq in samplers], expected_free=self._num_free,
            record=CallRecord(shape=shape, tokens=total, decode_tokens=decode,
                              seconds=time.perf_counter() - t0 - compile_s, compile_s=compile_s),
        )

    def _offer_pages(self, seq: _Seq) -> None:
        """Offers ``seq``'s newly full pages to the prefix cache: pages whose
        K/V a dispatched call computes and whose tokens the host knows (a
        token in flight is not known yet; its page is offered later)."""
        full = min(seq.num_computed, len(seq.tokens)) // self.page_size
        if full <= seq.num_keyed:
            return
        chain_keys(seq.tokens, self.page_size, seq.extra_key, seq.keys)
        table = self.pool.block_tables[seq.slot]
        for j in range(seq.num_keyed, full):
            self.prefix_cache.insert(int(table[j]), seq.tokens, seq.keys, seq.extra_key, j)
        seq.num_keyed = full

    def _complete(self, call: "_InFlight", finished: list[_Seq]) -> None:
        """Reads a call's sampled tokens (the one transfer), checks the
        device's page state against the host's plan, and records tokens."""
        t0 = time.perf_counter()
        sampled, (top_ids, top_lps), ok, num_free = jax.device_get((call.sampled, call.top, call.ok, call.num_free))
        rec = call.record
        rec.seconds += time.perf_counter() - t0
        if not ok or int(num_free) != call.expected_free:  # the host plan is exact, so this is a bug
            raise RuntimeError(
                f"page state disagrees with the scheduler: ok={bool(ok)}, device free pages {int(num_free)}, "
                f"host {call.expected_free}"
            )
        st = self.stats
        st.model_calls += 1
        st.model_s += rec.seconds
        st.decode_tokens += rec.decode_tokens
        st.prefill_tokens += rec.tokens - rec.decode_tokens
        st.calls.append(rec)
        now = time.perf_counter() - self._t0
        beam_groups: list[_Group] = []
        bad = [seq.request.request_id for seq, slot in zip(call.samplers, call.sampler_slots)
               if not seq.done and (np.isnan(top_lps[slot]).any() if seq.group.beam else sampled[slot] < 0)]
        if bad:  # a token drawn from NaN would look valid: stop instead (the engine is then failed)
            raise FloatingPointError(
                f"the model's logits are not finite (NaN or inf) for requests {bad}: a corrupt KV pool, "
                "weights or inputs; no token was taken from them")
        for seq, slot in zip(call.samplers, call.sampler_slots):
            seq.pending -= 1
            if seq.done:  # it stopped on the token before: this one was never wanted
                st.discarded_tokens += 1
                continue
            if seq.group.beam:  # the host chooses its next token once every beam has its candidates
                seq.group.results[seq.index] = (top_ids[slot], top_lps[slot])
                if seq.group not in beam_groups:
                    beam_groups.append(seq.group)
                continue
            tok = int(sampled[slot])
            seq.tokens.append(tok)
            st.generated_tokens += 1
            if seq.group.first_token_s != seq.group.first_token_s:  # NaN: its first token
                seq.group.first_token_s = now
            stop = tok in self.stop_ids and not seq.request.ignore_eos
            if stop or seq.num_generated >= seq.request.max_new_tokens:
                seq.done = True
                seq.finish_reason = "stop" if stop else "length"
                finished.append(seq)
        for group in beam_groups:
            live = group.live
            if all(s.index in group.results and not s.pending for s in live):
                if group.first_token_s != group.first_token_s:
                    group.first_token_s = now
                self._beam_step(group, live, finished)

    def _beam_step(self, group: _Group, live: list[_Seq], finished: list[_Seq]) -> None:
        """Chooses the group's next beams from every live beam's candidates
        (:func:`paged_jax.beam_search.expand`): a beam with several
        continuations forks (the children share its pages from the next
        call on), a beam with none is freed now, finished hypotheses are
        kept. Ends the group once ``beam_width`` hypotheses have finished or
        no beam is left."""
        sp = group.request.sampling
        ids = np.stack([group.results[s.index][0] for s in live])
        lps = np.stack([group.results[s.index][1] for s in live])
        group.results.clear()
        beams, ended = beam_search.expand(
            [s.cum_logprob for s in live], ids, lps, width=sp.beam_width,
            stop_ids=frozenset() if group.request.ignore_eos else self.stop_ids,
            at_max_len=live[0].num_generated + 1 >= group.request.max_new_tokens,
        )
        self.stats.generated_tokens += len(beams) + len(ended)
        for c in ended:
            out = live[c.parent].tokens[live[c.parent].num_prompt :] + [c.token]
            group.hyps.append((beam_search.score(c.cum_logprob, len(out), sp.length_penalty), out, c.cum_logprob,
                               c.finish_reason))
        if not beams or len(group.hyps) >= sp.beam_width:
            group.beam_done = True
            for seq in live:
                seq.done, seq.finish_reason = True, "length"
                finished.append(seq)
            return
        kids: dict[int, list[beam_search.Continuation]] = {i: [] for i in range(len(live))}
        for c in beams:
            kids[c.parent].append(c)
        # The group is wholly running, or wholly waiting (preempted while
        # its candidates were in flight): then beams change on the host
        # only, and a swapped child takes its parent's pages at swap-in.
        running = live[0].slot >= 0
        queue = self.running if running else self.waiting
        for i, parent in enumerate(live):
            if not kids[i]:  # pruned: its pages go now, its slot stays with the group
                parent.done, parent.finish_reason = True, "pruned"
                if running:
                    self._release(parent)
                    group.child_slots.append(self.free_slots.pop())
                else:
                    self.waiting.remove(parent)
        at = max(i for i, s in enumerate(queue) if s.group is group) + 1
        swapped = self.swap.get(group)
        for i, parent in enumerate(live):
            if not kids[i]:
                continue
            for c in kids[i][1:]:
                child = _Seq(group=group, index=len(group.seqs), tokens=parent.tokens + [c.token],
                             num_prompt=parent.num_prompt, num_computed=parent.num_computed, keys=list(parent.keys),
                             cum_logprob=c.cum_logprob)
                if running:
                    child.slot, child.fork_pre = group.child_slots.pop(), parent
                elif swapped is not None:
                    swapped.tables[child.index] = list(swapped.tables[parent.index])
                    swapped.num_tokens[child.index] = swapped.num_tokens[parent.index]
                group.seqs.append(child)
                queue.insert(at, child)
                at += 1
            parent.tokens.append(kids[i][0].token)
            parent.cum_logprob = kids[i][0].cum_logprob

    def _finish(self, group: _Group) -> RequestOutput:
        self._live.pop(group.request.request_id, None)
        group.reported = True
        now = time.perf_counter()
        first = group.seqs[0]
        if group.beam:  # the best hypotheses (and, if aborted, the beams still searching)
            sp = group.request.sampling
            hyps = group.hyps + [
                (beam_search.score(s.cum_logprob, s.num_generated, sp.length_penalty), s.tokens[s.num_prompt :],
                 s.cum_logprob, s.finish_reason) for s in group.seqs if s.finish_reason == "abort"
            ]
            best = sorted(hyps, key=lambda h: -h[0])[: sp.beam_width]
            outputs = [CompletionOutput(index=i, output_ids=toks, finish_reason=reason, cumulative_logprob=cum)
                       for i, (_, toks, cum, reason) in enumerate(best)]
        else:
            outputs = [CompletionOutput(index=s.index, output_ids=s.tokens[s.num_prompt :], finish_reason=s.finish_reason)
                       for s in group.seqs]
        return RequestOutput(
            request_id=group.request.request_id,
            prompt_ids=first.tokens[: first.num_prompt],
            outputs=outputs,
            num_preemptions=group.num_preemptions,
            first_token_s=group.first_token_s,
            finish_s=now - (self._t0 if self._t0 is not None else now),
            num_cached_tokens=max(group.num_cached_tokens, 0),
        )
