"""The online serving benchmark (experiments.lib.online, bench_serving,
serving_figures): arrival traces, the metrics on hand-worked records, the
driver against the offline engine on the toy model, and the scripts' flags.

Engines here are the toy model's (tests/engine_helpers.py) with a token
budget of 16, so every call has one static shape bucket and the file
compiles three step programs at most.
"""

import argparse
import http.server
import json
import math
import socket
import threading
import time

import numpy as np
import pytest
from flax import nnx

from experiments.lib import latency, online, preflight, provenance
from experiments.serving import bench_serving, serving_figures
from models.config import LlamaConfig
from models.llama import Llama
from models.ragged import RaggedModel
from paged_jax.engine.core import Request
from tests.engine_helpers import make_engine, serve, toy_requests

# ----------------------------------------------------------------- arrivals


def test_arrivals_repeat_with_a_seed_and_have_the_mean_rate():
    a = latency.arrival_times(20_000, 4.0, seed=3)
    np.testing.assert_array_equal(a, latency.arrival_times(20_000, 4.0, seed=3))
    assert not np.array_equal(a, latency.arrival_times(20_000, 4.0, seed=4))
    assert a[0] == 0 and (np.diff(a) >= 0).all()
    gaps = np.diff(a)
    # Poisson: exponential gaps, mean 1/rate and coefficient of variation 1 (std of the mean ~ 0.7%).
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_keep_the_rate_and_change_the_spread(burstiness):
    gaps = np.diff(latency.arrival_times(40_000, 2.0, burstiness=burstiness, seed=0))
    assert gaps.mean() == pytest.approx(0.5, rel=0.04)
    # Gamma with shape k: coefficient of variation 1/sqrt(k).
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)


def test_arrivals_at_two_rates_are_one_trace_stretched():
    np.testing.assert_allclose(latency.arrival_times(50, 1.0, burstiness=0.5, seed=7),
                               2 * latency.arrival_times(50, 2.0, burstiness=0.5, seed=7))
    np.testing.assert_array_equal(latency.arrival_times(5, math.inf), np.zeros(5))
    np.testing.assert_allclose(latency.arrival_times(4, 2.0, burstiness=math.inf), [0, 0.5, 1.0, 1.5])


@pytest.mark.parametrize("kwargs, name", [
    (dict(request_rate=-1.0), "request_rate"), (dict(request_rate=0), "request_rate"),
    (dict(request_rate=math.nan), "request_rate"), (dict(request_rate=1.0, burstiness=0.0), "burstiness"),
    (dict(request_rate=1.0, burstiness=-2.0), "burstiness"), (dict(request_rate=1.0, seed=-1), "seed"),
    (dict(request_rate=1.0, burstiness=5e-324), "do not end within"),  # gaps overflow to NaN: it hung
    (dict(request_rate=1e-300), "do not end within"),  # a sleep past time_t: it crashed after the warm-up
])
def test_arrival_arguments_are_checked(kwargs, name):
    with pytest.raises(ValueError, match=name):
        latency.arrival_times(10, **kwargs)


# ------------------------------------------------------------------ metrics


def hand_records():
    """Three requests; the arithmetic of every metric is in the test below."""
    return [
        latency.RequestRecord(request_id=0, prompt_len=10, output_len=3, generated=3, arrival_s=0.0, added_s=0.1,
                             first_token_s=1.0, token_times=(1.0, 1.5, 2.5), finish_s=2.5),
        latency.RequestRecord(request_id=1, prompt_len=4, output_len=2, generated=2, arrival_s=1.0, added_s=1.0,
                             first_token_s=1.5, token_times=(1.5, 2.0), finish_s=2.0, num_preemptions=1),
        latency.RequestRecord(request_id=2, prompt_len=6, output_len=1, generated=1, arrival_s=2.0, added_s=2.2,
                             first_token_s=4.0, token_times=(4.0,), finish_s=4.0),
    ]


