"""server: the OpenAI-compatible HTTP server, driven by the official
``openai`` client (and ``httpx`` where the client cannot send what is
tested: malformed JSON, wrong types, disconnects).

One server per module, on SmolLM2 (skipped when its GGUF is not
installed), in a background thread on a free loopback port. The oracle is
the same model object served in process: a second engine over the
server's own compiled model (``llm.engine.model``) with a pool and limits
of the same shapes, so it shares every compiled program, driven directly
while the server is idle.

Kept small so the module's compilation stays a handful of programs (7):
every model call carries at most 16 tokens (one token bucket; long prompts
prefill in 16-token chunks), outputs are a few tokens, every request is
greedy except those that sample, which all ask for 2 log-probs too (one
program variant). About a minute on 2 busy cores, most of it compiling.
The module's last test fails the shared engine on purpose.
"""

import asyncio
import copy
import json
import random
import re
import select
import socket
import threading
import time

import httpx
import jax.numpy as jnp
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from experiments.lib import http_backend
from experiments.serving import bench_serving
from models.loading.gguf_loader import smollm2_gguf_path
from models.llm import LLM
from models.tokenizer import TokenFloor
from paged_jax.engine.core import Engine, Request, SamplingParams
from paged_jax.profiling import ProfileSpec, trace_slices
from server import ThreadedServer, build_app
from server import __main__ as server_main
from server.limits import MIN_BODY_BYTES, RequestLimits
from server.protocol import MAX_MESSAGE_CHARS, SHOWN_CHARS, APIError, shown

MODEL = "smollm2-test"
KEY = "test-key"
PROMPTS = ["The capital of France is", "1 2 3"]
NEW = 6
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(f"SmolLM2 GGUF not installed: {e}")
    # 16 tokens a call for every program; 32 pages of 16 tokens; a host tier of 128 pages (720 KiB each).
    return LLM("smollm2", dtype=jnp.float32, kv_tokens=512, page_size=16, max_seqs=8, max_seq_len=256,
               max_num_batched_tokens=16, host_cache_bytes=128 * 737_280)


@pytest.fixture(scope="module")
def server(llm):
    app = build_app(llm, model_name=MODEL, api_key=KEY)
    with ThreadedServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def loop(server):
    return server.app.state.engine_loop


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def oracle(llm):
    """``run(prompt_ids_list, max_tokens (one, or one per prompt), **request_fields) -> outputs in order`` on
    an in-process engine of the same model object and shapes (sharing the server's compiled programs)."""
    engine = Engine(llm.engine.model, llm.config.make_kv_pool(llm.engine.kv.num_pages, llm.engine.page_size,
                                                              llm.engine.kv.k.dtype),
                    llm.engine.config, stop_ids=llm.tokenizer.stop_ids, tokenizer=llm.tokenizer)
    counter = iter(range(10**9))

    def run(prompts, max_tokens, **fields):
        lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        reqs = [Request(request_id=next(counter), prompt_ids=ids, max_new_tokens=n, **fields)
                for ids, n in zip(prompts, lengths)]
        outs = {o.request_id: o for o in engine.run(reqs)}
        return [outs[r.request_id] for r in reqs]

    return run


def chat_ids(llm, messages):
    tok = llm.tokenizer
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def idle(loop, timeout=60.0):
    """Waits until the engine has nothing left (aborts included); returns its page accounting."""
    deadline = time.monotonic() + timeout
    while True:
        busy, pages = loop.call(lambda e: (e.has_unfinished(), e.accounting())).result(timeout)
        if not busy:
            return pages
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.05)


def scrape(http) -> dict:
    """``{(name, labels as a sorted tuple): value}`` of every sample /metrics exposes."""
    text = http.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def sse_events(response) -> list:
    """The JSON events of a streamed response, checking the stream ends in [DONE]."""
    data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


# ------------------------------------------------------------------ basics


def test_models_health_and_auth(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"})  # no key at all
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_completions_greedy_equal_the_engine_in_process(llm, client, oracle):
    tok = llm.tokenizer
    want = oracle([tok.encode(p) for p in PROMPTS], NEW)
    # One prompt per request, then both as a batch (choice i is prompt i).
    for i, p in enumerate(PROMPTS):
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=NEW, temperature=0,
                                      extra_body={"return_token_ids": True})
        [c] = r.choices
        assert c.token_ids == want[i].output_ids and c.text == want[i].text and c.finish_reason == "length"
        assert r.usage.prompt_tokens == len(want[i].prompt_ids) and r.usage.completion_tokens == NEW
        assert r.usage.total_tokens == r.usage.prompt_tokens + NEW
    assert want[0].text.startswith(" Paris")
    r = client.completions.create(model=MODEL, prompt=[tok.encode(p) for p in PROMPTS], max_tokens=NEW,
                                  temperature=0)
    assert [(c.index, c.text) for c in r.choices] == [(0, want[0].text), (1, want[1].text)]
    assert r.usage.completion_tokens == 2 * NEW


