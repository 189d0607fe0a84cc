"""The KV connector (paged_jax.tiers.connector): one engine prefills and keeps
its pages for others, another loads them and decodes (prefill/decode
disaggregation), in one process and in two, through host memory and
through jax.experimental.transfer; outputs equal one engine's. Another
model's pages are refused by fingerprint, salts stay apart, a producer that
is gone costs hits and never requests, and bad settings are refused by name.
"""

import multiprocessing.connection
import os
import pathlib
import subprocess
import sys
import textwrap
import warnings
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import LlamaConfig
from models.llm import LLM
from models.presets import PRESETS
from paged_jax.engine.core import Engine, EngineConfig, Request
from paged_jax.engine.sampling import SamplingParams
from paged_jax.paging.kv_cache import KVPool
from paged_jax.simulator.engine import SimulatedEngine
from paged_jax.tiers.connector import PROTOCOL, KVConsumer, KVProducer, KVTransferConfig
from paged_jax.tiers.disk import pack_frame, unpack_frame
from paged_jax.tiers.offload import add_tier_flags, tier_options_from_args
from tests.engine_helpers import PAGE, VOCAB, check_accounting, make_engine, make_toy_step, toy_params, toy_pool

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE_BYTES = 2 * toy_pool(2).k[:, :, :1].nbytes  # K and V of one toy page (f32)


def _prompts(seed, n, length=40):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB, size=length).tolist() for _ in range(n)]


def _requests(prompts, max_new=12, salt=None):
    return [Request(request_id=i, prompt_ids=p, max_new_tokens=max_new, cache_salt=salt) for i, p in enumerate(prompts)]


def _ids(outs):
    return {o.request_id: o.outputs[0].output_ids for o in outs}


def _producer(transport="host", **config):
    engine = make_engine(kv_transfer=KVTransferConfig("producer", transport=transport), **config)
    return engine, engine.kv_manager.offload.remote


def _consumer(address, transport="host", **config):
    return make_engine(kv_transfer=KVTransferConfig("consumer", address=address, transport=transport, timeout_s=10),
                       **config)


@pytest.mark.parametrize("transport", ["host", "jax_transfer"])
def test_prefilled_by_one_engine_decoded_by_another(transport):
    """The producer serves each request one token (its prompt's pages
    cached and kept); the consumer then serves them in full, loading every
    prompt page but the last from the producer: the outputs are one
    engine's, and every page and byte is counted at both ends."""
    prompts = _prompts(0, 4)
    ref = _ids(make_engine().run(_requests(prompts)))
    producer, store = _producer(transport)
    producer.run(_requests(prompts, max_new=1))
    assert producer.stats.remote.spilled_pages == 4 * 10 and store.used_bytes == 40 * PAGE_BYTES
    consumer = _consumer(store.address, transport)
    outs = consumer.run(_requests(prompts))
    assert consumer.kv_manager.offload.remote.transport == transport
    assert _ids(outs) == ref
    assert [o.num_remote_cached_tokens for o in outs] == [36] * 4  # (40 - 1) // 4 pages: the last token computed
    assert [o.num_cached_tokens for o in outs] == [36] * 4
    st = consumer.stats.remote
    assert st.hit_tokens == 4 * 36 and st.loaded_pages == 4 * 9 and st.loaded_bytes == 36 * PAGE_BYTES
    assert st.refused_lookups == 0 and consumer.stats.prefix_hit_tokens == 4 * 36
    assert store.served_pages == 36 and store.served_bytes == 36 * PAGE_BYTES
    stats = consumer.stats  # the prefill the connector saved, estimated at the engine's own rate
    per_token = sum(c.seconds for c in stats.calls if c.tokens > c.decode_tokens) / sum(
        c.tokens for c in stats.calls if c.tokens > c.decode_tokens)
    assert stats.tier_saved_s("remote") == pytest.approx(4 * 36 * per_token) and per_token > 0
    assert stats.tier_saved_s("host") == 0
    with pytest.raises(ValueError, match="tier must be 'host', 'disk' or 'remote', got 'device'"):
        stats.tier_saved_s("device")
    assert check_accounting(consumer)["used"] == 0
    (again,) = consumer.run([Request(request_id="again", prompt_ids=prompts[0], max_new_tokens=12)])
    assert again.num_cached_tokens == 36 and again.num_remote_cached_tokens == 0  # in the consumer's own pool now
    assert again.outputs[0].output_ids == ref[0]


