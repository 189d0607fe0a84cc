"""bench_http's machinery: the clients in a child process, the server's
per-request timestamps (server.timing) matched to the clients' times, the
replayed in-process run, the report.

The end-to-end run (slow) serves the toy decoder (two layers, random
weights, no tokenizer) with one token bucket (16 tokens a call, 8
sequences), so it compiles three programs; 3 requests under load and 1
idle, 3 output tokens each. The default tests check the pieces: the
breakdown on hand-made stamps, the recorder, the client process.
"""

import csv

import numpy as np
import pytest

from experiments.lib import http_backend
from experiments.lib.latency import RequestRecord
from experiments.lib.online import OnlineRun
from experiments.serving import bench_http
from paged_jax.engine.requests import CompletionOutput, Request, RequestOutput
from server import timing

# ------------------------------------------------------- the breakdown, by hand


def http_run(sent_first: list[tuple[float, float]], response_ids: list[str], t0: float) -> http_backend.HttpRun:
    outputs = [RequestOutput(request_id=i, prompt_ids=[1], outputs=[CompletionOutput(index=0, output_ids=[5],
                                                                                      finish_reason="length")],
                             num_preemptions=0, first_token_s=first, finish_s=first, num_cached_tokens=0,
                             finished=True, arrival_s=sent) for i, (sent, first) in enumerate(sent_first)]
    records = [RequestRecord.from_output(o, arrival_s=0.0) for o in outputs]
    run = OnlineRun(outputs=outputs, records=records, start_s=0.0, end_s=1.0, running_times=[0.0],
                    running_counts=[0])
    counters = http_backend.ServerCounters(0, 0, 0, 0, 0, 0)
    return http_backend.HttpRun(run=run, before=counters, after=counters, response_ids=response_ids, t0=t0,
                                client_cpu_s=0.0)


def record(rid: str, start: float) -> timing.RequestTimes:
    # Stages 1 ms apart from `start`: entry = start, ..., first_chunk = start + 6 ms.
    return timing.RequestTimes(stamps={s: start + i * 1e-3 for i, s in enumerate(timing.STAGES)},
                               request_ids=[f"{rid}-0"])


def test_points_match_the_servers_record_by_response_id_and_gaps_add_up():
    t0 = 100.0
    # Request 0 sent at t0 + 0, first token received at t0 + 0.010; its server record starts at t0 + 0.002.
    # Request 1's record is incomplete (refused after parsing): no points.
    run = http_run([(0.0, 0.010), (0.0, 0.020)], ["cmpl-a", "cmpl-b"], t0)
    partial = timing.RequestTimes(stamps={"entry": 100.001, "parsed": 100.002}, request_ids=["cmpl-b-0"])
    points = bench_http.request_points(run, [partial, record("cmpl-a", 100.002)])
    assert points[1] is None
    assert points[0]["sent"] == 100.0 and points[0]["received"] == pytest.approx(100.010)
    assert points[0]["added"] == pytest.approx(100.005)
    rows = bench_http.gap_rows("load", points)
    gaps = {(r["from"], r["to"]): r["p50_ms"] for r in rows}
    assert len(rows) == len(bench_http.POINTS)  # one per consecutive pair, and the whole TTFT
    assert gaps["sent", "entry"] == pytest.approx(2.0)  # 100.002 - 100.000
    assert gaps["entry", "parsed"] == pytest.approx(1.0)
    assert gaps["first_chunk", "received"] == pytest.approx(2.0)  # 100.010 - 100.008
    assert gaps["sent", "received"] == pytest.approx(10.0)
    assert sum(r["mean_ms"] for r in rows[:-1]) == pytest.approx(rows[-1]["mean_ms"], abs=0.02)
    assert bench_http.gap_rows("idle", [None]) == []


def test_a_stage_is_stamped_once_and_records_are_taken_once():
    rec = timing.TimingRecorder()
    times = rec.begin()
    assert timing.current() is times and "entry" in times.stamps
    times.stamp("added", at=5.0)
    times.stamp("added", at=6.0)
    assert times.stamps["added"] == 5.0 and not times.complete
    assert rec.take() == [times] and rec.take() == []


def test_the_client_process_refuses_a_bad_trace_before_sending():
    target = http_backend.Target(base_url="http://127.0.0.1:9", model="m")
    reqs = [Request(request_id=0, prompt_ids=[1, 2], max_new_tokens=2)]
    with http_backend.ClientProcess() as clients:
        with pytest.raises(ValueError, match="one arrival per request"):
            clients.run(target, reqs, [0.0, 1.0])
        with pytest.raises(RuntimeError, match="client process failed: ConnectError"):
            clients.run(target, reqs, [0.0])  # nobody listens on port 9: the child's error comes back


# ---------------------------------------------------------------- end to end


@pytest.mark.slow  # 45 s on 2 cores at load average 9 (three toy programs compiled, a child process, 6 runs)
def test_bench_http_end_to_end_on_the_toy_model(tmp_path):
    rows = bench_http.main(["--model", "toy", "--num-requests", "3", "--max-output-len", "3", "--idle-requests",
                            "1", "--max-seqs", "8", "--max-batched-tokens", "16", "--no-compile-cache",
                            "--out", str(tmp_path)])
    by = {(r["phase"], r["backend"]): r for r in rows}
    assert set(by) == {("load", "in-process, detokenized"), ("load", "http"), ("load", bench_http.REPLAYED),
                       ("load", "in-process"), ("idle", "in-process, detokenized"), ("idle", "http")}
    for (phase, _), r in by.items():
        n = 3 if phase == "load" else 1
        assert r["same_outputs"] == f"{n}/{n}" and r["requests"] == n
        assert r["server_cpu_s"] > 0
    assert by["load", "http"]["client_cpu_s"] > 0 and by["idle", "http"]["client_cpu_s"] >= 0
    assert by["load", "in-process"]["client_cpu_s"] is None
    text = (tmp_path / "server_vs_inprocess.md").read_text()
    for phase in ("load", "idle"):  # every gap of the breakdown, for every request
        for a, b in zip(bench_http.POINTS, bench_http.POINTS[1:]):
            n = 3 if phase == "load" else 1
            assert f"| {phase} | {a} | {b} | {n} |" in text
    assert "in-process, replayed" in text and "## Provenance" in text
    with open(tmp_path / "server_vs_inprocess.csv") as f:  # provenance lines first, as comments
        table = list(csv.DictReader(line for line in f if not line.startswith("#")))
    assert len(table) == len(rows)
    assert np.isfinite([float(r["p50_ttft_ms"]) for r in table]).all()