def test_completions_stream_joins_to_the_same_text(llm, client, oracle):
    [want] = oracle([llm.tokenizer.encode(PROMPTS[0])], NEW)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert "".join(c.choices[0].text for c in body) == want.text
    assert [c.choices[0].finish_reason for c in body] == [None] * (len(body) - 1) + ["length"]
    assert last.choices == [] and last.usage.completion_tokens == NEW
    assert len({c.id for c in chunks}) == 1


def test_chat_greedy_stream_and_not_equal_the_engine(llm, client, oracle):
    [want] = oracle([chat_ids(llm, CHAT)], 12)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert r.choices[0].message.content == want.text == "The capital of France is Paris."
    assert r.choices[0].message.role == "assistant" and r.choices[0].finish_reason == "stop"
    assert want.outputs[0].stop_reason == llm.tokenizer.eos_id  # the engine's: the EOS id; vLLM says null
    assert r.choices[0].model_extra["stop_reason"] is None
    assert r.usage.prompt_tokens == len(want.prompt_ids) and r.usage.completion_tokens == len(want.output_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=12,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "stop" and chunks[-1].choices[0].model_extra["stop_reason"] is None


def test_n_samples_are_seeded_distinct_and_equal_the_engine(llm, client, oracle):
    # With log-probs, as test_logprobs_equal_the_engine: both run the same (sampled, 2 log-probs) programs.
    ids = llm.tokenizer.encode("Once upon a time")
    [want] = oracle([ids], NEW, sampling=SamplingParams(n=3, temperature=1.0, seed=7, logprobs=2))
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=NEW, n=3, temperature=1.0, seed=7,
                                  logprobs=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    choices = sorted(r.choices, key=lambda c: c.index)
    outs = sorted(want.outputs, key=lambda o: o.index)
    assert [c.text for c in choices] == [o.text for o in outs]
    assert len({c.text for c in choices}) > 1
    for c, o in zip(choices, outs):
        assert c.logprobs.token_logprobs == pytest.approx([d[t] for t, d in zip(o.output_ids, o.logprobs)], abs=1e-4)
    assert r.usage.completion_tokens == 3 * NEW


def test_stop_strings_cut_the_text(client):
    for stream in (False, True):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=NEW, temperature=0, stop=".",
                                      stream=stream)
        choices = [c.choices[0] for c in r] if stream else r.choices
        text = "".join(c.text for c in choices)
        assert text == " Paris" and choices[-1].finish_reason == "stop"


def test_logprobs_equal_the_engine(llm, client, oracle):
    # Sampled (seeded), so that the programs are test_n_samples_are_seeded_distinct_and_equal_the_engine's;
    # log-probs are the model's log-softmax, before temperature, whatever the sampling.
    tok = llm.tokenizer
    sampled = dict(temperature=1.0, seed=3)
    [want] = oracle([tok.encode(PROMPTS[0])], NEW, sampling=SamplingParams(logprobs=2, **sampled))
    lp = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=NEW, logprobs=2,
                                   **sampled).choices[0].logprobs
    names = [tok.decode([t], skip_special_tokens=False) for t in want.output_ids]
    assert lp.tokens == names
    assert lp.token_logprobs == pytest.approx([d[t] for t, d in zip(want.output_ids, want.outputs[0].logprobs)],
                                              abs=1e-4)
    assert lp.text_offset == [sum(len(n) for n in names[:i]) for i in range(len(names))]
    for top, d in zip(lp.top_logprobs, want.outputs[0].logprobs):
        assert top == pytest.approx({tok.decode([t], skip_special_tokens=False): v for t, v in d.items()}, abs=1e-4)

    [want] = oracle([chat_ids(llm, CHAT)], NEW, sampling=SamplingParams(logprobs=2, **sampled))
    content = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=NEW, logprobs=True,
                                             top_logprobs=2, **sampled).choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t], skip_special_tokens=False) for t in want.output_ids]
    for c, t, d in zip(content, want.output_ids, want.outputs[0].logprobs):
        assert c.logprob == pytest.approx(d[t], abs=1e-4) and c.bytes == list(c.token.encode())
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.logprob - 1e-6  # the best first
        assert [x.logprob for x in c.top_logprobs] == pytest.approx(list(d.values())[:2], abs=1e-4)


def test_cached_tokens_count_prefix_hits_and_respect_the_salt(client):
    prompt = " ".join(f"word{i}" for i in range(30))  # about 60 tokens: three full pages
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    salted = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                       extra_body={"cache_salt": "tenant-b"})
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 >= 48  # the last token is computed
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    assert again.choices[0].text == first.choices[0].text == salted.choices[0].text
    assert again.usage.prompt_tokens_details.model_dump()["cached_tokens_by_tier"] == {
        "device": again.usage.prompt_tokens_details.cached_tokens, "host": 0, "disk": 0, "remote": 0}