def test_a_request_waiting_to_be_admitted_fetches_its_pages_once():
    """The consumer's pool holds one request at a time: the second waits at
    the queue's head, costed every round, but its pages cross once."""
    prompts = _prompts(8, 2)
    ref = _ids(make_engine().run(_requests(prompts)))
    producer, store = _producer()
    producer.run(_requests(prompts, max_new=1))
    consumer = _consumer(store.address, num_pages=15, max_seq_len=56)
    outs = consumer.run(_requests(prompts))
    assert _ids(outs) == ref and [o.num_remote_cached_tokens for o in outs] == [36, 36]
    assert consumer.stats.iterations > 12  # the second request waited for the first to finish
    assert consumer.kv_manager.offload.remote.lookups == 2 and store.served_pages == 18


_CHILD = textwrap.dedent("""
    import json, sys
    from paged_jax.engine.core import Request
    from paged_jax.tiers.connector import KVTransferConfig
    from tests.engine_helpers import make_engine
    prompts = json.loads(sys.argv[1])
    engine = make_engine(kv_transfer=KVTransferConfig("producer", transport=sys.argv[2]))
    engine.run([Request(request_id=i, prompt_ids=p, max_new_tokens=1) for i, p in enumerate(prompts)])
    print(engine.kv_manager.offload.remote.address, flush=True)
    sys.stdin.read()
""")


@pytest.mark.parametrize("transport", ["host", "jax_transfer"])
def test_a_request_prefilled_in_another_process_equals_one_engines(transport):
    """Issue 38's test: the producer is another process; the requests it
    prefilled are decoded here and equal the requests served by one engine."""
    prompts = _prompts(1, 3, length=30)
    ref = _ids(make_engine().run(_requests(prompts)))
    import json

    child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(prompts), transport], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        address = child.stdout.readline().strip()
        assert address, child.stderr.read()
        consumer = _consumer(address, transport)
        outs = consumer.run(_requests(prompts))
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert _ids(outs) == ref
    assert [o.num_remote_cached_tokens for o in outs] == [28] * 3
    assert consumer.stats.remote.loaded_bytes == 3 * 7 * PAGE_BYTES


def test_another_models_pages_are_refused_by_fingerprint():
    """A producer of other weights holds pages for the same tokens: the
    consumer's lookups are refused with the reason, warned once, and it
    computes every prompt itself (its own model's outputs)."""
    prompts = _prompts(2, 3)
    other = Engine(make_toy_step(toy_params(1)), toy_pool(200),
                   EngineConfig(max_seqs=8, max_seq_len=80, max_num_batched_tokens=64,
                                kv_transfer=KVTransferConfig("producer")))
    other.run(_requests(prompts, max_new=1))
    ref = _ids(make_engine().run(_requests(prompts)))
    consumer = _consumer(other.kv_manager.offload.remote.address)
    with pytest.warns(UserWarning, match="fingerprint"):
        outs = consumer.run(_requests(prompts))
    assert _ids(outs) == ref and all(o.num_remote_cached_tokens == 0 for o in outs)
    assert consumer.kv_manager.offload.remote.refused == {"fingerprint": 3}
    assert consumer.stats.remote.refused_lookups == 3 and consumer.stats.remote.loaded_pages == 0


def test_a_salt_never_hits_another_salts_pages_through_the_connector():
    prompt = _prompts(3, 1)[0]
    producer, store = _producer()
    producer.run(_requests([prompt], max_new=1, salt="alice"))
    consumer = _consumer(store.address)
    (bob,) = consumer.run(_requests([prompt], salt="bob"))
    (none,) = consumer.run([Request(request_id="none", prompt_ids=prompt, max_new_tokens=3)])
    assert bob.num_cached_tokens == 0 and none.num_cached_tokens == 0
    (alice,) = consumer.run([Request(request_id="alice", prompt_ids=prompt, max_new_tokens=3, cache_salt="alice")])
    assert alice.num_remote_cached_tokens == 36