def test_metrics_of_hand_made_records():
    m = latency.compute_metrics(hand_records(), duration_s=4.0, running=([0.0, 1.0, 2.0, 3.0], [0, 2, 1, 0], 4.0))
    assert m.completed == 3 and m.input_tokens == 20 and m.output_tokens == 6 and m.preemptions == 1
    assert m.request_throughput == pytest.approx(3 / 4)
    assert m.output_throughput == pytest.approx(6 / 4)
    assert m.total_token_throughput == pytest.approx(26 / 4)
    # TTFT 1.0, 0.5, 2.0: sorted 0.5, 1, 2; p90 at rank 1.8 = 1 + 0.8 * 1; p99 at 1.98.
    assert (m.ttft.mean, m.ttft.p50, m.ttft.p90, m.ttft.p99) == pytest.approx((3.5 / 3, 1.0, 1.8, 1.98))
    # TPOT: (2.5 - 1.0) / 2 = 0.75 and (1.0 - 0.5) / 1 = 0.5; one-token request 2 has none.
    assert (m.tpot.mean, m.tpot.p50, m.tpot.p90, m.tpot.p99) == pytest.approx((0.625, 0.625, 0.725, 0.7475))
    # ITL: 0.5, 1.0 (request 0) and 0.5 (request 1): sorted 0.5, 0.5, 1.0.
    assert (m.itl.mean, m.itl.p50, m.itl.p90, m.itl.p99) == pytest.approx((2 / 3, 0.5, 0.9, 0.99))
    # E2EL: 2.5, 1.0, 2.0: sorted 1, 2, 2.5; p90 at rank 1.8 = 2 + 0.8 * 0.5, p99 at 1.98 = 2 + 0.98 * 0.5.
    assert (m.e2el.mean, m.e2el.p50, m.e2el.p90, m.e2el.p99) == pytest.approx((5.5 / 3, 2.0, 2.4, 2.49))
    # Normalized latency: mean of 2.5 / 3, 1.0 / 2, 2.0 / 1.
    assert m.normalized_latency == pytest.approx((2.5 / 3 + 0.5 + 2.0) / 3)
    # Running: 0 over [0, 1), 2 over [1, 2), 1 over [2, 3), 0 over [3, 4]: 3 / 4.
    assert m.mean_running == pytest.approx(0.75) and m.peak_running == 2
    assert m.goodput is None


@pytest.mark.parametrize("slos, good", [
    ({"ttft": 1000, "tpot": 600}, 1),  # request 0 misses TPOT (750 ms), request 2 TTFT (2000 ms)
    ({"e2el": 2000}, 2),  # 2500 ms misses; 2000 ms meets it (the bound is inclusive)
    ({"tpot": 500}, 2),  # request 1 at 500 ms and request 2, one token, whose TPOT counts 0
    ({"ttft": 2000, "tpot": 750, "e2el": 2500}, 3),
])
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    m = latency.compute_metrics(hand_records(), duration_s=4.0, slos=slos)
    assert m.goodput == pytest.approx(good / 4)


def test_one_token_outputs_have_no_tpot():
    m = latency.compute_metrics(hand_records()[2:], duration_s=1.0)
    assert m.tpot is None and m.itl is None and m.ttft.mean == pytest.approx(2.0)


def test_parse_goodput():
    assert latency.parse_goodput(["ttft:500", "tpot:50.5", "e2el:0"]) == {"ttft": 500, "tpot": 50.5, "e2el": 0}
    for bad, match in [("ttft", "KEY:MS"), ("itl:5", "KEY:MS"), ("ttft:-1", "ttft"), ("ttft:abc", "ttft"),
                       ("tpot:inf", "tpot")]:
        with pytest.raises(ValueError, match=match):
            latency.parse_goodput([bad])
    with pytest.raises(ValueError, match="twice"):
        latency.parse_goodput(["ttft:1", "ttft:2"])


def test_time_weighted_mean():
    assert latency.time_weighted_mean([0.0, 1.0], [4, 0], 4.0) == pytest.approx(1.0)
    assert latency.time_weighted_mean([2.0], [3], 2.0) == 0.0
    with pytest.raises(ValueError):
        latency.time_weighted_mean([1.0, 0.5], [1, 1], 2.0)