def test_a_prefix_the_pool_evicted_is_served_from_the_host_tier(http, client):
    """Prompts that fill the 32-page pool evict a cached prefix; asked
    again, it comes back from the host tier: the same text, its cached
    tokens counted by tier in the usage and in /metrics."""
    prompt = " ".join(f"tier{i}" for i in range(30))
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    for k in range(5):  # about 190 tokens each: 11 full pages cached per prompt
        client.completions.create(model=MODEL, prompt=" ".join(f"fill{k}x{i}" for i in range(40)), max_tokens=1)
    before = scrape(http)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    after = scrape(http)
    n = first.usage.prompt_tokens
    details = again.usage.prompt_tokens_details
    tiers = details.model_dump()["cached_tokens_by_tier"]
    assert again.choices[0].text == first.choices[0].text
    assert details.cached_tokens == (n - 1) // 16 * 16 and tiers["host"] > 0
    assert tiers["device"] + tiers["host"] == details.cached_tokens and tiers["disk"] == 0
    hits = ("paged_jax:prefix_cache_hits_by_tier_total", (("model_name", MODEL), ("tier", "host")))
    assert after[hits] - before[hits] == tiers["host"]
    loaded = ("paged_jax:kv_tier_bytes_moved_total", (("direction", "loaded"), ("model_name", MODEL), ("tier", "host")))
    assert after[loaded] - before[loaded] == tiers["host"] // 16 * 737_280
    assert 0 < after[("paged_jax:kv_tier_used_bytes", (("model_name", MODEL), ("tier", "host")))] <= 128 * 737_280
    assert after[("paged_jax:kv_tier_capacity_bytes", (("model_name", MODEL), ("tier", "disk")))] == 0
    saved = ("paged_jax:kv_tier_saved_seconds_total", (("model_name", MODEL), ("tier", "host")))
    assert after[saved] > before[saved] >= 0


# ------------------------------------------------------------------ errors