def test_a_producer_gone_costs_hits_never_requests():
    """The producer closes after prefilling: the consumer's lookups fail,
    are counted and warned, and every request is computed here, correct."""
    prompts = _prompts(4, 3)
    ref = _ids(make_engine().run(_requests(prompts)))
    producer, store = _producer()
    producer.run(_requests(prompts, max_new=1))
    consumer = _consumer(store.address)
    store.close()
    with pytest.warns(UserWarning, match="unreachable"):
        outs = consumer.run(_requests(prompts))
    assert _ids(outs) == ref and all(o.num_cached_tokens == 0 for o in outs)
    assert consumer.kv_manager.offload.remote.refused["unreachable"] == 3


def test_a_small_producer_store_evicts_least_recently_used_and_outputs_stay():
    prompts = _prompts(5, 3)
    ref = _ids(make_engine().run(_requests(prompts)))
    producer = make_engine(kv_transfer=KVTransferConfig("producer", buffer_bytes=12 * PAGE_BYTES))
    store = producer.kv_manager.offload.remote
    producer.run(_requests(prompts, max_new=1))
    assert store.used_bytes == 12 * PAGE_BYTES and producer.stats.remote.evicted_pages == 30 - 12
    outs = _consumer(store.address).run(_requests(prompts))
    assert _ids(outs) == ref
    assert sum(o.num_remote_cached_tokens for o in outs) < 3 * 36


@pytest.fixture()
def tiny(monkeypatch):
    monkeypatch.setitem(PRESETS, "tiny", LlamaConfig(vocab_size=64, model_dim=32, mlp_dim=64, num_layers=2,
                                                     num_q_heads=4, num_kv_heads=2, head_dim=8, max_seq_len=64))


def test_quantized_pages_and_their_scales_cross_between_engines(tiny):
    """int8 pages of the Llama decoder, with their per-token scales, through
    ``LLM``: the decoded outputs equal one engine's."""
    prompts = [[t % 64 for t in p] for p in _prompts(6, 2, length=34)]

    def llm(kv_transfer=None):
        return LLM("tiny", dtype=jnp.float32, kv_dtype="int8", kv_tokens=128, page_size=4, max_seqs=2,
                   kv_transfer=kv_transfer)

    ref = [o.output_ids for o in llm().generate(prompts, max_tokens=8)]
    producer = llm(KVTransferConfig("producer"))
    producer.generate(prompts, max_tokens=1)
    consumer = llm(KVTransferConfig("consumer", address=producer.engine.kv_manager.offload.remote.address))
    outs = consumer.generate(prompts, max_tokens=8)
    assert [o.output_ids for o in outs] == ref
    assert consumer.engine.stats.remote.hit_tokens == 2 * 32