def test_sustained_rate_interpolates_the_threshold_crossing():
    # Crosses 0.4 between rate 2 (0.2) and 3 (0.6): 2 + (0.4 - 0.2) / (0.6 - 0.2).
    assert online.sustained_rate([1, 2, 3], [0.1, 0.2, 0.6], 0.4) == online.Sustained(2.5)
    assert online.sustained_rate([1, 2, 3], [0.1, 0.2, 0.3], 0.4) == online.Sustained(3.0, "at least")
    assert online.sustained_rate([1, 2, 3], [0.5, None, None], 0.4) == online.Sustained(1.0, "below")
    assert online.sustained_rate([1, 2, 3], [0.1, None, None], 0.4) == online.Sustained(1.0)
    assert online.ratio(online.Sustained(3.0), online.Sustained(1.5)) == "2.00x"
    assert online.ratio(online.Sustained(3.0, "at least"), online.Sustained(1.5)) == ">= 2.00x"
    assert online.ratio(online.Sustained(3.0), online.Sustained(1.5, "at least")) == "<= 2.00x"
    with pytest.raises(ValueError):
        online.sustained_rate([2, 1], [0.1, 0.2], 0.4)


def test_warmup_batches_fill_every_bucket_with_each_kind_of_call():
    batches = online.warmup_batches(max_batched_tokens=64, max_seqs=8, max_seq_len=40, vocab_size=50)
    shapes = [sorted(len(r.prompt_ids) for r in b) for b in batches]
    # Bucket 16: chunks only, one one-token row + chunks, one-token rows only; 32 and 64: the first two
    # (8 one-token rows cannot fill more than the 16 bucket). Prompts stay <= max_seq_len - 2 = 38.
    assert shapes == [[16], [1, 15], [1] * 8, [32], [1, 31], [32, 32], [1, 31, 32]]
    ids = {r.request_id for b in batches for r in b}
    assert len(ids) == sum(map(len, batches))


# ------------------------------------------------------------------- driver


def engine():
    return make_engine(budget=16, max_seqs=8)


def test_online_run_gives_the_offline_outputs_and_consistent_times():
    requests = toy_requests(10, seed=2, max_new=(3, 12), prompt_len=(2, 30))
    offline, _ = serve(requests, budget=16, max_seqs=8)
    span = max(o.finish_s for o in offline.values())  # the offline run's length on this machine
    # Pairs arrive together over half that span, so requests arrive while others run; the first pair
    # after 50 ms, so the loop starts idle and sleeps.
    arrivals = 0.05 + np.repeat(np.linspace(0, span / 2, 5), 2)
    slept = []
    run = online.run_online(engine(), requests, arrivals, sleep=lambda s: (slept.append(s), time.sleep(s)))
    assert slept and slept[0] > 0
    assert [o.request_id for o in run.outputs] == [r.request_id for r in requests]
    for o in run.outputs:
        assert o.output_ids == offline[o.request_id].output_ids, o.request_id
    for r, t in zip(run.records, arrivals):
        assert r.arrival_s == pytest.approx(run.start_s + t)
        assert r.arrival_s <= r.added_s <= r.first_token_s == r.token_times[0] <= r.finish_s
        assert list(r.token_times) == sorted(r.token_times) and len(r.token_times) == r.output_len
        assert 0 <= r.ttft <= r.e2el
    assert max(run.running_counts) >= 2
    assert run.end_s == max(r.finish_s for r in run.records)
    m = run.metrics({"e2el": 1e9})
    assert m.completed == 10 and m.goodput == pytest.approx(10 / run.duration_s)
    assert 0 < m.mean_running <= 8


def test_serve_online_all_at_once_matches_the_offline_run():
    requests = toy_requests(6, seed=5, max_new=(2, 8), prompt_len=(2, 20))
    offline, _ = serve(requests, budget=16, max_seqs=8)
    result = online.serve_online(lambda policy: engine(), requests, policy="paged", request_rate=math.inf,
                                 slos={"ttft": 1e9})
    assert [o.output_ids for o in result.run.outputs] == [offline[r.request_id].output_ids for r in requests]
    row = result.row()
    assert set(row) == set(online.METRIC_COLUMNS) and row["requests"] == 6 and row["request_rate"] == math.inf
    assert len(result.request_rows()) == 6 and set(result.request_rows()[0]) == set(online.REQUEST_COLUMNS)
    assert "TTFT" in online.report(result)


