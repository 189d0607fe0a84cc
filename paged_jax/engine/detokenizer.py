"""Incremental detokenization with stop strings, for streaming outputs.

One :class:`IncrementalDetokenizer` per sequence turns its generated ids into
text one token at a time, the way vLLM v1's ``IncrementalDetokenizer`` and
``check_stop_strings`` do, and owns the two rules a streamed text must keep:

- never a partial character: a UTF-8 character split over several tokens
  (byte-level BPE, SentencePiece byte fallback) appears only once its last
  byte has arrived. ``tokenizers.decoders.DecodeStream`` does this for us, and
  since it decodes a short window of ids each step, it also gets the spacing
  right that depends on the previous token (SentencePiece's ``▁`` is dropped
  from the first token of a decode, so " world" after "Hello" needs "Hello");
- never part of a stop string: :meth:`IncrementalDetokenizer.take_delta`
  holds back the last ``max(len(s) for s in stop) - 1`` characters, which may
  be the start of a stop string that the next token completes.

Why the prompt's tail primes the stream, and why it is trimmed: the first
output token decodes after the prompt's last :data:`CONTEXT_TOKENS` tokens,
so a SentencePiece "▁Paris" after "The capital is" keeps its space (decoded
alone it would lose it). ``DecodeStream`` treats a context whose text ends
in U+FFFD (a prompt cut inside a character) as no context and then returns
the context's text with the first output (tokenizers 0.23.3,
``step_decode_stream``), so such trailing prompt tokens are taken out of the
context first.

A prompt cut inside a character (token ids that end with two of an emoji's
four bytes): those trailing bytes are pending, not lost. The tokens that
hold them are stepped through the stream after the context, so the first
output token that brings the character's last bytes completes it, and the
text starts with the whole character (``"🔥 is hot"``, where decoding the
output alone gives ``"�� is hot"``); the prompt's own complete characters
in those tokens are not repeated. Where the output does not complete the
character, the prompt's partial bytes are dropped: the text never starts
with a U+FFFD that the prompt's bytes, not the model, made.
"""

from __future__ import annotations

from typing import Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

CONTEXT_TOKENS = 8
"""Prompt tokens decoded before the first output token: enough for decoders
that look at the previous token (SentencePiece's first-token space), few
enough that the first steps' decodes stay cheap."""

REPLACEMENT = "\ufffd"


def as_tokenizer(tokenizer) -> tokenizers.Tokenizer:
    """The ``tokenizers.Tokenizer`` inside ``tokenizer``.

    Accepts a ``tokenizers.Tokenizer``; an object holding one as
    ``.tokenizer`` or ``.hf_tokenizer`` (``models.tokenizer.Tokenizer``); or
    a transformers fast tokenizer (``.backend_tokenizer``).

    Raises:
      ValueError: none of these.
    """
    if isinstance(tokenizer, tokenizers.Tokenizer):
        return tokenizer
    for name in ("tokenizer", "hf_tokenizer", "backend_tokenizer"):
        inner = getattr(tokenizer, name, None)
        if isinstance(inner, tokenizers.Tokenizer):
            return inner
    raise ValueError(f"tokenizer must be a tokenizers.Tokenizer or hold one as .tokenizer, .hf_tokenizer or "
                     f".backend_tokenizer, got {tokenizer!r} of type {type(tokenizer).__name__}")