def test_bad_pages_found_after_the_first_call_cost_their_hit_and_never_reach_the_disk_tier(tmp_path):
    """Bad pages whose first call shows nothing: a prompt tail chunked so that
    call samples no token (its K/V finite), or pages finite for the first
    query and not for a later one (a key that only a decode query weights).
    Found at the later call, they cost their hit all the same, the tokens in
    flight are dropped, and nothing computed on them is kept: a fresh engine
    on the consumer's disk folder serves the same outputs."""
    prompts = _prompts(13, 3)
    small = dict(budget=8, max_seqs=8)
    want = _ids(make_engine(**small).run(_requests(prompts)))
    listener = _fake_producer(_keys_with(lambda n: jax.tree.map(lambda x: np.full(x.shape, 3e38, np.float32),
                                                                   toy_pool(n))))
    consumer = _consumer(f"127.0.0.1:{listener.address[1]}", disk_cache_dir=str(tmp_path),
                         disk_cache_bytes=1 << 24, **small)
    with pytest.warns(UserWarning, match="bad pages"):
        assert _ids(consumer.run(_requests(prompts))) == want
    consumer.close()
    fresh = make_engine(disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 24, **small)
    outs = fresh.run(_requests(prompts))
    assert _ids(outs) == want and all(o.num_disk_cached_tokens == 36 for o in outs)
    listener.close()

    def later(n):  # token 0 of page 0: a key only some queries weight, a value that overflows once they do
        pool = toy_pool(n)
        k, v = np.zeros(pool.k.shape, np.float32), np.zeros(pool.v.shape, np.float32)
        k[:, :, 0, 0, 0], v[:, :, 0, 0, :] = 1e4, 3e38
        return KVPool(k=k, v=v)

    listener = _fake_producer(_keys_with(later))
    prompt = _prompts(13, 1)
    consumer = _consumer(f"127.0.0.1:{listener.address[1]}")
    with pytest.warns(UserWarning, match="bad pages"):
        assert _ids(consumer.run(_requests(prompt, max_new=20))) == _ids(make_engine().run(_requests(prompt,
                                                                                                      max_new=20)))
    assert consumer.kv_manager.offload.remote.refused == {"bad pages": 1}
    listener.close()


def test_pages_the_decoder_cannot_compute_on_cost_their_hit(tiny):
    """The same through ``LLM`` and the Llama decoder (its forward's own
    finiteness flags the bad pages), with swap preemption configured (the
    recompute never swaps the bad pages out) and beam search."""
    layout = {}
    listener = _fake_producer(_keys_with(lambda n: KVPool(**{
        f: np.full(shape[:2] + (n,) + shape[3:], 3e38, dtype) for f, (dtype, shape) in layout.items()})))
    prompts = [[t % 64 for t in p] for p in _prompts(14, 2, length=34)]

    def llm(kv_transfer=None):
        return LLM("tiny", dtype=jnp.float32, kv_tokens=256, page_size=4, max_seqs=4, preemption_mode="swap",
                   kv_transfer=kv_transfer)

    consumer = llm(KVTransferConfig("consumer", address=f"127.0.0.1:{listener.address[1]}"))
    layout.update(consumer.engine.kv_manager.offload.remote.layout)
    with pytest.warns(UserWarning, match="bad pages"):
        greedy = consumer.generate(prompts[:1], max_tokens=8)
        beams = consumer.generate(prompts[1:], SamplingParams(beam_width=2), max_tokens=6)
    ref = llm()
    assert [o.output_ids for o in greedy] == [o.output_ids for o in ref.generate(prompts[:1], max_tokens=8)]
    want = ref.generate(prompts[1:], SamplingParams(beam_width=2), max_tokens=6)
    assert [[c.output_ids for c in o.outputs] for o in beams] == [[c.output_ids for c in o.outputs] for o in want]
    assert consumer.engine.kv_manager.offload.remote.refused == {"bad pages": 2}
    listener.close()


class Exploit:
    """A pickle that would run code when unpickled."""

    ran = False

    def __reduce__(self):
        return (setattr, (Exploit, "ran", True))


def test_a_bad_request_to_the_producer_is_answered_and_it_goes_on():
    prompts = _prompts(7, 1)
    producer, store = _producer()
    producer.run(_requests(prompts, max_new=1))
    host, port = store.address.split(":")
    with multiprocessing.connection.Client((host, int(port)), authkey=b"paged-jax-kv") as conn:
        def ask(header):
            conn.send_bytes(pack_frame(header))
            return unpack_frame(conn.recv_bytes())[0]

        assert ask({"protocol": PROTOCOL, "op": "lookup"})["refused"] == "bad request"  # no fingerprint, no keys
        assert ask({"protocol": 99, "op": "hello"})["refused"] == "protocol"
        conn.send(Exploit())  # a pickle is never unpickled: no code runs, the request is refused
        assert unpack_frame(conn.recv_bytes())[0]["refused"] == "bad request" and not Exploit.ran
    (out,) = _consumer(store.address).run(_requests(prompts))
    assert out.num_remote_cached_tokens == 36


