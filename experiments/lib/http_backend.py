"""The online benchmark's HTTP backend: the same requests, sent to an
OpenAI-compatible server (``python -m server``) at the same arrival times.

Each request is one asyncio task: it sleeps until its arrival in the trace
(:func:`experiments.lib.latency.arrival_times`), then streams a
``/v1/completions`` call with its token ids as the prompt, its exact
``max_tokens`` and ``ignore_eos`` (vLLM's extension), greedy or as its
``SamplingParams`` say. Each server-sent chunk carries the ids it delivers
(``return_token_ids``, vLLM's extension), so every token gets the time its
chunk reached the client: the records are :class:`experiments.lib.latency.RequestRecord`
on the client's clock (``time.perf_counter``, zero at the trace's start),
and :func:`experiments.lib.latency.compute_metrics` reads them exactly as it
reads the in-process ones. What only the server knows (running sequences,
preemptions, XLA compilations) comes from its ``/metrics``: the running
count is sampled every :data:`SAMPLE_EVERY_S` seconds during the run.

Latencies here include the client and the network stack: TTFT counts from
the moment the request was due to its first chunk's arrival, as vLLM's
``bench serve`` counts it.

The clients can run in a child process (:class:`ClientProcess`, ``python
-m experiments.lib.http_backend --worker``) when the server runs in the
caller's: on a machine of few cores, clients in the server's process share
its interpreter lock and hide how much of a latency is the server's. The
child reports its CPU seconds per run (:attr:`HttpRun.client_cpu_s`) and,
per request, the response id the server gave it, so the server's own
timestamps (:mod:`server.timing`) can be matched to the client's. Times on
both sides are ``time.perf_counter()``, which on Linux is
``CLOCK_MONOTONIC``: one clock for every process of the machine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import pathlib
import pickle
import subprocess
import sys
import time
from collections.abc import Sequence

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families
from tqdm.auto import tqdm

from experiments.lib.latency import RequestRecord
from experiments.lib.online import TOY_CONFIG, OnlineRun
from experiments.lib.provenance import REPO
from models.loading.hf_loader import load_hf_tokenizer
from models.llm import SMOLLM2
from models.presets import PRESETS
from models.tokenizer import load_tokenizer
from paged_jax.engine.requests import CompletionOutput, Request, RequestOutput
from paged_jax.jit_stats import CompileCounts

SAMPLE_EVERY_S = 0.25
"""Seconds between two samples of the server's running sequences."""

TIMEOUT_S = 3600.0
"""A request's longest wait for the server (connection and each read)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Target:
    """Where the server is.

    Attributes:
      base_url: ``http://host:port`` (the server's root, not ``/v1``).
      model: the name to send as ``model``.
      api_key: sent as ``Authorization: Bearer``; None sends none.
    """

    base_url: str
    model: str
    api_key: str | None = None

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclasses.dataclass(frozen=True)
class ServerCounters:
    """The server's totals that the client cannot see (``/metrics``)."""

    preemptions: float
    compilations: float
    compile_seconds: float
    running_seqs: float
    ttft_sum_s: float
    ttft_count: float

    def since(self, before: ServerCounters) -> CompileCounts:
        """The compilations between two scrapes, as a ``CompileCounts``."""
        return CompileCounts(seconds=self.compile_seconds - before.compile_seconds,
                             requests=int(self.compilations - before.compilations))

    def mean_ttft_since(self, before: ServerCounters) -> float | None:
        """Mean TTFT the server measured (engine clock, from admission) over
        the requests between two scrapes, seconds; None for none."""
        n = self.ttft_count - before.ttft_count
        return (self.ttft_sum_s - before.ttft_sum_s) / n if n else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class HttpRun:
    """One run of the clients (:func:`measure_http_async`).

    Attributes:
      run: the requests' outputs and records (seconds after ``t0``).
      before, after: the server's counters before and after the run.
      response_ids: the ``id`` of each request's response, in the order of
        the requests (``cmpl-...``; the server's engine requests are this
        id with ``-0``, ``-1``, ... appended).
      t0: ``time.perf_counter()`` of the trace's zero in the clients'
        process (``CLOCK_MONOTONIC`` on Linux: comparable across processes).
      client_cpu_s: CPU seconds (user + system, every thread) the clients'
        process spent from the trace's zero to the last response.
    """

    run: OnlineRun
    before: ServerCounters
    after: ServerCounters
    response_ids: list[str]
    t0: float
    client_cpu_s: float


