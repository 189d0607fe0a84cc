"""``--profile``: a jax.profiler trace of a few engine steps after warm-up."""

import argparse
import gzip
import json
import time

import numpy as np
import pytest
from engine_helpers import make_engine, toy_requests

from experiments.serving import bench_serving
from paged_jax.engine.outputs import drain
from paged_jax.profiling import (
    ProfileSpec,
    StepProfiler,
    add_profile_args,
    check_profile_args,
    report_trace,
    trace_slices,
)


def test_traces_only_the_asked_steps_with_the_engine_phases(tmp_path):
    engine = make_engine()
    requests = toy_requests(4, max_new=(8, 12))
    for r in requests:
        engine.add_request(r)
    with StepProfiler(engine, tmp_path / "trace", skip=3, steps=2) as stepper:
        outputs = drain(stepper, len(requests), progress=False)
    assert stepper.traced == 2 and len(outputs) == 4
    slices = trace_slices(tmp_path / "trace")
    steps = sorted(int(e["args"]["step_num"]) for e in slices if e["name"] == "engine_step")
    assert steps == [3, 4]
    names = {e["name"] for e in slices}
    assert {"schedule", "dispatch", "complete"} <= names
    assert not any(n.startswith("$builtins") for n in names)  # the Python tracer is off by default


def test_a_run_shorter_than_the_skip_writes_no_trace_and_outputs_are_unchanged(tmp_path):
    want = sorted((o.request_id, o.output_ids) for o in make_engine().run(toy_requests(3)))
    engine = make_engine()
    for r in toy_requests(3):
        engine.add_request(r)
    started = time.time()
    with StepProfiler(engine, tmp_path / "never", skip=10_000, steps=1) as stepper:
        got = sorted((o.request_id, o.output_ids) for o in drain(stepper, 3, progress=False))
    assert got == want and stepper.traced == 0 and not (tmp_path / "never").exists()
    # What serve_sharegpt and bench_serving print then (they said "wrote the trace" before).
    assert report_trace(ProfileSpec(out_dir=tmp_path / "never", skip=10_000), started).startswith(
        f"no trace written to {tmp_path / 'never'}: the run ended within --profile-skip 10000 steps")
    assert stepper.num_free_pages == engine.num_free_pages  # everything else is the engine's


@pytest.mark.parametrize("argv, message", [
    (["--profile", ""], "argument --profile: must be a folder path, got ''"),
    (["--profile-skip", "-1"], "--profile-skip must be >= 0, got -1"),
    (["--profile-steps", "0"], "--profile-steps must be >= 1, got 0"),
])
def test_bad_flags_are_named(argv, message, capsys):
    p = argparse.ArgumentParser()
    add_profile_args(p)
    with pytest.raises(SystemExit):
        check_profile_args(p, p.parse_args(argv))
    assert message in capsys.readouterr().err


def test_spec_from_flags_and_bad_arguments(tmp_path):
    p = argparse.ArgumentParser()
    add_profile_args(p)
    assert ProfileSpec.from_args(p.parse_args([])) is None
    spec = ProfileSpec.from_args(p.parse_args(["--profile", str(tmp_path), "--profile-steps", "3"]))
    assert (spec.out_dir, spec.skip, spec.steps, spec.python) == (tmp_path, 8, 3, False)
    with pytest.raises(ValueError, match="skip must be an int >= 0, got skip=-2"):
        StepProfiler(None, tmp_path, skip=-2)
    with pytest.raises(ValueError, match="steps must be an int >= 1, got steps=0"):
        StepProfiler(None, tmp_path, steps=0)
    # One rule for both: NumPy ints are ints, 1 is not a bool, a folder is a path.
    for make in (lambda **kw: StepProfiler(None, **kw), ProfileSpec):
        got = make(out_dir=str(tmp_path), skip=np.int64(2), steps=np.int32(3), python=np.bool_(True))
        assert (got.out_dir, got.skip, got.steps, got.python) == (tmp_path, 2, 3, True)
        assert type(got.skip) is int and type(got.python) is bool
        with pytest.raises(ValueError, match="python must be a bool, got python=1"):
            make(out_dir=tmp_path, python=1)
        with pytest.raises(ValueError, match="skip must be an int >= 0, got skip=True"):
            make(out_dir=tmp_path, skip=True)
        for bad in (None, "", "a\0b"):
            with pytest.raises(ValueError, match=r"out_dir must be a folder path \(not empty, no NUL byte\)"):
                make(out_dir=bad)