def _raw(http, path, body, **kw):
    return http.post(path, content=body if isinstance(body, bytes) else json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"}, **kw)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),  # a RecursionError: was a 500
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', None),  # a lone surrogate: was a 500
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\udc00"}]}', None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**6]}, "prompt"),
    ("/v1/completions", {"prompt": [1] * 300}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1000}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": 2.5}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "n": 9}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 8, "max_tokens": 100}, "n"),  # the pool: 8 x 7 pages > 32
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}], "max_tokens": 1.5}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 500}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 10**6]]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": CHAT, "stream": False, "stream_options": {}}, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": ""}, "cache_salt"),
    ("/v1/chat/completions", {"messages": CHAT, "echo": True}, "echo"),  # vLLM's chat echo: was ignored
    ("/v1/chat/completions", {"messages": CHAT, "n": 2, "best_of": 3}, "best_of"),  # was ignored
])
def test_bad_requests_get_an_openai_400(http, path, body, param):
    r = _raw(http, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_errors_through_the_client_then_a_good_request(client, http):
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256"):
        client.completions.create(model=MODEL, prompt="hi " * 300, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-0.5)
    r = http.get("/v1/no-such-route")
    assert r.status_code == 404 and "error" in r.json()
    # Unknown fields are ignored, as OpenAI ignores them. (Greedy, as every request here that needs no
    # sampling: temperature defaults to 1, whose programs are others.)
    r = _raw(http, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1, "temperature": 0,
                                       "frobnicate": {"x": 1}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    r = client.completions.create(model=MODEL, prompt="hi", max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1


# ------------------------------------------- bounds: a body refused while it streams, fields refused by name

BIG = 64 << 20  # 64 MiB: 64 times the module server's body bound


def _body_chunks(total, pulled, chunk=64 << 10):
    """A JSON-looking body of ``total`` bytes in ``chunk``-byte pieces (one buffer reused: the client
    allocates nothing per chunk), counting in ``pulled[0]`` the bytes taken from it."""
    piece = b"x" * chunk
    yield b'{"prompt": "'
    pulled[0] += 12
    while pulled[0] < total:
        step = min(chunk, total - pulled[0])
        pulled[0] += step
        yield piece if step == chunk else piece[:step]


async def _in_process(app, headers):
    """POSTs a BIG streamed body to ``app`` in this thread's event loop (httpx's ASGI transport hands the
    app one chunk per receive, so what the app read is what the generator gave); returns the response, the
    bytes taken and the seconds."""
    pulled = [0]

    async def chunks():
        for c in _body_chunks(BIG, pulled):
            yield c

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as c:
        start = time.monotonic()
        r = await c.post("/v1/completions", content=chunks(), headers=headers)
        return r, pulled[0], time.monotonic() - start


def test_an_oversized_body_gets_413_after_at_most_the_bound(server, http):
    bound = server.app.state.limits.max_body_bytes
    assert bound == 1 << 20  # SmolLM2 at 256 tokens: the 1 MiB floor
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    # In process: chunked (no Content-Length), and a Content-Length past the bound (refused before a byte).
    for extra, most in (({}, bound + (64 << 10)), ({"Content-Length": str(BIG)}, 0)):
        r, pulled, seconds = asyncio.run(_in_process(server.app, {**auth, **extra}))
        error = r.json()["error"]
        assert r.status_code == 413 and error["code"] == "request_too_large" and str(bound) in error["message"]
        assert pulled <= most and seconds < 2, (extra, pulled, seconds)
    # Over a socket, uvicorn's: the client writes all 64 MiB, the server holds none of them.
    rss = psutil.Process().memory_info().rss
    for extra in ({}, {"Content-Length": str(BIG)}):
        start = time.monotonic()
        r = http.post("/v1/completions", content=_body_chunks(BIG, [0]), headers={**auth, **extra})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert time.monotonic() - start < 10
    assert psutil.Process().memory_info().rss - rss < BIG // 2
    good = _raw(http, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "temperature": 0})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 1


def test_an_endless_chunked_body_is_cut_off_after_its_413(server, http):
    """After the 413 the server closes the connection (``Connection: close``) instead of reading and dropping
    what the client goes on sending: a client that never stops gets a broken pipe within seconds (it used to
    be read for ever, 25 GB in 15 s, slowing every other request)."""
    host, port = server.url.removeprefix("http://").split(":")
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    chunk = b"%x\r\n%s\r\n" % (64 << 10, b"1" * (64 << 10))
    cut_off = {}

    def send_for_ever(sock):  # until the server hangs up (or 60 s)
        start = time.monotonic()
        try:
            while time.monotonic() - start < 60:
                sock.sendall(chunk)
        except OSError as e:  # BrokenPipeError or ConnectionResetError
            cut_off["at"], cut_off["error"] = time.monotonic(), e

    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(head + b"1\r\n[\r\n")
        sender = threading.Thread(target=send_for_ever, args=(sock,), daemon=True)
        sender.start()
        answered = sock.recv(1 << 16)
        answered_at = time.monotonic()
        sender.join(70)
    assert "at" in cut_off, "the server went on reading the body"
    assert cut_off["at"] - answered_at < 10
    assert answered.startswith(b"HTTP/1.1 413"), answered
    assert b"connection: close" in answered.lower()
    good = _raw(http, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "temperature": 0})
    assert good.status_code == 200


def test_text_past_the_context_is_refused_without_tokenizing(llm, http, monkeypatch):
    def refuse(text):
        raise AssertionError(f"tokenized {len(text)} characters")

    monkeypatch.setattr(llm.tokenizer, "encode", refuse)
    text = "a" * 1_000_000  # 1 MB: at least 12,346 tokens at SmolLM2's 81 bytes a token, past 256
    for path, body, name in [
        ("/v1/completions", {"prompt": text}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", text]}, "prompt[1]"),
        ("/v1/chat/completions", {"messages": [CHAT[0], {"role": "user", "content": text}]}, "messages[1].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]},
         "messages[0].content"),
    ]:
        start = time.monotonic()
        r = _raw(http, path, body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == name.split("[")[0], r.text[:300]
        assert f"{name} is 1000000 characters, which take at least 12346 tokens" in error["message"]
        assert "maximum context length is 256" in error["message"] and "... (1000000 chars)" in error["message"]
        assert time.monotonic() - start < 2
    monkeypatch.undo()
    good = _raw(http, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "temperature": 0})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 1


HUGE_INT = b"1" + b"0" * 5000  # 5,001 digits: past Python's int-string conversion limit


@pytest.mark.parametrize("headers, body, status, words", [
    ({"Content-Type": "text/plain"}, b'{"prompt": "hi", "max_tokens": 1}', 415, "got 'text/plain'"),
    ({"Content-Type": "application/x-www-form-urlencoded"}, b'{"prompt": "hi"}', 415, "must be application/json"),
    ({}, b'{"prompt": "hi"}', 415, "got none"),
    ({"Content-Type": "Application/JSON; charset=utf-8"}, b'{"prompt": [1, 2], "max_tokens": 1, "temperature": 0}',
     200, None),
])
def test_only_json_bodies_are_read(server, headers, body, status, words):
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=120,
                   headers={"Authorization": f"Bearer {KEY}", **headers})
    assert r.status_code == status, r.text
    if words is not None:
        error = r.json()["error"]
        assert error["code"] == "unsupported_media_type" and "Content-Type" in error["message"]
        assert words in error["message"]


def test_request_limits_defaults_flags_and_refusals(capsys):
    floor = TokenFloor(max_token_bytes=81)
    small = RequestLimits.for_context(256, token_floor=floor, vocab_size=49152)
    assert small.max_body_bytes == MIN_BODY_BYTES and small.max_messages == 256 and small.max_prompts == 256
    # 2,048 tokens: 2,047 x 81 x 6 text bytes + 32 x (256 x 6 + 4) stop bytes + 2,048 x 64 + 16 KiB.
    assert RequestLimits.for_context(2048, token_floor=floor, vocab_size=49152).max_body_bytes == (
        2047 * 486 + 32 * 1540 + 2048 * 64 + 16384)
    assert RequestLimits.for_context(256, token_floor=None, vocab_size=10, max_stop=4).max_stop == 4
    for bad, words in [({"max_stop": 0}, "max_stop must be an int >= 1, got max_stop=0"),
                       ({"max_bodies": 3}, "unknown bounds ['max_bodies']")]:
        with pytest.raises(ValueError, match=re.escape(words)):
            RequestLimits.for_context(256, token_floor=floor, vocab_size=10, **bad)
    args = server_main.parse_args(["--max-body-bytes", "5000", "--max-stop-chars", "9"])
    assert args.limit_bounds == {"max_body_bytes": 5000, "max_stop_chars": 9}
    assert args.tier_options == {"host_cache_bytes": 0, "disk_cache_bytes": 0, "disk_cache_dir": None,
                                 "kv_transfer": None}
    assert server_main.parse_args(["--host-cache-gib", "0.5", "--disk-cache-dir", "d", "--disk-cache-gib", "2"
                                   ]).tier_options == {"host_cache_bytes": 1 << 29, "disk_cache_bytes": 1 << 31,
                                                       "disk_cache_dir": "d", "kv_transfer": None}
    with pytest.raises(SystemExit):
        server_main.parse_args(["--max-prompts", "0"])
    assert "--max-prompts must be >= 1, got 0" in capsys.readouterr().err


# -------------------------------------------------------- metrics and soak


def test_metrics_parse_and_move(http, client):
    before = scrape(http)
    client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3, temperature=0)
    after = scrape(http)
    label = (("model_name", MODEL),)
    assert after[("paged_jax:generation_tokens_total", label)] >= before[("paged_jax:generation_tokens_total",
                                                                          label)] + 3
    assert after[("paged_jax:prompt_tokens_total", label)] > before[("paged_jax:prompt_tokens_total", label)]
    done = ("paged_jax:request_success_total", (("finished_reason", "length"), ("model_name", MODEL)))
    assert after[done] == before.get(done, 0) + 1
    assert after[("paged_jax:time_to_first_token_seconds_count", label)] > before.get(
        ("paged_jax:time_to_first_token_seconds_count", label), 0)
    assert after[("paged_jax:inter_token_latency_seconds_count", label)] >= before.get(
        ("paged_jax:inter_token_latency_seconds_count", label), 0) + 2
    pages = {s: after[("paged_jax:kv_cache_pages", (("model_name", MODEL), ("state", s)))]
             for s in ("free", "cached", "used")}
    assert sum(pages.values()) == after[("paged_jax:kv_cache_pages_total", label)] == 32
    assert after[("paged_jax:num_requests_running", label)] == 0


