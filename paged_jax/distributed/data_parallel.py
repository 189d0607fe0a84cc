"""Data parallelism: one engine per data shard, requests placed at admission.

Each data shard of the mesh (:mod:`paged_jax.distributed.sharding`) serves its own
sequences from its own KV pool with its own page state, prefix cache and
scheduler: an :class:`paged_jax.engine.core.Engine` over that shard's devices
(tensor parallel within it, ``models.sharded.ShardedRaggedModel``). A page
id never crosses shards, and a shard that runs out of pages preempts among
its own sequences only. This is how vLLM runs data parallelism too: an
engine core per data-parallel rank under a front end that places requests.

Placement: a new request goes to the shard that will have the most free
pages once its own waiting queue is admitted (free pages minus the pages its
waiting prompts need); ties go to the lower shard index. A request stays on
its shard until it finishes (preemption, swap and recompute happen there).

Several hosts (``jax.distributed``): every process builds the same
:class:`DataParallelEngine` from the same requests, but holds engines only
for the data shards whose devices are its own (``None`` for the others). A
process cannot see another host's free pages, so placement is then by
tokens: each request goes to the shard with the fewest tokens (prompt plus
``max_new_tokens``) placed on it so far, the same decision on every host.
Each process serves its own shards' requests; :func:`gather_outputs` brings
every request's tokens to every process.

Stepping: :meth:`DataParallelEngine.step` steps every shard with work once.
Device calls are dispatched asynchronously, so shard ``d + 1`` schedules
while shard ``d``'s call runs on its own devices.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

from paged_jax.checks import check_int
from paged_jax.engine.core import Engine, Request, RequestOutput, drain


class DataParallelEngine:
    """Engines, one per data shard, behind one request queue.

    Attributes:
      engines: the shards' engines, in data-axis order; ``None`` for a shard
        another process serves.
      placement: request id -> the shard serving it.

    Raises (constructor):
      ValueError: no local engine, something that is neither an
        :class:`Engine` nor None, or the same engine twice.
    """

    def __init__(self, engines: Sequence[Engine | None]):
        engines = list(engines)
        local = [e for e in engines if e is not None]
        if not local or not all(isinstance(e, Engine) for e in local):
            raise ValueError(f"engines must be a sequence of paged_jax.engine.core.Engine (None for another "
                             f"process's shard) with at least one engine, got {engines!r}")
        if len({id(e) for e in local}) != len(local):
            raise ValueError("engines must be distinct (one per data shard)")
        self.engines = engines
        self.placement: dict = {}
        self._placed_tokens = [0] * len(engines)

    @property
    def local_engines(self) -> list[Engine]:
        """The engines this process runs."""
        return [e for e in self.engines if e is not None]

    def load(self, shard: int) -> int:
        """Free pages of shard ``shard`` once its waiting prompts are admitted
        (may be negative): larger means less loaded."""
        engine = self.engines[shard]
        waiting = sum(-(-s.num_tokens // engine.page_size) for s in engine.waiting)
        return engine.num_free_pages - waiting

    def add_request(self, request: Request) -> int:
        """Places ``request`` on the least-loaded shard and queues it there.

        Returns:
          The shard's index.

        Raises:
          ValueError: a duplicate ``request_id`` (across all shards), or
            whatever the shard's :meth:`Engine.add_request` raises (the
            request is then placed nowhere).
        """
        rid = getattr(request, "request_id", None)
        try:
            placed = rid in self.placement
        except TypeError:
            raise ValueError(f"request_id must be hashable, got {rid!r}") from None
        if placed:
            raise ValueError(f"request_id {rid!r} was already added")
        if all(e is not None for e in self.engines):
            shard = max(range(len(self.engines)), key=lambda d: (self.load(d), -d))
        else:  # some shards are on other hosts: the same decision everywhere, from tokens alone
            shard = min(range(len(self.engines)), key=lambda d: (self._placed_tokens[d], d))
        if self.engines[shard] is not None:
            self.engines[shard].add_request(request)
        else:
            self.local_engines[0].check_request(request)  # the same check the serving host makes
        self.placement[rid] = shard
        self._placed_tokens[shard] += len(request.prompt_ids) + request.max_new_tokens
        return shard

    def has_unfinished(self) -> bool:
        """Whether this process's shards have work left."""
        return any(e.has_unfinished() for e in self.local_engines)

    def step(self) -> list[RequestOutput]:
        """Steps every local shard that has work once; returns what finished."""
        out: list[RequestOutput] = []
        for engine in self.local_engines:
            if engine.has_unfinished():
                out.extend(engine.step())
        return out

    def run(self, requests: Iterable[Request] = (), *, progress: bool = False) -> list[RequestOutput]:
        """Adds ``requests`` (all checked first: one bad request adds none) and
        steps until every request has finished; outputs in finishing order.
        ``progress`` shows a bar of finished requests.

        Raises:
          ValueError: as :meth:`add_request`, before any request is added.
        """
        requests = list(requests)
        ids = [getattr(r, "request_id", None) for r in requests]
        for i in ids:
            try:
                hash(i)
            except TypeError:
                raise ValueError(f"request_id must be hashable, got {i!r}") from None
            if i in self.placement:
                raise ValueError(f"request_id {i!r} was already added")
            if ids.count(i) > 1:
                raise ValueError(f"request_id {i!r} appears twice")
        for r in requests:  # each engine checks its own requests the same way
            self.local_engines[0].check_request(r)
        for r in requests:
            self.add_request(r)
        return drain(self, len(requests), progress)

    def abort(self, request_id) -> RequestOutput:
        """Aborts a request on the shard serving it.

        Raises:
          ValueError: an unknown ``request_id``, or one another process serves.
        """
        try:
            shard = self.placement.get(request_id)
        except TypeError:
            raise ValueError(f"request_id must be hashable, got {request_id!r}") from None
        if shard is None or self.engines[shard] is None:
            why = "was never added" if shard is None else f"is served by shard {shard} on another process"
            raise ValueError(f"request_id {request_id!r} {why}")
        return self.engines[shard].abort(request_id)

    def accounting(self) -> list[dict[str, int] | None]:
        """Each shard's :meth:`Engine.accounting` (free, cached, used, total
        pages); None for a shard on another process."""
        return [None if e is None else e.accounting() for e in self.engines]


