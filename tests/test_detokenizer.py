"""The incremental detokenizer streams exactly the text ``decode`` gives, a
whole character at a time, and ends it before a stop string without ever
handing out part of one: with SmolLM2's byte-level BPE and with a tiny
SentencePiece-style tokenizer (Metaspace ``▁``, byte fallback) built here."""

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import decoders, pre_tokenizers
from tokenizers.decoders import DecodeStream

from paged_jax.engine.detokenizer import IncrementalDetokenizer, as_tokenizer

PROMPT = "The capital of France is"
SPLIT_TEXTS = ["👍🏽", "👨‍👩‍👧", "🙂🚀 ok", "日本語のテキスト", " 中文，한국어 and ελληνικά ✓"]
# Random texts without U+FFFD: DecodeStream holds back text ending in one (see
# test_a_trailing_replacement_character_is_held_back). SmolLM2's vocabulary
# lacks the bytes 0x04 0x06 0x13 0x14 0x16 0x1d 0xf1 0xf2 (BPE drops them), so
# its texts keep to characters it can encode: no planes 4-15.
TEXTS = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"), max_size=24)
SMOLLM2_TEXTS = st.text(st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs",),
                                      exclude_characters="\ufffd\x04\x06\x13\x14\x16\x1d"), max_size=24)


@pytest.fixture(scope="module")
def smollm2():
    from models.loading.gguf_loader import smollm2_gguf_path
    from models.tokenizer import load_tokenizer

    try:
        smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return load_tokenizer()


def sentencepiece(decoder: str) -> tokenizers.Tokenizer:
    """A Unigram model over a few ``▁`` words, single letters and the 256
    ``<0xXX>`` byte pieces (every other character falls back to its UTF-8
    bytes), decoded as Gemma-style ``metaspace`` or Llama-2-style ``strip``."""
    pieces = ["▁", "▁the", "▁capital", "▁of", "▁is", "▁Paris", "▁world", "he", "ll", "or"]
    pieces += list("abcdefghijklmnopqrstuvwxyzFHPT.,!?")
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    vocab += [(p, -1.0 - 0.1 * len(p)) for p in pieces]
    tok = tokenizers.Tokenizer(tokenizers.models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = {
        "metaspace": decoders.Sequence([decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="first")]),
        "strip": decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)]),
    }[decoder]
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in ("<s>", "</s>")])
    return tok


SENTENCEPIECE = {d: sentencepiece(d) for d in ("metaspace", "strip")}


def stream(tok, prompt_ids, out_ids, **kw):
    """Pushes ``out_ids`` one by one, taking a delta after each as the engine
    does; returns the detokenizer and the deltas."""
    d = IncrementalDetokenizer(tok, prompt_ids, **kw)
    deltas = []
    for i in out_ids:
        stop = d.push(i)
        deltas.append(d.take_delta(finished=stop is not None))
        if stop is not None:
            return d, deltas
    deltas.append(d.take_delta(finished=True))
    return d, deltas


def continuation(tok, prompt_ids, out_ids) -> str:
    """What ``out_ids`` add to the prompt's text: the truth for a stream."""
    full, before = tok.decode(prompt_ids + out_ids), tok.decode(prompt_ids)
    assert full.startswith(before)
    return full[len(before):]


@settings(max_examples=60, deadline=None)
@given(text=SMOLLM2_TEXTS, prompt=st.sampled_from(["", PROMPT, "<|im_start|>assistant\n"]))
def test_byte_level_deltas_equal_decode(smollm2, text, prompt):
    tok = smollm2.hf_tokenizer
    out_ids, prompt_ids = smollm2.encode(text), smollm2.encode(prompt)
    d, deltas = stream(tok, prompt_ids, out_ids)
    assert "".join(deltas) == d.text == tok.decode(out_ids) == continuation(tok, prompt_ids, out_ids)
    assert all("\ufffd" not in delta for delta in deltas)


@settings(max_examples=60, deadline=None)
@given(text=TEXTS, prompt=st.sampled_from(["", PROMPT, "Paris"]), decoder=st.sampled_from(sorted(SENTENCEPIECE)))
def test_sentencepiece_deltas_equal_decode_after_the_prompt(text, prompt, decoder):
    tok = SENTENCEPIECE[decoder]
    out_ids, prompt_ids = tok.encode(text).ids, tok.encode(prompt).ids
    d, deltas = stream(tok, prompt_ids, out_ids)
    assert "".join(deltas) == d.text == continuation(tok, prompt_ids, out_ids)
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize("decoder", sorted(SENTENCEPIECE))
def test_sentencepiece_first_token_keeps_its_space(decoder):
    tok = SENTENCEPIECE[decoder]
    out_ids = tok.encode(" Paris").ids
    assert tok.decode(out_ids) == "Paris"  # decoded alone, the first ▁ is dropped
    assert stream(tok, tok.encode(PROMPT).ids, out_ids)[0].text == " Paris"
    assert stream(tok, [], out_ids)[0].text == "Paris"
    assert stream(tok, [tok.token_to_id("<s>")], out_ids)[0].text == "Paris"


