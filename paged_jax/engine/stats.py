"""What the engine counts: counters over its life (the columns of the
serving tables) and a window of recent per-call records.

Everything here is bounded, so an engine that serves for weeks holds the
same few kilobytes of statistics after a million calls as after a thousand:
counters, one count per distinct call shape (a handful: shapes are
bucketed, :func:`paged_jax.attention.batch.batch_shape`), and the last
``EngineConfig.call_records`` :class:`CallRecord` s. A benchmark that needs
every call's record asks for it (``call_records=None``).
"""

from __future__ import annotations

import collections
import dataclasses

from paged_jax.attention.batch import BatchShape
from paged_jax.jit_stats import CompileMonitor
from paged_jax.tiers.offload import TierStats

DEFAULT_CALL_RECORDS = 1024
"""Call records an engine keeps by default (``EngineConfig.call_records``)."""


@dataclasses.dataclass
class CallRecord:
    """One model call: its static shape, its work, and seconds from
    dispatch to results on the host, less ``compile_s`` spent compiling (or
    loading from the persistent cache) inside it.

    The work (what a step-time model, :mod:`paged_jax.simulator.step_time`,
    predicts from): ``tokens`` real query tokens, ``decode_tokens`` of them
    one-token decodes; ``rows`` sequences in the call; ``context_tokens``
    the K/V tokens its attention reads, each sequence's once (its computed
    tokens plus the call's); ``attention_pairs`` the (query, key) pairs it
    scores, causal within a chunk (``n * c + n * (n + 1) / 2`` for ``n``
    tokens after ``c`` computed ones).

    On the engine's clock: ``start_s`` the start of the iteration that
    dispatched it (the end of the iteration before when that one left work:
    the caller's loop between them counts as busy), ``read_s`` when its results reached the host, ``done_s``
    the end of the iteration that read them. ``done_s - max(start_s,
    previous call's done_s)`` is the time the call added to the engine's
    clock (:func:`paged_jax.simulator.step_time.call_seconds`; what a
    simulated engine advances by).
    """

    shape: BatchShape
    tokens: int
    decode_tokens: int
    seconds: float
    compile_s: float
    rows: int = 0
    context_tokens: int = 0
    attention_pairs: int = 0
    start_s: float = 0.0
    read_s: float = 0.0
    done_s: float = 0.0


