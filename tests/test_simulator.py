"""The simulated accelerator (:mod:`paged_jax.simulator`): the engine with its
model call and clock replaced makes the real engine's decisions, and the
step-time models compute what they say."""

import math

import numpy as np
import pytest

from experiments.lib.latency import arrival_times
from experiments.lib.online import run_online
from paged_jax.engine.core import Request
from paged_jax.engine.sampling import SamplingParams
from paged_jax.simulator.engine import SimulatedEngine, TimedEngine
from paged_jax.simulator.hardware import get_device, get_model
from paged_jax.simulator.step_time import (
    FEATURES,
    ProfiledStepTime,
    ReplayStepTime,
    RooflineStepTime,
    StepWork,
    call_seconds,
    features,
    mape,
)
from tests.engine_helpers import PAGE, VOCAB, make_engine, shared_step, toy_pool


def _requests(n=16, seed=0, **kw):
    rng = np.random.default_rng(seed)
    return [Request(request_id=i, prompt_ids=rng.integers(0, VOCAB, size=int(rng.integers(3, 30))).tolist(),
                    max_new_tokens=int(rng.integers(2, 24)), ignore_eos=True, **kw) for i in range(n)]


def _decisions(engine, run):
    """What the scheduler decided, call by call, and when each request ended."""
    calls = [(c.shape, c.tokens, c.rows, c.context_tokens, c.attention_pairs, c.start_s, c.done_s)
             for c in engine.stats.calls]
    ends = [(r.first_token_s, r.finish_s) for r in run.records]
    order = [o.request_id for o in sorted(run.outputs, key=lambda o: (run.records[o.request_id].finish_s,
                                                                      o.request_id))]
    return calls, ends, order, engine.stats.preemptions, engine.stats.swap_outs


@pytest.mark.parametrize("config", [
    dict(overlap=False),
    dict(overlap=True),
    dict(overlap=True, reservation="oracle"),  # buddy runs: admissions wait on fragmentation
    dict(overlap=False, preemption_mode="swap"),
], ids=["sync", "async", "orca-buddy", "swap"])
def test_the_simulated_engine_replays_a_real_run_into_the_same_decisions(config):
    """A real run's measured call times, replayed into the real engine on a
    virtual clock and into the simulated engine: the same calls (shapes,
    work, start and end times), preemptions, swaps, first-token and finish
    times, to the bit; the real run itself lies within the machine's
    scheduling noise of both."""
    reqs = _requests()
    arrivals = arrival_times(len(reqs), 30.0, seed=1)
    kw = dict(num_pages=31, max_seqs=6, call_records=None, check=False, **config)
    real = make_engine(**kw)
    real_run = run_online(real, reqs, arrivals)
    times = call_seconds(list(real.stats.calls))
    assert len(times) == real.stats.model_calls and min(times) > 0

    e = make_engine(**kw)
    timed = TimedEngine(shared_step(), toy_pool(31, PAGE), e.config, vocab_size=VOCAB,
                        step_time=ReplayStepTime(times + [1e-3] * 200))
    timed_run = run_online(timed, reqs, arrivals, sleep=timed.sleep)
    sim = SimulatedEngine(ReplayStepTime(times + [1e-3] * 200), e.config, num_pages=31, page_size=PAGE,
                          vocab_size=VOCAB)
    sim_run = run_online(sim, reqs, arrivals, sleep=sim.sleep)
    assert _decisions(sim, sim_run) == _decisions(timed, timed_run)
    assert [len(o.outputs[0].output_ids) for o in sim_run.outputs] == [r.max_new_tokens for r in reqs]
    # Against the real clock: the same work within the noise of a shared machine's loop and sleeps.
    assert abs(sim_run.duration_s - real_run.duration_s) < 0.1 * real_run.duration_s
    assert sim.kv_manager.accounting()["used"] == 0 and sim.accounting() == timed.accounting()


