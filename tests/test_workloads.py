"""The serving workloads of Figures 16 and 17 (experiments.lib.workloads), the
``-nocache`` policies (experiments.lib.policies) and serving_figures' quick runs
of them on the toy model.

Prompts are built with a character tokenizer over hand-made conversations,
so every expected prompt can be written out; the packaged-lengths path
(no tokenizer) is checked for its shape.
"""

import pytest
from flax import nnx

from experiments.lib import online, policies, provenance, workloads
from experiments.lib.sharegpt import conversation_rounds, sample_requests
from experiments.serving import serving_figures
from models.config import LlamaConfig
from models.llama import Llama
from models.ragged import RaggedModel


class CharTokenizer:
    """One id per character (its code point) and a ChatML template with a
    fixed system prompt: lengths are character counts."""

    SYSTEM = "<|im_start|>system\nBe brief.<|im_end|>\n"

    def encode(self, text):
        return [ord(c) for c in text]

    def encode_batch(self, texts):
        return [self.encode(t) for t in texts]

    def decode(self, ids):
        return "".join(map(chr, ids))

    def apply_chat_template(self, messages, add_generation_prompt=True):
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return self.SYSTEM + turns + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def record(name, *texts, roles=None):
    roles = roles or ["human", "gpt"] * len(texts)
    return {"id": name, "conversations": [{"from": r, "value": t} for r, t in zip(roles, texts)]}


def turn(role, text):
    return f"<|im_start|>{role}\n{text}<|im_end|>\n"


# ----------------------------------------------------------------- parsing


def test_workload_names_and_their_policies():
    w = workloads.workload("prefix-5")
    assert (w.prompts, w.shots, w.max_prompt_len) == ("prefix", 5, workloads.PREFIX_PROMPT_LEN)
    assert w.policies == ("paged", "paged-nocache", "oracle-nocache")
    c = workloads.workload("chatbot", max_prompt_len=64)
    assert (c.prompts, c.max_prompt_len, c.policies) == ("chatbot", 64, policies.POLICIES)
    assert workloads.workload("beam-2").prompts == "sharegpt"
    for name in ("beam-2", "parallel-6"):
        assert workloads.workload(name).policies == ("paged", "max", "oracle")
    assert workloads.workload("basic").policies == policies.POLICIES
    assert workloads.workload("parallel-10").name == "parallel-10"
    for bad in ("prefix-0", "prefix", "prefix-x", "chatbot-2", "fig16", "parallel-02", "beam-+2", "prefix- 5",
                "parallel-4 ", "beam--1", "parallel-2.0", "parallel-\u00b2", "parallel-\u0663"):
        with pytest.raises(ValueError, match="workload must be"):
            workloads.workload(bad)
    with pytest.raises(ValueError, match="'parallel-N', 'beam-W', 'prefix-K' or 'chatbot'.*without leading zeros, "
                                         "sign or spaces.*got 'parallel-02'"):
        workloads.workload("parallel-02")
    for bad in (None, 5, ["basic"], b"basic"):
        with pytest.raises(ValueError, match="workload name must be a str"):
            workloads.workload(bad)
    with pytest.raises(ValueError, match="max_prompt_len"):
        workloads.workload("basic", max_prompt_len=100)
    with pytest.raises(ValueError, match="max_prompt_len"):
        workloads.workload("chatbot", max_prompt_len=2048)


def test_policy_names_split_into_reservation_and_caching():
    assert policies.split_policy("oracle-nocache") == ("oracle", False)
    assert policies.split_policy("paged") == ("paged", True)
    assert policies.POLICY_LABELS["paged-nocache"] == "paged (vLLM), no prefix cache"
    with pytest.raises(ValueError, match="policy"):
        policies.split_policy("paged-cache")
    assert policies.engine_options("max-firstfit-nocache") == dict(reservation="max", allocator="first_fit",
                                                                   enable_prefix_caching=False)
    assert policies.engine_options("oracle") == dict(reservation="oracle", allocator="buddy",
                                                     enable_prefix_caching=True)
    assert policies.engine_options("pow2-pages")["allocator"] == "pages"
    assert policies.POLICY_LABELS["oracle-pages"] == "Orca (Oracle), page-backed"
    for bad in ("paged-pages", "oracle-nocache-pages", "oracle-buddy"):  # paging places no run; the order is fixed
        with pytest.raises(ValueError, match=f"got policy='{bad}'"):
            policies.engine_options(bad)
    model = Llama(LlamaConfig(vocab_size=64, model_dim=16, mlp_dim=32, num_layers=1, num_q_heads=2, num_kv_heads=1,
                              head_dim=8), rngs=nnx.Rngs(0))
    spec = online.EngineSpec(model=model, paged_model=RaggedModel(model), kv_tokens=4096, page_size=16, max_seqs=4,
                             max_batched_tokens=32)
    configs = {p: spec.build(p).config for p in ("paged", "paged-nocache", "oracle-nocache")}
    assert {p: (c.reservation, c.enable_prefix_caching) for p, c in configs.items()} == {
        "paged": ("paged", True), "paged-nocache": ("paged", False), "oracle-nocache": ("oracle", False)}


