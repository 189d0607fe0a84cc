"""Memory-waste simulation: the paper's Figure 2 over ShareGPT lengths, no model needed.

Requests arrive as a Poisson process (``arrival_rate`` requests per
iteration). One iteration is one decode step: every running request gains one
token. A request is admitted first come, first served, when memory allows; it
then holds its prompt and finishes after ``output_len`` steps, at its final
length ``prompt_len + output_len``.

Four layouts share one KV pool of ``pool_tokens`` slots (a slot = one token's
K and V, all layers):

* ``contiguous-max``: each request reserves ``max_seq_len`` (2,048) slots up
  front (Orca (Max) in the paper);
* ``contiguous-pow2``: the smallest power of two >= its final length (Orca
  (Pow2): the output length known to within 2x);
* ``contiguous-oracle``: exactly its final length (Orca (Oracle));
* ``paged``: pages of ``page_size`` slots taken one at a time as the request
  grows, from a shared pool (vLLM). When a step needs more pages than are free,
  the most recently admitted request is preempted (its pages freed, its tokens
  recomputed on readmission, vLLM's default), and admission keeps vLLM's 1%
  watermark of free pages.

The real page allocator (:mod:`paged_jax.paging.page_state`) holds every request's
slots: ``allocate`` on admission (with ``reserve_tokens`` for the contiguous
layouts, page size 1), one batched ``append`` per iteration for all running
requests, ``free`` on completion or preemption. The scheduler decides from
host-side bookkeeping and records the allocator calls; they are then replayed
on the device with no read-back until the end: a run of iterations between
two events goes as one jitted loop of ``append`` calls, and the block table
has as many rows as requests ever ran at once. The slot counts measured from
the allocator's state must equal the host's exactly, or the run fails.

The contiguous layouts also need an address space: a request's reservation is
one run of slots, placed first-fit in ``[0, pool_tokens)``
(:class:`paged_jax.paging.contiguous.FirstFitAllocator`, the engine's), so
holes left by finished requests fragment it.

Categories. At each iteration every slot of the pool is in exactly one bucket
(then summed over iterations, i.e. time-averaged):

* token states: slots holding K/V of a token already processed
  (``sum(len)``);
* reserved: slots a request holds beyond its current length that it *will*
  fill before it finishes (``min(held, final) - len``);
* internal fragmentation: slots a request holds that it will *never* fill
  (``max(held - final, 0)``);
* external fragmentation: free slots that cannot be used because of how they
  are laid out: while the next request in line waits although the free total
  would hold it, no hole does (all free slots count). Zero for paging by
  construction: any free page serves any request;
* unused: the other free slots (no one waiting, or not enough free in total).

Shares are reported over the memory in use, ``token + reserved + internal +
external`` (the paper's bars sum to 100%), and the unused share separately.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import heapq
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.checks import check_choice, check_float, check_int
from paged_jax.memory import pow2_reservation
from paged_jax.paging import page_state
from paged_jax.paging.contiguous import FirstFitAllocator

SCHEMES = ("contiguous-max", "contiguous-pow2", "contiguous-oracle", "paged")

PAPER_TOKEN_SHARE = {
    "contiguous-max": 0.204,
    "contiguous-pow2": 0.268,
    "contiguous-oracle": 0.382,
    "paged": 0.963,
}
"""Token-state share in Kwon et al., SOSP 2023, Figure 2 (Orca (Max), Orca
(Pow2), Orca (Oracle), vLLM)."""

_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulation.

    Attributes:
      scheme: one of :data:`SCHEMES`.
      pool_tokens: KV pool size, slots (tokens). 32,768 slots is 4 GiB of
        Llama-3-8B KV in bf16.
      page_size: tokens per page for ``paged``; the contiguous layouts use
        slot granularity (page size 1).
      max_seq_len: the declared maximum (``contiguous-max`` reserves it);
        every request's final length must be within it.
      max_seqs: running requests at most (vLLM's ``max_num_seqs``).
      arrival_rate: Poisson arrivals, requests per iteration.
      watermark: share of pages kept free at admission (paged only).
      seed: arrival-process seed.
    """

    scheme: str
    pool_tokens: int = 32_768
    page_size: int = 16
    max_seq_len: int = 2048
    max_seqs: int = 256
    arrival_rate: float = 1.0
    watermark: float = 0.01
    seed: int = 0

    def __post_init__(self):
        check_choice("scheme", self.scheme, SCHEMES)
        for name, low in (("pool_tokens", 1), ("page_size", 1), ("max_seq_len", 1), ("max_seqs", 1)):
            value = getattr(self, name)
            check_int(name, value, low)
        check_float("arrival_rate", self.arrival_rate, 0, low_open=True)
        check_float("watermark", self.watermark, 0, 1, high_open=True)
        if self.paged and self.pool_tokens % self.page_size:
            raise ValueError(
                f"page_size must divide pool_tokens, got {self.page_size=} {self.pool_tokens=}"
            )

    @property
    def paged(self) -> bool:
        return self.scheme == "paged"

    @property
    def slot_page_size(self) -> int:
        """Page size the allocator runs with: ``page_size`` or 1 (contiguous)."""
        return self.page_size if self.paged else 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimResult:
    """Time-averaged memory use of one simulation.

    Shares are fractions of the memory in use (they sum to 1); slot-iteration
    totals (``*_slot_iters``) are the raw sums over iterations.

    Attributes:
      config: the simulation.
      num_requests: requests served.
      iterations: decode steps from the first arrival to the last completion.
      token_share, reserved_share, internal_share, external_share: shares of
        the memory in use.
      unused_share: free, usable slots as a share of the whole pool.
      mean_running, peak_running: running requests per iteration (mean =
        tokens generated per iteration).
      preemptions: requests preempted (paged only).
      max_unfilled_slots: most slots any running request held beyond its
        length at any iteration, read from the allocator (paged: < page_size).
      wall_s: seconds the simulation took.
    """

    config: SimConfig
    num_requests: int
    iterations: int
    token_slot_iters: int
    reserved_slot_iters: int
    internal_slot_iters: int
    external_slot_iters: int
    unused_slot_iters: int
    mean_running: float
    peak_running: int
    preemptions: int
    max_unfilled_slots: int
    wall_s: float

    @property
    def _in_use(self) -> int:
        return (
            self.token_slot_iters
            + self.reserved_slot_iters
            + self.internal_slot_iters
            + self.external_slot_iters
        )

    @property
    def token_share(self) -> float:
        return self.token_slot_iters / self._in_use

    @property
    def reserved_share(self) -> float:
        return self.reserved_slot_iters / self._in_use

    @property
    def internal_share(self) -> float:
        return self.internal_slot_iters / self._in_use

    @property
    def external_share(self) -> float:
        return self.external_slot_iters / self._in_use

    @property
    def unused_share(self) -> float:
        return self.unused_slot_iters / (self.iterations * self.config.pool_tokens)


