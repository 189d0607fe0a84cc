"""One thread owns the engine; HTTP handlers talk to it through commands.

Why a thread and commands: :class:`paged_jax.engine.core.Engine` is not
thread-safe (``add_request``, ``abort`` and ``check_request`` read and
change the scheduler's queues, which ``step`` changes too), and ``step``
blocks for a whole model call. So exactly one thread, the loop, calls the
engine: handlers on the asyncio event loop put commands on a queue (submit
requests, abort them, run a function on the engine) and never touch the
engine themselves. Between two steps the loop takes every command queued,
so a request that arrives during a step is added before the next one, as a
client of an in-process engine would see it. With nothing to do, the loop
blocks on the queue (no busy spin); woken by a submission, it first lets
the event loop hand over the rest of a burst (:meth:`EngineLoop._settle`,
at most :data:`SETTLE_MAX_S`), so that concurrent clients start in one
step as they would in process.

Outputs flow back the other way: each submitted batch of requests names a
:class:`Sink` (an ``asyncio.Queue`` and its event loop); after each step
the loop hands every output to its sink with one
``loop.call_soon_threadsafe`` per event loop, not one per output.

With a :class:`server.timing.TimingRecorder` on the app, a submitted
batch carries its HTTP request's :class:`server.timing.RequestTimes`; the
loop stamps when it adds the requests, the end of the step that made their
first token, and when that output reached their queue (the stamps stop at
the first token: nothing per token). Without one, the only cost is one
empty-dict check per step.

A submit is all or nothing: every request is checked
(:meth:`Engine.check_request`) before any is added, and the verdict comes
back as a ``concurrent.futures.Future`` (a ``ValueError`` is the client's
fault, a 400). A handler that gives up before the verdict cancels the
future; the loop then never adds its requests (a cancelled future is
skipped, ``set_running_or_notify_cancel``).

If a step raises, the engine is failed for good (its device and host
states may disagree, :meth:`Engine.step`): every request in flight gets the
exception, later submits get :class:`EngineDeadError`, and ``/health``
says so.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from paged_jax.engine.core import Engine, Request, RequestOutput
from paged_jax.jit_stats import CompileMonitor
from server import timing

log = logging.getLogger(__name__)

PAGES_EVERY_S = 0.1
"""Most seconds between two page counts of :class:`EngineSnapshot` while
the engine is busy (always counted when it goes idle): page accounting
walks the prefix cache's pages, which a large pool makes worth not doing
every step. The counters are taken after every step, before its outputs
are handed out, so a client that got its answer and then reads
``/metrics`` sees its tokens counted."""


SETTLE_MAX_S = 0.1
"""Most seconds an idle loop, given a submission, waits for more from the
same event loop before its first step (:meth:`EngineLoop._settle`)."""
SETTLE_HOPS = 8
"""Event-loop iterations per round of :meth:`EngineLoop._settle`."""


class EngineDeadError(RuntimeError):
    """The engine failed in a step, or the loop has stopped: no request can
    be served any more."""


class Sink:
    """Where a batch of requests' outputs go: an ``asyncio.Queue`` on the
    event loop that submitted them. Items are :class:`RequestOutput`, or an
    exception when the engine fails."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSnapshot:
    """What ``/metrics`` reports about the engine, as of ``time_s``
    (``time.time()``). Counters are totals since the engine was made
    (:class:`paged_jax.engine.stats.EngineStats`: ``prompt_tokens`` are counted at
    a request's first admission, ``prefix_hit_tokens`` of them came from the
    prefix cache; ``spec_*`` count speculative decoding's verifications,
    proposed and accepted tokens; ``tiers`` the host and disk tiers'
    counters, :class:`paged_jax.tiers.offload.TierStats`, and their bytes
    used and allowed); pages are
    :meth:`Engine.accounting`'s (free + cached + used = total), counted at
    most every :data:`PAGES_EVERY_S` seconds while the engine is busy."""

    time_s: float
    requests_running: int
    requests_waiting: int
    seqs_running: int
    pages_free: int
    pages_cached: int
    pages_used: int
    pages_total: int
    prompt_tokens: int
    generation_tokens: int
    prefix_hit_tokens: int
    preemptions: int
    iterations: int
    compile_seconds: float
    compilations: int
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_by_position: tuple[int, ...] = ()
    tiers: dict = dataclasses.field(default_factory=dict)  # tier -> TierStats fields + used and capacity bytes


