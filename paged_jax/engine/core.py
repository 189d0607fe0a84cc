"""A continuous-batching serving engine over the paged KV cache: the loop.

Data path, one direction: request -> scheduler -> page state -> model step
-> sampler -> request. Each concept has its own module; this one runs the
loop (``add_request``, ``abort``, ``step``, ``run``) and reads the results:

- :mod:`paged_jax.engine.requests`: what goes in and comes out, and the checks a
  request passes before it is added (:meth:`Request.check`);
- :mod:`paged_jax.engine.sequence`: the records of a request in flight (its
  sequences and sequence group, PagedAttention, Kwon et al., SOSP 2023,
  section 4.5);
- :mod:`paged_jax.engine.scheduler`: the queues and the policy (iteration-level
  scheduling, chunked prefill in mixed batches, preemption by recompute or
  swap, admission under a token budget);
- :mod:`paged_jax.engine.kv_manager`: the pages: the device page state and KV
  pool, the host's exact twin of the page state, the prefix cache, the
  swap space, and what each decision costs;
- :mod:`paged_jax.engine.input_builder`: one call's flat batch;
- :mod:`paged_jax.engine.prompt_logprobs`: the rows that score prompt tokens;
- :mod:`paged_jax.engine.step`: the one jitted device program per iteration (drop
  pages out of a sliding window, free, share, fork, grow with
  copy-on-write, forward, sample); the model is an
  object the caller passes in, this package never imports one;
- :mod:`paged_jax.engine.beam_search`: beams chosen after each call;
- :mod:`paged_jax.engine.speculation`: speculative decoding's proposals
  before a call and verdicts after it (a draft model runs in an engine of
  its own).

The host gets back the sampled tokens, ``ok`` and the free-page count in
one transfer and checks them against its plan (the whole page state with
``check_page_state=True``). Shapes are bucketed
(:func:`paged_jax.attention.batch.batch_shape`), so ``jit`` compiles a handful of
programs shared by every engine of the same model object. With
``async_scheduling`` the next iteration is dispatched before the current
one's tokens are read.

Running out of pages is never an error here: it is what preemption is for.
The engine refuses, at construction, a pool too small to hold one sequence
of ``max_seq_len`` tokens, and at admission a group whose sequences could
not all fit in the pool, so the oldest running group can always proceed.

The paper's Orca baselines are ``EngineConfig(reservation="max")``,
``"pow2"`` and ``"oracle"``, each reservation one buddy-allocated run
(:mod:`paged_jax.engine.config`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.checks import check_bool, check_instance
from paged_jax.engine import beam_search
from paged_jax.engine.config import EngineConfig
from paged_jax.engine.detokenizer import IncrementalDetokenizer, as_tokenizer
from paged_jax.engine.input_builder import build_step_inputs, samples_in_call
from paged_jax.engine.kv_manager import KVCacheManager
from paged_jax.engine.outputs import drain, request_output
from paged_jax.engine.prompt_logprobs import PromptLogprobsBook, PromptRow
from paged_jax.engine.requests import CompletionOutput, Request, RequestLimits, RequestOutput, check_token_ids
from paged_jax.engine.sampling import SamplingParams
from paged_jax.engine.scheduler import ScheduledSeq, Scheduler
from paged_jax.engine.sequence import BeamCandidates, Sequence, SequenceGroup
from paged_jax.engine.speculation import Speculator
from paged_jax.engine.stats import CallRecord, EngineStats, compile_seconds
from paged_jax.engine.step import PagedModel, check_model, device_step, engine_kv_groups, num_traces
from paged_jax.paging.kv_cache import KVPool
from paged_jax.tiers.connector import KVConnector, KVConsumer, KVProducer
from paged_jax.tiers.disk import DiskTier, kv_fingerprint, page_layout

__all__ = [  # the engine's API; the types live in their own modules and are re-exported here
    "CallRecord", "CompletionOutput", "Engine", "EngineConfig", "EngineStats", "PagedModel", "Request",
    "RequestOutput", "SamplingParams", "drain", "num_traces",
]


@dataclasses.dataclass
class _InFlight:
    """A dispatched call whose results the host has not read yet."""

    sampled: jax.Array  # i32[S] sampled token per page-state row (device)
    top: tuple  # (i32[S, K] ids, f32[S, K] log-probs) per row, K = 0 without beam search or logprobs (device)
    sampled_lp: jax.Array  # f32[S] the sampled token's log-prob per row, zeros unless asked for (device)
    prompt: tuple | None  # the prompt rows' (f32[P] log-probs, i32[P, K] top ids, f32[P, K]), None if none (device)
    prompt_rows: list[PromptRow]  # what each prompt row scores
    verify: tuple | None  # (bool[V] accepted, i32[V] each row's token) of the proposals, None if none (device)
    verifiers: list[tuple[Sequence, list[int], int]]  # (sequence, its proposals, its first verification row)
    ok: jax.Array  # bool[] the page-state update succeeded (device)
    num_free: jax.Array  # i32[] free pages after it (device)
    samplers: list[Sequence]  # the sequences that sample in it
    sampler_slots: list[int]  # their rows at dispatch
    expected_free: int  # the host's free-page count right after it
    record: CallRecord
    kv_ok: jax.Array  # bool[S] per slot: its tokens' forwards stayed finite, K/V included (device)
    wrote: list[tuple[Sequence, int, list[int]]]  # (sequence, its slot, the pages its tokens were written to)


class Engine:
    """Continuous batching with paged KV, chunked prefill in mixed batches,
    prefix caching, parallel sampling, beam search and preemption.

    Args:
      model: a :class:`PagedModel` (``models.ragged.RaggedModel``). Engines
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
        (:class:`paged_jax.paging.block_pool.BlockPool`); slow, for tests.
      tokenizer: a ``tokenizers.Tokenizer`` (or an object holding one,
        such as ``models.tokenizer.Tokenizer``:
        :func:`paged_jax.engine.detokenizer.as_tokenizer`): outputs then
        carry their text, detokenized incrementally
        (:mod:`paged_jax.engine.detokenizer`), and requests may have stop strings.

    Raises:
      ValueError: the pool cannot hold one sequence of ``config.max_seq_len``
        tokens in each layer group (then no schedule could finish a long
        request), or does not fit the model (:func:`engine_kv_groups`), or
        was donated already (an earlier engine's pool); a bad
        ``vocab_size`` (or one above the model's) or ``stop_ids``; a model
        without ``params`` and ``apply``.
      RuntimeError: (from :meth:`step`) the engine failed in an earlier step.
    """

    def __init__(self, model: PagedModel, kv_pool: KVPool, config: EngineConfig, *, stop_ids: Iterable[int] = (),
                 vocab_size: int | None = None, check_page_state: bool = False, tokenizer=None):
        self._kv_connector = None
        try:
            self._build(model, kv_pool, config, stop_ids=stop_ids, vocab_size=vocab_size,
                        check_page_state=check_page_state, tokenizer=tokenizer)
        except BaseException:  # refused after the connector started: its port and threads go with the engine
            self.close()
            raise

    def close(self) -> None:
        """Closes the engine's KV connector, if any
        (:mod:`paged_jax.tiers.connector`): a producer stops serving and
        frees its port, a consumer drops its connection and looks up
        nothing more. The engine goes on serving without it. Idempotent."""
        if self._kv_connector is not None:
            self._kv_connector.close()

    def _build(self, model, kv_pool, config, *, stop_ids, vocab_size, check_page_state, tokenizer) -> None:
        check_instance("kv_pool", kv_pool, KVPool, what="paged_jax.paging.kv_cache.KVPool")
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(kv_pool)):
            raise ValueError("kv_pool's buffers were donated to an earlier engine or jitted call (deleted): pass a "
                             "fresh pool (model.make_kv_pool) to each engine")
        check_instance("config", config, EngineConfig)
        vocab_size = check_model(model, kv_pool, vocab_size)
        groups = engine_kv_groups(model, kv_pool, config.drop_out_of_window_pages)
        usable = (kv_pool.num_pages - 1) * kv_pool.page_size // groups.num_groups  # a sequence holds G tables
        if usable < config.max_seq_len:
            raise ValueError(
                f"the KV pool holds {usable} tokens per layer group ({kv_pool.num_pages - 1} usable pages x "
                f"page_size={kv_pool.page_size} / {groups.num_groups} groups), fewer than one sequence of "
                f"max_seq_len={config.max_seq_len}"
            )
        stop_ids = list(stop_ids) if isinstance(stop_ids, (list, tuple, set, frozenset, range)) else stop_ids
        if not isinstance(stop_ids, list):
            raise ValueError(f"stop_ids must be a list, tuple or set of token ids, got {stop_ids!r}")
        check_token_ids("stop_ids", stop_ids, vocab_size)
        self.check_page_state = check_bool("check_page_state", check_page_state)
        self.tokenizer = None if tokenizer is None else as_tokenizer(tokenizer)
        self.model = model
        self.params = model.params  # what the step runs with (update_weights swaps it)
        self.config = config
        self.vocab_size = vocab_size
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.page_size = kv_pool.page_size
        self.stats = EngineStats()
        self.stats.keep_call_records(config.call_records)
        swap_pages = config.swap_space_pages if config.swap_space_pages is not None else kv_pool.num_pages - 1
        fingerprint = self._fingerprint(kv_pool)  # hashed once, for the disk tier and the connector
        self.kv_manager = KVCacheManager(
            kv_pool, max_seqs=config.max_seqs, max_seq_len=config.max_seq_len, reservation=config.reservation,
            enable_prefix_caching=config.enable_prefix_caching, swap_space_pages=swap_pages, stats=self.stats,
            groups=groups, max_num_batched_tokens=config.max_num_batched_tokens, allocator=config.allocator,
            host_cache_bytes=config.host_cache_bytes, disk=self._disk_tier(kv_pool, fingerprint),
            connector=self._connector(kv_pool, fingerprint))
        self.scheduler = Scheduler(
            max_seqs=config.max_seqs, max_num_batched_tokens=config.max_num_batched_tokens, tiling=config.tiling,
            preemption_mode=config.preemption_mode, kv=self.kv_manager, stats=self.stats)
        self.max_pages_per_seq = self.kv_manager.max_pages_per_seq
        self.limits = RequestLimits(
            vocab_size=vocab_size, max_seq_len=config.max_seq_len, max_seqs=config.max_seqs,
            page_size=self.page_size, usable_pages=kv_pool.num_pages - 1, reservation=config.reservation,
            allocator=config.allocator,
            windows=groups.windows, max_num_batched_tokens=config.max_num_batched_tokens)
        self._live: dict = {}  # request_id -> group, while unfinished: ids need only be unique among these
        self._prompt_lps = PromptLogprobsBook()
        self._inflight: _InFlight | None = None  # the dispatched call not yet read
        self._no_prev = jnp.zeros(config.max_seqs, jnp.int32)  # per slot
        self._failed: BaseException | None = None
        self._t0: float | None = None
        self._busy_since: float | None = None  # the last iteration's end, if it left work
        self.speculator = None if config.speculative is None else Speculator.build(
            config.speculative, model=model, kv_pool=kv_pool, engine_config=config,
            vocab_size=getattr(model, "vocab_size", None) or vocab_size, num_groups=groups.num_groups,
            make_engine=Engine)

    def _fingerprint(self, kv_pool: KVPool, params=None) -> str | None:
        """What the tiers key this engine's K/V by: ``params`` (default the
        engine's), the model's class and configuration and this pool's
        layout (:func:`paged_jax.tiers.disk.kv_fingerprint`); None when no
        disk tier or connector needs one (it hashes every weight once)."""
        if self.config.disk_cache_dir is None and self.config.kv_transfer is None:
            return None
        m = self.model
        identity = (f"{type(m).__module__}.{type(m).__qualname__};config={getattr(m, 'config', None)!r};"
                    f"window={getattr(m, 'kv_window', None)!r};groups={getattr(m, 'kv_groups', None)!r}")
        return kv_fingerprint(self.params if params is None else params, kv_pool, extra=identity)

    def _connector(self, kv_pool: KVPool, fingerprint: str | None) -> KVConnector | None:
        """The KV connector ``config.kv_transfer`` asks for
        (:mod:`paged_jax.tiers.connector`), under ``fingerprint``
        (:meth:`_fingerprint`); None without one.

        Raises:
          ValueError: a producer's address cannot be listened on, or no
            producer answers a consumer (named, with the reason).
        """
        c = self.config.kv_transfer
        if c is None:
            return None
        make = KVProducer if c.role == "producer" else KVConsumer
        self._kv_connector = make(c, fingerprint, page_layout(kv_pool), kv_pool.page_size)
        return self._kv_connector

    def _disk_tier(self, kv_pool: KVPool, fingerprint: str | None) -> DiskTier | None:
        """The prefix cache's disk tier ``config.disk_cache_dir`` asks for,
        keyed by ``fingerprint`` (:meth:`_fingerprint`); None without one.

        Raises:
          ValueError: the folder cannot be used (named, with the OS's reason).
        """
        c = self.config
        if c.disk_cache_dir is None:
            return None
        try:
            return DiskTier(c.disk_cache_dir, c.disk_cache_bytes, kv_pool.page_size, fingerprint,
                            layout=page_layout(kv_pool))
        except OSError as e:
            raise ValueError(f"disk_cache_dir={c.disk_cache_dir!r} cannot hold the disk tier: {e}") from None

    # ------------------------------------------------------------ views

    @property
    def state(self):
        """The device page state (:class:`paged_jax.paging.page_state.PageState`)."""
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
        """Pages by state (:meth:`paged_jax.engine.kv_manager.KVCacheManager.accounting`):
        free + cached + used = total."""
        return self.kv_manager.accounting()

    def clock(self) -> float:
        """Seconds on the engine's clock (``time.perf_counter``), which
        starts at the first :meth:`add_request` or :meth:`step`: arrival,
        token and finish times are on it."""
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        return now - self._t0

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
        group = SequenceGroup.from_request(request, arrival_s=self.clock())
        self._attach_detokenizer(group.seqs[0])
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
        if request.sampling.stop and self.tokenizer is None:
            raise ValueError(f"request {request.request_id!r}: stop strings {request.sampling.stop!r} need an engine "
                             "built with a tokenizer (Engine(..., tokenizer=...))")
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

    def reset_prefix_cache(self) -> int:
        """Forgets every cached page, in the device pool, the host tier,
        the disk tier (this model's files deleted) and a KV producer's store
        for consumers: no later request hits
        K/V computed before now (vLLM's ``reset_prefix_cache``); a draft
        model's engine forgets its own too.
        Pages running sequences hold stay theirs. Returns the device pages
        forgotten (the target's)."""
        if self.speculator is not None:
            self.speculator.reset_prefix_cache()
        return self.kv_manager.clear_cache()

    def update_weights(self, params) -> None:
        """Serves ``params`` from now on, without recompiling: new weights
        of the same tree, shapes and dtypes, placed as the old ones (what RL
        rollouts do between training steps). The prefix cache is reset, so
        no request hits K/V the old weights computed.

        Args:
          params: a pytree like the model's ``params``.

        Raises:
          ValueError: a different tree structure, a leaf of another shape or
            dtype, or one holding NaN or inf (named by its path); a disk
            tier whose folder for the new weights cannot be made. The engine
            is then unchanged.
          RuntimeError: requests are unfinished (their K/V came from the old
            weights: finish or abort them first), or the engine failed.
        """
        self._raise_if_failed()
        if self._live:
            raise RuntimeError(f"update_weights with {len(self._live)} unfinished requests: their K/V came from the "
                               "old weights; finish or abort them first")
        while self.has_unfinished():  # an aborted request's call still in flight: read it (its tokens are dropped)
            self.step()
        old_leaves, old_tree = jax.tree_util.tree_flatten_with_path(self.params)
        new_leaves, new_tree = jax.tree_util.tree_flatten_with_path(params)
        if old_tree != new_tree:
            old_paths = [jax.tree_util.keystr(p) for p, _ in old_leaves]
            new_paths = [jax.tree_util.keystr(p) for p, _ in new_leaves]
            extra = [p for p in new_paths if p not in set(old_paths)]
            missing = [p for p in old_paths if p not in set(new_paths)]
            what = (f"params{extra[0]} is not in the model's params" if extra else
                    f"params{missing[0]} is missing" if missing else "params: the same leaves in another container")
            raise ValueError(f"{what} (a different tree structure: {len(extra)} leaves extra, {len(missing)} missing)")
        for (path, old), (_, new) in zip(old_leaves, new_leaves):
            if np.shape(new) != np.shape(old) or jnp.result_type(new) != jnp.result_type(old):
                raise ValueError(f"params{jax.tree_util.keystr(path)}: shape {np.shape(new)} dtype "
                                 f"{jnp.result_type(new)}, expected {np.shape(old)} {jnp.result_type(old)}")
            if jnp.issubdtype(jnp.result_type(new), jnp.inexact) and not bool(jnp.all(jnp.isfinite(new))):
                raise ValueError(f"params{jax.tree_util.keystr(path)}: holds NaN or inf; the engine would fail on "
                                 "its first step")
        offload = self.kv_manager.offload
        # The new weights' pages live under a new fingerprint: its folder made before anything changes.
        fingerprint = self._fingerprint(self.kv, params)  # once, for the disk tier and the connector
        disk = self._disk_tier(self.kv, fingerprint) if offload is not None and offload.disk is not None else None
        remote = offload.remote if offload is not None else None
        self.params = jax.tree.map(
            lambda new, old: jax.device_put(new, old.sharding) if isinstance(old, jax.Array) else new,
            params, self.params)
        self.reset_prefix_cache()
        if disk is not None:
            offload.disk = disk
        if remote is not None:  # a producer serves, a consumer asks for, the new weights' pages only
            remote.set_fingerprint(fingerprint)
        if self.speculator is not None:
            self.speculator.update_weights(self.model, self.params)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def run(self, requests: Iterable[Request] = (), *, progress: bool = False) -> list[RequestOutput]:
        """Adds ``requests`` (all or none: each is checked first) and steps
        until every request has finished.

        Returns the final outputs in the order the requests finished.

        Raises:
          ValueError: a request :meth:`add_request` would refuse, or one
            that streams deltas (``output_kind="delta"``: its final output
            would hold only its last delta; stream it with :meth:`step`).
        """
        if isinstance(requests, Request):
            raise ValueError("requests must be an iterable of Request, got one Request: pass [request]")
        requests = list(requests)
        taken = set(self._live)
        for r in requests:
            self.check_request(r, taken)
            if r.sampling.output_kind == "delta":
                raise ValueError(f"request {r.request_id!r}: output_kind='delta' streams through step(); run() "
                                 "returns final outputs only (use 'final' or 'cumulative')")
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

        Returns the requests that finished in it, and (for requests whose
        ``SamplingParams.output_kind`` streams) those that got tokens in it,
        with ``finished=False``.

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
        t_start, c_start = self.clock(), self._compile_clock()  # starts the clock
        # Busy since the last iteration's end if it left work (the time between is the caller's loop).
        busy_from = t_start if self._busy_since is None else self._busy_since
        # Named phases for a profiler's trace (paged_jax.profiling): nearly free when none runs.
        with jax.profiler.TraceAnnotation("schedule"):
            if self.speculator is not None:
                self.speculator.propose(self.scheduler.running)
            scheduled = self.scheduler.schedule()
        prev, self._inflight = self._inflight, None
        with jax.profiler.TraceAnnotation("dispatch"):
            current = self._dispatch(scheduled, prev, busy_from) if scheduled else None
        finished: list[Sequence] = []
        touched: dict[SequenceGroup, None] = {}  # groups that got tokens, in order
        with jax.profiler.TraceAnnotation("complete"):
            if prev is not None:
                self._complete(prev, finished, touched)
            if current is not None:
                # A call with proposals, or one before proposals may come, is read now: they follow from it.
                if self.config.async_scheduling and not current.verifiers and not (
                        self.speculator is not None and self.speculator.active(len(self.scheduler.running))):
                    self._inflight = current
                else:
                    self._complete(current, finished, touched)

        held, used = self.kv_manager.usage()
        free, longest = self.kv_manager.external_fragmentation()
        tokens = sum(s.num_computed for s in self.running)
        outputs = []
        for s in finished:
            self.scheduler.remove(s)  # running, or preempted while its last token was in flight
            if s.group.finished and not s.group.reported:
                outputs.append(self._finish(s.group))
        now = self.clock()
        for group in touched:
            if not group.reported and group.request.sampling.output_kind != "final":
                outputs.append(request_output(group, now=now, finished=False, prompt_book=self._prompt_lps))
        if not self.has_unfinished():
            self.kv_manager.flush_frees()
        end = self.clock()
        for call in (prev, None if self._inflight is current else current):
            if call is not None:  # read in this iteration
                call.record.done_s = end
        self._busy_since = end if self.has_unfinished() else None
        self.stats.record_iteration(seconds=end - t_start, compile_s=self._compile_clock() - c_start,
                                    held_pages=held, used_pages=used, concurrency=len(self.running) + len(finished),
                                    token_slots=tokens / (held * self.page_size) if held else None,
                                    unusable_free=(free - longest) / self.limits.usable_pages)
        return outputs

    # ------------------------------------------------------------- device

    def _dispatch(self, scheduled: list[ScheduledSeq], prev: _InFlight | None, start_s: float) -> _InFlight:
        """Builds and launches one call (JAX dispatch returns before the
        device is done) in the iteration that began at ``start_s`` (or the
        end of the one before, when that left work).
        Sequences that sample in it hold a token in flight until
        :meth:`_complete` reads it."""
        kvm = self.kv_manager
        children = {e.seq.slot: e.seq.group.spawn_children(e.seq) for e in scheduled
                    if samples_in_call(e.seq, e.num_tokens) and e.seq.group.wants_children(e.seq)}
        for kids in children.values():
            for child in kids:
                self._attach_detokenizer(child)
        forks_pre = [s for s in self.running if s.fork_pre is not None]
        call = build_step_inputs(scheduled, children, forks_pre, kvm.call_pages(), tiling=self.config.tiling,
                                 prompt_book=self._prompt_lps)
        for seq in forks_pre:
            seq.fork_pre = None
        # The twin takes the same steps as the device call: drop (a window's
        # pages, at the round's start), free, share (done at admission), fork
        # (beams), extend, fork (parallel samples).
        expected_free = kvm.plan_call(call.inputs.fork_pre, call.inputs.num_new, call.inputs.fork_src)
        self.stats.programs.add((call.shape, call.options))
        c0, t0 = self._compile_clock(), self.clock()
        wrote = [(e.seq, e.seq.slot, kvm.pages_written(e.seq, e.seq.num_computed, e.num_tokens)) for e in scheduled]
        record = CallRecord(
            shape=call.shape, tokens=sum(e.num_tokens for e in scheduled), compile_s=0.0, seconds=0.0,
            decode_tokens=sum(1 for e in scheduled if e.num_tokens == 1 and e.seq.num_computed >= e.seq.num_prompt),
            rows=len(scheduled), context_tokens=sum(e.seq.num_computed + e.num_tokens for e in scheduled),
            attention_pairs=sum(e.num_tokens * e.seq.num_computed + e.num_tokens * (e.num_tokens + 1) // 2
                                for e in scheduled), start_s=start_s)
        new, top, sampled_lp, prompt, verify, ok, num_free, kv_ok = self._launch(call, prev, record)
        record.compile_s = self._compile_clock() - c0
        record.seconds = self.clock() - t0 - record.compile_s  # dispatch; the read adds its wait
        if self.check_page_state:
            kvm.pool.check(kvm.state)
        for e in scheduled:
            e.seq.num_computed += e.num_tokens
            if e.seq.slot in children:  # they join the group, right after its first sequence
                kids = children[e.seq.slot]
                for child in kids:
                    child.num_computed = e.seq.num_computed
                e.seq.group.seqs.extend(kids)
                e.seq.group.child_slots = []
                self.scheduler.add_children(e.seq, kids)
        for seq in call.samplers:
            seq.pending += 1
        for seq in self.running:
            kvm.offer(seq)
        kvm.store_cached()  # after the call that computes them: this round's cached pages to the disk tier
        return _InFlight(
            sampled=new, top=top, sampled_lp=sampled_lp, prompt=prompt, prompt_rows=call.prompt_rows,
            verify=verify, verifiers=call.verifiers, ok=ok,
            num_free=num_free, samplers=call.samplers,
            sampler_slots=[seq.slot for seq in call.samplers], expected_free=expected_free,
            record=record,
            kv_ok=kv_ok, wrote=wrote,
        )

    def _compile_clock(self) -> float:
        """Seconds JAX has spent compiling in this process (none on a
        simulated engine's clock)."""
        return compile_seconds()

    def _launch(self, call, prev: _InFlight | None, record: CallRecord) -> tuple:
        """Dispatches the jitted step for ``call`` (a
        :class:`paged_jax.engine.input_builder.StepCall`; ``record`` holds
        its work), updating the page state and the KV pool; returns its
        device outputs ``(sampled, top, sampled_logprob, prompt, verify, ok,
        num_free, kv_ok)`` (:func:`paged_jax.engine.step.device_step`). A
        simulated engine replaces this and :meth:`_read` only."""
        kvm = self.kv_manager
        kvm.state, kvm.kv, *out = device_step(
            self.model, self.params, kvm.state, kvm.kv, self._no_prev if prev is None else prev.sampled,
            call.inputs, shape=call.shape, **dataclasses.asdict(call.options))
        return tuple(out)

    def _read(self, call: _InFlight) -> tuple:
        """A dispatched call's outputs on the host (the one transfer):
        ``(sampled, (top_ids, top_logprobs), sampled_logprob, prompt,
        verify, ok, num_free, kv_ok)`` as numpy."""
        return jax.device_get((call.sampled, call.top, call.sampled_lp, call.prompt, call.verify, call.ok,
                               call.num_free, call.kv_ok))

    def _complete(self, call: _InFlight, finished: list[Sequence], touched: dict[SequenceGroup, None]) -> None:
        """Reads a call's sampled tokens (the one transfer), checks the
        device's page state against the host's plan, and records tokens
        (their times, log-probs and text) and prompt log-probs; ``touched``
        gets the groups that got tokens."""
        t0 = self.clock()
        sampled, (top_ids, top_lps), sampled_lp, prompt, verify, ok, num_free, kv_ok = self._read(call)
        rec = call.record
        rec.read_s = self.clock()
        rec.seconds += rec.read_s - t0
        if not ok or int(num_free) != call.expected_free:  # the host plan is exact, so this is a bug
            raise RuntimeError(
                f"page state disagrees with the scheduler: ok={bool(ok)}, device free pages {int(num_free)}, "
                f"host {call.expected_free}"
            )
        self.stats.record_call(rec)
        self._recompute_bad_remote(call, kv_ok, sampled, top_lps)
        if not kv_ok.all():
            self._refuse_poison(call, kv_ok)
        self._prompt_lps.record(call.prompt_rows, prompt)
        now = self.clock()
        # A verifying sequence's tokens; the others' one each.
        emitted = self.speculator.verify(call.verifiers, verify, sampled, self.stats) if call.verifiers else {}
        bad = [seq.request.request_id for seq, slot in zip(call.samplers, call.sampler_slots)
               if not seq.done and not seq.stale and (np.isnan(top_lps[slot]).any() if seq.group.beam
                                    else min(emitted.get(seq, [sampled[slot]])) < 0)]
        if bad:  # a token drawn from NaN would look valid: stop instead (the engine is then failed)
            raise FloatingPointError(
                f"the model's logits are not finite (NaN or inf) for requests {bad}: a corrupt KV pool, "
                "weights or inputs; no token was taken from them")
        beam_groups: list[SequenceGroup] = []
        for seq, slot in zip(call.samplers, call.sampler_slots):
            seq.pending -= 1
            if seq.stale:  # computed on a connector's bad pages: the sequence is being recomputed
                seq.stale -= 1
                self.stats.discarded_tokens += 1
                continue
            if seq.done:  # it stopped on the token before: this one was never wanted
                self.stats.discarded_tokens += 1
                continue
            group = seq.group
            if group.beam:  # the host chooses its next token once every beam has its candidates
                group.candidates[seq.index] = BeamCandidates(ids=top_ids[slot], logprobs=top_lps[slot])
                if group not in beam_groups:
                    beam_groups.append(group)
                continue
            touched[group] = None
            for tok in emitted.get(seq, [sampled[slot]]):  # the accepted proposals, then the target's own
                if self._take_token(seq, int(tok), slot, sampled_lp, top_ids, top_lps, now):
                    finished.append(seq)
                    break
        # Pages past what verification kept go back now (a finished sequence's all go at its release).
        self.kv_manager.rollback([(seq, seq.num_computed) for seq, _, _ in call.verifiers
                                  if not seq.done and seq.running])
        for group in beam_groups:
            live = group.live
            if all(s.index in group.candidates and not s.pending for s in live):
                if group.first_token_s is None:
                    group.first_token_s = now
                group.step_times.append(now)
                self._advance_beams(group, live, finished)

    def _take_token(self, seq: Sequence, tok: int, slot: int, sampled_lp, top_ids, top_lps, now: float) -> bool:
        """Appends ``tok`` to ``seq`` (its time, log-probs and text); True
        when it ends the sequence (a stop token or string, or its
        ``max_new_tokens``), which is then finished."""
        seq.tokens.append(tok)
        seq.token_times.append(now)
        self.stats.generated_tokens += 1
        if seq.group.first_token_s is None:
            seq.group.first_token_s = now
        if seq.logprobs is not None:
            lp = float(sampled_lp[slot])
            seq.cum_logprob += lp
            k = seq.request.sampling.logprobs
            seq.logprobs.append({**{int(t): float(v) for t, v in zip(top_ids[slot, :k], top_lps[slot, :k])},
                                 tok: lp})
        stop_str = seq.detok.push(tok) if seq.detok is not None else None
        stop = tok in self.stop_ids and not seq.request.ignore_eos
        if stop_str is not None or stop or seq.num_generated >= seq.request.max_new_tokens:
            seq.finish("stop" if stop_str is not None or stop else "length")
            seq.stop_reason = stop_str if stop_str is not None else (tok if stop else None)
            return True
        return False

    def _recompute_bad_remote(self, call: _InFlight, kv_ok: np.ndarray, sampled: np.ndarray,
                              top_lps: np.ndarray) -> None:
        """Where ``call`` computed non-finite values (``kv_ok``, or a row's
        logits: ``sampled`` -1, ``top_lps`` NaN) for a group that reads
        pages a KV connector sent, those pages were bad (a producer in
        error: finite numbers no model gives; NaN and inf are refused at
        the lookup). They and what the group computed after them leave the
        prefix cache and the tiers (:meth:`KVCacheManager.distrust`), the
        group's tokens in flight are marked stale, and it is preempted by
        recompute (never swapped: its pages are what is wrong), to compute
        those tokens here: one bad answer costs its hit, never a request or
        the engine, and is not counted as cached in the request's output."""
        bad: list[SequenceGroup] = []

        def suspect(seq):  # reads a connector's pages, and is not finished or being recomputed already
            return seq.group.remote_pages and not seq.done and not seq.stale and seq.group not in bad

        for seq, slot, _ in call.wrote:
            if suspect(seq) and not kv_ok[slot]:
                bad.append(seq.group)
        for seq, slot in zip(call.samplers, call.sampler_slots):
            if suspect(seq) and (np.isnan(top_lps[slot]).any() if seq.group.beam else sampled[slot] < 0):
                bad.append(seq.group)
        for group in bad:
            if not group.num_preemptions:  # its first admission counted those pages as cached: they were not
                tokens = min(len(group.remote_pages) * self.page_size, group.num_cached_tokens)
                self.stats.prefix_hit_tokens -= tokens
                self.stats.remote.hit_tokens -= group.num_remote_cached_tokens
                group.num_cached_tokens -= tokens
                group.num_remote_cached_tokens = 0
            self.kv_manager.distrust([s for s in group.live if s.running], group.remote_pages)
            group.remote_pages = {}
            group.candidates.clear()  # a beam's candidates from this call are not taken either
            for seq in group.live:
                seq.stale = seq.pending  # this call's token, and the next call's if one is in flight
            self.scheduler.preempt(group, recompute=True)

    def _refuse_poison(self, call: _InFlight, kv_ok: np.ndarray) -> None:
        """A call computed non-finite values for some sequences' tokens (their
        K/V, or what they reach): their pages leave
        the prefix cache (a later request must never hit them), and a
        request still running is stopped by name, unless it is being
        recomputed (:meth:`_recompute_bad_remote`); one already aborted or
        finished is only counted (``EngineStats.nonfinite_kv``).

        Raises:
          FloatingPointError: naming the running requests that computed it
            (the engine is then failed, as for non-finite logits).
        """
        poisoned = [(seq, pages) for seq, slot, pages in call.wrote if not kv_ok[slot]]
        for _, pages in poisoned:
            self.kv_manager.forget_cached(pages)
        self.stats.nonfinite_kv += len(poisoned)
        live = list(dict.fromkeys(seq.request.request_id for seq, _ in poisoned if not seq.done and not seq.stale))
        if live:
            raise FloatingPointError(
                f"the model computed non-finite values (NaN or inf) for tokens of requests {live}, whose K/V would "
                "poison the prefix cache: a corrupt KV pool, weights or inputs; their pages are kept out of it")

    def _advance_beams(self, group: SequenceGroup, live: list[Sequence], finished: list[Sequence]) -> None:
        """Chooses the group's next beams (:func:`paged_jax.engine.beam_search.advance`)
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
        """The group's final output; its rows and swapped pages go back."""
        self._live.pop(group.request.request_id, None)
        self.scheduler.return_child_slots(group)
        self.kv_manager.drop_swapped(group)
        group.reported = True
        return request_output(group, now=self.clock(), finished=True, decode=self._decode, prompt_book=self._prompt_lps)

    def _attach_detokenizer(self, seq: Sequence) -> None:
        if self.tokenizer is not None and not seq.group.beam:
            sampling = seq.request.sampling
            seq.detok = IncrementalDetokenizer(self.tokenizer, seq.tokens[: seq.num_prompt],
                                               skip_special_tokens=sampling.skip_special_tokens, stop=sampling.stop)

    def _decode(self, prompt_ids: list[int], ids: list[int], skip_special_tokens: bool) -> str | None:
        """A beam hypothesis' text, as a streamed sequence's would read (None
        without a tokenizer)."""
        if self.tokenizer is None:
            return None
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
        for t in ids:
            detok.push(t)
        return detok.text