def _soak_client(url, prompt, max_tokens, quit_after, results, i):
    """One client thread: streams a completion; with ``quit_after`` chunks seen it drops the connection
    (streamed) or, with ``quit_after == 0``, times out a plain request."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": quit_after != 0, "return_token_ids": True}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as c:
        if quit_after == 0:
            with pytest.raises(httpx.ReadTimeout):
                c.post("/v1/completions", json=body, timeout=httpx.Timeout(120, read=1.0))
            results[i] = "gone"
            return
        ids, seen = [], 0
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ids += json.loads(line[6:])["choices"][0]["token_ids"]
                seen += 1
                if quit_after is not None and seen >= quit_after:
                    results[i] = "gone"
                    return
        results[i] = ids


@pytest.mark.parametrize("num_clients", [6, pytest.param(12, marks=pytest.mark.slow)])
def test_soak_with_disconnects_frees_every_page(llm, server, loop, http, oracle, num_clients):
    tok = llm.tokenizer
    prompts = [tok.encode(f"Request {i}: count the letters in the word number {i}.") for i in range(num_clients)]
    gone = random.Random(num_clients).sample(range(num_clients), num_clients // 3)
    # Clients that go away: after 2 or 3 streamed chunks, or (the first) a plain request timed out. Their
    # outputs are long enough (200 tokens, hundreds of steps) to be running still when they leave.
    quits = {i: 0 if k == 0 else 2 + k % 2 for k, i in enumerate(gone)}
    lengths = [200 if i in quits else 3 + i % 4 for i in range(num_clients)]
    before = scrape(http)
    results = [None] * num_clients
    threads = [threading.Thread(target=_soak_client, args=(server.url, prompts[i], lengths[i], quits.get(i),
                                                           results, i)) for i in range(num_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    pages = idle(loop)
    assert pages["used"] == 0 and pages["free"] + pages["cached"] == pages["total"] == 32
    assert loop.call(lambda e: (e.reset_prefix_cache(), e.num_free_pages)).result(30)[1] == 32
    survivors = [i for i in range(num_clients) if i not in quits]
    want = oracle([prompts[i] for i in survivors], [lengths[i] for i in survivors])  # undisturbed
    assert [results[i] for i in survivors] == [w.output_ids for w in want]
    assert all(results[i] == "gone" for i in quits)
    after = scrape(http)
    aborted = ("paged_jax:request_success_total", (("finished_reason", "abort"), ("model_name", MODEL)))
    # A streamed client saw chunks, so its request ran and was aborted; the timed-out plain request may
    # have been withdrawn before the engine loop added it (a busy machine), which is not an engine abort.
    streamed = sum(1 for q in quits.values() if q)
    assert streamed <= after[aborted] - before.get(aborted, 0) <= len(quits)
    assert httpx.get(server.url + "/health").status_code == 200


# ------------------------------------------------- the benchmark's HTTP client


def test_http_backend_records_every_token(llm, server, oracle):
    tok = llm.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS + ["Once upon a time"]]
    reqs = [Request(request_id=i, prompt_ids=ids, max_new_tokens=3 + i, ignore_eos=True)
            for i, ids in enumerate(prompts)]
    target = http_backend.Target(base_url=server.url, model=MODEL, api_key=KEY)
    run, before, after = http_backend.run_http(target, reqs, [0.0, 0.0, 0.05])
    want = oracle(prompts, [3, 4, 5], ignore_eos=True)
    assert [o.output_ids for o in run.outputs] == [w.output_ids for w in want]
    for r, rec in zip(reqs, run.records):
        assert rec.output_len == rec.generated == len(rec.token_times) == r.max_new_tokens
        assert rec.prompt_len == len(r.prompt_ids)
        assert rec.arrival_s <= rec.added_s <= rec.first_token_s == rec.token_times[0] <= rec.finish_s
        assert list(rec.token_times) == sorted(rec.token_times)
    assert run.records[2].arrival_s == pytest.approx(0.05)
    assert after.mean_ttft_since(before) > 0 and after.ttft_count - before.ttft_count == 3
    m = run.metrics()
    assert m.completed == 3 and m.output_tokens == 12
    with pytest.raises(ValueError, match="beam search"):
        http_backend.payload(Request(request_id=0, prompt_ids=[1], max_new_tokens=1,
                                     sampling=SamplingParams(beam_width=2)), MODEL)


@pytest.mark.parametrize("flags, message", [
    (["--policy", "max"], "one policy"), (["--workload", "beam-2"], "beam search"),
    (["--no-prefix-caching"], "the server's setting"),
])
def test_bench_serving_refuses_what_a_server_cannot_do(flags, message, capsys):
    with pytest.raises(SystemExit):
        bench_serving.parse_args(["--backend", "http", *flags])
    assert message in capsys.readouterr().err


# ------------------------------------------- last: it fails the module's engine


def test_a_failed_engine_answers_503_and_health_says_so(server, loop, client):
    def boom():
        raise FloatingPointError("injected: the model's logits are not finite")

    loop.call(lambda e: setattr(e, "step", boom)).result(30)
    with pytest.raises(openai.InternalServerError, match="engine failed"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    r = httpx.get(server.url + "/health")
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    with pytest.raises(openai.InternalServerError, match="restart the server"):  # and every later request
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
    assert client.models.list().data[0].id == MODEL  # what needs no engine still answers


# ---------------------------------- echo: a prompt scored (a fresh engine: the one above was failed on purpose)

ECHO = dict(echo=True, logprobs=2, temperature=1.0, seed=3)  # sampled, as test_logprobs_equal_the_engine: its programs


@pytest.fixture(scope="module")
def echo_client(llm):
    """A client of a second server, on a fresh engine over the module's model object (so the compiled
    programs are shared): the test above failed the first server's engine on purpose."""
    fresh = copy.copy(llm)
    fresh.engine = Engine(llm.engine.model, llm.config.make_kv_pool(llm.engine.kv.num_pages, llm.engine.page_size,
                                                                    llm.engine.kv.k.dtype),
                          llm.engine.config, stop_ids=llm.tokenizer.stop_ids, tokenizer=llm.tokenizer)
    with ThreadedServer(build_app(fresh, model_name=MODEL, api_key=KEY)) as srv:
        yield openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def echo_oracle(llm, oracle, prompt, max_tokens):
    """The in-process engine's output for ``prompt`` with ECHO's log-probs, and the token names."""
    ids = llm.tokenizer.encode(prompt)
    [want] = oracle([ids], max_tokens, sampling=SamplingParams(logprobs=2, prompt_logprobs=2, temperature=1.0,
                                                               seed=3))
    return ids, want, lambda t: llm.tokenizer.decode([t], skip_special_tokens=False)