def _fake_producer(answer, *, raw=False, transfer_address=None):
    """A peer that shakes hands and says hello as a producer (naming
    ``transfer_address``), then answers every lookup with
    ``answer(request header)``: a message's bytes, or with ``raw`` bytes
    written as they are (no length before them)."""
    import threading

    listener = multiprocessing.connection.Listener(("127.0.0.1", 0), authkey=b"paged-jax-kv")

    def serve():
        with listener.accept() as conn:
            conn.recv_bytes()
            conn.send_bytes(pack_frame({"transport": "host", "transfer_address": transfer_address}))  # hello
            while True:
                try:
                    head, _ = unpack_frame(conn.recv_bytes())
                except (EOFError, OSError):
                    return
                if raw:
                    os.write(conn.fileno(), answer(head))
                else:
                    conn.send_bytes(answer(head))

    threading.Thread(target=serve, daemon=True).start()
    return listener


def _keys_with(kv_of):
    """An answer with the asked-for keys and the K/V ``kv_of(n pages)``."""
    def answer(head):
        keys = head["keys"][head["start"]:head["max_pages"]]
        return pack_frame({"keys": keys}, kv_of(len(keys)))
    return answer


@pytest.mark.parametrize("answer", [
    lambda head: pack_frame({"keys": "not a list of keys"}),
    lambda head: b"not a frame",
    lambda head: pack_frame({"keys": head["keys"][head["start"]:head["max_pages"]]}),  # keys without K/V
    _keys_with(lambda n: KVPool(k=np.zeros((1, 1, n, PAGE, 3), np.float32), v=np.zeros((1, 1, n, PAGE, 3),
                                                                                      np.float32))),
    _keys_with(lambda n: jax.tree.map(lambda x: np.full(x.shape, np.nan, np.float32), toy_pool(n))),
], ids=["no keys", "not a frame", "no K/V", "another layout", "NaN"])
def test_a_producer_that_answers_badly_costs_hits_never_requests(answer):
    """A peer that shakes hands but answers lookups with garbage, pages of
    another layout or NaN pages: counted as a bad answer, never loaded, and
    the request computed here, right."""
    listener = _fake_producer(answer)
    prompt = _prompts(9, 1)[0]
    consumer = _consumer(f"127.0.0.1:{listener.address[1]}")
    with pytest.warns(UserWarning, match="bad answer"):
        (out,) = consumer.run(_requests([prompt]))
    assert out.outputs[0].output_ids == _ids(make_engine().run(_requests([prompt])))[0]
    assert out.num_cached_tokens == 0 and consumer.kv_manager.offload.remote.refused == {"bad answer": 1}
    listener.close()


def test_a_silent_peer_neither_hangs_a_consumer_nor_blocks_a_producer():
    """Something that accepts a connection and says nothing: a consumer
    gives up within timeout_s and names the address; clients that connect
    to a producer and say nothing (a hundred) delay no other consumer."""
    import socket
    import time

    silent = socket.create_server(("127.0.0.1", 0))
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="no KV producer answers there .TimeoutError"):
        KVConsumer(KVTransferConfig("consumer", address=f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.5),
                   "fp", {}, PAGE)
    assert time.monotonic() - t0 < 5
    silent.close()
    prompt = _prompts(10, 1)[0]
    producer, store = _producer()
    producer.run(_requests([prompt], max_new=1))
    host, port = store.address.split(":")
    strays = [socket.create_connection((host, int(port))) for _ in range(100)]  # connect, never speak
    (out,) = _consumer(store.address).run(_requests([prompt]))
    assert out.num_remote_cached_tokens == 36
    assert len(store._handshaking) <= 64  # the oldest silent ones dropped: a flood turns over, never piles up
    for stray in strays:
        stray.close()