def payload(request: Request, model: str) -> dict:
    """The streamed ``/v1/completions`` body for ``request``.

    Raises:
      ValueError: beam search (not an OpenAI completion option).
    """
    s = request.sampling
    if s.beam_width:
        raise ValueError(f"request {request.request_id!r}: beam search (beam_width={s.beam_width}) cannot be sent "
                         "as an OpenAI completion")
    body = {"model": model, "prompt": request.token_ids(), "max_tokens": request.max_new_tokens,
            "temperature": s.temperature, "top_p": s.top_p, "seed": s.seed, "n": s.n, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": request.ignore_eos, "return_token_ids": True,
            "skip_special_tokens": s.skip_special_tokens}
    if s.stop:
        body["stop"] = list(s.stop)
    if s.logprobs is not None:
        body["logprobs"] = s.logprobs
    if request.cache_salt is not None:
        body["cache_salt"] = request.cache_salt
    return body


async def served_model(base_url: str, api_key: str | None = None) -> tuple[str, int]:
    """``(the first model id, its max_model_len)`` from ``GET /v1/models``.

    Raises:
      RuntimeError: the server answers with an error or lists no model.
    """
    headers = Target(base_url=base_url, model="", api_key=api_key).headers
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30) as client:
        r = await client.get("/v1/models")
    if r.status_code != 200 or not r.json().get("data"):
        raise RuntimeError(f"GET {base_url}/v1/models: {r.status_code} {r.text[:300]}")
    card = r.json()["data"][0]
    return card["id"], int(card.get("max_model_len", 0))


async def scrape(client: httpx.AsyncClient) -> ServerCounters:
    """The server's counters from ``GET /metrics``."""
    r = await client.get("/metrics")
    r.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return ServerCounters(preemptions=values.get("paged_jax:num_preemptions_total", 0.0),
                          compilations=values.get("paged_jax:xla_compilations_total", 0.0),
                          compile_seconds=values.get("paged_jax:compile_seconds_total", 0.0),
                          running_seqs=values.get("paged_jax:num_seqs_running", 0.0),
                          ttft_sum_s=values.get("paged_jax:time_to_first_token_seconds_sum", 0.0),
                          ttft_count=values.get("paged_jax:time_to_first_token_seconds_count", 0.0))


async def reset_prefix_cache(target: Target) -> int:
    """``POST /reset_prefix_cache``: pages forgotten, so a run starts as a
    fresh in-process engine does."""
    async with httpx.AsyncClient(base_url=target.base_url, headers=target.headers, timeout=60) as client:
        r = await client.post("/reset_prefix_cache")
    if r.status_code != 200:
        raise RuntimeError(f"POST /reset_prefix_cache: {r.status_code} {r.text[:300]}")
    return int(r.json()["pages_forgotten"])


async def _send(client: httpx.AsyncClient, target: Target, request: Request, due: float, t0: float,
                bar) -> tuple[RequestOutput, float, str | None]:
    """Streams one request at ``t0 + due``; ``(its output, its due time,
    the response's id)`` with times on the client's clock (seconds after
    ``t0``)."""
    await asyncio.sleep(max(0.0, t0 + due - time.perf_counter()))
    sent = time.perf_counter() - t0
    choices: dict[int, CompletionOutput] = {}
    first = None
    usage = None
    response_id = None
    async with client.stream("POST", "/v1/completions", json=payload(request, target.model)) as r:
        if r.status_code != 200:
            body = (await r.aread()).decode(errors="replace")
            raise RuntimeError(f"request {request.request_id!r}: HTTP {r.status_code}: {body[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.perf_counter() - t0
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"request {request.request_id!r}: the server failed mid-stream: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            response_id = response_id or chunk.get("id")
            for c in chunk.get("choices", ()):
                out = choices.setdefault(c["index"], CompletionOutput(index=c["index"], output_ids=[],
                                                                      finish_reason=None, text=""))
                ids = c.get("token_ids") or []
                if ids and first is None:
                    first = now
                out.output_ids += ids
                out.token_times += [now] * len(ids)
                out.text += c.get("text") or ""
                if c.get("finish_reason") is not None:
                    out.finish_reason = c["finish_reason"]
    finish = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"request {request.request_id!r}: the stream ended without a token")
    cached = (usage or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0) or 0
    if bar is not None:
        bar.update(1)
    return RequestOutput(request_id=request.request_id, prompt_ids=request.token_ids(),
                         outputs=[choices[i] for i in sorted(choices)], num_preemptions=0, first_token_s=first,
                         finish_s=finish, num_cached_tokens=cached, finished=True, arrival_s=sent), due, response_id