def test_run_online_checks_its_arguments():
    requests = toy_requests(2, seed=0)
    with pytest.raises(ValueError, match="one arrival per request"):
        online.run_online(engine(), requests, [0.0])
    with pytest.raises(ValueError, match="non-decreasing"):
        online.run_online(engine(), requests, [1.0, 0.5])


def test_engine_spec_builds_each_policy_on_one_model():
    model = Llama(LlamaConfig(vocab_size=64, model_dim=16, mlp_dim=32, num_layers=1, num_q_heads=2, num_kv_heads=1,
                              head_dim=8), rngs=nnx.Rngs(0))
    spec = online.EngineSpec(model=model, paged_model=RaggedModel(model), kv_tokens=4096, page_size=16, max_seqs=4,
                             max_batched_tokens=32)
    engines = {p: spec.build(p) for p in online.POLICIES}
    assert {p: e.config.reservation for p, e in engines.items()} == {p: p for p in online.POLICIES}
    assert all(e.model is spec.paged_model for e in engines.values())  # one model object: shared programs
    with pytest.raises(ValueError, match="reservation"):
        spec.build("fifo")


# -------------------------------------------------------------------- flags


@pytest.mark.parametrize("argv, flag", [
    (["--request-rate", "-1"], "--request-rate"),
    (["--request-rate", "0"], "--request-rate"),
    (["--request-rate", "nan"], "--request-rate"),
    (["--burstiness", "0"], "--burstiness"),
    (["--burstiness", "-0.5"], "--burstiness"),
    (["--goodput", "ttft"], "--goodput"),
    (["--goodput", "ttft:500", "itl:20"], "--goodput"),
    (["--goodput", "e2el:-3"], "--goodput"),
    (["--workload", "parallel-0"], "--workload"),
    (["--num-requests", "0"], "--num-requests"),
    (["--policy", "paged", "paged"], "--policy"),
    (["--name", "../elsewhere"], "--name"),
])
def test_bench_serving_refuses_bad_flags(argv, flag, capsys):
    with pytest.raises(SystemExit):
        bench_serving.parse_args(argv)
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["--latency-threshold", "0"], "--latency-threshold"),
    (["--loads", "0.5", "-1"], "--loads"),
    (["--rates", "1", "inf"], "--rates"),
    (["--rates", "1", "--loads", "0.5"], "--loads"),
    (["--fig13-rate", "-2"], "--fig13-rate"),
    (["--burstiness", "0"], "--burstiness"),
])
def test_serving_figures_refuses_bad_flags(argv, flag, capsys):
    with pytest.raises(SystemExit):
        serving_figures.parse_args(argv)
    assert flag in capsys.readouterr().err


# ------------------------------------------------------------------ scripts


# Slow (58 s): its default twins are test_bench_serving_on_the_toy_model (the same online runs) and
# tests/test_serving_figures.py's Figure 14 quick run (the same script).
@pytest.mark.slow
def test_serving_figures_quick_on_the_toy_model(tmp_path):
    summary, rows13 = serving_figures.main(["--quick", "--model", "toy", "--out", str(tmp_path)])
    for stem in ("serving_fig12_quick", "serving_fig13_quick"):
        for ext in ("md", "csv", "png"):
            assert (tmp_path / f"{stem}.{ext}").stat().st_size > 0
        assert "<!-- provenance -->" in (tmp_path / f"{stem}.md").read_text()
    assert [s["policy"] for s in summary] == list(online.POLICIES)
    assert [r["policy"] for r in rows13] == list(online.POLICIES)
    assert all(r["mean_running"] > 0 for r in rows13)
    _, runs = provenance.read_csv(tmp_path / "serving_fig12_quick.csv")
    assert runs[0]["request_rate"] == "inf" and {r["compiled"] for r in runs} == {"0"}  # the warm-up compiled all
    text = (tmp_path / "serving_fig13_quick.md").read_text()
    assert "30.42" in text and "Orca (Oracle)" in text  # the paper's numbers beside ours