@pytest.mark.parametrize("n", [1, 2])
def test_pages_the_model_cannot_compute_on_cost_their_hit_never_a_request(n):
    """A producer in error sends finite K/V no model gives (3e38): they pass
    the lookup's checks and are loaded, the first call on them goes
    non-finite, and instead of failing the engine the pages leave the
    cache, the request (each of its samples) is recomputed here and ends
    right; the connector is not asked for those keys again."""
    listener = _fake_producer(_keys_with(lambda n: jax.tree.map(lambda x: np.full(x.shape, 3e38, np.float32),
                                                                   toy_pool(n))))
    prompts = _prompts(13, 1) * 2  # the second hits the first's loaded pages on device
    consumer = _consumer(f"127.0.0.1:{listener.address[1]}")

    def reqs():
        return [Request(request_id=i, prompt_ids=p, max_new_tokens=8,
                        sampling=SamplingParams(n=n, temperature=1.0 if n > 1 else 0.0, seed=i))
                for i, p in enumerate(prompts)]

    with pytest.warns(UserWarning, match="bad pages"):
        outs = consumer.run(reqs())
    want = make_engine().run(reqs())
    assert ({o.request_id: [c.output_ids for c in o.outputs] for o in outs}
            == {o.request_id: [c.output_ids for c in o.outputs] for o in want})
    remote = consumer.kv_manager.offload.remote
    assert remote.refused == {"bad pages": 1} and remote.lookups == 1  # recomputing, the lookup stops before them
    assert all(o.num_cached_tokens == o.num_remote_cached_tokens == 0 for o in outs)
    assert consumer.stats.remote.hit_tokens == consumer.stats.prefix_hit_tokens == 0
    assert consumer.stats.remote.loaded_pages == 9 and consumer.stats.preemptions == 2
    check_accounting(consumer)
    listener.close()


@pytest.mark.parametrize("how", ["half a reply", "a pull nobody answers"])
def test_a_peer_that_stops_half_way_costs_timeout_s_never_a_hang(how):
    """A producer that sends the start of a reply and goes silent, or names
    a transfer server where nothing answers a pull: the lookup gives up
    after timeout_s (counted as unreachable) and the request is computed
    here, right."""
    import socket
    import struct

    silent = socket.create_server(("127.0.0.1", 0))
    if how == "half a reply":
        listener = _fake_producer(lambda head: struct.pack("!i", 1000) + b"x" * 10, raw=True)
    else:  # keys without K/V: the consumer pulls them from a transfer server that is not one
        listener = _fake_producer(lambda head: pack_frame({"keys": head["keys"][head["start"]:head["max_pages"]],
                                                           "layout": head["layout"]}),
                                  transfer_address=f"127.0.0.1:{silent.getsockname()[1]}")
    consumer = make_engine(kv_transfer=KVTransferConfig("consumer", address=f"127.0.0.1:{listener.address[1]}",
                                                        transport="auto", timeout_s=0.5))
    remote = consumer.kv_manager.offload.remote
    assert remote.transport == ("host" if how == "half a reply" else "jax_transfer")
    prompt = _prompts(11, 1)[0]
    with pytest.warns(UserWarning, match="unreachable"):
        (out,) = consumer.run(_requests([prompt]))
    assert out.outputs[0].output_ids == _ids(make_engine().run(_requests([prompt])))[0]
    assert remote.refused == {"unreachable": 1} and remote.lookups == 1 and 0.5 <= remote.lookup_s < 3
    listener.close()
    silent.close()


def test_a_consumer_that_stops_half_way_is_dropped_by_the_producer():
    """A client that shakes hands, sends the start of a lookup and goes
    silent: the producer drops it after its timeout_s and serves others."""
    import struct
    import time

    prompt = _prompts(12, 1)[0]
    producer = make_engine(kv_transfer=KVTransferConfig("producer", timeout_s=0.5))
    store = producer.kv_manager.offload.remote
    producer.run(_requests([prompt], max_new=1))
    host, port = store.address.split(":")
    with multiprocessing.connection.Client((host, int(port)), authkey=b"paged-jax-kv") as conn:
        os.write(conn.fileno(), struct.pack("!i", 1000) + b"{")
        t0 = time.monotonic()
        with pytest.raises(EOFError):
            conn.recv_bytes()  # the producer closes it
        assert time.monotonic() - t0 < 5
    (out,) = _consumer(store.address).run(_requests([prompt]))
    assert out.num_remote_cached_tokens == 36