@dataclasses.dataclass
class EngineStats:
    """Counters over an engine's life. Times in seconds.

    ``mean_concurrency`` and ``kv_token_fraction`` are time-averaged over
    iterations, weighting each by its wall time; ``kv_token_fraction`` is the
    share of allocated KV slots (pages held x page size) that hold a token.
    ``model_s`` is the time the host spends in the jitted step calls
    (page-state update, forward and sampling): dispatching them and waiting
    for their results, compilation excluded; ``compile_s`` all compilation
    (and loading from the persistent cache) during iterations, inside the
    calls or not (the page-state frees, swap copies); ``host_s`` everything
    else an iteration spends (scheduling, building the batch), which with
    ``async_scheduling`` overlaps the device's work on the previous call:
    ``model_s + compile_s + host_s = busy_s``.

    Prefix caching: ``prompt_tokens`` counts the prompt tokens of requests
    at their first admission and ``prefix_hit_tokens`` those of them served
    from the cache (``prefix_hit_rate`` is the ratio); ``recompute_hit_tokens``
    counts tokens of preempted sequences found again in the cache when
    readmitted. ``prefix_hit_pages`` counts pages taken from the cache, and
    ``pages_saved`` those of them another running sequence held at the time
    (memory not spent twice; the others only save compute).

    Sharing: after each iteration ``seq_pages_sum`` adds the pages every
    sequence holds, each sequence counting its own (what they would take
    without sharing), and ``used_pages_sum`` the distinct pages held;
    ``sharing_saving`` is ``1 - used / seq`` over the run, the measure of
    the paper's Figures 15 and 17. ``recomputed_tokens``: tokens prefilled
    again after a preemption by recompute. ``window_dropped_pages``: pages
    returned to the pool while their sequence ran because a sliding window
    no longer saw them (:mod:`paged_jax.paging.sliding_window`), every layer group
    counted (:mod:`paged_jax.paging.kv_groups`).

    External fragmentation (a contiguous allocator under a reservation
    policy, ``EngineConfig.allocator``): ``fragmentation_blocked_steps``
    counts schedule rounds whose next admission waited with pages enough
    but no run to hold them, ``fragmentation_blocked_requests`` the requests
    that ever waited so, and ``unusable_free_s`` integrates over time the
    share of the pool free but outside the longest free run
    (``external_fragmentation`` is its time average).

    Speculative decoding (:mod:`paged_jax.speculative`): ``spec_verifications``
    counts a sequence verifying proposals in a call, ``spec_proposed`` and
    ``spec_accepted`` the proposed tokens and the accepted ones, and
    ``spec_proposed_by_position`` / ``spec_accepted_by_position`` the same
    per position in the proposal (index 0 the first proposed token; a
    position is proposed only when the ones before it were):
    ``acceptance_rate`` is accepted / proposed, ``mean_accepted_length``
    the tokens a verifying sequence emits per call (accepted plus the one
    of the target's own, vLLM's "mean acceptance length"), and
    ``acceptance_by_position`` the rate at each position.

    KV tiers (:mod:`paged_jax.tiers`): ``host``, ``disk`` and ``remote``
    (the KV connector) count each tier's hits (``host.hit_tokens`` is the
    part of ``prefix_hit_tokens`` the host tier served), pages and bytes
    copied to it and loaded back, pages it refused and dropped, files and
    lookups it refused (:class:`paged_jax.tiers.offload.TierStats`);
    :meth:`tier_saved_s` estimates the prefill seconds each saved.

    Poison: ``nonfinite_kv`` counts sequences a call wrote non-finite K/V
    for (a running one stops the engine by name; an aborted one's pages are
    only kept out of the prefix cache).
    """

    iterations: int = 0
    model_calls: int = 0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens computed
    decode_tokens: int = 0  # tokens fed back one at a time
    generated_tokens: int = 0
    discarded_tokens: int = 0  # sampled after a stop token was already in flight
    preemptions: int = 0
    swap_outs: int = 0  # preemptions by swapping (the rest recomputed)
    swapped_out_pages: int = 0
    swapped_in_pages: int = 0
    aborted: int = 0
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0
    recompute_hit_tokens: int = 0
    prefix_hit_pages: int = 0
    pages_saved: int = 0
    recomputed_tokens: int = 0
    window_dropped_pages: int = 0
    spec_verifications: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_proposed_by_position: list = dataclasses.field(default_factory=list)
    spec_accepted_by_position: list = dataclasses.field(default_factory=list)
    host: TierStats = dataclasses.field(default_factory=TierStats)
    disk: TierStats = dataclasses.field(default_factory=TierStats)
    remote: TierStats = dataclasses.field(default_factory=TierStats)
    nonfinite_kv: int = 0  # sequences a call wrote non-finite K/V for (their pages never cached)
    fragmentation_blocked_steps: int = 0
    fragmentation_blocked_requests: int = 0
    unusable_free_s: float = 0.0  # integral of (free - longest free run) / pool over time
    seq_pages_sum: int = 0
    used_pages_sum: int = 0
    peak_pages_used: int = 0
    peak_concurrency: int = 0
    busy_s: float = 0.0
    model_s: float = 0.0
    prefill_call_s: float = 0.0  # model seconds of the calls that prefilled (tier_saved_s)
    prefill_call_tokens: int = 0  # their tokens, decodes included
    compile_s: float = 0.0
    concurrency_s: float = 0.0  # integral of running sequences over time
    token_fraction_s: float = 0.0  # integral of used/allocated over time
    call_tokens: int = 0  # real tokens over every model call
    call_rows: int = 0  # token rows over every model call, padding included (the shapes' token counts)
    programs: set = dataclasses.field(default_factory=set)  # (BatchShape, StepOptions): one compiled program each
    calls_by_shape: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # BatchShape -> calls
    calls: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=DEFAULT_CALL_RECORDS))
    """The most recent :class:`CallRecord` s, oldest first: a window of
    ``EngineConfig.call_records`` (every call with ``None``)."""

    def record_call(self, rec: CallRecord) -> None:
        """Counts one model call whose results the host has read."""
        self.model_calls += 1
        self.model_s += rec.seconds
        self.decode_tokens += rec.decode_tokens
        self.prefill_tokens += rec.tokens - rec.decode_tokens
        self.call_tokens += rec.tokens
        if rec.tokens > rec.decode_tokens:  # a call that prefills: the rate a tier's hit would have cost
            self.prefill_call_s += rec.seconds
            self.prefill_call_tokens += rec.tokens
        self.call_rows += rec.shape.num_tokens
        self.calls_by_shape[rec.shape] += 1
        self.calls.append(rec)

    def record_verification(self, num_proposed: int, num_accepted: int) -> None:
        """Counts one sequence's verification of ``num_proposed`` tokens, the
        first ``num_accepted`` of them accepted."""
        self.spec_verifications += 1
        self.spec_proposed += num_proposed
        self.spec_accepted += num_accepted
        for counts, n in ((self.spec_proposed_by_position, num_proposed),
                          (self.spec_accepted_by_position, num_accepted)):
            counts.extend([0] * (num_proposed - len(counts)))
            for j in range(n):
                counts[j] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted proposed tokens / proposed tokens (0 with none)."""
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verifying sequence emits per call: 1 + accepted /
        verifications (0 with none)."""
        return 1 + self.spec_accepted / self.spec_verifications if self.spec_verifications else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Per position in the proposal, accepted / proposed there."""
        return [a / p if p else 0.0 for a, p in zip(self.spec_accepted_by_position, self.spec_proposed_by_position)]

    def keep_call_records(self, n: int | None) -> None:
        """Keeps the last ``n`` call records from now on (``None``: every one)."""
        self.calls = collections.deque(self.calls, maxlen=n)

    @property
    def padding(self) -> float:
        """Share of the model calls' token rows that were padding (calls run
        at bucketed token counts)."""
        return 1 - self.call_tokens / self.call_rows if self.call_rows else 0.0

    def record_iteration(self, *, seconds: float, compile_s: float, held_pages: int, used_pages: int,
                         concurrency: int, token_slots: float | None, unusable_free: float = 0.0) -> None:
        """Counts one engine iteration of ``seconds`` (``compile_s`` of them
        compiling, in a model call or not), with ``held_pages`` pages held
        summed over sequences, ``used_pages`` distinct pages in use,
        ``concurrency`` sequences running, and ``token_slots`` the share of
        held slots holding tokens (None when no page is held);
        ``unusable_free`` the pool's share free but outside a contiguous
        allocator's longest free run."""
        self.iterations += 1
        self.seq_pages_sum += held_pages
        self.used_pages_sum += used_pages
        self.peak_pages_used = max(self.peak_pages_used, used_pages)
        self.busy_s += seconds
        self.compile_s += compile_s
        self.peak_concurrency = max(self.peak_concurrency, concurrency)
        self.concurrency_s += concurrency * seconds
        if token_slots is not None:
            self.token_fraction_s += token_slots * seconds
        self.unusable_free_s += unusable_free * seconds

    @property
    def sharing_saving(self) -> float:
        """Share of the pages sequences hold that sharing saves (0 when
        nothing is shared)."""
        return 1 - self.used_pages_sum / self.seq_pages_sum if self.seq_pages_sum else 0.0

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens."""
        return self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def host_s(self) -> float:
        return self.busy_s - self.model_s - self.compile_s

    def tier_saved_s(self, tier: str) -> float:
        """An estimate of the prefill seconds a KV tier saved (the TTFT its
        hits took off, summed over requests): the prompt tokens it served
        (``hit_tokens``) times the engine's model seconds per token in the
        calls that prefilled so far (``prefill_call_s /
        prefill_call_tokens``: those calls' decode tokens counted too,
        compiling excluded). It does not subtract the loads' own time
        (their bytes are ``loaded_bytes``), and an engine that has run few
        calls has a rough rate: read it as an estimate, and measure TTFT
        side by side for a claim (``experiments.serving.kv_tiers``,
        ``experiments.serving.disaggregated``).

        Args:
          tier: ``"host"``, ``"disk"`` or ``"remote"``.

        Raises:
          ValueError: another ``tier``.
        """
        if tier not in ("host", "disk", "remote"):
            raise ValueError(f"tier must be 'host', 'disk' or 'remote', got {tier!r}")
        rate = self.prefill_call_s / self.prefill_call_tokens if self.prefill_call_tokens else 0.0
        return getattr(self, tier).hit_tokens * rate

    @property
    def mean_concurrency(self) -> float:
        return self.concurrency_s / self.busy_s if self.busy_s else 0.0

    @property
    def kv_token_fraction(self) -> float:
        return self.token_fraction_s / self.busy_s if self.busy_s else 0.0

    @property
    def external_fragmentation(self) -> float:
        """Time-averaged share of the pool free but unusable: outside the
        contiguous allocator's longest free run (0 without one)."""
        return self.unusable_free_s / self.busy_s if self.busy_s else 0.0

    @property
    def num_programs(self) -> int:
        """Distinct static shapes run: the jit compilations this engine
        needed (fewer if another engine of the same model compiled some)."""
        return len(self.programs)


_MONITOR: CompileMonitor | None = None


def compile_seconds() -> float:
    """Seconds JAX has spent compiling in this process (since the first
    call of this function)."""
    global _MONITOR
    if _MONITOR is None:
        _MONITOR = CompileMonitor()
    return _MONITOR.counts.seconds