def test_echo_puts_the_prompt_and_its_logprobs_first(llm, echo_client, oracle):
    prompt = PROMPTS[0]
    ids, want, name = echo_oracle(llm, oracle, prompt, NEW)
    n = len(ids)
    r = echo_client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, **ECHO)
    [c] = r.choices
    assert c.text == prompt + want.text
    lp = c.logprobs
    names = [name(t) for t in ids + want.output_ids]
    assert lp.tokens == names
    assert lp.text_offset == [sum(len(x) for x in names[:i]) for i in range(len(names))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before the first token
    assert lp.token_logprobs[1:n] == pytest.approx([want.prompt_logprobs[p][ids[p]] for p in range(1, n)], abs=1e-4)
    assert lp.token_logprobs[n:] == pytest.approx([d[t] for t, d in zip(want.output_ids, want.outputs[0].logprobs)],
                                                  abs=1e-4)
    for p in range(1, n):
        assert lp.top_logprobs[p] == pytest.approx({name(t): v for t, v in want.prompt_logprobs[p].items()}, abs=1e-4)
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == NEW
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # a scored prompt is computed whole

    chunks = list(echo_client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, stream=True, **ECHO))
    assert chunks[0].choices[0].text.startswith(prompt) and chunks[0].choices[0].logprobs.tokens[:n] == names[:n]
    assert "".join(ch.choices[0].text for ch in chunks) == c.text
    streamed = [x for ch in chunks for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-6)