def test_conversation_rounds_stop_where_the_turns_stop_alternating():
    assert conversation_rounds(record("a", "q0", "a0", "q1", "a1", "q2")) == [("q0", "a0"), ("q1", "a1")]
    assert conversation_rounds(record("b", "q0", "a0", "q1", roles=["human", "gpt", "gpt"])) == [("q0", "a0")]
    assert conversation_rounds(record("c", "s", "q0", "a0", roles=["system", "human", "gpt"])) == []
    assert conversation_rounds({"id": "d"}) == []


# ---------------------------------------------------------- Figure 16 prompts


def prefix_conversations():
    """Twelve one-round chats: prompt ``i`` is 20 + i characters, its answer
    30 + i; chat 3's prompt is 60 characters (over the 40 allowed)."""
    recs = [record(f"c{i}", f"{i:02d}" + "q" * (18 + i), f"{i:02d}" + "a" * (28 + i)) for i in range(12)]
    recs[3] = record("c3", "03" + "q" * 58, "03" + "a" * 30)
    return recs


def test_prefix_prompts_are_the_examples_then_the_request():
    tok, convs = CharTokenizer(), prefix_conversations()
    requests, prefix_len = workloads.prefix_requests(tok, shots=2, shot_tokens=5, max_prompt_len=40,
                                                     num_requests=4, max_output_len=31, seed=0, conversations=convs)
    sampled = sample_requests(convs, tok.encode_batch, 6, seed=0, max_prompt_len=40)
    answers = {r["id"]: r["conversations"][1]["value"] for r in convs}
    # Each side of an example keeps its first 5 characters.
    prefix = tok.SYSTEM + "".join(turn("user", s.prompt[:5]) + turn("assistant", answers[s.conversation_id][:5])
                                  for s in sampled[:2])
    # 39 system + 2 shots * (5 + 28 around a user turn + 5 + 33 around an assistant's).
    assert len(prefix) == 39 + 2 * (5 + 28 + 5 + 33) == 181 == prefix_len
    assert len(requests) == 4
    for i, (r, s) in enumerate(zip(requests, sampled[2:])):
        assert r.request_id == i
        assert tok.decode(r.prompt_ids) == prefix + turn("user", s.prompt) + "<|im_start|>assistant\n"
        assert r.max_new_tokens == min(len(answers[s.conversation_id]), 31) and r.ignore_eos
        assert s.conversation_id != "c3"  # its 60-character prompt is over max_prompt_len
    # Every request's turn opens with "<|im_start|>user\n" (and here a "0" or "1" of its number, maybe shared).
    assert workloads.shared_prefix_len(requests) >= len(prefix) + len("<|im_start|>user\n")
    again, _ = workloads.prefix_requests(tok, shots=2, shot_tokens=5, max_prompt_len=40, num_requests=4,
                                         max_output_len=31, seed=0, conversations=convs)
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in requests]
    other, _ = workloads.prefix_requests(tok, shots=2, shot_tokens=5, max_prompt_len=40, num_requests=4,
                                         max_output_len=31, seed=1, conversations=convs)
    assert other[0].prompt_ids[:len(prefix)] != requests[0].prompt_ids[:len(prefix)]


def test_prefix_needs_enough_pairs():
    with pytest.raises(ValueError, match="num_requests"):
        workloads.prefix_requests(CharTokenizer(), shots=5, shot_tokens=5, max_prompt_len=40, num_requests=8,
                                  max_output_len=8, conversations=prefix_conversations())


@pytest.mark.parametrize("shots", [1, 5])
def test_prefix_without_a_tokenizer_shares_exactly_the_shots(shots):
    kw = dict(shots=shots, shot_tokens=10, max_prompt_len=100, num_requests=8, max_output_len=16, vocab_size=49152)
    requests, prefix_len = workloads.prefix_requests(None, seed=3, **kw)
    assert prefix_len == shots * 2 * 10
    base = workloads.packaged_requests(1000, 2048, vocab_size=49152, seed=3)
    prefix = requests[0].prompt_ids[:shots * 2 * 10]
    overhead = workloads._template_overhead()
    own = [r for r in base if len(r.prompt_ids) - overhead <= 100][:8]
    assert [r.prompt_ids for r in requests] == [prefix + r.prompt_ids for r in own]
    assert [r.max_new_tokens for r in requests] == [min(r.max_new_tokens, 16) for r in own]
    assert requests[1].prompt_ids == workloads.prefix_requests(None, seed=3, **kw)[0][1].prompt_ids
    assert workloads.prefix_requests(None, seed=4, **kw)[0][0].prompt_ids[:len(prefix)] != prefix