def prompt_text(tokenizer: tokenizers.Tokenizer, prompt_ids: Sequence[int], *,
                skip_special_tokens: bool = False) -> str:
    """The prompt's text as it reads before its output (``echo``): a
    character its last bytes begin is left out, since the output that
    completes it starts with it whole (:class:`IncrementalDetokenizer`), and
    bytes nothing completes are dropped, so the prompt's text followed by
    the output's never holds a U+FFFD the whole text would not have.

    Args:
      tokenizer: a ``tokenizers.Tokenizer``.
      prompt_ids: the prompt's ids, int[prompt_len].
      skip_special_tokens: leave special tokens out of the text.
    """
    return tokenizer.decode([int(i) for i in prompt_ids], skip_special_tokens=skip_special_tokens).rstrip(REPLACEMENT)


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens, pushed one at a time.

    Args:
      tokenizer: a ``tokenizers.Tokenizer`` (see :func:`as_tokenizer`).
      prompt_ids: the prompt's ids (int[prompt_len]); only the last
        :data:`CONTEXT_TOKENS` are read, for spacing.
      skip_special_tokens: leave special tokens (``<|im_end|>``) out of
        the text.
      stop: stop strings. The text ends right before the earliest
        occurrence of any of them; the stop string itself is not in it.

    Attributes:
      text: the output text so far, as ``tokenizer.decode`` writes it after
        the prompt (a character the prompt's last bytes begin and the
        output completes included whole); cut before the stop string once
        one is found. It never
        ends inside a character, nor in a U+FFFD the model wrote, which
        ``DecodeStream`` cannot tell from a partial character: that one
        comes with the next character, or never.
      stop_str: the stop string that ended the text, else None.

    Raises:
      ValueError: ``stop`` is a str, or holds an empty or non-str entry.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, prompt_ids: Sequence[int], *,
                 skip_special_tokens: bool = True, stop: Sequence[str] = ()):
        if isinstance(stop, str) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a sequence of non-empty str, got {stop!r}")
        context = [int(i) for i in prompt_ids[-CONTEXT_TOKENS:]]
        pending: list[int] = []  # trailing prompt tokens that end inside a character
        while context and tokenizer.decode(context, skip_special_tokens=skip_special_tokens).endswith(REPLACEMENT):
            pending.insert(0, context.pop())
        self._tokenizer = tokenizer
        self._stream = DecodeStream(context, skip_special_tokens)
        # The pending tokens' text after the context: complete characters (the prompt's, never output) and the
        # U+FFFD of the partial bytes at its end, which the first output either completes or leaves invalid.
        self._skip, self._partial = 0, 0
        if pending:
            before = tokenizer.decode(context, skip_special_tokens=skip_special_tokens)
            after = tokenizer.decode(context + pending, skip_special_tokens=skip_special_tokens)
            tail = after[len(before):] if after.startswith(before) else after
            whole = tail.rstrip(REPLACEMENT)
            said = "".join(self._stream.step(tokenizer, i) or "" for i in pending)
            self._skip, self._partial = max(len(whole) - len(said), 0), len(tail) - len(whole)
        self._stop = tuple(stop)
        # Characters that may be the start of a stop string not yet complete.
        self._hold = max(map(len, self._stop), default=1) - 1
        self._sent = 0  # chars of `text` handed out by take_delta
        self.text = ""
        self.stop_str: str | None = None

    def push(self, token_id: int) -> str | None:
        """Adds one generated token.

        Searches only the new text and the ``max_len - 1`` characters before
        it (an occurrence wholly before would have stopped an earlier push),
        so the search costs O(new text) whatever the length so far.

        Returns:
          The stop string this token completed, else None. On a stop, ``text``
          is cut right before the earliest occurrence (the token's text may
          run past the stop string: that rest is dropped too).

        Raises:
          RuntimeError: a stop string already ended the text.
        """
        if self.stop_str is not None:
            raise RuntimeError(f"push after the stop string {self.stop_str!r} ended the text")
        new = self._stream.step(self._tokenizer, int(token_id))
        if not new:  # None: a character still incomplete, or a skipped special token
            return None
        if self._skip or self._partial:  # the first text after a prompt cut inside a character
            new = new[self._skip:]
            while self._partial and new.startswith(REPLACEMENT):  # the prompt's bytes were never completed
                new, self._partial = new[1:], self._partial - 1
            self._skip, self._partial = 0, 0
            if not new:
                return None
        start = max(len(self.text) - self._hold, 0)
        self.text += new
        found = [(at, k) for k, s in enumerate(self._stop) if (at := self.text.find(s, start)) >= 0]
        if not found:
            return None
        at, k = min(found)  # earliest start; equal starts: the first listed
        self.text = self.text[:at]
        self.stop_str = self._stop[k]
        return self.stop_str

    def take_delta(self, finished: bool) -> str:
        """Text not handed out before.

        Args:
          finished: the sequence has ended: hand out everything. Otherwise
            the last ``max(len(s) for s in stop) - 1`` characters stay
            back, since the next tokens may complete a stop string from them
            (after a stop nothing stays back: the text is final).

        Returns:
          The new text; all deltas concatenated equal ``text`` once a call
          with ``finished=True`` (or after a stop) has been made.
        """
        end = len(self.text)
        if not finished and self.stop_str is None:
            end = max(end - self._hold, self._sent)
        delta = self.text[self._sent:end]
        self._sent = end
        return delta
