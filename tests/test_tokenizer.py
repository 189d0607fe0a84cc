"""The GGUF-rebuilt SmolLM2 tokenizer equals transformers' tokenizer for the same file."""

import os
import pathlib

import pytest
import tokenizers
from tokenizers import pre_tokenizers

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

from models.loading.gguf_loader import smollm2_gguf_path  # noqa: E402
from models.tokenizer import BYTE_CHARS, TokenFloor, load_tokenizer, token_floor  # noqa: E402

TEXTS = [
    "Hello, world!",
    "In 2024, 1234567 people paid $3.50 each (≈ 4,321,000.75 €).",
    "Ünïcödé: naïve café, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, русский.",
    "  leading spaces,\ttabs\nand\n\nnewlines   trailing  ",
    "def f(x):\n    return x ** 2  # squares\n",
    "<|im_start|>user\nliteral special tokens<|im_end|>\n<|endoftext|>",
    "",
]

CHATS = [
    "What is the capital of France?",
    [{"role": "user", "content": "Count from 1 to 12."}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Name 3 primes > 100."},
    ],
]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


@pytest.fixture(scope="module")
def hf_tok():
    import transformers  # the test extra's oracle
    path = pathlib.Path(smollm2_gguf_path())
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_known_ids_and_special_ids(tok):
    assert tok.encode("Hello, world!") == [19556, 28, 905, 17]
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 2, 2)
    assert tok.stop_ids == (2,)  # eos is <|im_end|> in SmolLM2
    assert tok.vocab_size == 49152
    # Digits are split one by one.
    assert len(tok.encode("12345")) == 5


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_equal_transformers(tok, hf_tok, text):
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_encode_batch(tok):
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_equals_transformers(tok, hf_tok, messages):
    hf_messages = [{"role": "user", "content": messages}] if isinstance(messages, str) else messages
    for gen in (True, False):
        text = tok.apply_chat_template(messages, add_generation_prompt=gen)
        assert text == hf_tok.apply_chat_template(hf_messages, tokenize=False, add_generation_prompt=gen)
        assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)


def test_chat_template_default_system_prompt(tok):
    text = tok.apply_chat_template("Hi")
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(text)
    # ... "<|im_end|>" "\n" "<|im_start|>" "assistant\n"
    assert ids[0] == tok.bos_id
    assert ids[-6:] == [tok.eos_id, 198, tok.bos_id] + tok.encode("assistant\n")


def test_bad_inputs(tok, tmp_path):
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(TypeError, match="texts\\[1\\]"):
        tok.encode_batch(["ok", 3])
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_tokenizer(missing)


FLOOR_TEXTS = TEXTS + ["\n" + " " * 80, "\x04" * 50 + "a\x1db", "\U00040000\U0001f642" * 30, "ab" * 500]


def test_token_floor_bounds_the_token_count(tok):
    floor = tok.token_floor
    assert floor.max_token_bytes == 81  # a newline and 80 spaces, one token
    assert tok.encode("\n" + " " * 80) and len(tok.encode("\n" + " " * 80)) == 1 == tok.fewest_tokens("\n" + " " * 80)
    # Bytes the vocabulary lacks are dropped, so they count for nothing (0x04 among them).
    assert b"\x04" in floor.dropped and tok.encode("\x04" * 10) == [] and tok.fewest_tokens("\x04" * 10) == 0
    assert set(BYTE_CHARS) == set(pre_tokenizers.ByteLevel.alphabet())
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    text = "".join(map(chr, range(1, 128))) + "é€🙂\U00040000"
    assert spell.pre_tokenize_str(text)[0][0] == "".join(BYTE_CHARS[b] for b in text.encode())
    for t in FLOOR_TEXTS:
        assert tok.fewest_tokens(t) <= len(tok.encode(t)), t
    assert tok.fewest_tokens("a" * 81_000) == 1000
    with pytest.raises(TypeError, match="text must be a str"):
        tok.fewest_tokens(b"bytes")


def test_token_floor_is_none_where_no_floor_holds():
    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"w0": 0}, unk_token="w0"))
    assert token_floor(words) is None  # a word-level model drops spaces: no floor
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE({c: i for i, c in enumerate(BYTE_CHARS)}, []))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    assert token_floor(bpe) == TokenFloor(max_token_bytes=1)
    bpe.normalizer = tokenizers.normalizers.NFC()  # composes characters into fewer bytes
    assert token_floor(bpe) is None
    with pytest.raises(ValueError, match="max_token_bytes must be an int >= 1"):
        TokenFloor(max_token_bytes=0)