# ---------------------------------------------------------- Figure 17 prompts


def chats():
    """Eight chats of 1 to 4 rounds (texts name their chat and round), one
    that opens with a system turn, and one whose round-1 answer is 3
    characters (under vLLM's 4: never an output)."""
    recs = [record(f"c{i}", *[f"c{i}{kind}{k}" + "." * (10 * k) for k in range(1 + i % 4) for kind in "qa"])
            for i in range(8)]
    recs.append(record("sys", "s", "c8q0", "c8a0", "c8q1", "c8a1", roles=["system", "human", "gpt", "human", "gpt"]))
    recs.append(record("short", "c9q0", "c9a0", "c9q1", "abc"))
    return recs


def expected_chat_requests(tok, convs, max_prompt_len, max_output_len):
    """Every (prompt ids, output length) a chatbot request may be: any round
    k >= 1 of any chat of two or more rounds, whose answer has >= 4 tokens."""
    options = {}
    for rec in convs:
        rounds = conversation_rounds(rec)
        for k in range(1, len(rounds)):
            msgs = [{"role": role, "content": text} for pair in rounds[:k]
                    for role, text in zip(("user", "assistant"), pair)]
            ids = tok.encode(tok.apply_chat_template(msgs + [{"role": "user", "content": rounds[k][0]}]))
            if len(rounds[k][1]) >= 4:
                options[(rec["id"], k)] = (ids[-max_prompt_len:], min(len(rounds[k][1]), max_output_len))
    return options


def test_chatbot_prompts_are_histories_cut_to_their_last_tokens():
    tok, convs = CharTokenizer(), chats()
    options = expected_chat_requests(tok, convs, 120, 25)
    requests = workloads.chatbot_requests(tok, max_prompt_len=120, num_requests=4, max_output_len=25, seed=0,
                                          conversations=convs, batch_size=3)
    seen = set()
    for r in requests:
        match = [key for key, (ids, out) in options.items() if ids == r.prompt_ids and out == r.max_new_tokens]
        assert len(match) == 1, r
        seen.add(match[0][0])
        assert len(r.prompt_ids) <= 120
        assert tok.decode(r.prompt_ids).endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert len(seen) == 4  # one request per conversation
    assert any(len(r.prompt_ids) == 120 for r in requests)  # a long history, cut: its end kept
    assert [r.prompt_ids for r in workloads.chatbot_requests(tok, max_prompt_len=120, num_requests=4,
                                                             max_output_len=25, seed=0, conversations=convs)] == [
        r.prompt_ids for r in requests]
    picks = {s: [r.prompt_ids for r in workloads.chatbot_requests(tok, max_prompt_len=120, num_requests=4,
                                                                 max_output_len=25, seed=s, conversations=convs)]
             for s in (1, 2)}
    assert picks[1] != picks[2]


def test_chatbot_skips_what_cannot_be_a_request():
    tok, convs = CharTokenizer(), chats()
    # Chats of two or more rounds: c1, c2, c3, c5, c6, c7 and "short", whose only later answer is 3
    # characters; "sys" opens with a system turn, so it has no rounds.
    qualifying = sum(len(conversation_rounds(r)) >= 2 for r in convs)
    assert qualifying == 7
    with pytest.raises(ValueError, match="only 6 of 7"):
        workloads.chatbot_requests(tok, max_prompt_len=120, num_requests=7, max_output_len=25, conversations=convs)


def test_chatbot_without_a_tokenizer_keeps_the_packaged_shape():
    requests = workloads.chatbot_requests(None, max_prompt_len=300, num_requests=10, max_output_len=20, seed=0,
                                          vocab_size=49152)
    base = workloads.packaged_requests(1000, 2048, vocab_size=49152, seed=0)
    tails = [r.prompt_ids for r in base]
    assert len(requests) == 10 and all(len(r.prompt_ids) <= 300 for r in requests)
    assert any(len(r.prompt_ids) == 300 for r in requests)
    for r in requests:  # each prompt ends with one packaged prompt: the current round's
        assert any(r.prompt_ids[-min(len(t), 300):] == t[-300:] for t in tails)
        assert 1 <= r.max_new_tokens <= 20
    again = workloads.chatbot_requests(None, max_prompt_len=300, num_requests=10, max_output_len=20, seed=0,
                                       vocab_size=49152)
    assert [r.prompt_ids for r in again] == [r.prompt_ids for r in requests]



