"""A continuous-batching serving engine over the paged KV cache: the loop.

Data path, one direction: request -> scheduler -> page state -> model step
-> sampler -> request. Each concept has its own module; this one runs the
loop (``add_request``, ``abort``, ``step``, ``run``) and reads the results:

- :mod:`paged_jax.requests`: what goes in and comes out, and the checks a
  request passes before it is added (:meth:`Request.check`);
- :mod:`paged_jax.sequence`: the records of a request in flight (its
  sequences and sequence group, PagedAttention, Kwon et al., SOSP 2023,
  section 4.5);
- :mod:`paged_jax.scheduler`: the queues and the policy (iteration-level
  scheduling, chunked prefill in mixed batches, preemption by recompute or
  swap, admission under a token budget);
- :mod:`paged_jax.kv_manager`: the pages: the device page state and KV
  pool, the host's exact twin of the page state, the prefix cache, the
  swap space, and what each decision costs;
- :mod:`paged_jax.input_builder`: one call's flat batch;
- :mod:`paged_jax.step`: the one jitted device program per iteration (free,
  share, fork, grow with copy-on-write, forward, sample); the model is an
  object the caller passes in, this package never imports one;
- :mod:`paged_jax.beam_search`: beams chosen after each call.

The host gets back the sampled tokens, ``ok`` and the free-page count in
one transfer and checks them against its plan (the whole page state with
``check_page_state=True``). Shapes are bucketed
(:func:`paged_jax.batch.batch_shape`), so ``jit`` compiles a handful of
programs shared by every engine of the same model object. With
``async_scheduling`` the next iteration is dispatched before the current
one's tokens are read.

Running out of pages is never an error here: it is what preemption is for.
The engine refuses, at construction, a pool too small to hold one sequence
of ``max_seq_len`` tokens, and at admission a group whose sequences could
not all fit in the pool, so the oldest running group can always proceed.

The contiguous baseline is ``EngineConfig(reserve_max_len=True)``
(:mod:`paged_jax.config`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax import beam_search
from paged_jax.checks import check_bool, check_instance
from paged_jax.config import EngineConfig
from paged_jax.input_builder import build_step_inputs, samples_in_call
from paged_jax.kv_cache import KVPool
from paged_jax.kv_manager import KVCacheManager
from paged_jax.outputs import drain, request_output
from paged_jax.requests import CompletionOutput, Request, RequestLimits, RequestOutput, check_token_ids
from paged_jax.sampling import SamplingParams
from paged_jax.scheduler import ScheduledSeq, Scheduler
from paged_jax.sequence import BeamCandidates, Sequence, SequenceGroup
from paged_jax.stats import CallRecord, EngineStats, compile_seconds
from paged_jax.step import PagedModel, check_model, device_step, num_traces

__all__ = [  # the engine's API; the types live in their own modules and are re-exported here
    "CallRecord", "CompletionOutput", "Engine", "EngineConfig", "EngineStats", "PagedModel", "Request",
    "RequestOutput", "SamplingParams", "drain", "num_traces",
]


@dataclasses.dataclass
class _InFlight:
    """A dispatched call whose results the host has not read yet."""

    sampled: jax.Array  # i32[S] sampled token per page-state row (device)
    top: tuple  # (i32[S, K] ids, f32[S, K] log-probs) per row, K = 0 without beam search (device)
    ok: jax.Array  # bool[] the page-state update succeeded (device)
    num_free: jax.Array  # i32[] free pages after it (device)
    samplers: list[Sequence]  # the sequences that sample in it
    sampler_slots: list[int]  # their rows at dispatch
    expected_free: int  # the host's free-page count right after it
    record: CallRecord


class Engine:
    """Continuous batching with paged KV, chunked prefill in mixed batches,
    prefix caching, parallel sampling, beam search and preemption.

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

    def __init__(self, model: PagedModel, kv_pool: KVPool, config: EngineConfig, *, stop_ids: Iterable[int] = (),
                 vocab_size: int | None = None, check_page_state: bool = False):
        check_instance("kv_pool", kv_pool, KVPool, what="paged_jax.kv_cache.KVPool")
        check_instance("config", config, EngineConfig)
        vocab_size = check_model(model, kv_pool, vocab_size)
        usable = (kv_pool.num_pages - 1) * kv_pool.page_size
        if usable < config.max_seq_len:
            raise ValueError(
                f"the KV pool holds {usable} tokens ({kv_pool.num_pages - 1} usable pages x "
                f"page_size={kv_pool.page_size}), fewer than one sequence of max_seq_len={config.max_seq_len}"
            )
        stop_ids = list(stop_ids) if isinstance(stop_ids, (list, tuple, set, frozenset, range)) else stop_ids
        if not isinstance(stop_ids, list):
            raise ValueError(f"stop_ids must be a list, tuple or set of token ids, got {stop_ids!r}")
        check_token_ids("stop_ids", stop_ids, vocab_size)
        self.check_page_state = check_bool("check_page_state", check_page_state)
        self.model = model
        self.config = config
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.page_size = kv_pool.page_size
        self.stats = EngineStats()
        swap_pages = config.swap_space_pages if config.swap_space_pages is not None else kv_pool.num_pages - 1
        self.kv_manager = KVCacheManager(
            kv_pool, max_seqs=config.max_seqs, max_seq_len=config.max_seq_len, reserve_max_len=config.reserve_max_len,
            enable_prefix_caching=config.enable_prefix_caching, swap_space_pages=swap_pages, stats=self.stats)
        self.scheduler = Scheduler(
            max_seqs=config.max_seqs, max_num_batched_tokens=config.max_num_batched_tokens, tiling=config.tiling,
            preemption_mode=config.preemption_mode, kv=self.kv_manager, stats=self.stats)
        self.max_pages_per_seq = self.kv_manager.max_pages_per_seq
        self.limits = RequestLimits(
            vocab_size=vocab_size, max_seq_len=config.max_seq_len, max_seqs=config.max_seqs,
            page_size=self.page_size, usable_pages=kv_pool.num_pages - 1, reserve_pages=self.kv_manager.reserve_pages)
        self._live: dict = {}  # request_id -> group, while unfinished: ids need only be unique among these
        self._inflight: _InFlight | None = None  # the dispatched call not yet read
        self._no_prev = jnp.zeros(config.max_seqs, jnp.int32)
        self._failed: BaseException | None = None
        self._t0: float | None = None

    # ------------------------------------------------------------ views

    @property
    def state(self):
        """The device page state (:class:`paged_jax.page_state.PageState`)."""
        return self.kv_manager.state

    @property
    def kv(self) -> KVPool:
        """The KV pool."""
        return self.kv_manager.kv

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def num_free_pages(self) -> int:
        """Free pages once the pending frees are done (the scheduler's view)."""
        return self.kv_manager.num_free

    def accounting(self) -> dict[str, int]:
        """Pages by state (:meth:`paged_jax.kv_manager.KVCacheManager.accounting`):
        free + cached + used = total."""
        return self.kv_manager.accounting()

    # ------------------------------------------------------------------ API

    def add_request(self, request: Request) -> None:
        """Queues a request.

        Raises:
          ValueError: what :meth:`Request.check` refuses against this
            engine's limits (prompt ids, lengths, sampling against
            ``max_seqs`` and the pool), or a ``request_id`` that an
            unfinished request holds. The engine is then unchanged.
          RuntimeError: the engine failed in an earlier step.
        """
        self._raise_if_failed()
        self.check_request(request, self._live)
        group = SequenceGroup.from_request(request)
        self.scheduler.add(group)
        self._live[request.request_id] = group

    def check_request(self, request: Request, taken: Iterable = ()) -> None:
        """Checks ``request`` as :meth:`add_request` would, without adding
        it, and that its id is not among ``taken``.

        Raises:
          ValueError: naming the request and what is wrong.
        """
        check_instance("request", request, Request)
        request.check(self.limits)
        if request.request_id in taken:
            raise ValueError(f"request_id {request.request_id!r} was already added and has not finished")

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
            raise ValueError(f"request_id {request_id!r} is not an unfinished request (never added, or already "
                             "finished or aborted)")
        for seq in group.live:
            seq.finish("abort")  # a token of it still in flight is discarded when read
            self.scheduler.remove(seq)
        self.stats.aborted += 1
        out = self._finish(group)
        if not self.has_unfinished():
            self.kv_manager.flush_frees()
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def run(self, requests: Iterable[Request] = (), *, progress: bool = False) -> list[RequestOutput]:
        """Adds ``requests`` (all or none: each is checked first) and steps
        until every request has finished.

        Returns the outputs in the order the requests finished.
        """
        if isinstance(requests, Request):
            raise ValueError("requests must be an iterable of Request, got one Request: pass [request]")
        requests = list(requests)
        taken = set(self._live)
        for r in requests:
            self.check_request(r, taken)
            taken.add(r.request_id)
        for r in requests:
            self.add_request(r)
        return drain(self, len(self._live), progress,
                     lambda: dict(running=len(self.running), free_pages=self.num_free_pages))

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
        t_start, c_start = time.perf_counter(), compile_seconds()
        scheduled = self.scheduler.schedule()
        prev, self._inflight = self._inflight, None
        current = self._dispatch(scheduled, prev) if scheduled else None
        finished: list[Sequence] = []
        if prev is not None:
            self._complete(prev, finished)
        if current is not None:
            if self.config.async_scheduling:
                self._inflight = current
            else:
                self._complete(current, finished)

        held, used = self.kv_manager.usage()
        tokens = sum(s.num_computed for s in self.running)
        outputs = []
        for s in finished:
            self.scheduler.remove(s)  # running, or preempted while its last token was in flight
            if s.group.finished and not s.group.reported:
                outputs.append(self._finish(s.group))
        if not self.has_unfinished():
            self.kv_manager.flush_frees()
        self.stats.record_iteration(seconds=time.perf_counter() - t_start, compile_s=compile_seconds() - c_start,
                                    held_pages=held, used_pages=used, concurrency=len(self.running) + len(finished),
                                    token_slots=tokens / (held * self.page_size) if held else None)
        return outputs

    # ------------------------------------------------------------- device

    def _dispatch(self, scheduled: list[ScheduledSeq], prev: _InFlight | None) -> _InFlight:
        """Builds and launches one call (JAX dispatch returns before the
        device is done). Sequences that sample in it hold a token in flight
        until :meth:`_complete` reads it."""
        kvm = self.kv_manager
        children = {e.seq.slot: e.seq.group.spawn_children(e.seq) for e in scheduled
                    if samples_in_call(e.seq, e.num_tokens) and e.seq.group.wants_children(e.seq)}
        forks_pre = [s for s in self.running if s.fork_pre is not None]
        inputs, shape, samplers = build_step_inputs(scheduled, children, forks_pre, kvm.call_pages(),
                                                    tiling=self.config.tiling, reserve_pages=kvm.reserve_pages)
        for seq in forks_pre:
            seq.fork_pre = None
        # The twin takes the same steps as the device call: free, share (done
        # at admission), fork (beams), extend, fork (parallel samples).
        expected_free = kvm.plan_call(inputs.fork_pre, inputs.num_new, inputs.fork_src)
        greedy_only = all(s.request.sampling.greedy for s in samplers)
        width = max((s.request.sampling.beam_width for s in samplers), default=0)
        top_k = 1 << (2 * width - 1).bit_length() if width else 0  # 2 * width, bucketed to a power of two
        self.stats.programs.add((shape, greedy_only, top_k))
        c0, t0 = compile_seconds(), time.perf_counter()
        kvm.state, kvm.kv, new, top, ok, num_free = device_step(
            self.model, self.model.params, kvm.state, kvm.kv, self._no_prev if prev is None else prev.sampled,
            inputs, shape=shape, greedy_only=greedy_only, top_k=top_k,
        )
        compile_s = compile_seconds() - c0
        if self.check_page_state:
            kvm.pool.check(kvm.state)
        decode = sum(1 for e in scheduled if e.num_tokens == 1 and e.seq.num_computed >= e.seq.num_prompt)
        for e in scheduled:
            e.seq.num_computed += e.num_tokens
            if e.seq.slot in children:  # they join the group, right after its first sequence
                kids = children[e.seq.slot]
                for child in kids:
                    child.num_computed = e.seq.num_computed
                e.seq.group.seqs.extend(kids)
                e.seq.group.child_slots = []
                self.scheduler.add_children(e.seq, kids)
        for seq in samplers:
            seq.pending += 1
        for seq in self.running:
            kvm.offer(seq)
        return _InFlight(
            sampled=new, top=top, ok=ok, num_free=num_free, samplers=samplers,
            sampler_slots=[seq.slot for seq in samplers], expected_free=expected_free,
            record=CallRecord(shape=shape, tokens=sum(e.num_tokens for e in scheduled), decode_tokens=decode,
                              seconds=time.perf_counter() - t0 - compile_s, compile_s=compile_s),
        )

    def _complete(self, call: _InFlight, finished: list[Sequence]) -> None:
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
        self.stats.record_call(rec)
        now = time.perf_counter() - self._t0
        bad = [seq.request.request_id for seq, slot in zip(call.samplers, call.sampler_slots)
               if not seq.done and (np.isnan(top_lps[slot]).any() if seq.group.beam else sampled[slot] < 0)]
        if bad:  # a token drawn from NaN would look valid: stop instead (the engine is then failed)
            raise FloatingPointError(
                f"the model's logits are not finite (NaN or inf) for requests {bad}: a corrupt KV pool, "
                "weights or inputs; no token was taken from them")
        beam_groups: list[SequenceGroup] = []
        for seq, slot in zip(call.samplers, call.sampler_slots):
            seq.pending -= 1
            if seq.done:  # it stopped on the token before: this one was never wanted
                self.stats.discarded_tokens += 1
                continue
            group = seq.group
            if group.beam:  # the host chooses its next token once every beam has its candidates
                group.candidates[seq.index] = BeamCandidates(ids=top_ids[slot], logprobs=top_lps[slot])
                if group not in beam_groups:
                    beam_groups.append(group)
                continue
            tok = int(sampled[slot])
            seq.tokens.append(tok)
            self.stats.generated_tokens += 1
            if group.first_token_s is None:
                group.first_token_s = now
            stop = tok in self.stop_ids and not seq.request.ignore_eos
            if stop or seq.num_generated >= seq.request.max_new_tokens:
                seq.finish("stop" if stop else "length")
                finished.append(seq)
        for group in beam_groups:
            live = group.live
            if all(s.index in group.candidates and not s.pending for s in live):
                if group.first_token_s is None:
                    group.first_token_s = now
                self._advance_beams(group, live, finished)

    def _advance_beams(self, group: SequenceGroup, live: list[Sequence], finished: list[Sequence]) -> None:
        """Chooses the group's next beams (:func:`paged_jax.beam_search.advance`)
        and moves its sequences: a pruned beam's pages go now (its row stays
        with the group), a new beam shares its parent's pages from the next
        call on (or at swap-in, when the group is swapped out)."""
        step = beam_search.advance(group, live, frozenset() if group.request.ignore_eos else self.stop_ids)
        self.stats.generated_tokens += step.num_tokens
        if step.done:
            finished.extend(live)
            return
        for seq in step.pruned:
            self.scheduler.prune(seq)
        for parent, child in step.forks:
            self.kv_manager.copy_swapped(group, parent, child)
        self.scheduler.add_forks(group, step.forks)

    def _finish(self, group: SequenceGroup) -> RequestOutput:
        """The group's output; its rows and swapped pages go back."""
        self._live.pop(group.request.request_id, None)
        self.scheduler.return_child_slots(group)
        self.kv_manager.drop_swapped(group)
        group.reported = True
        now = time.perf_counter()
        return request_output(group, finish_s=now - (self._t0 if self._t0 is not None else now))