def test_checking_the_flags_leaves_no_folder_behind(tmp_path, capsys):
    """The folder is created to check it can be, then removed: a refusal of
    a later flag leaves nothing; the trace creates it when it starts."""
    p = argparse.ArgumentParser()
    add_profile_args(p)
    check_profile_args(p, p.parse_args(["--profile", str(tmp_path / "a" / "b")]))
    assert not (tmp_path / "a").exists()
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit):
        check_profile_args(p, p.parse_args(["--profile", str(tmp_path / "file" / "b")]))
    assert "is not a folder that can be created" in capsys.readouterr().err


def test_bench_serving_traces_a_few_steps_after_warm_up(tmp_path, capsys):
    results = bench_serving.main(["--model", "toy", "--num-requests", "3", "--max-output-len", "4", "--max-seqs", "16",
                                  "--max-batched-tokens", "32", "--request-rate", "inf", "--out", str(tmp_path),
                                  "--profile", str(tmp_path / "trace"), "--profile-skip", "2", "--profile-steps",
                                  "3"])
    assert len(results) == 1 and results[0].compiles.requests == 0  # the timed run: no row reads the traced one
    steps = sorted(int(e["args"]["step_num"]) for e in trace_slices(tmp_path / "trace") if e["name"] == "engine_step")
    assert steps == [2, 3, 4]
    out = capsys.readouterr().out
    assert "3 steps traced; wrote the trace to " in out and "perfetto_trace.json.gz" in out


def test_trace_slices_reads_a_file_a_run_or_a_folder_of_one_run(tmp_path):
    with pytest.raises(ValueError, match="exactly one .* found 0"):
        trace_slices(tmp_path)
    files = []
    for run in ("2026_01_01_00_00_00", "2026_01_01_00_01_00"):  # two runs of one --profile DIR
        f = tmp_path / "plugins" / "profile" / run / "perfetto_trace.json.gz"
        f.parent.mkdir(parents=True)
        f.write_bytes(gzip.compress(json.dumps({"traceEvents": [{"ph": "X", "name": run}, {"ph": "M"}]}).encode()))
        files.append(f)
        assert [e["name"] for e in trace_slices(f)] == [run] == [e["name"] for e in trace_slices(f.parent)]
    with pytest.raises(ValueError, match=r"found 2 \(pass one of them\):\n  .*00_00_00.*\n  .*00_01_00"):
        trace_slices(tmp_path)
    files[0].unlink()
    assert [e["name"] for e in trace_slices(tmp_path)] == ["2026_01_01_00_01_00"]
    for content in (b"not gzip", gzip.compress(b"not json"), gzip.compress(b'{"foo": 1}'), b""):
        files[1].write_bytes(content)
        with pytest.raises(ValueError, match="perfetto_trace.json.gz' is not a Perfetto trace"):
            trace_slices(files[1])
    for bad, match in (("", "must be a non-empty str or Path"), (5, "got path=5"), ("/tmp/a\0b", "NUL"),
                       (tmp_path / "missing", "does not exist")):
        with pytest.raises(ValueError, match=match):
            trace_slices(bad)


def test_a_trace_that_cannot_start_warns_and_the_engine_steps_on(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    want = sorted((o.request_id, o.output_ids) for o in make_engine().run(toy_requests(3)))
    engine = make_engine()
    for r in toy_requests(3):
        engine.add_request(r)
    with StepProfiler(engine, blocker / "trace", skip=0, steps=2) as stepper:
        with pytest.warns(RuntimeWarning, match="no trace written"):
            got = sorted((o.request_id, o.output_ids) for o in drain(stepper, 3, progress=False))
    assert got == want and stepper.traced == 0
    assert stepper.failed.startswith(("FileExistsError", "NotADirectoryError")), stepper.failed
