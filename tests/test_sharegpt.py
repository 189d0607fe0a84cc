"""ShareGPT loading (truncated file) and vLLM-style request sampling."""

import json
import random

import pytest

from experiments.lib.sharegpt import (
    SampledRequest,
    load_conversations,
    sample_requests,
    sharegpt_path,
)


def whitespace_tokenize(texts):
    return [t.split() for t in texts]


def conv(conv_id, *turns):
    return {
        "id": conv_id,
        "conversations": [
            {"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)
        ],
    }


def words(n):
    return " ".join(["w"] * n)


def test_real_file_is_truncated_and_loads():
    records, report = load_conversations()
    assert report.path == sharegpt_path()
    assert report.truncated
    assert report.records == len(records) > 17_000
    assert 0 < report.bytes_read < report.file_bytes
    assert all("conversations" in r for r in records[:100])


def test_synthetic_truncated_file(tmp_path):
    records = [conv(f"c{i}", f"prompt {i}", f"answer {i}") for i in range(3)]
    text = json.dumps(records, indent=2)
    cut = text.index("answer 2")  # inside the third record
    path = tmp_path / "cut.json"
    path.write_text(text[:cut])
    loaded, report = load_conversations(path)
    assert [r["id"] for r in loaded] == ["c0", "c1"]
    assert (report.path, report.records, report.file_bytes, report.truncated) == (path, 2, cut, True)
    # bytes_read ends exactly at the closing brace of the second record.
    assert text[: report.bytes_read].endswith("}")
    assert json.loads(text[: report.bytes_read] + "]") == records[:2]


def test_complete_file_is_not_truncated(tmp_path):
    records = [conv("a", "x", "y"), conv("b", "z")]
    path = tmp_path / "ok.json"
    path.write_text(json.dumps(records))
    loaded, report = load_conversations(path)
    assert loaded == records
    assert not report.truncated and report.bytes_read == report.file_bytes


@pytest.mark.parametrize("cut_text", ["", "[", "[\n  ", '[{"id": "a", "conv'])
def test_cut_before_any_record(tmp_path, cut_text):
    path = tmp_path / "tiny.json"
    path.write_text(cut_text) if cut_text else path.write_bytes(b"")
    if not cut_text:
        with pytest.raises(ValueError, match="JSON array"):
            load_conversations(path)
        return
    loaded, report = load_conversations(path)
    assert loaded == [] and report.records == 0 and report.truncated


def test_missing_file_names_path(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_conversations(missing)


def synthetic_conversations():
    return [
        conv("ok-a", words(10), words(20)),
        conv("one-turn", words(10)),
        conv("short-prompt", words(3), words(20)),
        conv("short-output", words(10), words(3)),
        conv("long-prompt", words(1025), words(5)),
        conv("long-total", words(1000), words(1049)),
        conv("edge", words(1024), words(1024)),  # exactly at both limits: kept
        conv("ok-b", words(4), words(4), words(999)),
        {"id": "empty", "conversations": []},
        conv("ok-c", words(50), words(60)),
    ]


def expected_order(convs, seed=0):
    two = [c["id"] for c in convs if len(c["conversations"]) >= 2]
    random.Random(seed).shuffle(two)
    return two


def test_sampling_rules_exact_ids():
    convs = synthetic_conversations()
    accepted = {"ok-a", "edge", "ok-b", "ok-c"}
    want = [i for i in expected_order(convs) if i in accepted]
    got = sample_requests(convs, whitespace_tokenize, 4)
    assert [r.conversation_id for r in got] == want
    by_id = {r.conversation_id: r for r in got}
    assert by_id["ok-a"] == SampledRequest(
        prompt=words(10), prompt_len=10, output_len=20, conversation_id="ok-a"
    )
    assert (by_id["edge"].prompt_len, by_id["edge"].output_len) == (1024, 1024)
    assert by_id["ok-b"].output_len == 4  # turn 1, not the later turns


def test_sampling_stops_early_and_tokenizes_lazily():
    convs = [conv(f"c{i}", words(5 + i % 7), words(5 + i % 11)) for i in range(5000)]
    seen = []

    def counting(texts):
        seen.append(len(texts))
        return whitespace_tokenize(texts)

    got = sample_requests(convs, counting, 10, batch_size=16)
    assert len(got) == 10 and seen == [32]
    assert [r.conversation_id for r in got] == expected_order(convs)[:10]


def test_sampling_seed_changes_order():
    convs = [conv(f"c{i}", words(5), words(5)) for i in range(50)]
    a = sample_requests(convs, whitespace_tokenize, 10, seed=0)
    b = sample_requests(convs, whitespace_tokenize, 10, seed=1)
    assert [r.conversation_id for r in a] != [r.conversation_id for r in b]


def test_too_few_qualify_is_an_error():
    with pytest.raises(ValueError, match="num_requests=5"):
        sample_requests(synthetic_conversations(), whitespace_tokenize, 5)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"num_requests": 0}, "num_requests"),
        ({"num_requests": -3}, "num_requests"),
        ({"num_requests": 1.5}, "num_requests"),
        ({"num_requests": 1, "min_len": -1}, "min_len"),
        ({"num_requests": 1, "max_prompt_len": 0}, "max_prompt_len"),
        ({"num_requests": 1, "batch_size": 0}, "batch_size"),
        ({"num_requests": 1, "seed": -1}, "seed"),  # Random(-1) shuffles as Random(1)
        ({"num_requests": 1, "seed": 2.5}, "seed"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        sample_requests(synthetic_conversations(), whitespace_tokenize, **kwargs)