def test_echo_with_max_tokens_0_scores_the_prompt_alone(llm, echo_client, oracle):
    prompt = "Once upon a time, in a small village by the sea, there"
    ids, want, name = echo_oracle(llm, oracle, prompt, 1)
    n = len(ids)
    for stream in (False, True):
        r = echo_client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, stream=stream,
                                           stream_options={"include_usage": True} if stream else None, **ECHO)
        chunks = list(r) if stream else [r]
        choices = [c for ch in chunks for c in ch.choices]
        assert "".join(c.text for c in choices) == prompt  # the prompt, nothing after it
        assert choices[-1].finish_reason == "length"
        lp = [x for c in choices for x in c.logprobs.token_logprobs]
        assert [t for c in choices for t in c.logprobs.tokens] == [name(t) for t in ids]
        assert lp[0] is None
        assert lp[1:] == pytest.approx([want.prompt_logprobs[p][ids[p]] for p in range(1, n)], abs=1e-4)
        assert chunks[-1].usage.prompt_tokens == n and chunks[-1].usage.completion_tokens == 0


def test_echo_text_offsets_index_the_returned_text_with_split_characters(echo_client):
    """Emoji and accents split over byte-level tokens: each offset is where its token's text starts in the
    returned text (a token holding only part of a character points at where that character starts)."""
    prompt = "I \u2764\ufe0f \U0001f355 caf\u00e9"
    r = echo_client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, **ECHO)
    [c] = r.choices
    lp = c.logprobs
    assert c.text.startswith(prompt)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(c.text)
    whole = [(t, at) for t, at in zip(lp.tokens, lp.text_offset) if "\ufffd" not in t]
    assert len(whole) >= 5
    for t, at in whole:
        assert c.text[at: at + len(t)] == t, (t, at, c.text)


def test_echo_of_ids_that_end_inside_a_character_has_no_replacement_character(llm, echo_client):
    """The prompt's last bytes begin a character the output completes: the echo leaves it to the output,
    which starts with it whole ('Fire 🔥' + '🔥...', was 'Fire 🔥�' + '🔥...'); with max_tokens 0 nothing
    completes it and its bytes are dropped."""
    ids = llm.tokenizer.encode("Fire \U0001f525\U0001f525")[:-2]
    whole = llm.tokenizer.decode(ids)
    assert whole.endswith("\ufffd")  # the ids do end inside a character
    for max_tokens in (3, 0):
        r = echo_client.completions.create(model=MODEL, prompt=ids, max_tokens=max_tokens, **ECHO)
        text = r.choices[0].text
        assert text.startswith("Fire \U0001f525") and "\ufffd" not in text, (max_tokens, text)


# ------------------------------- error messages (on the fresh server: a good request must follow them)


def test_shown_clips_long_values_and_says_how_long():
    assert shown("ab") == "'ab'" and shown([1, 2]) == "[1, 2]"
    assert shown("x" * 5000) == repr("x" * 5000)[:SHOWN_CHARS] + "... (5000 chars)"
    assert shown(list(range(3000))).endswith("... (3000 items)") and shown({str(i): i for i in range(99)}).endswith(
        "... (99 items)")
    assert shown(10**300).endswith("... (301 chars)")
    assert APIError(400, "m" * 5000).message == "m" * MAX_MESSAGE_CHARS + "... (5000 chars)"


@pytest.mark.parametrize("path, body, status, param, words", [
    ("/v1/completions", {"model": "y" * 5000, "prompt": "hi"}, 404, "model", "... (5000 chars)` does not exist"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x" * 250, ""]}, 400, "stop", "stop[1] is empty"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, 400, "stop", "stop is empty"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "t" * 5000}, 400, "max_tokens", "... (5000 chars)"),
    ("/v1/completions", {"prompt": "hi", "n": 10**300}, 400, "n", "n: an integer of 301 digits is too large"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**19}, 400, "max_tokens", "10000000000000000000 for the"),
    ("/v1/completions", {"prompt": "hi", "seed": 10**300}, 400, "seed", "seed: an integer of 301 digits"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -(10**300)}, 400, "max_tokens", "an integer of 301 digits"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x" * 5000: 1}}, 400, "logit_bias",
     "logit_bias is not supported"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 999999]]}, 400, "prompt",
     "prompt[1][1]=999999 is not a token id: the vocabulary has 49152 ids"),
    ("/v1/completions", {"prompt": [5, -1]}, 400, "prompt", "prompt[1]=-1 is not a token id"),
    ("/v1/completions", {"prompt": [[7], [7] * 3 + [10**200]]}, 400, "prompt", "prompt[1][3]: an integer of 201 digits"),
    ("/v1/completions", {"prompt": [[7], [7] * 3 + [10**19]]}, 400, "prompt", "prompt[1][3]=10000000000000000000"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "Stream options can only be defined when `stream=True`."),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": False}}, 400, "stream_options",
     "Stream options can only be defined when `stream=True`."),
    ("/v1/completions", {"prompt": "hi", "n": 2, "best_of": 10**300}, 400, "best_of", "best_of: an integer of 301 digits"),
    # bounds (server.limits): each field a body can grow, refused by name
    ("/v1/completions", {"prompt": [[1]] * 257}, 400, "prompt", "prompt has 257 prompts in a batch; at most 256"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 33}, 400, "stop", "stop has 33 stop strings; at most 32"),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", "x" * 5000]}, 400, "stop",
     "stop[1] is 5000 characters; a stop string may have at most 256"),
    ("/v1/completions", {"prompt": "hi", "stop": "x" * 257}, 400, "stop", "stop is 257 characters"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias",
     "logit_bias has 301 entries; at most 300"),
    ("/v1/chat/completions", {"messages": CHAT * 257}, 400, "messages", "messages has 257 messages; at most 256"),
    ("/v1/completions", {"prompt": "hi", "cache_salt": "s" * 1_000_000}, 400, "cache_salt",
     "cache_salt is 1000000 characters; it may have at most 256"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": ' + HUGE_INT + b"}", 400, "max_tokens",
     "max_tokens: an integer of 5001 digits is too large; integers may have at most 20"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": int("9" * 4300)}, 400, "max_tokens",
     "max_tokens: an integer of 4300 digits"),  # was a 500: len(prompt) + max_tokens could not be printed
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": int("9" * 21)}, 400,
     "max_completion_tokens", "an integer of 21 digits"),
    ("/v1/completions", b'{"prompt": "hi", "metadata": {"x": [0, -' + HUGE_INT + b"]}}", 400, "metadata",
     "metadata.x[1]: an integer of 5001 digits"),  # a field the server ignores
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi", "n": ' + HUGE_INT + b"}]}", 400,
     "messages", "messages[0].n: an integer"),
])
def test_error_messages_are_bounded_and_name_the_value(echo_client, path, body, status, param, words):
    with httpx.Client(base_url=str(echo_client.base_url).removesuffix("/v1/"), timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as http:
        r = _raw(http, path, body)
        error = r.json()["error"]
        assert r.status_code == status and error["param"] == param, r.text[:500]
        assert words in error["message"] and len(error["message"]) < 2 * SHOWN_CHARS + 200, error["message"][:500]
        assert "ChatMessage(" not in error["message"]  # the client's fields, not the server's classes
        good = _raw(http, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "temperature": 0})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 1