def test_simulated_tokens_never_stop_and_pages_come_back_for_samples_and_beams():
    reqs = [Request(request_id=i, prompt_ids=list(range(1, 6 + i)), max_new_tokens=9,
                    sampling=SamplingParams(**s)) for i, s in
            enumerate([dict(n=3, seed=0, temperature=1.0), dict(beam_width=3), {}, dict(logprobs=2)])]
    sim = SimulatedEngine(ReplayStepTime([0.01] * 500), make_engine(41).config, num_pages=41, page_size=PAGE,
                          vocab_size=VOCAB, stop_ids=list(range(0, VOCAB, 2)))
    outs = {o.request_id: o for o in sim.run(reqs)}
    for i in (0, 2, 3):
        for c in outs[i].outputs:
            assert len(c.output_ids) == 9 and all(t % 2 == 1 for t in c.output_ids)  # stop ids never drawn
    assert len(outs[1].outputs) == 3
    assert sim.clock() == pytest.approx(0.01 * sim.stats.model_calls)
    assert sim.accounting()["used"] == 0



def test_simulated_swap_moves_pages_out_and_back():
    """Preemption by swap on the simulated pool (a regression: K and V were one
    placeholder buffer, and a swap-in donates each, so the copy was refused
    whenever a simulated run swapped)."""
    import dataclasses

    reqs = [Request(request_id=i, prompt_ids=list(range(1, 20)), max_new_tokens=40) for i in range(6)]
    config = dataclasses.replace(make_engine(25).config, preemption_mode="swap", swap_space_pages=64)
    sim = SimulatedEngine(ReplayStepTime([0.01] * 2000), config, num_pages=25, page_size=PAGE, vocab_size=VOCAB)
    outs = sim.run(reqs)
    assert sim.stats.swap_outs > 0 and [len(o.outputs[0].output_ids) for o in outs] == [40] * 6
    assert sim.accounting()["used"] == 0

def test_simulated_engine_arguments_are_checked():
    config = make_engine(41).config
    with pytest.raises(ValueError, match="step_time must have seconds"):
        SimulatedEngine(0.01, config, num_pages=41, page_size=PAGE, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="num_pages"):
        SimulatedEngine(ReplayStepTime([]), config, num_pages=1, page_size=PAGE, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="fewer than one sequence"):
        SimulatedEngine(ReplayStepTime([]), config, num_pages=5, page_size=PAGE, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="stop_ids cover the whole vocabulary"):
        SimulatedEngine(ReplayStepTime([]), config, num_pages=41, page_size=PAGE, vocab_size=4, stop_ids=[0, 1, 2, 3])
    sim = SimulatedEngine(ReplayStepTime([]), config, num_pages=41, page_size=PAGE, vocab_size=VOCAB)
    sim.add_request(Request(request_id=0, prompt_ids=[1, 2], max_new_tokens=2))
    with pytest.raises(RuntimeError, match="the replay has 0 call times"):
        sim.step()


# ----------------------------------------------------------- step times


def test_roofline_of_one_hand_worked_decode_step():
    """OPT-13B on an A100-40GB, bf16, ten decodes at 499 cached tokens in a
    16-row program.

    Weights one layer multiplies by: 5120 x (4 x 5120) + 2 x 5120 x 20480 =
    314,572,800. FLOPs: 2 x 16 x 314,572,800 x 40 = 402,653,184,000 (layers)
    + 2 x 16 x 5120 x 50272 = 8,236,564,480 (LM head) + 4 x 40 x 128 x
    5,000 x 40 = 4,096,000,000 (attention over 10 x 500 pairs) =
    414,985,748,480. Bytes: 12,853,000,000 x 2 = 25,706,000,000 (weights) +
    819,200 x (5,000 + 10) = 4,104,192,000 (K/V read and written; 2 x 40 x
    40 x 128 x 2 bytes a token) + 2 x 16 x 40 x (4 x 5120 + 2 x 20480) x 2 =
    157,286,400 (activations) = 29,967,478,400. Memory-bound:
    29,967,478,400 / (1,555e9 x 0.8) = 24.09 ms, against 414,985,748,480 /
    (312e12 x 0.6) = 2.22 ms of compute; plus 2 ms overhead: 26.09 ms."""
    roof = RooflineStepTime(model=get_model("opt-13b"), device=get_device("a100-40gb"))
    work = StepWork(padded_tokens=16, logit_rows=16, tokens=10, decode_tokens=10, rows=10, context_tokens=5000,
                    attention_pairs=5000)
    assert get_model("opt-13b").layer_matmul_params == 314_572_800
    assert roof.flops(work) == 414_985_748_480
    assert roof.bytes(work) == 29_967_478_400
    assert roof.seconds(work) == pytest.approx(0.002 + 29_967_478_400 / (1555e9 * 0.8))
    assert roof.name == "roofline on a100-40gb"