@functools.partial(jax.jit, donate_argnums=(0,))
def _advance(
    state: page_state.PageState,
    active: jax.Array,  # bool[max_seqs]
    final: jax.Array,  # i32[max_seqs] final lengths (0 where empty)
    num_steps: jax.Array,  # i32[]
):
    """``num_steps`` decode steps: one batched :func:`page_state.append` each.

    Returns ``(state, sums, max_unfilled, ok)``: ``sums`` i32[4] are
    token, reserved, internal and held slots summed over the steps (the caller
    keeps ``num_steps * pool_tokens < 2**31``); ``max_unfilled`` the most slots
    a running sequence held beyond its length; ``ok`` every append fit.
    """
    page_size = state.page_size

    def body(_, carry):
        state, sums, max_unfilled, ok_all = carry
        state, ok, _, _ = page_state.append(state, active)
        held = state.num_seq_pages * page_size
        lens = state.seq_lens
        step = jnp.stack(
            [
                lens.sum(),
                (jnp.minimum(held, final) - lens).sum(),
                jnp.maximum(held - final, 0).sum(),
                held.sum(),
            ]
        )
        unfilled = jnp.max(jnp.where(active, held - lens, 0))
        return state, sums + step, jnp.maximum(max_unfilled, unfilled), ok_all & ok

    init = (state, jnp.zeros(4, jnp.int32), jnp.int32(0), jnp.bool_(True))
    return jax.lax.fori_loop(0, num_steps, body, init)