def test_an_engine_refused_after_its_producer_started_frees_the_port_and_close_frees_it_too():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    config = KVTransferConfig("producer", address=f"127.0.0.1:{port}")
    with pytest.raises(ValueError, match="a KV producer: the KV tiers serve models whose layers all attend"):
        Engine(type(make_toy_step(toy_params()))(toy_params(), window=8), toy_pool(200),
               EngineConfig(max_seqs=8, max_seq_len=80, max_num_batched_tokens=64, kv_transfer=config))
    engine = make_engine(kv_transfer=config)  # the port is free again
    engine.close()
    engine.close()  # idempotent
    make_engine(kv_transfer=config).close()


def test_a_consumer_without_a_producer_or_with_the_wrong_key_is_refused_by_name():
    producer, store = _producer()
    _, port = store.address.split(":")
    with pytest.raises(ValueError, match=f"kv_transfer.authkey: the KV producer at '127.0.0.1:{port}' holds another"):
        KVConsumer(KVTransferConfig("consumer", address=f"127.0.0.1:{port}", authkey=b"wrong", timeout_s=2),
                   "fp", {}, PAGE)
    store.close()
    with pytest.raises(ValueError, match=f"kv_transfer.address='127.0.0.1:{port}': no KV producer answers"):
        _consumer(f"127.0.0.1:{port}")


@pytest.mark.parametrize("kwargs, match", [
    (dict(role="both"), "kv_transfer.role='both'"),
    (dict(role="producer", transport="nccl"), "kv_transfer.transport='nccl'"),
    (dict(role="producer", address="localhost"), "kv_transfer.address='localhost': expected 'host:port'"),
    (dict(role="producer", address="h:70000"), r"port in \[0, 65535\]"),
    (dict(role="consumer", address="127.0.0.1:0"), "a consumer needs the producer's port"),
    (dict(role="producer", buffer_bytes=0), "kv_transfer.buffer_bytes=0"),
    (dict(role="producer", buffer_bytes=-1), "buffer_bytes"),
    (dict(role="consumer", address="h:1", timeout_s=float("nan")), "kv_transfer.timeout_s=nan"),
    (dict(role="consumer", address="h:1", timeout_s=0), "kv_transfer.timeout_s=0"),
    (dict(role="consumer", address="h:1", timeout_s=1e300), r"kv_transfer.timeout_s=1e\+300: expected seconds in"),
    (dict(role="producer", authkey="text"), "kv_transfer.authkey='text'"),
    (dict(role="producer", address="0.0.0.0:0"), "is not a loopback address and kv_transfer.authkey is the public"),
    (dict(role="producer", address="a\x00b:1"), "is not a host name"),
    (dict(role="producer", address="..:1"), "is not a host name"),
    (dict(role="producer", address="h:\u0663"), r"expected a host name and a port in \[0, 65535\]"),
    (dict(role="consumer", address="h:1", timeout_s=1e-9), "kv_transfer.timeout_s=1e-09: expected seconds in"),
    (dict(role="consumer", address="10.0.0.2:8470"), "pass a key of your own"),
])
def test_bad_transfer_configs_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVTransferConfig(**kwargs)


def test_a_connector_takes_only_a_config_of_its_role_and_a_producer_room_for_a_page():
    assert KVTransferConfig("consumer", address="127.0.0.1:1", timeout_s=np.float32(2.0)).timeout_s == 2.0  # any real number
    layout = {"k": ("float32", (1, 1, 1, 16, 8)), "v": ("float32", (1, 1, 1, 16, 8))}  # 1,024 bytes a page
    with pytest.raises(ValueError, match="config must be a KVTransferConfig of role 'producer', got 'consumer'"):
        KVProducer(KVTransferConfig("consumer", address="127.0.0.1:1"), "fp", layout, 16)
    with pytest.raises(ValueError, match="config must be a KVTransferConfig of role 'consumer', got 'dict'"):
        KVConsumer({"role": "consumer"}, "fp", layout, 16)
    with pytest.raises(ValueError, match="buffer_bytes=1 is below one page's 1024 bytes"):
        KVProducer(KVTransferConfig("producer", buffer_bytes=1), "fp", layout, 16)