def test_roofline_arguments_are_checked():
    with pytest.raises(ValueError, match="device must be one of"):
        get_device("a200")
    with pytest.raises(ValueError, match="dtype must be one of"):
        RooflineStepTime(model=get_model("opt-13b"), device=get_device("tpu-v5e"), dtype="float8")
    with pytest.raises(ValueError, match="flops_efficiency"):
        RooflineStepTime(model=get_model("opt-13b"), device=get_device("h100"), flops_efficiency=0.0)


def _works(n=40, seed=0):
    rng = np.random.default_rng(seed)
    return [StepWork(padded_tokens=int(t), logit_rows=int(g), tokens=int(t), decode_tokens=int(r),
                     rows=int(r), context_tokens=int(c), attention_pairs=int(c + t * t))
            for t, r, g, c in zip(rng.choice([16, 32, 64, 128, 256], n), rng.integers(1, 16, n),
                                  rng.choice([1, 2, 4, 8, 16], n), rng.integers(10, 4000, n))]


def test_a_profiled_step_time_recovers_a_linear_truth_and_stays_non_negative():
    works = _works()
    truth = np.array([3e-3, 2e-5, 1e-5, 1e-4, 2e-6, 1e-8])
    y = np.stack([features(w) for w in works]) @ truth
    fit = ProfiledStepTime.fit(works, y, device="cpu")
    np.testing.assert_allclose(fit.coef, truth, rtol=1e-6)
    assert fit.fit_mape < 1e-6 and fit.name == "profiled on cpu" and fit.num_calls == 40
    assert [r["feature"] for r in fit.table()] == list(FEATURES)
    y2 = 0.01 - 1e-6 * np.array([w.context_tokens for w in works])  # faster with more work: clipped to 0
    assert (ProfiledStepTime.fit(works, y2, device="cpu").coef >= 0).all()
    with pytest.raises(ValueError, match="at least 6 calls"):
        ProfiledStepTime.fit(works[:3], y[:3], device="cpu")


def test_a_fitted_roofline_finds_the_efficiencies_it_was_given():
    roof = RooflineStepTime(model=get_model("smollm2-135m"), device=get_device("h100"), flops_efficiency=0.25,
                            bandwidth_efficiency=0.5, overhead_s=0.001)
    works = _works()
    fitted = RooflineStepTime(model=get_model("smollm2-135m"), device=get_device("h100")).fitted(
        works, [roof.seconds(w) for w in works], source="test")
    assert mape([fitted.seconds(w) for w in works], [roof.seconds(w) for w in works]) < 2
    assert fitted.efficiency_source == "test"


def test_mape_and_call_seconds():
    assert mape([1.1, 0.9], [1.0, 1.0]) == pytest.approx(10.0)
    with pytest.raises(ValueError, match="must be > 0"):
        mape([1.0], [0.0])
    with pytest.raises(ValueError, match="equally long"):
        mape([1.0], [])
    from paged_jax.attention.batch import BatchShape
    from paged_jax.engine.stats import CallRecord

    def rec(start, done):
        return CallRecord(shape=BatchShape(num_tokens=16, num_logits=16), tokens=1, decode_tokens=1, seconds=0,
                          compile_s=0, start_s=start, done_s=done)
    # busy: each from the previous end; after an idle gap, from its own start
    assert call_seconds([rec(0.0, 1.0), rec(0.5, 1.5), rec(3.0, 3.25)]) == [1.0, 0.5, 0.25]