@pytest.mark.parametrize("name", ["basic", "beam-2", "prefix-1", "chatbot"])
def test_packaged_limit_is_what_the_workload_makes(name):
    w = workloads.workload(name)
    most = workloads.packaged_limit(w, vocab_size=49152, seed=1)
    requests, _ = w.requests(None, vocab_size=49152, num_requests=most, max_output_len=64, seed=1)
    assert len(requests) == most and (most == 1000) == (w.prompts == "sharegpt")
    if w.prompts != "sharegpt":
        with pytest.raises(ValueError, match=f"{most} .*num_requests={most + 1}"):
            w.requests(None, vocab_size=49152, num_requests=most + 1, max_output_len=64, seed=1)
    with pytest.raises(ValueError, match="vocab_size"):
        workloads.packaged_limit(w, vocab_size=0)

def test_shared_prefix_len():
    make = workloads._request
    rs = [make(0, [1, 2, 3, 4], 2, 2), make(1, [1, 2, 3], 2, 2), make(2, [1, 2, 9, 4], 2, 2)]
    assert workloads.shared_prefix_len(rs) == 2
    assert workloads.shared_prefix_len(rs[:2]) == 3
    assert workloads.shared_prefix_len([]) == 0


# ------------------------------------------------------------------- scripts


@pytest.mark.parametrize("argv, flag", [
    (["--workload", "prefix-0"], "--workload"),
    (["--workload", "basic", "--max-prompt-len", "100"], "--max-prompt-len"),
    (["--workload", "chatbot", "--max-prompt-len", "3"], "--max-prompt-len"),
    (["--workload", "prefix-1", "--fig13-rate", "1"], "--fig13-rate"),
    (["--policy", "paged-cache"], "--policy"),
])
def test_serving_figures_refuses_bad_workload_flags(argv, flag, capsys):
    with pytest.raises(SystemExit):
        serving_figures.parse_args(argv)
    assert flag in capsys.readouterr().err


def test_serving_figures_names_the_files_and_policies_of_each_figure(tmp_path):
    args = serving_figures.parse_args(["--workload", "prefix-5", "--out", str(tmp_path)])
    assert args.stems == ("serving_fig16_prefix-5", None)
    assert args.policy == ["paged", "paged-nocache", "oracle-nocache"]
    args = serving_figures.parse_args(["--workload", "chatbot", "--quick", "--policy", "oracle", "max-nocache",
                                       "--out", str(tmp_path)])
    assert args.stems == ("serving_fig17_quick", None) and args.policy == ["paged", "oracle", "max-nocache"]


def read_runs(path):
    _, rows = provenance.read_csv(path)
    return rows


def test_fig16_quick_on_the_toy_model_shows_the_cache(tmp_path):
    summary, batched = serving_figures.main(["--quick", "--model", "toy", "--workload", "prefix-1",
                                             "--out", str(tmp_path)])
    assert batched is None
    for ext in ("md", "csv", "png"):
        assert (tmp_path / f"serving_fig16_prefix-1_quick.{ext}").stat().st_size > 0
    cached = {s["policy"]: s["cached_tokens"] for s in summary}
    # The toy prefix: 54 random ids and the 24-id template opening, 78 tokens = 4 full pages of 16. Every
    # request but the first (or those admitted with it) takes them from the cache.
    assert set(cached) == {"paged", "paged-nocache", "oracle-nocache"}
    assert 0 < cached["paged"] <= 64 and cached["paged-nocache"] == cached["oracle-nocache"] == 0
    runs = read_runs(tmp_path / "serving_fig16_prefix-1_quick.csv")
    assert {r["compiled"] for r in runs} == {"0"}
    assert all((float(r["mean_cached_tokens"]) > 0) == (r["policy"] == "paged") for r in runs)
    text = (tmp_path / "serving_fig16_prefix-1_quick.md").read_text()
    assert "1.67x" in text and "Orca (Oracle), no prefix cache" in text and "prefix of 54 tokens" in text


def test_fig17_quick_on_the_toy_model(tmp_path):
    summary, _ = serving_figures.main(["--quick", "--model", "toy", "--workload", "chatbot", "--out", str(tmp_path)])
    for ext in ("md", "csv", "png"):
        assert (tmp_path / f"serving_fig17_quick.{ext}").stat().st_size > 0
    assert [s["policy"] for s in summary] == list(policies.POLICIES)
    assert [s["paper_paged_over_policy"] for s in summary] == ["-", "2x", "2x", "2x"]
    assert "last 256 tokens" in (tmp_path / "serving_fig17_quick.md").read_text()