@dataclasses.dataclass
class _Submit:
    requests: list[Request]
    sink: Sink
    future: concurrent.futures.Future
    times: timing.RequestTimes | None = None


@dataclasses.dataclass
class _Abort:
    request_ids: list


@dataclasses.dataclass
class _Call:
    fn: Callable[[Engine], Any]
    future: concurrent.futures.Future


_STOP = object()


class EngineLoop:
    """The thread that owns ``engine`` (see the module docstring).

    Args:
      engine: an engine with no unfinished requests; from :meth:`start` on,
        only this loop's thread may call it (use :meth:`call` to run code
        on it).
      on_output: called on the loop's thread with every output the engine
        reports, aborted ones included (the server's metrics); must not
        raise or block.
      name: the thread's name.

    Raises:
      ValueError: ``engine`` is not an Engine, or has unfinished requests.
    """

    def __init__(self, engine: Engine, *, on_output: Callable[[RequestOutput], None] | None = None,
                 name: str = "paged-jax-engine"):
        if not isinstance(engine, Engine):
            raise ValueError(f"engine must be a paged_jax.engine.core.Engine, got a {type(engine).__name__}")
        if engine.has_unfinished():
            raise ValueError("engine has unfinished requests; the loop must own it from an idle state")
        self.engine = engine
        self._on_output = on_output
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict = {}  # request_id -> Sink, while unfinished
        self._timed: dict = {}  # request_id -> RequestTimes, until its first token is delivered
        self._failed: BaseException | None = None
        self._stopped = False  # set by the loop's thread when it stops; no command is taken after
        self._closing = threading.Lock()  # orders a command's put against the thread's last drain
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._compiles: CompileMonitor | None = None
        self._snapshot: EngineSnapshot | None = None
        self._pages: dict | None = None  # the last page accounting, and when (time.monotonic)
        self._pages_at = 0.0

    # ------------------------------------------------------------- handlers' side

    def start(self) -> None:
        """Starts the thread (once)."""
        self._compiles = CompileMonitor()
        self._refresh_snapshot()
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Aborts what is in flight (its sinks get :class:`EngineDeadError`)
        and ends the thread; waits up to ``timeout`` seconds for it."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)
        if self._compiles is not None:
            self._compiles.close()
            self._compiles = None

    def stop_soon(self) -> None:
        """Asks the loop to stop as :meth:`stop` does (what is in flight
        aborted, its sinks given :class:`EngineDeadError`) without waiting:
        for a signal handler, so that open streams end now rather than when
        their requests would have finished. :meth:`stop` still ends it."""
        if self._thread.is_alive():
            self._commands.put(_STOP)

    @property
    def alive(self) -> bool:
        """The thread runs and the engine has not failed."""
        return self._thread.is_alive() and self._failed is None and not self._stopped

    @property
    def failed(self) -> BaseException | None:
        """What made a step fail, else None."""
        return self._failed

    def snapshot(self) -> EngineSnapshot | None:
        """The latest :class:`EngineSnapshot` (None before :meth:`start`)."""
        return self._snapshot

    def submit(self, requests: Iterable[Request], sink: Sink) -> concurrent.futures.Future:
        """Queues ``requests`` (all or none) with their outputs going to
        ``sink``. The future's result is None once they are added; its
        exception is the ``ValueError`` of the first request the engine
        refuses (none is then added), or :class:`EngineDeadError`. Cancel
        it to withdraw the requests if they were not added yet."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        times = timing.current()
        if times is not None:
            times.request_ids = [r.request_id for r in requests]
            times.stamp("submitted")
        self._put(_Submit(list(requests), sink, future, times), future)
        return future

    def abort(self, request_ids: Iterable) -> None:
        """Aborts every listed request still unfinished (unknown or finished
        ids are skipped: a client may go away just as its request ends).
        Returns at once; the engine frees their pages before its next step."""
        ids = list(request_ids)
        if ids:
            self._commands.put(_Abort(ids))

    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Runs ``fn(engine)`` on the loop's thread between two steps; the
        future holds its result or exception. For warm-ups, tests and
        maintenance (``lambda e: e.reset_prefix_cache()``): ``fn`` must
        leave no request of its own unfinished."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(_Call(fn, future), future)
        return future

    def _put(self, cmd, future: concurrent.futures.Future) -> None:
        with self._closing:
            if not self._stopped:
                self._commands.put(cmd)
                return
        future.set_exception(EngineDeadError("the server is shutting down"))

    # ---------------------------------------------------------------- loop's side

    def _run(self) -> None:
        engine = self.engine
        while True:
            busy = self._failed is None and engine.has_unfinished()
            commands = self._take(block=not busy)
            if not busy:
                commands += self._settle(commands)
            for i, cmd in enumerate(commands):
                if cmd is _STOP:
                    self._shutdown(commands[i + 1:])
                    return
                self._handle(cmd)
            if self._failed is None and engine.has_unfinished():
                try:
                    outputs = engine.step()
                except BaseException as e:  # noqa: BLE001 - the engine is failed whatever it was
                    self._fail(e)
                    continue
                stepped = time.perf_counter()
                self._refresh_snapshot()
                self._dispatch(outputs, stepped)
            elif commands:
                self._refresh_snapshot()

    def _settle(self, commands: list) -> list:
        """The commands that follow a submission to an idle engine while its
        event loop still hands new ones over: lets that loop run
        :data:`SETTLE_HOPS` iterations (a callback that reschedules itself,
        posted with ``call_soon_threadsafe``) and takes what was queued
        meanwhile, until a round brings no submission or
        :data:`SETTLE_MAX_S` has passed since the first.

        Why: a burst of clients (48 streams at once) reaches the handlers
        over a few hundred milliseconds on 2 shared cores, and without this
        the first step starts with the first request alone; the rest,
        submitted while it runs, wait for it (and, the engine dispatching
        one call ahead, the next) to end. Measured over HTTP on a quiet
        machine (``bench_http``, 2 repeats each, :mod:`server.timing`):
        ``submitted`` to ``added`` had a median of 29 ms with it and 267 ms
        without, and the clients' mean TTFT exceeded the server's own by
        287 ms with it and 560 ms without. Waiting on the event loop rather
        than a clock costs a lone request one round of an idle event loop
        (0.3 to 0.4 ms median, idle). Why several iterations a round: a
        handler needs a few (its body, the tokenizer's thread, the submit)
        between arriving and submitting. It catches only what the event
        loop already holds: a request whose bytes are still on their way
        when a round passes empty waits a step."""
        submits = [cmd for cmd in commands if isinstance(cmd, _Submit)]
        if not submits or any(cmd is _STOP for cmd in commands):
            return []
        loop, more = submits[0].sink.loop, []
        deadline = time.perf_counter() + SETTLE_MAX_S
        while True:
            reached = threading.Event()

            def hop(left: int, reached=reached) -> None:  # each call_soon runs in the loop's next iteration
                if left:
                    loop.call_soon(hop, left - 1)
                else:
                    reached.set()
            try:
                loop.call_soon_threadsafe(hop, SETTLE_HOPS)
            except RuntimeError:  # its event loop has closed
                return more
            if not reached.wait(max(0.0, deadline - time.perf_counter())):
                return more
            new = self._take(block=False)
            more += new
            if (not any(isinstance(cmd, _Submit) for cmd in new) or any(cmd is _STOP for cmd in new)
                    or time.perf_counter() >= deadline):
                return more

    def _take(self, block: bool) -> list:
        commands = []
        if block:
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, cmd) -> None:
        if isinstance(cmd, _Submit):
            self._submit(cmd)
        elif isinstance(cmd, _Abort):
            self._abort(cmd.request_ids)
        elif isinstance(cmd, _Call):
            if not cmd.future.set_running_or_notify_cancel():
                return
            try:
                cmd.future.set_result(cmd.fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                cmd.future.set_exception(e)
        else:
            raise TypeError(f"unknown command {cmd!r}")

    def _submit(self, cmd: _Submit) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return  # the handler gave up first: never add them
        if self._failed is not None:
            cmd.future.set_exception(self._dead())
            return
        try:
            taken = set(self._sinks)
            for r in cmd.requests:
                self.engine.check_request(r, taken)
                taken.add(r.request_id)
            for r in cmd.requests:
                self.engine.add_request(r)
                self._sinks[r.request_id] = cmd.sink
        except BaseException as e:  # noqa: BLE001 - a ValueError is the client's; anything else goes back too
            cmd.future.set_exception(e)
            return
        if cmd.times is not None:
            cmd.times.stamp("added")
            for r in cmd.requests:
                self._timed[r.request_id] = cmd.times
        cmd.future.set_result(None)

    def _abort(self, request_ids: list) -> None:
        if self._failed is not None:
            return
        outputs = []
        for rid in request_ids:
            self._timed.pop(rid, None)
            if self._sinks.pop(rid, None) is None:
                continue  # finished already, never added, or aborted twice
            try:
                outputs.append(self.engine.abort(rid))
            except ValueError:
                continue
        for out in outputs:
            self._observe(out)

    def _dispatch(self, outputs: list[RequestOutput], stepped: float) -> None:
        by_loop: dict = {}
        firsts: dict = {}  # event loop -> RequestTimes whose first token is in this step's outputs
        for out in outputs:
            self._observe(out)
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue  # a request someone else added through call(), or aborted
            if out.finished:
                del self._sinks[out.request_id]
            by_loop.setdefault(sink.loop, []).append((sink, out))
            if self._timed and any(c.output_ids for c in out.outputs):
                times = self._timed.pop(out.request_id, None)
                if times is not None:
                    times.stamp("first_token", stepped)
                    firsts.setdefault(sink.loop, []).append(times)
        for loop, items in by_loop.items():
            self._deliver(loop, items, firsts.get(loop, ()))

    @staticmethod
    def _deliver(loop: asyncio.AbstractEventLoop, items: list, firsts=()) -> None:
        def put():
            for sink, item in items:
                sink.queue.put_nowait(item)
            for times in firsts:
                times.stamp("delivered")

        try:
            loop.call_soon_threadsafe(put)
        except RuntimeError:  # its event loop has closed: nobody is listening
            pass

    def _observe(self, out: RequestOutput) -> None:
        if self._on_output is not None:
            try:
                self._on_output(out)
            except Exception:  # noqa: BLE001 - metrics must never stop the engine
                log.exception("on_output failed")

    def _fail(self, e: BaseException) -> None:
        log.error("engine step failed; the engine serves no more requests", exc_info=e)
        self._failed = e
        self._fail_sinks(self._dead())
        self._refresh_snapshot()

    def _fail_sinks(self, error: BaseException) -> None:
        by_loop: dict = {}
        for sink in set(self._sinks.values()):
            by_loop.setdefault(sink.loop, []).append((sink, error))
        self._sinks.clear()
        self._timed.clear()
        for loop, items in by_loop.items():
            self._deliver(loop, items)

    def _dead(self) -> EngineDeadError:
        if self._stopped:
            return EngineDeadError("the server is shutting down")
        first = str(self._failed).splitlines()[0] if self._failed is not None and str(self._failed) else ""
        return EngineDeadError(f"the engine failed ({type(self._failed).__name__}: {first}) and serves no more "
                               "requests; restart the server")

    def _shutdown(self, taken: list) -> None:
        """Stops: fails every stream, aborts its requests, and answers every
        command not handled (``taken`` after the stop, and what is still
        queued) with :class:`EngineDeadError`, so no caller waits for ever."""
        with self._closing:
            self._stopped = True
        in_flight = list(self._sinks)
        self._fail_sinks(EngineDeadError("the server is shutting down"))  # first: _abort forgets the sinks
        if self._failed is None:
            for rid in in_flight:  # their pages go back to the pool
                try:
                    self._observe(self.engine.abort(rid))
                except ValueError:
                    continue
            try:  # the call already dispatched is read (nothing new is scheduled), so every page is free
                while self.engine.has_unfinished():
                    self.engine.step()
            except Exception as e:  # noqa: BLE001 - shutting down: log it, do not mask the stop
                log.error("the last engine step while stopping failed", exc_info=e)
        while True:
            if taken:
                cmd = taken.pop(0)
            else:
                try:
                    cmd = self._commands.get_nowait()
                except queue.Empty:
                    break
            future = getattr(cmd, "future", None)
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError("the server is shutting down"))

    def _refresh_snapshot(self) -> None:
        engine = self.engine
        stats = engine.stats
        now = time.monotonic()
        if self._pages is None or now - self._pages_at >= PAGES_EVERY_S or not engine.has_unfinished():
            self._pages, self._pages_at = engine.accounting(), now
        pages = self._pages
        counts = self._compiles.counts if self._compiles is not None else None
        offload = engine.kv_manager.offload
        self._snapshot = EngineSnapshot(
            time_s=time.time(),
            requests_running=len({s.request.request_id for s in engine.running}),
            requests_waiting=len({s.request.request_id for s in engine.waiting}),
            seqs_running=len(engine.running),
            pages_free=pages["free"], pages_cached=pages["cached"], pages_used=pages["used"],
            pages_total=pages["total"],
            prompt_tokens=stats.prompt_tokens, generation_tokens=stats.generated_tokens,
            prefix_hit_tokens=stats.prefix_hit_tokens,
            preemptions=stats.preemptions, iterations=stats.iterations,
            compile_seconds=counts.seconds if counts is not None else 0.0,
            compilations=counts.requests if counts is not None else 0,
            spec_drafts=stats.spec_verifications, spec_draft_tokens=stats.spec_proposed,
            spec_accepted_tokens=stats.spec_accepted,
            spec_accepted_by_position=tuple(stats.spec_accepted_by_position),
            tiers={name: {**dataclasses.asdict(getattr(stats, name)),
                          "saved_s": stats.tier_saved_s(name),
                          "used_bytes": 0 if tier is None else tier.used_bytes,
                          "capacity_bytes": 0 if tier is None else tier.capacity_bytes}
                   for name, tier in (("host", offload and offload.host), ("disk", offload and offload.disk),
                                      ("remote", offload and offload.remote))},
        )


# ------------------------------------------------------------------ asyncio side

class RequestStream:
    """The outputs of requests admitted together, in the order the engine
    reports them: an async iterator of :class:`RequestOutput` ("delta"
    reports) that ends once every request has finished.

    :meth:`close` aborts the requests not finished yet (a client that went
    away); a stream dropped without being closed aborts them when it is
    garbage-collected, so no request outlives its reader for long.

    Raises (from iteration):
      EngineDeadError: the engine failed, or the server is stopping.
    """

    def __init__(self, engine_loop: EngineLoop, sink: Sink, request_ids: Iterable):
        self._sink = sink
        self._remaining = set(request_ids)
        self._abort = weakref.finalize(self, engine_loop.abort, self._remaining)
        self._abort.atexit = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._remaining:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        if isinstance(item, BaseException):
            self._remaining.clear()
            self._abort.detach()
            raise item
        if item.finished:
            self._remaining.discard(item.request_id)
            if not self._remaining:
                self._abort.detach()
        return item

    def close(self) -> None:
        """Aborts the requests not finished yet (idempotent)."""
        self._abort()


async def admit(engine_loop: EngineLoop, requests: list[Request]) -> RequestStream:
    """Submits ``requests`` (all or none) and waits for the engine's verdict.

    Returns:
      their :class:`RequestStream`.

    Raises:
      ValueError: the engine refused one (nothing was added).
      EngineDeadError: the engine has failed or the server is stopping.
      asyncio.CancelledError: the caller was cancelled (the requests are
        withdrawn, or aborted if the loop had already added them).
    """
    sink = Sink(asyncio.get_running_loop())
    future = engine_loop.submit(requests, sink)
    try:
        await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        engine_loop.abort([r.request_id for r in requests])  # queued after the submit: skipped if never added
        raise
    return RequestStream(engine_loop, sink, [r.request_id for r in requests])
