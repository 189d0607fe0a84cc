"""A continuous-batching serving engine over the paged KV cache.

Data path, one direction: request -> scheduler (this module) -> page state
(:mod:`paged_jax.page_state`) -> model step (a function the caller passes in;
this module never imports a model) -> sampler -> request.

Each iteration (iteration-level scheduling, Orca, OSDI 2022; PagedAttention,
Kwon et al., SOSP 2023, section 4.5):

1. Admit waiting requests first come, first served while their prompts'
   pages are free, and prefill each one (one model call per request).
2. Grow every other running sequence by one slot (``append``, one batched
   call); if the pool is short, preempt the newest running sequence by
   *recompute* (free all its pages, put it back at the head of the queue with
   the tokens it has generated, and prefill prompt + generated tokens when it
   is readmitted) until the rest fits. Then one decode call for all of them.
3. Free the pages of every sequence that finished, in the same iteration.

Running out of pages is never an error here: it is what preemption is for.
The engine refuses, at construction, a pool too small to hold one sequence of
``max_seq_len`` tokens, so the oldest running sequence can always proceed.

Shapes are padded to buckets (powers of two for batch, query tokens and
pages per sequence) so ``jit`` compiles a handful of programs; the engine
counts them.

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
from typing import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import page_state as ps
from paged_jax.checks import check_int
from paged_jax.kv_cache import KVPool, copy_pages
from paged_jax.sampling import SamplingParams, greedy, sample

StepFn = Callable[..., tuple[jax.Array, KVPool]]
"""``step(tokens i32[B, T], kv, block_tables i32[B, pages], kv_lens i32[B],
q_lens i32[B]) -> (logits f32[B, V] at each row's last real query token,
new kv)``: one pure model call; the convention of
:func:`paged_jax.attention.ref_paged_attention`."""


def bucket(n: int, low: int = 1, high: int | None = None) -> int:
    """Smallest power of two >= max(n, low), capped at ``high``."""
    b = max(low, 1)
    while b < n:
        b *= 2
    return b if high is None else min(b, high)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Scheduler limits.

    Attributes:
      max_seqs: most sequences running at once (the decode batch), >= 1.
      max_seq_len: most tokens per sequence, prompt plus output, >= 1.
      reserve_max_len: reserve ``max_seq_len`` slots per request at admission
        (the contiguous baseline) instead of paging on demand.
      max_prefill_tokens: prompt tokens admitted per iteration (at least one
        request is admitted whatever its length), >= 1.
      min_prefill_bucket: smallest padded prefill length, tokens.
      decode_split_overhead: if set, a decode batch whose lengths differ
        widely runs as two calls (short and long sequences) when the padded
        attention saved, in row-pages (batch rows x pages per row), exceeds
        this fixed cost of one more call. For attention that pads every row
        to the longest (the XLA path); leave None for kernels that stop at
        each length. About 128 fits SmolLM2 on 2 CPU cores (measured: a
        call's fixed cost ~25 ms, attention ~0.2 ms per row-page).
    """

    max_seqs: int = 64
    max_seq_len: int = 2048
    reserve_max_len: bool = False
    max_prefill_tokens: int = 4096
    min_prefill_bucket: int = 16
    decode_split_overhead: float | None = None

    def __post_init__(self):
        for name in ("max_seqs", "max_seq_len", "max_prefill_tokens", "min_prefill_bucket"):
            check_int(name, getattr(self, name))
        split = self.decode_split_overhead
        if split is not None and (isinstance(split, bool) or not isinstance(split, (int, float)) or not split >= 0):
            raise ValueError(
                f"decode_split_overhead must be None or >= 0, got decode_split_overhead={self.decode_split_overhead!r}"
            )
        if not isinstance(self.reserve_max_len, bool):
            raise ValueError(f"reserve_max_len must be a bool, got reserve_max_len={self.reserve_max_len!r}")


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
    """

    request_id: str | int
    prompt_ids: Sequence[int]
    max_new_tokens: int
    sampling: SamplingParams = SamplingParams()
    ignore_eos: bool = False


@dataclasses.dataclass
class RequestOutput:
    """What came of a request.

    Attributes:
      output_ids: generated token ids (a stop token, if one ended it, last).
      finish_reason: "stop" (a stop token) or "length" (max_new_tokens).
      num_preemptions: times it was preempted and recomputed.
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


@dataclasses.dataclass
class _Seq:
    request: Request
    tokens: list[int]  # prompt + generated
    num_prompt: int
    slot: int = -1
    num_preemptions: int = 0
    first_token_s: float = float("nan")

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt


@dataclasses.dataclass
class EngineStats:
    """Counters over an engine's life. Times in seconds.

    ``mean_concurrency`` and ``kv_token_fraction`` are time-averaged over
    iterations, weighting each by its wall time; ``kv_token_fraction`` is the
    share of allocated KV slots (pages held x page size) that hold a token.
    """

    iterations: int = 0
    prefill_calls: int = 0
    decode_calls: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    peak_concurrency: int = 0
    busy_s: float = 0.0
    concurrency_s: float = 0.0  # integral of running sequences over time
    token_fraction_s: float = 0.0  # integral of used/allocated over time
    programs: set = dataclasses.field(default_factory=set)  # (phase, B, T, pages)

    @property
    def mean_concurrency(self) -> float:
        return self.concurrency_s / self.busy_s if self.busy_s else 0.0

    @property
    def kv_token_fraction(self) -> float:
        return self.token_fraction_s / self.busy_s if self.busy_s else 0.0

    @property
    def num_programs(self) -> int:
        """Distinct padded shapes run: the number of jit compilations of a
        step function that is jitted once."""
        return len(self.programs)


_copy_pages = jax.jit(copy_pages, donate_argnums=0)


class Engine:
    """Continuous batching with paged KV and preemption by recompute.

    Args:
      step_fn: the model step (:data:`StepFn`), jitted by the caller, ideally
        donating its ``kv`` argument.
      kv_pool: the KV pool the step reads and writes; its ``num_pages`` and
        ``page_size`` define the page state.
      config: scheduler limits.
      stop_ids: token ids that end a request (unless it ignores EOS).
      vocab_size: prompt ids are checked against it; default: the step
        function's ``vocab_size`` attribute, if it has one.

    Raises:
      ValueError: the pool cannot hold one sequence of ``config.max_seq_len``
        tokens (then no schedule could finish a long request); a bad
        ``vocab_size`` or ``stop_ids``.
    """

    def __init__(
        self,
        step_fn: StepFn,
        kv_pool: KVPool,
        config: EngineConfig,
        *,
        stop_ids: Iterable[int] = (),
        vocab_size: int | None = None,
    ):
        page_size = kv_pool.page_size
        usable = (kv_pool.num_pages - 1) * page_size
        if usable < config.max_seq_len:
            raise ValueError(
                f"the KV pool holds {usable} tokens ({kv_pool.num_pages - 1} usable pages x "
                f"page_size={page_size}), fewer than one sequence of max_seq_len={config.max_seq_len}"
            )
        self.step_fn = step_fn
        self.kv = kv_pool
        self.config = config
        if vocab_size is None:
            vocab_size = getattr(step_fn, "vocab_size", None)
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1):
            raise ValueError(f"vocab_size must be None or an int >= 1, got vocab_size={vocab_size!r}")
        self.vocab_size = vocab_size
        stop_ids = list(stop_ids) if isinstance(stop_ids, (list, tuple, set, frozenset, range)) else stop_ids
        if not isinstance(stop_ids, list):
            raise ValueError(f"stop_ids must be a list, tuple or set of token ids, got {stop_ids!r}")
        self._check_token_ids("stop_ids", stop_ids)
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.page_size = page_size
        self.max_pages_per_seq = ps.pages_for_tokens(config.max_seq_len, page_size)
        self.state = ps.init_page_state(
            num_pages=kv_pool.num_pages,
            max_seqs=config.max_seqs,
            max_pages_per_seq=self.max_pages_per_seq,
            page_size=page_size,
        )
        self.waiting: collections.deque[_Seq] = collections.deque()
        self.running: list[_Seq] = []  # admission order, oldest first
        self.free_slots = list(range(config.max_seqs - 1, -1, -1))  # pop() gives 0 first
        self.stats = EngineStats()
        self._ids: set = set()
        self._t0: float | None = None
        self._sync()

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
        """
        self._check(request, self._ids)
        self._ids.add(request.request_id)
        ids = request.prompt_ids
        prompt = [int(t) for t in (ids.tolist() if isinstance(ids, (np.ndarray, jax.Array)) else ids)]
        self.waiting.append(_Seq(request=request, tokens=prompt, num_prompt=len(prompt)))

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
        return bool(self.waiting or self.running)

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
        return self._num_free

    # ------------------------------------------------------------ iteration

    def step(self) -> list[RequestOutput]:
        """One scheduler iteration: admit + prefill, grow + decode, free.

        Returns the requests that finished in it.
        """
        if self._t0 is None:
            self._t0 = time.perf_counter()
        t_start = time.perf_counter()
        finished: list[_Seq] = []
        prefilled = self._admit_and_prefill(finished)
        decoding = [s for s in self.running if s not in prefilled and s not in finished]
        decoding = self._grow(decoding)
        if decoding:
            self._decode(decoding, finished)

        # Measure occupancy while the finished sequences still hold pages.
        held_pages = self.state.num_pages - 1 - self._num_free
        tokens = int(self._seq_lens[[s.slot for s in self.running]].sum()) if self.running else 0
        dt = time.perf_counter() - t_start
        st = self.stats
        st.iterations += 1
        st.busy_s += dt
        st.peak_concurrency = max(st.peak_concurrency, len(self.running))
        st.concurrency_s += len(self.running) * dt
        if held_pages:
            st.token_fraction_s += tokens / (held_pages * self.page_size) * dt

        outputs = [self._finish(s) for s in finished]
        if finished:
            mask = np.zeros(self.config.max_seqs, bool)
            mask[[s.slot for s in finished]] = True
            self.state = ps.free(self.state, jnp.asarray(mask))
            for s in finished:
                self.running.remove(s)
                self.free_slots.append(s.slot)
                s.slot = -1
            self._sync()
        return outputs

    def _sync(self) -> None:
        """Host copies of what the scheduler reads (one device-to-host copy)."""
        seq_lens, num_seq_pages, num_free, block_tables = jax.device_get(
            (self.state.seq_lens, self.state.num_seq_pages, self.state.num_free_pages, self.state.block_tables)
        )
        self._seq_lens, self._num_seq_pages, self._num_free = seq_lens, num_seq_pages, int(num_free)
        self._block_tables = block_tables

    def _admit_and_prefill(self, finished: list[_Seq]) -> list[_Seq]:
        cfg = self.config
        budget = cfg.max_prefill_tokens
        admitted: list[_Seq] = []
        while self.waiting and self.free_slots:
            seq = self.waiting[0]
            n = len(seq.tokens)
            if admitted and n > budget:
                break
            reserve = cfg.max_seq_len if cfg.reserve_max_len else 0
            need = ps.pages_for_tokens(max(n, reserve), self.page_size)
            # Watermark: keep one page for every running sequence whose pages
            # are full, so the next decode step does not preempt at once what
            # was just admitted.
            full = sum(
                1
                for s in self.running
                if self._seq_lens[s.slot] >= self._num_seq_pages[s.slot] * self.page_size
            )
            if need > self._num_free - full:
                break
            slot = self.free_slots.pop()
            self.state, ok = ps.allocate(self.state, slot, n, reserve)
            self._sync()
            if not bool(ok):  # the host-side check above makes this a bug
                raise RuntimeError(f"allocate failed with {self._num_free} free pages for {need}")
            self.waiting.popleft()
            seq.slot = slot
            self.running.append(seq)
            admitted.append(seq)
            budget -= n
            self._prefill(seq, finished)
        return admitted

    def _prefill(self, seq: _Seq, finished: list[_Seq]) -> None:
        n = len(seq.tokens)
        t_bucket = bucket(n, self.config.min_prefill_bucket, self.config.max_seq_len)
        pages = bucket(ps.pages_for_tokens(n, self.page_size), 1, self.max_pages_per_seq)
        tokens = np.zeros((1, t_bucket), np.int32)
        tokens[0, :n] = seq.tokens
        block_tables = self._block_tables[seq.slot : seq.slot + 1, :pages]
        lens = np.array([n], np.int32)
        self.stats.programs.add(("prefill", 1, t_bucket, pages))
        logits, self.kv = self.step_fn(jnp.asarray(tokens), self.kv, jnp.asarray(block_tables), lens, lens)
        self.stats.prefill_calls += 1
        self.stats.prefill_tokens += n
        self._accept([seq], logits, finished)

    def _grow(self, decoding: list[_Seq]) -> list[_Seq]:
        """One more slot for each decoding sequence, preempting the newest
        running sequences until the pool suffices. Returns who still decodes."""
        while decoding:
            active = np.zeros(self.config.max_seqs, bool)
            active[[s.slot for s in decoding]] = True
            state, ok, cow_src, cow_dst = ps.append(self.state, jnp.asarray(active))
            if bool(ok):
                self.state = state
                cow_src = np.asarray(cow_src)
                if (cow_src != ps.NO_PAGE).any():
                    self.kv = _copy_pages(self.kv, jnp.asarray(cow_src), cow_dst)
                self._sync()
                return decoding
            victim = self.running[-1]
            self._preempt(victim)
            if victim in decoding:
                decoding.remove(victim)
        return decoding

    def _preempt(self, seq: _Seq) -> None:
        mask = np.zeros(self.config.max_seqs, bool)
        mask[seq.slot] = True
        self.state = ps.free(self.state, jnp.asarray(mask))
        self._sync()
        self.running.remove(seq)
        self.free_slots.append(seq.slot)
        seq.slot = -1
        seq.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def _batch_bucket(self, n: int) -> int:
        """Padded decode batch: powers of two up to 8, then multiples of 8
        (padding rows cost as much attention as real ones)."""
        b = bucket(n) if n <= 8 else -(-n // 8) * 8
        return min(b, bucket(self.config.max_seqs))

    def _decode_groups(self, decoding: list[_Seq]) -> list[list[_Seq]]:
        """Splits the decode batch in two by length when that saves more
        padded attention than one more model call costs.

        Attention work of a call is ``batch bucket x pages bucket`` row-pages
        (every row is padded to the longest); ``decode_split_overhead`` is a
        call's fixed cost (weights read, launch) in the same units.
        """
        seqs = sorted(decoding, key=lambda s: self._seq_lens[s.slot])
        overhead = self.config.decode_split_overhead
        if overhead is None or len(seqs) < 2:
            return [seqs]
        pages = [bucket(ps.pages_for_tokens(int(self._seq_lens[s.slot]), self.page_size), 1,
                        self.max_pages_per_seq) for s in seqs]

        def cost(i, j):  # one call for seqs[i:j]
            return self._batch_bucket(j - i) * pages[j - 1]

        best, split = cost(0, len(seqs)), None
        for k in range(1, len(seqs)):
            c = cost(0, k) + cost(k, len(seqs)) + overhead
            if c < best:
                best, split = c, k
        return [seqs] if split is None else [seqs[:split], seqs[split:]]

    def _decode(self, decoding: list[_Seq], finished: list[_Seq]) -> None:
        for group in self._decode_groups(decoding):
            self._decode_call(group, finished)

    def _decode_call(self, decoding: list[_Seq], finished: list[_Seq]) -> None:
        slots = np.array([s.slot for s in decoding])
        batch = len(decoding)
        b_bucket = self._batch_bucket(batch)
        lens = self._seq_lens[slots]
        pages = bucket(ps.pages_for_tokens(int(lens.max()), self.page_size), 1, self.max_pages_per_seq)
        tokens = np.zeros((b_bucket, 1), np.int32)
        tokens[:batch, 0] = [s.tokens[-1] for s in decoding]
        block_tables = np.full((b_bucket, pages), ps.NULL_PAGE, np.int32)
        block_tables[:batch] = self._block_tables[slots, :pages]
        kv_lens = np.zeros(b_bucket, np.int32)
        kv_lens[:batch] = lens
        q_lens = (kv_lens > 0).astype(np.int32)
        self.stats.programs.add(("decode", b_bucket, 1, pages))
        logits, self.kv = self.step_fn(
            jnp.asarray(tokens), self.kv, jnp.asarray(block_tables), jnp.asarray(kv_lens), jnp.asarray(q_lens)
        )
        self.stats.decode_calls += 1
        self._accept(decoding, logits[:batch] if b_bucket > batch else logits, finished)

    def _accept(self, seqs: list[_Seq], logits: jax.Array, finished: list[_Seq]) -> None:
        """Samples one token per sequence from ``logits`` (f32[len(seqs), V])
        and records it; marks finished sequences."""
        params = [s.request.sampling for s in seqs]
        if all(p.greedy for p in params):
            new = np.asarray(greedy(logits))
        else:
            new = np.asarray(
                sample(
                    logits,
                    jnp.asarray([p.temperature for p in params], jnp.float32),
                    jnp.asarray([p.top_p for p in params], jnp.float32),
                    jnp.asarray([p.seed for p in params], jnp.uint32),
                    jnp.asarray([s.num_generated for s in seqs], jnp.int32),
                )
            )
        now = time.perf_counter() - self._t0
        for seq, tok in zip(seqs, new.tolist()):
            seq.tokens.append(tok)
            self.stats.generated_tokens += 1
            if seq.num_generated == 1 and seq.num_preemptions == 0:
                seq.first_token_s = now
            stop = tok in self.stop_ids and not seq.request.ignore_eos
            if stop or seq.num_generated >= seq.request.max_new_tokens:
                finished.append(seq)

    def _finish(self, seq: _Seq) -> RequestOutput:
        out = seq.tokens[seq.num_prompt :]
        stop = out[-1] in self.stop_ids and not seq.request.ignore_eos
        return RequestOutput(
            request_id=seq.request.request_id,
            prompt_ids=seq.tokens[: seq.num_prompt],
            output_ids=out,
            finish_reason="stop" if stop else "length",
            num_preemptions=seq.num_preemptions,
            first_token_s=seq.first_token_s,
            finish_s=time.perf_counter() - self._t0,
        )
