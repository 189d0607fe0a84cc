"""Multi-turn chat replayed turn by turn (experiments.lib.workloads'
conversations, experiments.lib.online's replay) and the KV tiers' benchmark on it (experiments.serving.kv_tiers): turns in the chat
template that continue the previous answer, later prompts that carry the
answers the engine generated, every turn served once, and the script's
quick path on the toy model.
"""

import pytest

from experiments.lib import provenance
from experiments.lib.online import hit_tokens, run_conversations
from experiments.lib.workloads import Conversation, sharegpt_conversations
from experiments.serving import kv_tiers
from tests.engine_helpers import VOCAB, make_engine

RECORDS = [{"conversations": [{"from": "human", "value": f"question {i} " * (3 + i)},
                              {"from": "gpt", "value": f"answer {i} " * (2 + i)},
                              {"from": "human", "value": f"follow-up {i}"},
                              {"from": "gpt", "value": "ok " * 5},
                              {"from": "human", "value": "and then?"},
                              {"from": "gpt", "value": "the end"}]} for i in range(4)]


@pytest.fixture(scope="module")
def tokenizer():
    from models.loading.gguf_loader import smollm2_gguf_path
    from models.tokenizer import load_tokenizer

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return load_tokenizer()


def test_turns_continue_the_template_after_each_answer(tokenizer):
    convs = sharegpt_conversations(tokenizer, num_conversations=3, max_turns=3, max_context=512, max_output_len=4,
                                   seed=1, conversations=RECORDS)
    assert len(convs) == 3 and all(len(c.turns) == 3 for c in convs)
    conv = convs[0]
    (first, a0), (second, a1), (third, _) = conv.turns
    assert tokenizer.decode(first, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    # A later turn: the answer's end, the user's message, the assistant's header.
    text = tokenizer.decode(second, skip_special_tokens=False)
    assert text.startswith("<|im_end|>") and text.endswith("<|im_start|>assistant\n") and "<|im_start|>user" in text
    assert a0 <= 4 and a1 <= 4  # capped
    assert conv.context_len() == sum(len(ids) + n for ids, n in conv.turns)
    # The whole conversation rendered, with the answers as generated ids, is what the replay sends.
    short = sharegpt_conversations(tokenizer, num_conversations=1, max_turns=3, max_context=conv.context_len(2),
                                   max_output_len=4, seed=1, conversations=RECORDS)
    assert len(short[0].turns) == 2  # the third turn would pass max_context
    with pytest.raises(ValueError, match="only 0 conversations of two turns fit max_context=8"):
        sharegpt_conversations(tokenizer, num_conversations=1, max_turns=2, max_context=8, max_output_len=4,
                               conversations=RECORDS)
    with pytest.raises(ValueError, match="max_turns must be an int >= 2, got max_turns=1"):
        sharegpt_conversations(tokenizer, num_conversations=1, max_turns=1, max_context=64, max_output_len=4)


def test_replay_sends_the_generated_answers_back_and_serves_every_turn():
    convs = [Conversation(0, (((1, 2, 3, 4, 5, 6), 5), ((7, 8), 3), ((9,), 2))),
             Conversation(1, (((10, 11, 12, 13, 14), 4), ((15, 16, 17), 2)))]
    engine = make_engine(num_pages=60, page_size=4)
    run = run_conversations(engine, convs, conversation_rate=float("inf"), think_s=0.01, seed=0)
    assert sorted(run.outputs) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
    for (conv, turn), out in run.outputs.items():
        assert len(out.outputs[0].output_ids) == convs[conv].turns[turn][1]
        if turn:
            before = run.outputs[(conv, turn - 1)]
            assert out.prompt_ids == (before.prompt_ids + before.outputs[0].output_ids
                                      + list(convs[conv].turns[turn][0]))
    # A later turn's prompt starts with the previous context: its full pages hit the prefix cache.
    assert run.outputs[(0, 1)].num_cached_tokens == (6 + 5) // 4 * 4
    prompt, cached, host = hit_tokens(list(run.outputs.values()))
    assert prompt == sum(len(o.prompt_ids) for o in run.outputs.values()) and cached > 0 and host == 0
    assert [r.request_id for r in run.records] == run.turns and run.duration_s > 0
    assert all(t < VOCAB for out in run.outputs.values() for t in out.outputs[0].output_ids)


def test_the_benchmark_on_the_toy_model(tmp_path):
    result = kv_tiers.main(["--model", "toy", "--num-conversations", "3", "--max-turns", "3", "--max-output-len", "4",
                            "--max-seqs", "4", "--max-batched-tokens", "16", "--max-context", "128",
                            "--host-sizes", "0", "1", "--think-s", "0.05", "--conversation-rate", "inf",
                            "--out", str(tmp_path)])
    assert result["same"] == result["total"] > 3
    rows = result["rows"]
    assert [r["host_over_working_set"] for r in rows] == [0.0, 1.0] and rows[0]["spilled_pages"] == 0
    _, csv_rows = provenance.read_csv(tmp_path / "kv_tiers.csv")
    assert len(csv_rows) == 2 and (tmp_path / "kv_tiers.png").stat().st_size > 0
    assert "issue 38's target" in (tmp_path / "kv_tiers.md").read_text()


@pytest.mark.parametrize("argv, words", [
    (["--max-turns", "1"], "--max-turns must be >= 2"),
    (["--pool-fraction", "0"], "--pool-fraction must be in (0, 1]"),
    (["--host-sizes", "0", "-1"], "--host-sizes must be finite numbers >= 0, got -1.0"),
    (["--host-sizes", "1", "1"], "--host-sizes lists a size twice"),
    (["--think-s", "nan"], "--think-s must be a finite number >= 0"),
    (["--conversation-rate", "0"], "--conversation-rate must be > 0"),
])
def test_the_benchmark_refuses_bad_flags(argv, words, capsys):
    with pytest.raises(SystemExit):
        kv_tiers.parse_args(argv)
    assert words in capsys.readouterr().err


def _restart_args(tmp_path, *extra):
    from experiments.serving import kv_restart

    return kv_restart, ["--model", "toy", "--num-requests", "4", "--max-output-len", "4", "--max-seqs", "4",
                        "--max-batched-tokens", "16", "--out", str(tmp_path), *extra]


def test_a_second_serve_on_the_same_disk_folder_hits_the_cacheable_tokens(tmp_path):
    kv_restart, argv = _restart_args(tmp_path, "--role", "serve", "--disk-dir", str(tmp_path / "disk"))
    args = kv_restart.parse_args(argv)
    first, second = kv_restart.serve(args), kv_restart.serve(args)
    assert first["outputs_sha"] == second["outputs_sha"] and first["disk_files_written"] > 0
    assert second["cached_tokens"] == second["cacheable_tokens"] > 0 and second["disk_tokens"] > 0
    assert second["disk_files_written"] == 0 and second["refused_files"] == 0


@pytest.mark.slow  # two processes, each loading JAX and compiling
def test_the_restart_benchmark_runs_two_processes(tmp_path):
    kv_restart, argv = _restart_args(tmp_path)
    result = kv_restart.main(argv)
    assert result["same"] and result["share"] >= 0.9
    assert "issue 38's target: at least 90%" in (tmp_path / "kv_restart.md").read_text()


@pytest.mark.parametrize("argv, words", [(["--role", "serve"], "--role serve needs --disk-dir"),
                                         (["--disk-cache-gib", "0"], "--disk-cache-gib must be a finite number > 0")])
def test_the_restart_benchmark_refuses_bad_flags(argv, words, capsys):
    from experiments.serving import kv_restart

    with pytest.raises(SystemExit):
        kv_restart.parse_args(argv)
    assert words in capsys.readouterr().err