# ------------------------------------------------------------ the scripts


def test_paper_serving_fig12_at_a_small_scale_writes_its_table(tmp_path):
    from experiments.lib import provenance
    from experiments.simulator import paper_serving

    out = paper_serving.main(["--num-requests", "40", "--rates", "1", "8", "--policy", "oracle", "oracle-pages",
                              "--out", str(tmp_path)])
    assert [(r["policy"], r["request_rate"]) for r in out["rows"]] == [
        (p, r) for p in ("paged", "oracle", "oracle-pages") for r in (1.0, 8.0)]
    _, rows = provenance.read_csv(tmp_path / "paper_fig12_13b.csv")
    assert len(rows) == 6 and (tmp_path / "paper_fig12_13b.png").exists()
    text = (tmp_path / "paper_fig12_13b.md").read_text()
    assert "the paper's Table 1: 12 GiB" in text and "15,728 tokens" in text  # 12 x 2**30 // 819,200
    assert "roofline on a100-40gb" in text and "1.7-2.7x" in text


def test_paper_serving_sets_up_the_papers_servers():
    from experiments.simulator import paper_serving

    big = paper_serving.parse_args(["--setup", "175b"])
    assert (big.model, big.device, big.num_devices, big.name) == ("opt-175b", "a100-80gb", 8, "paper_fig12_175b")
    assert paper_serving.kv_tokens(big, get_model("opt-175b"), get_device("a100-80gb"))[0] == 60_074
    mid = paper_serving.parse_args(["--setup", "66b"])
    assert paper_serving.kv_tokens(mid, get_model("opt-66b"), get_device("a100-40gb"))[0] == 9_557
    custom = paper_serving.parse_args(["--setup", "66b", "--device", "h100"])
    assert (custom.model, custom.num_devices, custom.name) == ("opt-66b", 4, "paper_fig12_custom")
    tokens, source = paper_serving.kv_tokens(custom, get_model("opt-66b"), get_device("h100"))
    assert tokens == int((0.9 * 80e9 * 4 - 65.7e9 * 2) // 2_359_296) and "0.9 of memory" in source



def test_paper_serving_sets_up_figures_14_16_17():
    from experiments.simulator import paper_serving

    beams = paper_serving.parse_args(["--workloads", "beam-6", "parallel-2"])
    assert (beams.figure, beams.name, beams.policy) == (14, "paper_fig14_13b", ["paged", "max", "oracle"])
    assert beams.rates_["beam-6"][0] == 0.125 and beams.rates_["parallel-2"][-1] == 2.5  # Figure 14's over sequences
    assert [r.sampling.beam_width for r in beams.requests_["beam-6"][:2]] == [6, 6]
    assert len(beams.requests_["beam-6"]) == 1000
    prefix = paper_serving.parse_args(["--setup", "llama-13b", "--workloads", "prefix-5"])
    assert (prefix.figure, prefix.name, prefix.policy) == (16, "paper_fig16_llama-13b",
                                                           ["paged", "paged-nocache", "oracle-nocache"])
    requests = prefix.requests_["prefix-5"]
    assert len(requests) == 496 and max(r.max_new_tokens for r in requests) == paper_serving.PREFIX_OUTPUT_LEN
    assert requests[0].prompt_ids[:270] == requests[-1].prompt_ids[:270]  # 5 shots x 2 sides x 27 ids, shared
    tokens, source = prefix.tokens_  # Table 1 has no LLaMA: 0.9 of 40 GB less 13.016 B bf16 weights
    assert tokens == int((0.9 * 40e9 - 13.016e9 * 2) // 819_200) and "0.9 of memory" in source
    chat = paper_serving.parse_args(["--workloads", "chatbot"])
    assert chat.figure == 17 and chat.policy == ["paged", "max", "pow2", "oracle"]
    assert len(chat.requests_["chatbot"]) == 329  # each chat uses 2 to 4 of the 1,000 packaged requests
    assert max(len(r.prompt_ids) for r in chat.requests_["chatbot"]) == paper_serving.CHATBOT_PROMPT_LEN


def test_paper_serving_fig14_reports_the_sharing(tmp_path):
    from experiments.lib import provenance
    from experiments.simulator import paper_serving

    out = paper_serving.main(["--workloads", "beam-2", "parallel-2", "--num-requests", "30", "--rates", "1", "4",
                              "--policy", "oracle", "--out", str(tmp_path)])
    _, rows = provenance.read_csv(tmp_path / "paper_fig14_13b.csv")
    assert [(r["workload"], r["policy"]) for r in rows] == [
        (w, p) for w in ("beam-2", "parallel-2") for p in ("paged", "oracle") for _ in range(2)]
    saved = {(r["workload"], r["policy"]): float(r["kv_saved_by_sharing"]) for r in rows}
    assert saved["beam-2", "paged"] > 0.1 and saved["parallel-2", "paged"] > 0  # forks share the prompt's pages
    assert saved["beam-2", "oracle"] == 0 == saved["parallel-2", "oracle"]  # Orca copies per holder
    assert {r["workload"] for r in out["summary"]} == {"beam-2", "parallel-2"}
    text = (tmp_path / "paper_fig14_13b.md").read_text()
    assert "KV saved by sharing" in text and "beam search, width 2" in text



def test_paper_serving_skips_rates_far_past_a_policys_knee(tmp_path):
    from experiments.lib import provenance
    from experiments.simulator import paper_serving

    out = paper_serving.main(["--num-requests", "30", "--rates", "1", "4", "--policy", "max", "--stop-above", "0.5",
                              "--out", str(tmp_path)])
    # Max's latency at 1 req/s is above half the threshold (1.5x paged's lowest): 4 req/s is not run.
    assert [(r["policy"], r["request_rate"]) for r in out["rows"]] == [("paged", 1.0), ("paged", 4.0), ("max", 1.0)]
    _, rows = provenance.read_csv(tmp_path / "paper_fig12_13b.csv")
    assert len(rows) == 3
    text = (tmp_path / "paper_fig12_13b.md").read_text()
    assert "| 4.0 | " in text and "| - |" in text and "passed 0.5x the threshold" in text
    with pytest.raises(SystemExit):
        paper_serving.parse_args(["--stop-above", "-1"])

def test_paper_ratio_names_what_the_paper_says():
    from experiments.lib.policies import paper_ratio

    assert paper_ratio("basic", "oracle") == "1.7-2.7x" and paper_ratio("basic", "oracle-pages") == "-"
    assert paper_ratio("beam-6", "oracle") == "2.3x (Alpaca)" and paper_ratio("beam-4", "oracle") == "-"
    assert paper_ratio("prefix-5", "oracle-nocache") == "3.58x" and paper_ratio("prefix-1", "paged-nocache") == "-"
    assert paper_ratio("chatbot", "pow2") == "2x" and paper_ratio("chatbot", "paged") == "-"
    with pytest.raises(ValueError, match="policy must be"):
        paper_ratio("basic", "orca")


def test_paper_serving_flags_are_checked(capsys):
    from experiments.simulator import paper_serving

    for argv, needle in ((["--num-requests", "1001"], "--num-requests must be in [1, 1000]"),
                         (["--rates", "inf"], "--rates must be finite"),
                         (["--device", "a200"], "invalid choice"),
                         (["--kv-tokens", "0"], "--kv-tokens must be >= 1"),
                         (["--num-devices", "0"], "--num-devices must be >= 1"),
                         (["--setup", "7b"], "invalid choice"),
                         (["--workloads", "basic", "beam-2"], "--workloads must belong to one figure"),
                         (["--workloads", "beam-2", "beam-2"], "--workloads lists a workload twice"),
                         (["--workloads", "beam-0"], "--workloads: workload must be"),
                         (["--workloads", "beam-300", "--rates", "1"], "--workload beam-300: each request runs 300"),
                         (["--num-devices", "100"], "opt-13b has 40 attention heads"),
                         (["--kv-tokens", "100000000"], "more than the simulator's 16,777,216"),
                         (["--model", "opt-175b", "--num-devices", "1", "--kv-tokens", "20000"],
                          "need 444.4 GB, more than 1 x a100-40gb hold"),
                         (["--workloads", "beam-4", "--kv-tokens", "2048"], "more than the pool's 128"),
                         (["--stop-above", "nan"], "--stop-above must be a finite number >= 0"),
                         (["--workloads", "prefix-1", "--num-requests", "497"],
                          "--num-requests must be in [1, 496] (prefix-1 with seed 0 make 496")):
        with pytest.raises(SystemExit):
            paper_serving.parse_args(argv)
        assert needle in capsys.readouterr().err


@pytest.mark.slow  # two toy warm-ups (about 3 min on 2 cores)
def test_profile_then_validate_on_the_toy_model(tmp_path):
    from experiments.simulator import profile_steps, validate

    prof = profile_steps.main(["--model", "toy", "--max-seqs", "4", "--kv-budget-tokens", "2048", "--contexts", "16",
                               "--decode-steps", "2", "--staggered-requests", "4", "--staggered", "1", "--out",
                               str(tmp_path)])
    assert prof["rows"] and prof["fit"].num_calls == len(prof["rows"])
    out = validate.main(["--model", "toy", "--num-requests", "6", "--max-output-len", "4", "--loads", "1",
                         "--profile", str(tmp_path / "step_profile_cpu.csv"), "--out", str(tmp_path)])
    assert [(r["policy"], r["load"]) for r in out["rows"]][1:] == [("paged", 1.0), ("oracle", 1.0)]
    assert (tmp_path / "simulator_validation.md").exists()


def test_the_profile_runs_its_grid_and_staggered_runs_and_keeps_every_call():
    from paged_jax.simulator.profile import profile_calls, profile_runs

    runs = profile_runs(vocab_size=VOCAB, max_seqs=4, kv_tokens=120, contexts=(8, 40), decode_steps=3,
                        staggered=(2,), staggered_requests=3, max_seq_len=80)
    assert all(len(r.prompt_ids) + r.max_new_tokens <= 80 for r in runs[-1].requests)
    # 1, 2 and 4 requests of 8 tokens; of 40, those whose 43 tokens each fit in 120: 1 and 2
    assert [r.phase for r in runs] == ["grid 1x8", "grid 1x40", "grid 2x8", "grid 2x40", "grid 4x8",
                                       "staggered every 2"]
    assert [len(r.requests) for r in runs] == [1, 1, 2, 2, 4, 3] and runs[-1].every == 2
    rows = profile_calls(lambda: make_engine(31, max_seqs=4, max_seq_len=80, call_records=None), runs[-2:])
    assert rows and {r["phase"] for r in rows} == {"grid 4x8", "staggered every 2"}
    assert all(r["seconds"] > 0 and r["rows"] >= 1 for r in rows)
    with pytest.raises(ValueError, match="call_records=None"):
        profile_calls(lambda: make_engine(31), runs[:1])
    with pytest.raises(ValueError, match="staggered"):
        profile_runs(vocab_size=VOCAB, max_seqs=4, kv_tokens=120, staggered=(0,))


def test_plan_finds_the_rate_by_doubling_and_bisection():
    from experiments.simulator.plan import Trial, sustained

    seen = []

    def run_at(rate):  # meets the SLOs up to 3.3 req/s
        seen.append(rate)
        return Trial(rate, 1.0 if rate <= 3.3 else 0.5, None)

    cap = sustained(run_at, attainment=0.9, tolerance=0.05)
    assert seen[:3] == [1.0, 2.0, 4.0] and 3.3 * 0.95 <= cap.rate <= 3.3 and cap.simulations == len(seen)
    assert not cap.at_least
    none = sustained(lambda r: Trial(r, 0.0, None), attainment=0.9, tolerance=0.05)
    assert none.rate == 0 and none.trial is None
    every = sustained(lambda r: Trial(r, 1.0, None), attainment=0.9, tolerance=0.05, ceiling=64)
    assert every.rate == 64 and every.at_least


def test_plan_sizes_a_deployment_and_sweeps_its_two_settings(tmp_path):
    from experiments.simulator import plan

    out = plan.main(["--model", "opt-13b", "--device", "a100-80gb", "--rate", "10", "--slo", "ttft:3000,tpot:150",
                     "--num-requests", "60", "--cache-fractions", "0.5", "--page-sizes", "128", "--tolerance", "0.2",
                     "--out", str(tmp_path)])
    answer = out["answer"]
    assert answer["kv_tokens"] == int((0.9 * 80e9 - 12_853_000_000 * 2) // 819_200)
    assert answer["sustained_rate"] > 0 and answer["replicas"] == math.ceil(10 / answer["sustained_rate"])
    assert [r["cache_fraction"] for r in out["by_fraction"]] == [0.5, 0.9]
    assert [r["page_size"] for r in out["by_page"]] == [16, 128]
    # less memory for the cache: fewer KV tokens, never a higher rate
    assert out["by_fraction"][0]["kv_tokens"] < answer["kv_tokens"]
    assert out["by_fraction"][0]["sustained_rate"] <= answer["sustained_rate"] * 1.2
    text = (tmp_path / "plan_opt-13b_a100-80gb.md").read_text()
    assert "10 req/s needs" in text and (tmp_path / "plan_opt-13b_a100-80gb.png").exists()
    assert "True" not in text and "False" not in text  # a bound reads ">= rate", not a flag


def test_plan_flags_are_checked(capsys):
    from experiments.simulator import plan

    base = ["--model", "opt-13b", "--device", "a100-40gb", "--rate", "1"]
    for argv, needle in ((base + ["--slo", "ttft"], "expected KEY:MS"),
                         (base + ["--slo", ","], "give at least one KEY:MS"),
                         (["--model", "opt-13b", "--device", "a100-40gb", "--rate", "0", "--slo", "ttft:1"],
                          "--rate must be a finite number > 0"),
                         (base + ["--slo", "ttft:1", "--attainment", "1.5"], "--attainment must be in (0, 1]"),
                         (base + ["--slo", "ttft:1", "--cache-fraction", "0.5"], "fewer than one 2048-token"),
                         (["--model", "opt-175b", "--device", "a100-80gb", "--rate", "1", "--slo", "ttft:1"],
                          "more devices or a larger fraction")):
        with pytest.raises(SystemExit):
            plan.parse_args(argv)
        assert needle in capsys.readouterr().err


def test_bad_times_and_runs_are_refused_and_change_nothing():
    from paged_jax.paging.contiguous import BuddyAllocator, FirstFitAllocator, HeldRuns
    from paged_jax.simulator.hardware import kv_pool_tokens
    from paged_jax.simulator.step_time import ReplayStepTime, profile_rows

    for alloc in (BuddyAllocator(16), FirstFitAllocator(16)):
        alloc.allocate(4)
        before = (dict(alloc.runs), alloc.num_free, alloc.free_blocks())
        with pytest.raises(ValueError, match="start must be an int"):
            alloc.free(0.0)
        assert (dict(alloc.runs), alloc.num_free, alloc.free_blocks()) == before
    held = HeldRuns(BuddyAllocator(8))
    with pytest.raises(ValueError, match="sizes must be an int >= 1"):
        held.place("x", [2, 0])
    assert held.allocator.num_free == 8
    with pytest.raises(ValueError, match="seconds"):
        ReplayStepTime([-1.0])
    with pytest.raises(ValueError, match="profile row 0: padded_tokens must be a whole number"):
        profile_rows([{**dict.fromkeys(("padded_tokens", "logit_rows", "tokens", "decode_tokens", "rows",
                                        "context_tokens", "attention_pairs"), "16"), "padded_tokens": "16.7",
                       "seconds": "0.1"}])
    with pytest.raises(ValueError, match="memory_fraction must be"):
        kv_pool_tokens(get_model("opt-13b"), get_device("h100"), 1, float("nan"))
    with pytest.raises(ValueError, match="finite and > 0"):
        RooflineStepTime(model=get_model("opt-13b"), device=get_device("h100")).fitted(_works(3), [-0.1] * 3,
                                                                                       source="x")
