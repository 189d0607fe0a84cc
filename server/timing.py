"""Where a streamed request's time goes inside the server: timestamps at
each hand-off, recorded only when a benchmark asks for them.

Stages, in the order a request passes them (:data:`STAGES`):

- ``entry``: the route handler starts (the body may not be read yet);
- ``parsed``: the body is read, parsed and validated (:mod:`server.app`);
- ``submitted``: tokenized, checked, handed to the engine loop's queue
  (:meth:`server.engine_loop.EngineLoop.submit`, on the event loop);
- ``added``: the engine loop's thread has added it to the engine;
- ``first_token``: the end of the engine step whose outputs carry its first
  token (engine loop thread);
- ``delivered``: that output is on the request's asyncio queue (the
  ``call_soon_threadsafe`` callback ran on the event loop);
- ``first_chunk``: the first server-sent event written after ``delivered``
  (Starlette asked for the next one, so ``send`` of that event returned):
  the event carrying the first token. A chat stream's role event, written
  before any token, is not it.

Every stamp is ``time.perf_counter()``: on Linux ``CLOCK_MONOTONIC``, one
clock for every thread of the server and for other processes on the same
machine (a benchmark's clients in a child process), so stamps compare with
the clients' send and receive times directly.

Why a context variable: a request's stamps are taken in three places that
share no argument (the route handler, the engine loop's ``submit`` called
deep inside :mod:`server.openai_serving`, the streaming response), and the
handler's task, its response and the tasks it starts all run in copies of
one context. With no :class:`TimingRecorder` on the app the variable stays
None: each hook is one ``ContextVar.get`` and nothing is kept, so serving
pays nothing measurable (no per-token work at all; the engine loop checks
one dict per step).
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
import time
from collections.abc import AsyncIterator

STAGES = ("entry", "parsed", "submitted", "added", "first_token", "delivered", "first_chunk")
"""The stamps of a complete record, in order."""

_current: contextvars.ContextVar[RequestTimes | None] = contextvars.ContextVar("paged_jax_request_times",
                                                                                 default=None)


@dataclasses.dataclass(eq=False, kw_only=True)
class RequestTimes:
    """One HTTP request's stamps.

    Attributes:
      stamps: stage (:data:`STAGES`) -> ``time.perf_counter()`` seconds;
        a stage is stamped once, the first time it is reached (a batch of
        prompts: its first request's).
      request_ids: the engine requests it became (set at ``submitted``);
        the response id the client sees is theirs less the ``-i`` suffix.
    """

    stamps: dict[str, float] = dataclasses.field(default_factory=dict)
    request_ids: list = dataclasses.field(default_factory=list)

    def stamp(self, stage: str, at: float | None = None) -> None:
        """Stamps ``stage`` now (or ``at``) unless it has been already."""
        if stage not in self.stamps:
            self.stamps[stage] = time.perf_counter() if at is None else at

    @property
    def complete(self) -> bool:
        return all(s in self.stamps for s in STAGES)


class TimingRecorder:
    """Collects :class:`RequestTimes` of the requests an app serves while
    it is attached (``build_app(..., timing=TimingRecorder())``). Thread-safe:
    records are begun on the event loop and read from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self._records: list[RequestTimes] = []

    def begin(self) -> RequestTimes:
        """A new record stamped ``entry``, current in the caller's context
        (the route handler's: its tasks and response inherit it)."""
        times = RequestTimes()
        times.stamp("entry")
        with self._lock:
            self._records.append(times)
        _current.set(times)
        return times

    def take(self) -> list[RequestTimes]:
        """The records begun since the last take (complete or not: a request
        refused or cut short lacks its later stages), oldest first."""
        with self._lock:
            records, self._records = self._records, []
        return records


def current() -> RequestTimes | None:
    """The record of the request being handled in this context, else None."""
    return _current.get()


async def stamp_first_chunk(events: AsyncIterator[str], times: RequestTimes) -> AsyncIterator[str]:
    """``events`` passed through, stamping ``first_chunk`` once the first
    event after ``delivered`` has been written; closes ``events`` however
    it ends (a client that goes away must still abort its requests)."""
    try:
        async for event in events:
            # Made from a delivered output? (A chat stream's role event is made before any.)
            carries = "first_chunk" not in times.stamps and "delivered" in times.stamps
            yield event
            if carries:  # resumed: Starlette's send of this event returned
                times.stamp("first_chunk")
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