def test_bench_serving_on_the_toy_model(tmp_path):
    results = bench_serving.main(["--model", "toy", "--num-requests", "4", "--max-output-len", "4", "--max-seqs", "16",
                                  "--max-batched-tokens", "32", "--request-rate", "50", "inf", "--policy", "paged",
                                  "oracle", "--goodput", "ttft:60000", "--out", str(tmp_path)])
    assert [(r.policy, r.request_rate) for r in results] == [("paged", 50), ("oracle", 50),
                                                             ("paged", math.inf), ("oracle", math.inf)]
    assert all(r.metrics.goodput == pytest.approx(4 / r.metrics.duration_s) for r in results)
    _, rows = provenance.read_csv(tmp_path / "bench_serving.csv")
    assert len(rows) == 4 and list(rows[0]) == list(online.METRIC_COLUMNS)
    _, requests = provenance.read_csv(tmp_path / "bench_serving_requests.csv")
    assert len(requests) == 16


# ------------------------------------------- checks before the model loads or the warm-up (preflight)


@pytest.mark.parametrize("argv, words", [
    (["--workload", "parallel-100000"], "--workload parallel-100000: each request runs 100,000 sequences"),
    (["--workload", "beam-65"], "more than --max-seqs 64"),
    (["--workload", "parallel-9", "--max-seqs", "8", "--backend", "http"], "--workload parallel-9"),
    (["--model", "toy", "--kv-budget-tokens", str(10**12)], "--kv-budget-tokens 1,000,000,000,000: the KV pool "
                                                           "would take 512,000.0 GB (512 bytes per token"),
    (["--api-key", ""], "--api-key must not be empty"),
    (["--backend", "http", "--profile", "trace"], "profile the server process"),
    (["--backend", "http", "--base-url", "ftp://127.0.0.1:1"], "--base-url 'ftp://127.0.0.1:1': expected http://"),
    (["--backend", "http", "--base-url", "http://127.0.0.1:1/api"], "not another path"),
    (["--profile-steps", "0"], "--profile-steps must be >= 1"),
])
def test_bench_serving_refuses_before_loading(argv, words, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        bench_serving.parse_args([*argv, "--out", str(tmp_path)])
    assert words in capsys.readouterr().err


def test_kv_budget_counts_pages_and_weights_against_the_memory_available(capsys):
    p = argparse.ArgumentParser()
    config = online.TOY_CONFIG  # 2 layers x 2 KV heads x 16 dims x 4 bytes x (K, V): 512 bytes per token
    weights = config.num_params * 4
    pool = (8192 // 16 + 1) * 16 * 512  # whole pages and the null page
    assert preflight.check_kv_budget(p, "--kv", 8192, 16, config, kv_dtype="float32", weight_dtype="float32",
                                     available=pool + weights) == pool
    with pytest.raises(SystemExit):
        preflight.check_kv_budget(p, "--kv", 8192, 16, config, kv_dtype="float32", weight_dtype="float32",
                                  available=pool + weights - 1)
    assert "--kv 8,192: the KV pool would take" in capsys.readouterr().err


def test_a_refused_request_stops_the_run_before_the_warm_up(tmp_path, capsys):
    # 2 pages of 16 tokens per sequence at most: ShareGPT prompts of the packaged set need more than 8 pages
    # for 4 samples; the message names the request and the pool, and no warm-up line was printed.
    with pytest.raises(SystemExit, match="--policy paged: request .* sequences holding"):
        bench_serving.main(["--model", "toy", "--num-requests", "2", "--workload", "parallel-16", "--max-seqs", "16",
                            "--kv-budget-tokens", "2048", "--out", str(tmp_path)])
    assert "warm-up" not in capsys.readouterr().out


@pytest.mark.parametrize("url, root", [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000"), ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"),
    ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"), ("http://localhost:8000/v1/", "http://localhost:8000"),
    ("https://example.org", "https://example.org"),
])
def test_server_root_drops_v1(url, root):
    assert preflight.server_root(url) == root


class _StubServer:
    """A loopback HTTP server answering /health and /v1/models as told (no model behind it)."""

    def __init__(self, *, health=200, models=("m",), key=None):
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/health":
                    self._send(stub.health, {"status": "ok"} if stub.health == 200 else {"error": "down"})
                elif self.path == "/v1/models":
                    if stub.key and self.headers.get("Authorization") != f"Bearer {stub.key}":
                        self._send(401, {"error": {"message": "bad key"}})
                    else:
                        self._send(200, {"data": [{"id": m, "max_model_len": 99} for m in stub.models]})
                else:
                    self._send(404, {})

            def _send(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.health, self.models, self.key = health, models, key
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bench_serving_probes_the_server_before_the_warm_up(tmp_path, capsys):
    def refused(*flags):
        with pytest.raises(SystemExit):
            bench_serving.parse_args(["--backend", "http", "--out", str(tmp_path), *flags])
        return capsys.readouterr().err

    assert "no server answers there" in refused("--base-url", f"http://127.0.0.1:{_free_port()}")
    with _StubServer(models=("a", "b"), key="k") as srv:
        args = bench_serving.parse_args(["--backend", "http", "--base-url", srv.url + "/v1", "--api-key", "k",
                                         "--served-model", "b", "--out", str(tmp_path)])
        assert args.base_url == srv.url and (args.served.name, args.served.max_model_len) == ("b", 99)
        err = refused("--base-url", srv.url, "--api-key", "k", "--served-model", "nope")
        assert "--served-model 'nope': the server at" in err and "serves ['a', 'b']" in err
        assert "--api-key: the server at" in refused("--base-url", srv.url, "--api-key", "wrong")
        assert "--api-key: the server at" in refused("--base-url", srv.url)  # no key at all
        with pytest.raises(SystemExit, match=r"1 of 2 requests need more tokens than the server's max_model_len "
                                             r"99 \(the first, 1: 245 in the prompt \+ 48 output\); start the "
                                             r"server with --max-seq-len 293 or more"):
            bench_serving.main(["--backend", "http", "--base-url", srv.url, "--api-key", "k", "--model", "toy",
                                "--num-requests", "2", "--out", str(tmp_path)])
        assert "warm-up" not in capsys.readouterr().out
    with _StubServer(health=503) as srv:
        assert "GET /health answered 503" in refused("--base-url", srv.url)


def test_a_run_that_compiled_is_repeated_warm():
    """A timed run during which JAX compiled (no warm-up here: a vocabulary
    no other test uses, so every shape is new) is discarded and run again
    on a fresh engine: the result is the warm run, and says so."""
    model = Llama(LlamaConfig(vocab_size=61, model_dim=16, mlp_dim=32, num_layers=1, num_q_heads=2, num_kv_heads=1,
                              head_dim=8), rngs=nnx.Rngs(0))
    spec = online.EngineSpec(model=model, paged_model=RaggedModel(model), kv_tokens=4096, max_seqs=4,
                             max_batched_tokens=32)
    requests = [Request(request_id=i, prompt_ids=list(range(1, 6 + i)), max_new_tokens=3) for i in range(3)]
    result = online.serve_online(spec.build, requests, policy="paged", request_rate=math.inf)
    assert result.discarded > 0 and result.compiles.requests == 0
    assert result.row()["repeated_after_compiling"] == result.discarded
    assert f"a first attempt compiled {result.discarded}: discarded and run again" in online.report(result)
    assert online.serve_online(spec.build, requests, policy="paged", request_rate=math.inf).discarded == 0
    cold = online.serve_online(spec.build, requests, policy="paged", request_rate=2.0, repeat_if_compiled=False)
    assert cold.discarded == 0 and cold.row()["repeated_after_compiling"] == 0
    with pytest.raises(ValueError, match="repeat_if_compiled must be a bool"):
        online.serve_online(spec.build, requests, policy="paged", request_rate=2.0, repeat_if_compiled="no")