@pytest.mark.parametrize("text", SPLIT_TEXTS)
def test_characters_split_over_tokens_come_out_whole(smollm2, text):
    tok = smollm2.hf_tokenizer
    for t, prompt_ids in ((tok, smollm2.encode(PROMPT)), (SENTENCEPIECE["metaspace"], [])):
        out_ids = t.encode(text, add_special_tokens=False).ids
        assert any("\ufffd" in t.decode([i]) for i in out_ids)  # some character is split over tokens
        d, deltas = stream(t, prompt_ids, out_ids)
        assert all("\ufffd" not in delta for delta in deltas)
        assert "".join(deltas) == d.text == continuation(t, prompt_ids, out_ids)
        assert text.strip() in d.text


def test_special_tokens_skipped_or_kept(smollm2):
    tok = smollm2.hf_tokenizer
    out_ids = smollm2.encode("Hi.<|im_end|>\nBye")
    assert stream(tok, [], out_ids)[0].text == "Hi.\nBye"
    assert stream(tok, [], out_ids, skip_special_tokens=False)[0].text == "Hi.<|im_end|>\nBye"


def test_a_prompt_cut_inside_a_character_does_not_leak_into_the_text(smollm2):
    ids = smollm2.encode("hi 👍 x")  # "hi", " " + bytes 1-2 of 👍, byte 3, byte 4, " x"
    assert smollm2.decode(ids[:3]).endswith("\ufffd")
    # DecodeStream, primed with ids whose text ends in U+FFFD, takes them for
    # no context and returns their text with the first output (tokenizers 0.23.3).
    assert DecodeStream(ids[:3], True).step(smollm2.hf_tokenizer, ids[3]) == "hi 👍"
    d, deltas = stream(smollm2.hf_tokenizer, ids[:3], ids[3:])
    assert "".join(deltas) == d.text == "👍 x"  # the prompt's bytes completed; its "hi " not repeated
    assert "hi" not in d.text


@pytest.mark.parametrize("text, cut, want", [
    ("The 🔥 is hot", 2, "🔥 is hot"),         # " " + 2 of the emoji's 4 bytes in the prompt
    ("The 🔥 is hot", 3, "🔥 is hot"),         # 3 of its 4 bytes
    ("x 日本 y", 2, "日本 y"),                  # a 3-byte CJK character split 1 + 2
    ("x 日本 y", 3, "日本 y"),
    ("a 👨\u200d👩\u200d👧 b", 2, "👨\u200d👩\u200d👧 b"),  # a ZWJ sequence, cut in its first emoji
    ("a 👨\u200d👩\u200d👧 b", 7, "👩\u200d👧 b"),       # cut in its second: the first stays the prompt's
    ("a 👨\u200d👩\u200d👧 b", 12, "👧 b"),
])
def test_a_prompt_ending_inside_a_character_is_completed_by_the_output(smollm2, text, cut, want):
    """Issue 34: the prompt's trailing partial bytes are pending; the first
    output token that brings the rest completes the character, in the
    streamed deltas and the final text alike, with no U+FFFD (decoding the
    output alone gives ``"�� is hot"``)."""
    ids = smollm2.encode(text)
    assert smollm2.decode(ids[:cut]).endswith("\ufffd") and "\ufffd" in smollm2.decode(ids[cut:])
    d, deltas = stream(smollm2.hf_tokenizer, ids[:cut], ids[cut:])
    assert "".join(deltas) == d.text == want
    assert all("\ufffd" not in delta for delta in deltas)


@pytest.mark.parametrize("out, want", [(" x", " x"), ("é!", "é!"), ("\ufffd ok", "\ufffd ok")])
def test_prompt_bytes_the_output_never_completes_are_dropped(smollm2, out, want):
    """The output starts a new character: the prompt's two partial bytes are
    dropped, not shown as U+FFFD; a U+FFFD the model writes itself stays."""
    prompt = smollm2.encode("hi 👍")[:2]  # "hi", " " + bytes 1-2
    d, deltas = stream(smollm2.hf_tokenizer, prompt, smollm2.encode(out))
    assert "".join(deltas) == d.text == want


def test_a_prompt_cut_inside_a_character_keeps_its_stop_strings(smollm2):
    ids = smollm2.encode("The 🔥 is hot")
    d, deltas = stream(smollm2.hf_tokenizer, ids[:2], ids[2:], stop=[" is"])
    assert "".join(deltas) == d.text == "🔥" and d.stop_str == " is"