async def _sample_running(client: httpx.AsyncClient, t0: float, times: list, counts: list, stop: asyncio.Event):
    while not stop.is_set():
        try:
            counters = await scrape(client)
            times.append(time.perf_counter() - t0)
            counts.append(int(counters.running_seqs))
        except httpx.HTTPError:
            pass
        try:
            await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
        except asyncio.TimeoutError:
            pass


def _check_trace(target: Target, requests: Sequence[Request], arrivals: Sequence[float]) -> np.ndarray:
    """``arrivals`` as f64[len(requests)] once everything can be sent."""
    arrivals = np.asarray(arrivals, np.float64)
    if arrivals.shape != (len(requests),):
        raise ValueError(f"need one arrival per request, got {arrivals.shape} for {len(requests)} requests")
    if len(requests) and (arrivals[0] < 0 or (np.diff(arrivals) < 0).any()):
        raise ValueError("arrivals must be non-negative and non-decreasing")
    for r in requests:
        payload(r, target.model)  # refuse what cannot be sent before anything is
    return arrivals


async def run_http_async(target: Target, requests: Sequence[Request], arrivals: Sequence[float], *,
                         progress: bool = False,
                         sample_running: bool = True) -> tuple[OnlineRun, ServerCounters, ServerCounters]:
    """Sends ``requests[i]`` at ``arrivals[i]`` seconds after the start:
    :func:`measure_http_async`'s ``(run, before, after)``."""
    m = await measure_http_async(target, requests, arrivals, progress=progress, sample_running=sample_running)
    return m.run, m.before, m.after


async def measure_http_async(target: Target, requests: Sequence[Request], arrivals: Sequence[float], *,
                             progress: bool = False, sample_running: bool = True) -> HttpRun:
    """Sends ``requests[i]`` at ``arrivals[i]`` seconds after the start.

    Args:
      sample_running: sample the server's running sequences during the run
        (each sample is a ``/metrics`` scrape: a little work for both
        sides); off, the run's running counts are a single 0.

    Returns:
      an :class:`HttpRun`; the run's times are seconds on the client's
      clock after the trace's zero, its running counts the server's running
      sequences sampled from ``/metrics``.

    Raises:
      ValueError: lengths differ, arrivals decrease or are negative; a
        request :func:`payload` refuses.
      RuntimeError: the server refused a request or failed mid-stream.
    """
    arrivals = _check_trace(target, requests, arrivals)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(TIMEOUT_S)
    async with httpx.AsyncClient(base_url=target.base_url, headers=target.headers, limits=limits,
                                 timeout=timeout) as client:
        before = await scrape(client)
        bar = tqdm(total=len(requests), unit="req", leave=False, disable=None) if progress else None
        t0, cpu0 = time.perf_counter(), time.process_time()
        times, counts = [0.0], [0]
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample_running(client, t0, times, counts, stop)) if sample_running else None
        try:
            results = await asyncio.gather(*(_send(client, target, r, float(due), t0, bar)
                                             for r, due in zip(requests, arrivals)))
        finally:
            stop.set()
            if sampler is not None:
                await sampler
            if bar is not None:
                bar.close()
        cpu_s = time.process_time() - cpu0
        after = await scrape(client)
    outputs = [out for out, _, _ in results]
    records = [RequestRecord.from_output(out, arrival_s=due) for out, due, _ in results]
    end = max((r.finish_s for r in records), default=0.0)
    run = OnlineRun(outputs=outputs, records=records, start_s=0.0, end_s=end, running_times=times,
                    running_counts=counts)
    return HttpRun(run=run, before=before, after=after, response_ids=[rid for _, _, rid in results], t0=t0,
                   client_cpu_s=cpu_s)


def run_http(target: Target, requests: Sequence[Request], arrivals: Sequence[float], *, progress: bool = False,
             sample_running: bool = True) -> tuple[OnlineRun, ServerCounters, ServerCounters]:
    """:func:`run_http_async` in a new event loop (the caller's thread must
    not be running one)."""
    return asyncio.run(run_http_async(target, requests, arrivals, progress=progress, sample_running=sample_running))


def warm_up_http(target: Target, batches: Sequence[Sequence[Request]]) -> CompileCounts:
    """Sends each batch at once and waits for it before the next (the
    batches of :func:`experiments.lib.online.warmup_batches`), so the server
    compiles its programs before a timed run; returns what it compiled."""

    async def go():
        async with httpx.AsyncClient(base_url=target.base_url, headers=target.headers, timeout=TIMEOUT_S) as c:
            before = await scrape(c)
        for batch in batches:
            await run_http_async(target, batch, np.zeros(len(batch)), sample_running=False)
        async with httpx.AsyncClient(base_url=target.base_url, headers=target.headers, timeout=TIMEOUT_S) as c:
            after = await scrape(c)
        return after.since(before)

    return asyncio.run(go())