# ------------------------------------------------------- python -m server --profile DIR


def test_server_profile_traces_steps_after_the_first_request(llm, tmp_path):
    """``--profile``'s spec installed on a fresh engine over the module's model object (as ``python -m server``
    installs it before the loop starts): steps count from the first request, and the trace has them."""
    fresh = copy.copy(llm)
    fresh.engine = Engine(llm.engine.model, llm.config.make_kv_pool(llm.engine.kv.num_pages, llm.engine.page_size,
                                                                    llm.engine.kv.k.dtype),
                          llm.engine.config, stop_ids=llm.tokenizer.stop_ids, tokenizer=llm.tokenizer)
    profiler = ProfileSpec(out_dir=tmp_path / "trace", skip=1, steps=2).install(fresh.engine)
    with ThreadedServer(build_app(fresh, model_name=MODEL)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0,
                                                         "ignore_eos": True}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    profiler.close()
    assert profiler.traced == 2
    steps = sorted(int(e["args"]["step_num"]) for e in trace_slices(tmp_path / "trace") if e["name"] == "engine_step")
    assert steps == [1, 2]


@pytest.mark.parametrize("argv, words", [
    (["--profile-skip", "-1"], "--profile-skip must be >= 0, got -1"),
    (["--profile-steps", "0"], "--profile-steps must be >= 1, got 0"),
    (["--profile", "/proc/no-such-folder"], "--profile '/proc/no-such-folder' is not a folder that can be created"),
    (["--host-cache-gib", "-1"], "--host-cache-gib must be a number in [0, 1073741824], got -1.0"),
    (["--host-cache-gib", "nan"], "--host-cache-gib must be a number in [0, 1073741824], got nan"),
    (["--host-cache-gib", "1e300"], "--host-cache-gib must be a number in [0, 1073741824], got 1e+300"),
    (["--host-cache-gib", "1e-12"], "--host-cache-gib 1e-12 is less than one byte"),
    (["--host-cache-gib", "1", "--no-prefix-caching"], "--host-cache-gib, --disk-cache-dir and --kv-role keep"),
    (["--kv-role", "producer", "--no-prefix-caching"], "they need prefix caching"),
    (["--kv-role", "consumer"], "--kv-role consumer: kv_transfer.address='127.0.0.1:0': a consumer needs"),
    (["--kv-role", "producer", "--kv-address", "0.0.0.0:8470"], "is not a loopback address and kv_transfer.authkey"),
    (["--kv-role", "producer", "--kv-timeout-s", "0"], "kv_transfer.timeout_s=0.0: expected seconds in"),
    (["--kv-role", "producer", "--kv-buffer-gib", "0"], "kv_transfer.buffer_bytes=0"),
    (["--kv-role", "producer", "--kv-address", "nohost"], "kv_transfer.address='nohost': expected 'host:port'"),
    (["--disk-cache-dir", "/tmp/x"], "--disk-cache-dir and --disk-cache-gib go together"),
    (["--disk-cache-gib", "1"], "--disk-cache-dir and --disk-cache-gib go together"),
])
def test_server_refuses_bad_profile_and_tier_flags(argv, words, capsys):
    with pytest.raises(SystemExit):
        server_main.parse_args(argv)
    assert words in capsys.readouterr().err