def test_a_trailing_replacement_character_is_held_back(smollm2):
    # DecodeStream cannot tell a real U+FFFD from a partial character.
    assert stream(smollm2.hf_tokenizer, [], smollm2.encode("a\ufffd"))[0].text == "a"
    assert stream(smollm2.hf_tokenizer, [], smollm2.encode("a\ufffdb"))[0].text == "a\ufffdb"


TEXT = "Hello world, this is fine."  # Hello| world|,| this| is| fine|.


@pytest.mark.parametrize("stop, text, stop_str, pushes", [
    (["wor"], "Hello ", "wor", 2),                   # ends inside " world": its "ld" is dropped too
    (["o w"], "Hell", "o w", 2),                     # spans "Hello" and " world"
    (["xyz"], TEXT, None, 7),                        # never occurs
    (["ld", "o wor", "this"], "Hell", "o wor", 2),   # both end in " world": the earliest start wins
    (["fine", " is", "s i"], "Hello world, thi", "s i", 5),  # "s i" and " is" both end in " is"
    (["Hel", "Hello world"], "", "Hel", 1),          # the very first output token
    (["."], "Hello world, this is fine", ".", 7),
])
def test_stop_strings(smollm2, stop, text, stop_str, pushes):
    out_ids = smollm2.encode(TEXT)
    d, deltas = stream(smollm2.hf_tokenizer, smollm2.encode(PROMPT), out_ids, stop=stop)
    assert (d.text, d.stop_str, len(deltas) - (stop_str is None)) == (text, stop_str, pushes)
    assert "".join(deltas) == text
    if stop_str is not None:
        with pytest.raises(RuntimeError, match="push after the stop string"):
            d.push(out_ids[0])


def test_held_back_text_is_the_possible_start_of_a_stop_string(smollm2):
    hello, world, comma = smollm2.encode("Hello world,")
    d = IncrementalDetokenizer(smollm2.hf_tokenizer, [], stop=["o w", "xyz"])
    assert d.push(hello) is None and d.take_delta(finished=False) == "Hel"  # "lo" held back: 2 = len("o w") - 1
    assert d.push(world) == "o w" and d.text == "Hell"
    assert d.take_delta(finished=False) == "l"  # after a stop nothing is held back
    d = IncrementalDetokenizer(smollm2.hf_tokenizer, [], stop=["o w!", "xyz"])
    assert [d.push(i) for i in (hello, world, comma)] == [None] * 3
    assert d.take_delta(finished=False) == "Hello wor"  # 3 = len("o w!") - 1 held back
    assert d.take_delta(finished=True) == "ld,"


def first_stop(decodes: list[str], stop: list[str]) -> tuple[str, str | None]:
    """Naive reference: the first of the successive decodes that contains a
    stop string, cut before the earliest-starting one, and that stop string."""
    for text in decodes:
        found = sorted((text.find(s), k) for k, s in enumerate(stop) if s in text)
        if found:
            return text[: found[0][0]], stop[found[0][1]]
    return decodes[-1], None


@settings(max_examples=60, deadline=None)
@given(text=SMOLLM2_TEXTS, data=st.data())
def test_stop_strings_equal_a_rescan_of_every_prefix(smollm2, text, data):
    """Stops drawn mostly from the text's own substrings; what was handed out
    is always a prefix of the final text."""
    out_ids = smollm2.encode(text)
    decodes = [smollm2.decode(out_ids[:k]) for k in range(len(out_ids) + 1)]
    decodes = [t for t in decodes if not t.endswith("\ufffd")]  # DecodeStream waits for whole characters
    full = decodes[-1]
    substrings = st.builds(lambda i, n: full[i:i + n] or "x", st.integers(0, len(full)), st.integers(1, 6))
    stop = data.draw(st.lists(substrings | st.text(min_size=1, max_size=3), min_size=1, max_size=3))
    want_text, want_stop = first_stop(decodes, stop)
    d = IncrementalDetokenizer(smollm2.hf_tokenizer, smollm2.encode(PROMPT), stop=stop)
    out = ""
    for i in out_ids:
        ended = d.push(i) is not None
        out += d.take_delta(finished=ended)
        assert want_text.startswith(out)
        if ended:
            break
    out += d.take_delta(finished=True)
    assert (out, d.text, d.stop_str) == (want_text, want_text, want_stop)


def test_bad_inputs(smollm2):
    hf = smollm2.hf_tokenizer
    with pytest.raises(ValueError, match=r"tokenizer must be .* got 42 of type int"):
        as_tokenizer(42)
    assert as_tokenizer(hf) is as_tokenizer(smollm2) is hf
    assert as_tokenizer(type("Fast", (), {"backend_tokenizer": hf})()) is hf
    assert as_tokenizer(type("Holder", (), {"tokenizer": hf})()) is hf
    for stop in ("abc", [""], [3]):
        with pytest.raises(ValueError, match="stop must be a sequence of non-empty str"):
            IncrementalDetokenizer(hf, [], stop=stop)