_allocate = jax.jit(page_state.unchecked_allocate.__wrapped__, donate_argnums=(0,))
_free = jax.jit(page_state.unchecked_free.__wrapped__, donate_argnums=(0,))


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> np.ndarray:
    """Arrival iteration of each request: i64[num_requests], non-decreasing,
    exponential gaps of mean ``1 / rate`` iterations, starting at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, num_requests)
    gaps[0] = 0.0
    return np.floor(np.cumsum(gaps)).astype(np.int64)


def declared_slots(final_lens: np.ndarray, config: SimConfig) -> np.ndarray:
    """Slots each request reserves at admission (contiguous layouts), i64[R]."""
    if config.scheme == "contiguous-max":
        return np.full_like(final_lens, config.max_seq_len)
    if config.scheme == "contiguous-pow2":
        return np.minimum(pow2_reservation(final_lens), config.max_seq_len)
    return final_lens.copy()  # oracle; paged does not reserve


def _replay(calls: list[tuple], config: SimConfig, num_pages: int, max_seqs: int) -> tuple[np.ndarray, int]:
    """Runs the recorded allocator calls on the real page state.

    The block table has ``max_seqs`` rows, the peak number of running
    requests: a scheduler that always takes the lowest free sequence slot
    never uses a slot id at or above its peak concurrency, and the cost of
    every allocator call grows with the table. Calls are queued without
    reading anything back; one read at the end.

    Returns:
      ``(sums, max_unfilled)``: i64[4] token, reserved, internal and held
      slot-iterations measured from the allocator's state, and the most slots
      any running sequence held beyond its length.

    Raises:
      RuntimeError: the allocator refused a call, or pages are left held.
    """
    ps = config.slot_page_size
    state = page_state.init_page_state(
        num_pages=num_pages + 1,  # + the null page
        max_seqs=max_seqs,
        max_pages_per_seq=-(-config.max_seq_len // ps),
        page_size=ps,
    )
    chunk = max(1, _INT32_MAX // config.pool_tokens)  # keeps the i32 sums exact
    sums, gaps, oks = [], [], []
    for call in calls:
        if call[0] == "advance":
            _, active, final, steps = call
            active, final = active[:max_seqs], final[:max_seqs]
            while steps:
                n = min(steps, chunk)
                state, step_sums, gap, ok = _advance(state, active, final, np.int32(n))
                sums.append(step_sums)
                gaps.append(gap)
                oks.append(ok)
                steps -= n
        elif call[0] == "alloc":
            _, seq, tokens, reserve = call
            state, ok = _allocate(state, np.int32(seq), np.int32(tokens), np.int32(reserve))
            oks.append(ok)
        else:
            state = _free(state, call[1][:max_seqs])
    # device_get, not jnp.stack: stacking thousands of arrays would compile a
    # concatenation of that many operands.
    sums, gaps, oks, free_left = jax.device_get((sums, gaps, oks, state.num_free_pages))
    if not all(oks):
        raise RuntimeError("the page allocator refused a call the simulation allowed")
    if int(free_left) != num_pages:
        raise RuntimeError(f"{num_pages - int(free_left)} pages still held after every request finished")
    return np.sum(np.asarray(sums, np.int64), axis=0), int(max(gaps, default=0))


def simulate(prompt_lens, output_lens, config: SimConfig) -> SimResult:
    """Serves the requests under ``config`` and measures where the memory goes.

    Args:
      prompt_lens: i64[R] prompt tokens per request (>= 1).
      output_lens: i64[R] generated tokens per request (>= 1).
      config: the layout and the workload knobs.

    Returns:
      A :class:`SimResult`.

    Raises:
      ValueError: mismatched or out-of-range lengths, a request that can never
        fit the pool (the message names it).
      RuntimeError: the page allocator disagrees with the host bookkeeping.
    """
    t_start = time.perf_counter()
    prompt = np.asarray(prompt_lens, dtype=np.int64)
    output = np.asarray(output_lens, dtype=np.int64)
    if prompt.ndim != 1 or prompt.shape != output.shape or prompt.size == 0:
        raise ValueError(
            f"prompt_lens and output_lens must be equal-length non-empty 1-D, got "
            f"{prompt.shape} and {output.shape}"
        )
    if prompt.min() < 1 or output.min() < 1:
        raise ValueError("prompt_lens and output_lens must all be >= 1")
    final = prompt + output
    if final.max() > config.max_seq_len:
        raise ValueError(
            f"every final length must be <= max_seq_len={config.max_seq_len}, got {int(final.max())}"
        )
    num_req = prompt.size
    ps = config.slot_page_size
    num_pages = config.pool_tokens // ps
    watermark_pages = math.ceil(config.watermark * num_pages) if config.paged else 0
    declared = declared_slots(final, config)
    need_most = (
        -(-int(final.max()) // ps) + watermark_pages if config.paged else int(declared.max())
    )
    if need_most > num_pages:
        raise ValueError(
            f"pool_tokens={config.pool_tokens} cannot hold the largest request "
            f"({need_most} pages of {ps} slots)"
        )
    arrival = poisson_arrivals(num_req, config.arrival_rate, config.seed)

    max_seqs = config.max_seqs
    # Host bookkeeping, per sequence slot.
    slot_req = np.full(max_seqs, -1, np.int64)
    lens = np.zeros(max_seqs, np.int64)
    fin = np.zeros(max_seqs, np.int64)
    held = np.zeros(max_seqs, np.int64)
    start = np.zeros(max_seqs, np.int64)  # contiguous: address of the reservation
    admitted_at = np.zeros(max_seqs, np.int64)  # admission counter, for preemption order
    empty_slots = list(range(max_seqs))
    heapq.heapify(empty_slots)
    free_pages = num_pages
    space = FirstFitAllocator(config.pool_tokens)
    queue: collections.deque[int] = collections.deque()
    resume_len = prompt.copy()  # tokens a request holds on (re)admission

    # Allocator calls, recorded here and replayed on the device afterwards
    # (see _replay): ("alloc", seq, tokens, reserve), ("free", mask) and
    # ("advance", active, final, steps) for a run of decode steps.
    calls: list[tuple] = []
    pending = 0  # decode steps not yet recorded, all with the current active set

    def flush():
        nonlocal pending
        if pending:
            calls.append(("advance", slot_req >= 0, fin.astype(np.int32), pending))
            pending = 0

    host = np.zeros(6, np.int64)  # token, reserved, internal, held, external, unused
    running_sum = peak_running = preemptions = admissions = done = steps = 0
    nxt = 0  # next request to arrive
    t = 0
    while done < num_req:
        while nxt < num_req and arrival[nxt] <= t:
            queue.append(nxt)
            nxt += 1
        if not queue and not (slot_req >= 0).any():
            t = int(arrival[nxt])  # idle until the next arrival
            continue

        # Admission, first come first served.
        blocked_by_layout = False
        while queue and empty_slots:
            r = queue[0]
            length = int(resume_len[r])
            if config.paged:
                need = -(-length // ps)
                if free_pages - need < watermark_pages:
                    break
                addr = 0
            else:
                need = int(declared[r])
                addr = space.allocate(need)
                if addr is None:
                    blocked_by_layout = space.num_free >= need
                    break
            flush()
            seq = heapq.heappop(empty_slots)
            calls.append(("alloc", seq, length, 0 if config.paged else need))
            queue.popleft()
            slot_req[seq], lens[seq], fin[seq] = r, length, final[r]
            held[seq] = need * ps
            start[seq] = addr
            admitted_at[seq] = admissions
            admissions += 1
            free_pages -= need

        running = slot_req >= 0
        if config.paged:
            # Every running request whose pages are full takes one page now.
            grow = running & (lens % ps == 0)
            while grow.sum() > free_pages:
                victim = int(np.argmax(np.where(running, admitted_at, -1)))
                flush()
                calls.append(("free", np.arange(max_seqs) == victim))
                r = int(slot_req[victim])
                resume_len[r] = lens[victim]
                queue.appendleft(r)
                free_pages += held[victim] // ps
                slot_req[victim], lens[victim], fin[victim], held[victim] = -1, 0, 0, 0
                heapq.heappush(empty_slots, victim)
                preemptions += 1
                running = slot_req >= 0
                grow = running & (lens % ps == 0)
            free_pages -= int(grow.sum())
            held = held + grow * ps

        # One decode step.
        pending += 1
        steps += 1
        lens = lens + running
        n_running = int(running.sum())
        running_sum += n_running
        peak_running = max(peak_running, n_running)
        token = int(lens.sum())
        reserved = int((np.minimum(held, fin) - lens).sum())
        internal = int(np.maximum(held - fin, 0).sum())
        held_total = int(held.sum())
        external = space.num_free if blocked_by_layout else 0
        host += (token, reserved, internal, held_total, external,
                 config.pool_tokens - held_total - external)

        finished = running & (lens == fin)
        if finished.any():
            flush()
            calls.append(("free", finished))
            for seq in np.flatnonzero(finished):
                if config.paged:
                    free_pages += held[seq] // ps
                else:
                    space.free(int(start[seq]))
                    free_pages += held[seq]
                heapq.heappush(empty_slots, int(seq))
            slot_req[finished], lens[finished], fin[finished], held[finished] = -1, 0, 0, 0
            done += int(finished.sum())
        t += 1
    flush()

    dev_sums, max_unfilled = _replay(calls, config, num_pages, max(peak_running, 1))
    if (dev_sums != host[:4]).any():
        raise RuntimeError(
            f"page allocator and simulation disagree: device {dev_sums.tolist()} vs host {host[:4].tolist()}"
        )
    iterations = t - int(arrival[0])
    return SimResult(
        config=config,
        num_requests=num_req,
        iterations=iterations,
        token_slot_iters=int(host[0]),
        reserved_slot_iters=int(host[1]),
        internal_slot_iters=int(host[2]),
        external_slot_iters=int(host[4]),
        unused_slot_iters=int(host[5]) + config.pool_tokens * (iterations - steps),
        mean_running=running_sum / iterations,
        peak_running=peak_running,
        preemptions=preemptions,
        max_unfilled_slots=max_unfilled,
        wall_s=time.perf_counter() - t_start,
    )
