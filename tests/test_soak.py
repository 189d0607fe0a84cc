"""A long-lived engine and server hold bounded state (issue 34).

Rounds of requests run one after another; after a warm-up every container reachable from the engine, the
engine loop and the server's metrics (lists, dicts, sets, deques, walked through the project's own objects,
:mod:`soak_helpers`) is measured, and again after more rounds: none may have grown, except the prefix
cache, which may fill up to the pool's pages and no further. A benchmark that asks for every call's record
(``EngineConfig(call_records=None)``) still gets them.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time

import httpx
import jax.numpy as jnp
import pytest
from engine_helpers import make_engine, toy_requests
from flax import nnx
from soak_helpers import container_sizes, grown

from models.llama import Llama, LlamaConfig
from models.llm import LLM
from models.tokenizer import load_tokenizer
from paged_jax.engine import SamplingParams
from server import ThreadedServer, build_app

NUM_PAGES = 120


def _round(engine, seed: int, n: int = 120) -> None:
    """``n`` toy requests, a third streaming deltas, some sampled twice, a few aborted mid-flight."""
    def sampling(i):
        return SamplingParams(n=1 + (i % 5 == 0), temperature=0.7 if i % 5 == 0 else 0.0, seed=i,
                              output_kind="delta" if i % 3 == 0 else "final")

    requests = [dataclasses.replace(r, request_id=f"{seed}-{i}")
                for i, r in enumerate(toy_requests(n, seed=seed, max_new=(1, 12), prompt_len=(1, 30),
                                                   sampling=sampling))]
    for r in requests:
        engine.add_request(r)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps % 7 == 0:  # abort whatever is oldest in flight
            live = sorted(engine._live)
            if live:
                engine.abort(live[0])


def _bounded_elsewhere(path: str) -> bool:
    """Containers that may grow after warm-up, up to a bound of their own: the prefix cache (to the pool's
    pages) and one entry per compiled program (as many as JAX's own cache of compiled programs holds;
    a shape first met after warm-up adds one)."""
    return ".prefix_cache." in path or path.endswith((".stats.programs", ".stats.programs[]", ".stats.calls_by_shape"))


def test_an_engine_that_serves_round_after_round_holds_the_same_state():
    engine = make_engine(num_pages=NUM_PAGES, max_seqs=8, max_seq_len=80, call_records=64)
    _round(engine, 1)
    _round(engine, 2)
    before = container_sizes(engine, "engine")
    for seed in (3, 4):
        _round(engine, seed)
    after = container_sizes(engine, "engine")
    assert len(before) > 15, sorted(before)  # the walk reaches the scheduler, the KV manager, the stats
    growth = grown(before, after)
    assert not {p: v for p, v in growth.items() if not _bounded_elsewhere(p)}, growth
    assert all(n <= NUM_PAGES for p, n in after.items() if ".prefix_cache." in p), after
    assert engine.stats.model_calls > 4 * 64 and len(engine.stats.calls) == 64  # a window of the latest
    assert engine.stats.calls[-1].tokens > 0 and sum(engine.stats.calls_by_shape.values()) == engine.stats.model_calls
    assert 0 <= engine.stats.padding < 1


def test_a_benchmark_that_asks_for_every_call_record_gets_them():
    engine = make_engine(num_pages=NUM_PAGES, call_records=None)
    _round(engine, 1, n=40)
    stats = engine.stats
    assert len(stats.calls) == stats.model_calls > 0
    assert sum(c.tokens for c in stats.calls) == stats.call_tokens
    assert sum(c.shape.num_tokens for c in stats.calls) == stats.call_rows


def test_call_records_is_checked_by_name():
    with pytest.raises(ValueError, match="call_records"):
        make_engine(call_records=-1)


@pytest.fixture(scope="module")
def tiny_server():
    """The server over a tiny random decoder with SmolLM2's tokenizer (text in, text out, fast)."""
    tok = load_tokenizer()
    config = LlamaConfig(vocab_size=tok.vocab_size, model_dim=32, mlp_dim=64, num_layers=1, num_q_heads=2,
                         num_kv_heads=1, head_dim=16)
    llm = LLM((Llama(config, rngs=nnx.Rngs(0)), tok), dtype=jnp.float32, kv_tokens=1024, page_size=16,
              max_seqs=8, max_seq_len=256, max_num_batched_tokens=64, call_records=64)
    app = build_app(llm, model_name="tiny")
    with ThreadedServer(app) as srv:
        yield srv, app


def _http_round(url: str, seed: int, n: int = 48) -> None:
    """``n`` requests from 6 clients: completions and chat, streamed and not, n up to 2, stop strings, and
    streams the client closes after its first event."""
    def one(i: int) -> None:
        body = {"model": "tiny", "max_tokens": 4 + i % 9, "temperature": 0.8 if i % 4 == 0 else 0.0, "seed": i,
                "n": 1 + (i % 6 == 0), "stop": [" the"] if i % 5 == 0 else None, "stream": i % 2 == 0}
        if i % 3:
            path, body["prompt"] = "/v1/completions", f"Request {seed}-{i}: once upon a time"
        else:
            path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": f"Hi {seed}-{i}"}]
        with httpx.Client(base_url=url, timeout=120) as client:
            if not body["stream"]:
                r = client.post(path, json=body)
                assert r.status_code == 200, r.text
                return
            with client.stream("POST", path, json=body) as r:
                assert r.status_code == 200
                for k, line in enumerate(r.iter_lines()):
                    if line.startswith("data: {"):
                        assert "error" not in json.loads(line[6:]), line
                    if i % 8 == 2 and k >= 1:  # the client goes away mid-stream
                        return

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(pool.map(one, range(n)))


def _server_sizes(app) -> dict[str, int]:
    loop = app.state.engine_loop
    for _ in range(50):  # let the loop settle: a closed stream's request leaves at the loop's next turn
        if loop.call(lambda engine: not engine.has_unfinished()).result(timeout=60):
            break
        time.sleep(0.1)
    return {**container_sizes(loop, "loop"), **container_sizes(app.state.metrics, "metrics")}


def test_a_server_that_serves_round_after_round_holds_the_same_state(tiny_server):
    srv, app = tiny_server
    for seed in (1, 2):
        _http_round(srv.url, seed)
    before = _server_sizes(app)
    for seed in (3, 4):
        _http_round(srv.url, seed)
    after = _server_sizes(app)
    assert any(p.startswith("loop.engine.") for p in before) and any(p.startswith("metrics.") for p in before)
    growth = grown(before, after)
    assert not {p: v for p, v in growth.items() if not _bounded_elsewhere(p)}, growth
    used = app.state.engine_loop.call(lambda engine: engine.accounting()["used"]).result(timeout=60)
    assert used == 0  # every page back (cached ones aside)
    assert httpx.get(srv.url + "/health").status_code == 200