def test_engine_settings_that_cannot_transfer_are_refused_by_name():
    with pytest.raises(ValueError, match="kv_transfer .a KV producer. needs enable_prefix_caching=True"):
        EngineConfig(enable_prefix_caching=False, kv_transfer=KVTransferConfig("producer"))
    with pytest.raises(ValueError, match="kv_transfer must be"):
        EngineConfig(kv_transfer={"role": "producer"})
    with pytest.raises(ValueError, match="config.kv_transfer=.*the simulated accelerator has no K/V to hand"):
        SimulatedEngine(SimpleNamespace(), EngineConfig(kv_transfer=KVTransferConfig("producer")), num_pages=300,
                        page_size=16, vocab_size=100)
    with pytest.raises(ValueError, match="a KV producer: the KV tiers serve models whose layers all attend"):
        Engine(type(make_toy_step(toy_params()))(toy_params(), window=8), toy_pool(200),
               EngineConfig(max_seqs=8, max_seq_len=80, max_num_batched_tokens=64,
                            kv_transfer=KVTransferConfig("producer")))


def test_the_flags_build_the_transfer_config():
    import argparse

    p = argparse.ArgumentParser()
    add_tier_flags(p)
    opts = tier_options_from_args(p, p.parse_args(["--kv-role", "consumer", "--kv-address", "10.0.0.2:8470",
                                                   "--kv-transport", "host", "--kv-timeout-s", "5",
                                                   "--kv-authkey", "s3cret"]))
    assert opts["kv_transfer"] == KVTransferConfig("consumer", "10.0.0.2:8470", "host", 1 << 30, 5.0, b"s3cret")
    assert tier_options_from_args(p, p.parse_args([]))["kv_transfer"] is None
    with pytest.raises(SystemExit), warnings.catch_warnings():
        tier_options_from_args(p, p.parse_args(["--kv-role", "consumer"]))  # port 0: no producer to reach
    with pytest.raises(SystemExit):
        tier_options_from_args(p, p.parse_args(["--kv-address", "127.0.0.1:8470"]))  # no role: refused, not ignored


def _bench_args(tmp_path, *extra):
    return ["--model", "toy", "--num-requests", "3", "--max-output-len", "4", "--max-seqs", "4",
            "--max-batched-tokens", "16", "--max-seq-len", "512", "--kv-budget-tokens", "2048",
            "--out", str(tmp_path), *extra]


@pytest.mark.slow  # three processes, each loading JAX and compiling
def test_the_disaggregation_benchmark_runs_its_processes(tmp_path):
    from experiments.serving import disaggregated

    result = disaggregated.main(_bench_args(tmp_path, "--transports", "host"))
    colocated, split = result["rows"]
    assert result["same"] and split["remote_tokens"] > 0 and split["computed_prompt_tokens"] < colocated[
        "computed_prompt_tokens"]
    assert "Outputs identical" in (tmp_path / "disaggregated.md").read_text()


@pytest.mark.parametrize("extra, words", [
    (["--transports", "nixl"], "--transports takes host and/or jax_transfer, got ['nixl']"),
    (["--transports", ","], "--transports takes host and/or jax_transfer, got none"),
    (["--kv-budget-tokens", "100"], "--kv-budget-tokens rounded down to pages of --page-size 16 must hold one"),
    (["--max-seq-len", "0"], "--max-seq-len must be >= 1, got 0"),
])
def test_the_disaggregation_benchmark_refuses_bad_flags(tmp_path, extra, words, capsys):
    from experiments.serving import disaggregated

    with pytest.raises(SystemExit):
        disaggregated.parse_args(_bench_args(tmp_path, *extra))
    assert words in capsys.readouterr().err