def merged_stats(engine: "DataParallelEngine | Engine"):
    """One :class:`paged_jax.engine.core.EngineStats` for all local shards (an
    :class:`Engine`'s own stats as they are).

    The shards are stepped one after another by one host thread, so their
    busy, model and compile seconds add up to the loop's (``busy_s`` is the
    sum, and ``host_s`` stays the host's share). Counts, token and page sums
    and peaks are summed (a summed peak is an upper bound of the mesh's: the
    shards' peaks need not coincide). Time-weighted means are per shard, so
    they are combined as such: ``mean_concurrency`` is the sum of the
    shards' (sequences running on the mesh), ``kv_token_fraction`` their
    mean. Programs are united, per-shape call counts added and call records
    concatenated.
    """
    import dataclasses

    from paged_jax.engine.core import EngineStats

    if isinstance(engine, Engine):
        return engine.stats
    parts = [e.stats for e in engine.local_engines]
    merged = EngineStats()
    for field in dataclasses.fields(EngineStats):
        values = [getattr(p, field.name) for p in parts]
        if field.name == "programs":
            value = set().union(*values)
        elif field.name == "calls_by_shape":
            value = sum(values, collections.Counter())
        elif field.name == "calls":
            value = collections.deque((c for v in values for c in v), maxlen=None)
        else:
            value = sum(values)
        setattr(merged, field.name, value)
    # Rescale the two integrals so that dividing by the summed busy time
    # gives the combined means described above.
    merged.concurrency_s = sum(p.mean_concurrency for p in parts) * merged.busy_s
    merged.token_fraction_s = sum(p.kv_token_fraction for p in parts) / len(parts) * merged.busy_s
    return merged


def gather_outputs(outputs: Sequence[RequestOutput], request_ids: Sequence, max_new_tokens: int) -> dict:
    """Every process's greedy-or-sampled tokens, on every process.

    Under ``jax.distributed`` each process returns only its own shards'
    outputs; this all-gathers them (``multihost_utils.process_allgather``) as
    one padded i32 array. In a single process it just indexes ``outputs``.

    Args:
      outputs: this process's :class:`RequestOutput` (first sample of each).
      request_ids: every request's id, in the same order on every process.
      max_new_tokens: the longest output (the array's width).

    Returns:
      request id -> list of output token ids.

    Raises:
      ValueError: an output whose request id is not in ``request_ids``, a
        repeated id, or an output longer than ``max_new_tokens``.
    """
    import numpy as np

    index = {rid: i for i, rid in enumerate(request_ids)}
    if len(index) != len(request_ids):
        raise ValueError("request_ids must be distinct")
    longest = max((len(o.output_ids) for o in outputs), default=0)
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 0)
    if max_new_tokens < longest:
        raise ValueError(f"max_new_tokens must be >= the longest output ({longest} tokens), got {max_new_tokens=}")
    table = np.full((len(request_ids), max_new_tokens + 1), -1, np.int32)  # column 0: the output's length
    for out in outputs:
        if out.request_id not in index:
            raise ValueError(f"output for request_id {out.request_id!r}, which request_ids does not hold")
        ids = out.output_ids
        table[index[out.request_id], 0] = len(ids)
        table[index[out.request_id], 1: 1 + len(ids)] = ids
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        table = np.asarray(multihost_utils.process_allgather(table)).max(axis=0)  # each row filled by one process
    return {rid: table[i, 1: 1 + table[i, 0]].tolist() for rid, i in index.items() if table[i, 0] >= 0}