class ClientProcess:
    """The streaming clients of :func:`measure_http_async` in a child
    process, kept for several runs; a context manager (closing ends it).

    The child is ``python -m experiments.lib.http_backend --worker`` (this
    module, so it imports neither the server nor a model); a run's
    requests go to it and its :class:`HttpRun` comes back, pickled, over
    its stdin and stdout. It starts importing at once, so a caller that
    makes it before a warm-up pays nothing for the wait.

    Raises:
      OSError: the child cannot be started.
    """

    def __init__(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                                           if p)}
        self._proc = subprocess.Popen([sys.executable, "-m", "experiments.lib.http_backend", "--worker"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, env=env)

    def run(self, target: Target, requests: Sequence[Request], arrivals: Sequence[float], *,
            sample_running: bool = True) -> HttpRun:
        """:func:`measure_http_async` in the child; waits for its result.

        Raises:
          ValueError: what :func:`measure_http_async` refuses (checked here,
            before the child gets anything).
          RuntimeError: the run failed in the child (its message), or the
            child has died.
        """
        arrivals = _check_trace(target, requests, arrivals)
        try:
            pickle.dump((target, list(requests), [float(a) for a in arrivals], sample_running), self._proc.stdin)
            self._proc.stdin.flush()
            ok, value = pickle.load(self._proc.stdout)
        except (BrokenPipeError, EOFError):
            raise RuntimeError(f"the client process ended (exit code {self._proc.poll()}); its stderr above says "
                               "why") from None
        if not ok:
            raise RuntimeError(f"the client process failed: {value}")
        return value

    def close(self, timeout: float = 30.0) -> None:
        """Ends the child (it exits when its stdin closes)."""
        if self._proc.stdin is not None and not self._proc.stdin.closed:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()

    def __enter__(self) -> ClientProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _worker(jobs, results) -> None:
    """The child's loop: a pickled ``(target, requests, arrivals,
    sample_running)`` in, ``(True, HttpRun)`` or ``(False, message)`` out,
    until ``jobs`` ends."""
    while True:
        try:
            target, requests, arrivals, sample_running = pickle.load(jobs)
        except EOFError:
            return
        try:
            result = (True, asyncio.run(measure_http_async(target, requests, arrivals,
                                                           sample_running=sample_running)))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
            result = (False, f"{type(e).__name__}: {e}")
        pickle.dump(result, results)
        results.flush()


def tokenizer_for(spec: str) -> tuple[object | None, int, str]:
    """``(tokenizer or None, vocabulary size, display name)`` of a
    ``--model`` spec, without building its weights: the client needs only
    the token ids (``smollm2``, a ``.gguf``, a Hugging Face folder; a
    random-weight preset or ``toy`` has no tokenizer and serves random ids).

    Raises:
      ValueError, FileNotFoundError: from the tokenizer loaders; an unknown spec.
    """
    if spec == "toy":
        return None, TOY_CONFIG.vocab_size, "toy decoder (random weights)"
    if spec in PRESETS:
        return None, PRESETS[spec].vocab_size, f"{spec} (random weights)"
    if spec == SMOLLM2:
        tok = load_tokenizer()
        return tok, tok.vocab_size, "SmolLM2-135M-Instruct"
    path = pathlib.Path(spec).expanduser()
    if path.is_dir():
        tok = load_hf_tokenizer(path)
        return tok, tok.vocab_size, path.resolve().name
    if path.is_file() and path.suffix.lower() == ".gguf":
        tok = load_tokenizer(path)
        return tok, tok.vocab_size, path.name
    raise ValueError(f"--model {spec!r}: expected 'smollm2', 'toy', a preset {sorted(PRESETS)}, a .gguf file or a "
                     "Hugging Face folder (the same model the server serves)")


if __name__ == "__main__":
    if sys.argv[1:] != ["--worker"]:
        sys.exit("usage: python -m experiments.lib.http_backend --worker (ClientProcess starts it; it reads pickled "
                 "jobs on stdin)")
    from experiments.lib import http_backend  # noqa: PLW0406 - pickles must name this module, not __main__

    _results = sys.stdout.buffer
    sys.stdout = sys.stderr  # stdout carries the results: anything printed goes to stderr
    http_backend._worker(sys.stdin.buffer, _results)
