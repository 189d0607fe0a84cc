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
   If the pool is short, the newest running sequence is preempted by
   *recompute*: its pages are freed and it goes back to the head of the queue
   with the tokens it has generated, to be prefilled again when readmitted.
2. One jitted call does the rest on device: free the pages of sequences that
   finished or were preempted, grow each scheduled sequence's pages
   (:func:`paged_jax.page_state.unchecked_extend`, copy-on-write included),
   run the model over the flat batch of every scheduled token
   (:mod:`paged_jax.batch`), and sample one token for each sequence whose
   chunk reached its end. The host gets back the sampled tokens, ``ok`` and
   the free-page count in one transfer.

Running out of pages is never an error here: it is what preemption is for.
The engine refuses, at construction, a pool too small to hold one sequence of
``max_seq_len`` tokens, so the oldest running sequence can always proceed.

The host plans with a mirror of what it needs of the page state (each
slot's tokens and pages, the free-page count); it computes exactly what the
device will do, and the device's ``ok`` and free count are checked against
it after each call.

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
import functools
import time
from typing import Any, Iterable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from paged_jax import page_state as ps
from paged_jax.batch import BatchShape, RaggedBatch, Tiling, batch_shape
from paged_jax.block_pool import BlockPool
from paged_jax.checks import check_int
from paged_jax.jit_stats import CompileMonitor
from paged_jax.kv_cache import KVPool, copy_pages
from paged_jax.prefix_cache import PrefixCache, chain_keys
from paged_jax.sampling import SamplingParams, greedy, sample


class PagedModel(Protocol):
    """What the engine needs of a model.

    Attributes:
      params: the weights, a pytree (an argument of the jitted step, never a
        constant folded into it).
      vocab_size: tokens in the vocabulary (prompt ids are checked against
        it).
      apply: ``apply(params, batch: RaggedBatch, kv: KVPool) -> (logits
        f32[R, V] at ``batch.logits_rows``, kv)``, pure and jittable, writing
        the batch's K/V at ``batch.slots`` (``models.llama.RaggedModel``).
    """

    params: Any
    vocab_size: int

    def apply(self, params, batch: RaggedBatch, kv: KVPool) -> tuple[jax.Array, KVPool]: ...


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
    """

    max_seqs: int = 64
    max_seq_len: int = 2048
    max_num_batched_tokens: int = 256
    reserve_max_len: bool = False
    tiling: Tiling = Tiling()
    async_scheduling: bool = True
    enable_prefix_caching: bool = True

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
        for name in ("reserve_max_len", "async_scheduling", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {name}={getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Request:
    """One generation request.

    Attributes:
      request_id: unique among the engine's requests.
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


@dataclasses.dataclass
class RequestOutput:
    """What came of a request.

    Attributes:
      output_ids: generated token ids (a stop token, if one ended it, last).
      finish_reason: "stop" (a stop token), "length" (max_new_tokens) or
        "abort" (:meth:`Engine.abort`).
      num_preemptions: times it was preempted and recomputed.
      num_cached_tokens: prompt tokens served from the prefix cache when
        it was first admitted.
      first_token_s, finish_s: seconds from the start of :meth:`Engine.run`
        (or the first :meth:`Engine.step`).
    """

    request_id: str | int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    num_preemptions: int
    first_token_s: float
    finish_s: float
    num_cached_tokens: int = 0


@dataclasses.dataclass
class _Seq:
    request: Request
    tokens: list[int]  # prompt + generated
    num_prompt: int
    slot: int = -1
    num_computed: int = 0  # tokens whose K/V are in the cache (or being computed)
    pending: int = 0  # tokens sampled on device, not yet read by the host (0 or 1)
    done: bool = False  # finished: anything still in flight for it is discarded
    num_preemptions: int = 0
    first_token_s: float = float("nan")
    keys: list = dataclasses.field(default_factory=list)  # prefix-cache key per full page of tokens
    num_keyed: int = 0  # leading pages offered to the prefix cache
    num_cached_tokens: int = -1  # prompt tokens hit at first admission (-1: not admitted yet)

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


@dataclasses.dataclass
class CallRecord:
    """One model call: its static shape, real tokens, and seconds from
    dispatch to results on the host, less ``compile_s`` spent compiling (or
    loading from the persistent cache) inside it."""

    shape: BatchShape
    tokens: int
    decode_tokens: int
    seconds: float
    compile_s: float


@dataclasses.dataclass
class EngineStats:
    """Counters over an engine's life. Times in seconds.

    ``mean_concurrency`` and ``kv_token_fraction`` are time-averaged over
    iterations, weighting each by its wall time; ``kv_token_fraction`` is the
    share of allocated KV slots (pages held x page size) that hold a token.
    ``model_s`` is the time the host spends in the jitted step calls
    (page-state update, forward and sampling): dispatching them and waiting
    for their results, compilation excluded; ``compile_s`` the compilation
    inside them; ``host_s`` everything else an iteration spends (scheduling,
    building the batch), which with ``async_scheduling`` overlaps the
    device's work on the previous call.

    Prefix caching: ``prompt_tokens`` counts the prompt tokens of requests
    at their first admission and ``prefix_hit_tokens`` those of them served
    from the cache (``prefix_hit_rate`` is the ratio); ``recompute_hit_tokens``
    counts tokens of preempted sequences found again in the cache when
    readmitted. ``prefix_hit_pages`` counts pages taken from the cache, and
    ``pages_saved`` those of them another running sequence held at the time
    (memory not spent twice; the others only save compute).
    """

    iterations: int = 0
    model_calls: int = 0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens computed
    decode_tokens: int = 0  # tokens fed back one at a time
    generated_tokens: int = 0
    discarded_tokens: int = 0  # sampled after a stop token was already in flight
    preemptions: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    recompute_hit_tokens: int = 0
    prefix_hit_pages: int = 0
    pages_saved: int = 0
    peak_concurrency: int = 0
    busy_s: float = 0.0
    model_s: float = 0.0
    compile_s: float = 0.0
    concurrency_s: float = 0.0  # integral of running sequences over time
    token_fraction_s: float = 0.0  # integral of used/allocated over time
    programs: set = dataclasses.field(default_factory=set)  # (BatchShape, greedy only)
    calls: list = dataclasses.field(default_factory=list)  # CallRecord per model call

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens."""
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_s(self) -> float:
        return self.busy_s - self.model_s - self.compile_s

    @property
    def mean_concurrency(self) -> float:
        return self.concurrency_s / self.busy_s if self.busy_s else 0.0

    @property
    def kv_token_fraction(self) -> float:
        return self.token_fraction_s / self.busy_s if self.busy_s else 0.0

    @property
    def num_programs(self) -> int:
        """Distinct static shapes run: the jit compilations this engine
        needed (fewer if another engine of the same model compiled some)."""
        return len(self.programs)


@struct.dataclass
class _StepInputs:
    """Host-built arrays of one call (numpy; see :meth:`Engine._build`), a
    pytree handed to the jitted step as is."""

    free_mask: np.ndarray  # bool[S] slots to free before growing
    num_hit: np.ndarray  # i32[S] prefix-cache pages an empty slot takes
    hit_pages: np.ndarray  # i32[S, max_pages_per_seq] their ids
    num_new: np.ndarray  # i32[S]
    min_pages: np.ndarray  # i32[S]
    tokens: np.ndarray  # i32[T]
    from_prev: np.ndarray  # bool[T] token is the previous call's sample for its row
    positions: np.ndarray  # i32[T]
    token_rows: np.ndarray  # i32[T] page-state row of each token, -1 padding
    q_starts: np.ndarray  # i32[S]
    logits_rows: np.ndarray  # i32[R]
    logits_slots: np.ndarray  # i32[R] page-state row of each sampled token, -1 none
    temperature: np.ndarray  # f32[R]
    top_p: np.ndarray  # f32[R]
    seeds: np.ndarray  # u32[R]
    steps: np.ndarray  # i32[R]


@dataclasses.dataclass
class _InFlight:
    """A dispatched call whose results the host has not read yet."""

    sampled: jax.Array  # i32[S] sampled token per page-state row (device)
    ok: jax.Array  # bool[] the page-state update succeeded (device)
    num_free: jax.Array  # i32[] free pages after it (device)
    samplers: list  # the _Seq that sample in it
    sampler_slots: list  # their rows at dispatch
    expected_free: int  # the host's free-page count right after it
    record: CallRecord


_TRACES: collections.Counter = collections.Counter()  # id(model) -> traces of _device_step
_MONITOR: CompileMonitor | None = None


def _compile_seconds() -> float:
    """Seconds JAX has spent compiling in this process (since the first
    engine call)."""
    global _MONITOR
    if _MONITOR is None:
        _MONITOR = CompileMonitor()
    return _MONITOR.counts.seconds


@functools.partial(jax.jit, static_argnames=("model", "shape", "greedy_only"), donate_argnums=(2, 3))
def _device_step(model, params, state: ps.PageState, kv: KVPool, prev: jax.Array, inp: _StepInputs, *, shape: BatchShape,
                 greedy_only: bool):
    """Free, grow, forward, sample: one iteration's device work, one program
    per (model, shape, greedy_only). ``prev``: i32[S] the previous call's
    sampled token per page-state row (inputs marked ``from_prev`` take it).
    Returns ``(state, kv, sampled i32[S] per row, ok, num_free_pages)``."""
    _TRACES[id(model)] += 1  # runs at trace time only
    state = ps.unchecked_free(state, inp.free_mask)
    state, hit_ok = jax.lax.cond(
        jnp.any(inp.num_hit > 0), ps.unchecked_share, lambda st, n, p: (st, jnp.bool_(True)), state, inp.num_hit, inp.hit_pages
    )
    state, ok, cow_src, cow_dst = ps.unchecked_extend(state, inp.num_new, inp.min_pages)
    ok &= hit_ok
    # Copy-on-write copies are rare: skip the pool-wide gather when none.
    kv = jax.lax.cond(jnp.any(cow_src != ps.NO_PAGE), copy_pages, lambda kv, s, d: kv, kv, cow_src, cow_dst)
    rows, positions = inp.token_rows, inp.positions
    slots = ps.flat_slot_mapping(state.block_tables, rows, positions, page_size=state.page_size)
    tokens = jnp.where(inp.from_prev, prev[jnp.clip(rows, 0, prev.shape[0] - 1)], inp.tokens)
    batch = RaggedBatch(
        tokens=tokens,
        positions=positions,
        slots=slots,
        block_tables=state.block_tables,
        q_starts=inp.q_starts,
        q_lens=inp.num_new,
        kv_lens=state.seq_lens,
        logits_rows=inp.logits_rows,
        shape=shape,
    )
    logits, kv = model.apply(params, batch, kv)  # [R, V]
    if greedy_only:
        new = greedy(logits)
    else:
        new = sample(logits, inp.temperature, inp.top_p, inp.seeds, inp.steps)
    dest = jnp.where(inp.logits_slots < 0, prev.shape[0], inp.logits_slots)  # -1: dropped
    by_row = jnp.zeros_like(prev).at[dest].set(new, mode="drop")
    return state, kv, by_row, ok, state.num_free_pages


def num_traces(model) -> int:
    """Programs traced (compiled, unless JAX's persistent cache had them)
    for ``model``'s engine step, over all its engines."""
    return _TRACES[id(model)]


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
        self._hits: dict[int, list[int]] = {}  # slot -> prefix-cache pages it takes in the next call
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
            that is not a :class:`SamplingParams`, or a duplicate
            ``request_id``. The engine is then unchanged.
          RuntimeError: the engine failed in an earlier step.
        """
        self._raise_if_failed()
        self._check(request, self._ids)
        self._ids.add(request.request_id)
        ids = request.prompt_ids
        prompt = [int(t) for t in (ids.tolist() if isinstance(ids, (np.ndarray, jax.Array)) else ids)]
        seq = _Seq(request=request, tokens=prompt, num_prompt=len(prompt))
        self.waiting.append(seq)
        self._live[request.request_id] = seq

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
            seq = self._live.get(request_id)
        except TypeError:
            raise ValueError(f"request_id must be hashable, got {request_id!r}") from None
        if seq is None:
            state = "already finished or aborted" if request_id in self._ids else "never added"
            raise ValueError(f"request_id {request_id!r} is not an unfinished request ({state})")
        seq.done = True  # a token of it still in flight is discarded when read
        if seq.slot >= 0:
            self._release(seq)
        else:
            self.waiting.remove(seq)
        self.stats.aborted += 1
        out = self._finish(seq, reason="abort")
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
        bar = None
        if progress:
            from tqdm.auto import tqdm

            # disable=None: no bar when stderr is not a terminal (logs stay small).
            bar = tqdm(total=len(self.waiting) + len(self.running), unit="req", leave=False, disable=None)
        outputs: list[RequestOutput] = []
        while self.has_unfinished():
            done = self.step()
            outputs.extend(done)
            if bar is not None:
                bar.update(len(done))
                bar.set_postfix(running=len(self.running), free_pages=self.num_free_pages)
        if bar is not None:
            bar.close()
        return outputs

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
        t_start = time.perf_counter()
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
        tokens = sum(s.num_computed for s in self.running)
        outputs = [self._finish(s) for s in finished]
        for s in finished:
            if s.slot >= 0:
                self._release(s)
            else:  # preempted while its last token was in flight
                self.waiting.remove(s)
        if not self.has_unfinished():
            self._flush_frees()
        dt = time.perf_counter() - t_start
        st = self.stats
        st.iterations += 1
        st.busy_s += dt
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
        scheduled: list[tuple[_Seq, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if seq.num_generated + seq.pending >= seq.request.max_new_tokens or n == 0 or (n > 1 and not chunks):
                i += 1  # finishes when its token in flight is read; or waits for the next call
                continue
            need = self._pages_after(seq, n) - self._held[seq.slot] + self.pool.cow_needed(seq.slot)
            while need > self._num_free:  # preempt the newest until it fits
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq.slot < 0:  # preempted itself: nothing newer was left
                break
            self._num_free -= need
            self._held[seq.slot] += need
            scheduled.append((seq, n))
            budget -= n
            chunks -= n > 1
            i += 1

        # Pages that running sequences will need for their next token soon:
        # keep one for each whose pages are full, so admission does not cause
        # preemption on the very next step.
        watermark = sum(
            1 for s, n in scheduled if (s.num_computed + n) >= self._held[s.slot] * self.page_size
        )
        while self.waiting and self.free_slots and budget > 0:
            seq = self.waiting[0]
            if seq.pending:
                break  # a preempted sequence waits for its token in flight
            hits = self._lookup(seq)
            rest = len(seq.tokens) - len(hits) * self.page_size
            if min(rest, budget) > 1 and not chunks:
                break
            whole = max(ps.pages_for_tokens(len(seq.tokens), self.page_size), self._reserve_pages)
            reused = sum(1 for p in hits if self.pool.ref_counts[p] == 0)  # cached pages leave the free queue
            if whole - len(hits) + reused + watermark > self._num_free:
                break
            self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            self.running.append(seq)
            self._admit_hits(seq, hits)
            n = min(rest, budget)
            need = self._pages_after(seq, n)
            self._num_free -= need - len(hits)
            self._held[seq.slot] = need
            scheduled.append((seq, n))
            budget -= n
            chunks -= n > 1
        return scheduled

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
        if seq.num_cached_tokens < 0:  # first admission
            seq.num_cached_tokens = hit_tokens
            st.prompt_tokens += seq.num_prompt
            st.prefix_hit_tokens += hit_tokens
        else:
            st.recompute_hit_tokens += hit_tokens
        if not hits:
            return
        st.prefix_hit_pages += len(hits)
        st.pages_saved += sum(1 for p in hits if self.pool.ref_counts[p] > 0)
        self._num_free -= self.pool.share(seq.slot, hits)
        self._hits[seq.slot] = hits
        seq.num_computed = hit_tokens

    def _preempt(self, seq: _Seq) -> None:
        """Recompute: free everything; prefill prompt + generated tokens
        again when readmitted."""
        self._release(seq)
        seq.num_computed = 0
        seq.num_keyed = 0  # its pages come anew (or from the cache) when readmitted
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: _Seq) -> None:
        """Gives back ``seq``'s slot and pages (freed on device by the next
        call, or by :meth:`_flush_frees`); a page another sequence shares
        stays held."""
        self.running.remove(seq)
        self._num_free += self.pool.release(seq.slot)  # it is not scheduled in this round: no planned growth
        self._held[seq.slot] = 0
        self._hits.pop(seq.slot, None)
        self._to_free[seq.slot] = True
        self.free_slots.append(seq.slot)
        seq.slot = -1

    def _flush_frees(self) -> None:
        if self._to_free.any():
            self.state = ps.free(self.state, jnp.asarray(self._to_free))
            self._to_free[:] = False
        self.pool.flush()

    # ------------------------------------------------------------- device

    def _build(self, scheduled: list[tuple[_Seq, int]]) -> tuple[_StepInputs, BatchShape, list[_Seq]]:
        S = self.config.max_seqs
        num_new = np.zeros(S, np.int32)
        q_starts = np.zeros(S, np.int32)
        for seq, n in scheduled:
            num_new[seq.slot] = n
        shape = batch_shape(num_new, num_seq_rows=S, tiling=self.config.tiling)
        T, R = shape.num_tokens, shape.num_logits
        tokens = np.zeros(T, np.int32)
        from_prev = np.zeros(T, bool)
        positions = np.zeros(T, np.int32)
        token_rows = np.full(T, -1, np.int32)
        logits_rows = np.zeros(R, np.int32)
        logits_slots = np.full(R, -1, np.int32)
        temperature = np.zeros(R, np.float32)
        top_p = np.ones(R, np.float32)
        seeds = np.zeros(R, np.uint32)
        steps = np.zeros(R, np.int32)
        samplers: list[_Seq] = []
        offset = 0
        for seq, n in scheduled:
            start = seq.num_computed
            known = min(start + n, len(seq.tokens))  # the rest is the token in flight
            q_starts[seq.slot] = offset
            tokens[offset : offset + known - start] = seq.tokens[start:known]
            from_prev[offset + known - start : offset + n] = True
            positions[offset : offset + n] = np.arange(start, start + n)
            token_rows[offset : offset + n] = seq.slot
            if start + n == seq.num_tokens:  # the chunk reaches the end: sample
                r = len(samplers)
                p = seq.request.sampling
                logits_rows[r] = offset + n - 1
                logits_slots[r] = seq.slot
                temperature[r], top_p[r], seeds[r] = p.temperature, p.top_p, p.seed
                steps[r] = seq.num_generated + seq.pending
                samplers.append(seq)
            offset += n
        num_hit = np.zeros(S, np.int32)
        hit_pages = np.zeros((S, self.max_pages_per_seq), np.int32)
        for slot, pages in self._hits.items():
            num_hit[slot] = len(pages)
            hit_pages[slot, : len(pages)] = pages
        inputs = _StepInputs(
            free_mask=self._to_free.copy(), num_hit=num_hit, hit_pages=hit_pages, num_new=num_new,
            min_pages=np.full(S, self._reserve_pages, np.int32), tokens=tokens, from_prev=from_prev,
            positions=positions, token_rows=token_rows, q_starts=q_starts, logits_rows=logits_rows,
            logits_slots=logits_slots, temperature=temperature, top_p=top_p, seeds=seeds, steps=steps,
        )
        return inputs, shape, samplers

    def _dispatch(self, scheduled: list[tuple[_Seq, int]], prev: "_InFlight | None") -> "_InFlight":
        """Builds and launches one call (JAX dispatch returns before the
        device is done). Sequences that sample in it hold a token in flight
        until :meth:`_complete` reads it."""
        inputs, shape, samplers = self._build(scheduled)
        # The twin takes the same steps as the device call: free, share (done
        # at admission), extend.
        if self.pool.extend(inputs.num_new, self._reserve_pages) is None:  # the plan is exact: a bug
            raise RuntimeError(f"the scheduler planned growth the pool cannot give ({self.pool.num_free} free pages)")
        self._hits.clear()
        self._num_free = self.pool.num_free  # the plan counted a copy for every shared page; now exact
        self._held[:] = self.pool.num_seq_pages
        greedy_only = all(s.request.sampling.greedy for s in samplers)
        self.stats.programs.add((shape, greedy_only))
        c0, t0 = _compile_seconds(), time.perf_counter()
        self.state, self.kv, new, ok, num_free = _device_step(
            self.model, self.model.params, self.state, self.kv, self._no_prev if prev is None else prev.sampled,
            inputs, shape=shape, greedy_only=greedy_only,
        )
        compile_s = _compile_seconds() - c0
        self._to_free[:] = False
        if self.check_page_state:
            self.pool.check(self.state)
        decode = sum(1 for s, n in scheduled if n == 1 and s.num_computed >= s.num_prompt)
        total = sum(n for _, n in scheduled)
        for seq, n in scheduled:
            seq.num_computed += n
        for seq in samplers:
            seq.pending += 1
        if self.prefix_cache is not None:
            for seq in self.running:
                self._offer_pages(seq)
        return _InFlight(
            sampled=new, ok=ok, num_free=num_free, samplers=samplers,
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
        sampled, ok, num_free = jax.device_get((call.sampled, call.ok, call.num_free))
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
        st.compile_s += rec.compile_s
        st.decode_tokens += rec.decode_tokens
        st.prefill_tokens += rec.tokens - rec.decode_tokens
        st.calls.append(rec)
        now = time.perf_counter() - self._t0
        for seq, slot in zip(call.samplers, call.sampler_slots):
            seq.pending -= 1
            if seq.done:  # it stopped on the token before: this one was never wanted
                st.discarded_tokens += 1
                continue
            tok = int(sampled[slot])
            seq.tokens.append(tok)
            st.generated_tokens += 1
            if seq.num_generated == 1 and seq.num_preemptions == 0:
                seq.first_token_s = now
            stop = tok in self.stop_ids and not seq.request.ignore_eos
            if stop or seq.num_generated >= seq.request.max_new_tokens:
                seq.done = True
                finished.append(seq)

    def _finish(self, seq: _Seq, reason: str | None = None) -> RequestOutput:
        self._live.pop(seq.request.request_id, None)
        out = seq.tokens[seq.num_prompt :]
        if reason is None:
            reason = "stop" if out[-1] in self.stop_ids and not seq.request.ignore_eos else "length"
        now = time.perf_counter()
        return RequestOutput(
            request_id=seq.request.request_id,
            prompt_ids=seq.tokens[: seq.num_prompt],
            output_ids=out,
            finish_reason=reason,
            num_preemptions=seq.num_preemptions,
            first_token_s=seq.first_token_s,
            finish_s=now - (self._t0 if self._t0 is not None else now),
            num_cached_tokens=max(seq.num_cached_tokens, 0),
        )
