"""The serving workloads: what the requests of an online run
(:mod:`experiments.lib.online`) ask for, after the paper's serving experiments
(PagedAttention, Kwon et al., SOSP 2023, section 6).

* ``basic`` (Figures 12, 13): vLLM's ShareGPT sampling
  (:func:`experiments.lib.sharegpt.build_requests`): turn 0 is the prompt, turn
  1's length the output's; greedy.
* ``parallel-N``, ``beam-W`` (Figure 14): the same prompts, N samples at
  temperature 1 or beam search of width W.
* ``prefix-K`` (Figure 16, shared prefix): every prompt opens with the same
  K-shot prefix. The paper translates WMT16 sentences after 1 or 5 example
  translations (80 and 341 tokens on LLaMA-13B). Here the examples are the
  first K (prompt, answer) pairs vLLM's sampling accepts, each side cut to
  its first :data:`SHOT_TOKENS` tokens, rendered as earlier rounds of the
  chat; the requests are the pairs accepted after them, among prompts of at
  most ``max_prompt_len`` tokens (translation requests are short). With
  SmolLM2's ChatML (a 20-token system prompt, 5 tokens around each message)
  a shot of two full sides is 64 tokens; with seed 0 the prefixes are 75
  tokens (one shot) and 325 (five), against the paper's 80 and 341.
* ``chatbot`` (Figure 17): the prompt is a conversation so far. For each
  ShareGPT conversation of two or more complete rounds, in an order
  shuffled with the seed, one round ``i >= 1`` is drawn (with the same
  seeded generator); the prompt is rounds ``0 .. i - 1`` and round ``i``'s
  human turn in the chat template, cut to its last ``max_prompt_len``
  tokens (the paper: the last 1,024); the output is round ``i``'s answer
  (its token count, capped). Answers or prompts under 4 tokens are
  skipped, as vLLM's sampling skips them.

Without a tokenizer (``--model toy``, the random-weight presets) the
workloads keep their shape with the packaged ShareGPT lengths and random
ids (:func:`experiments.lib.sharegpt.packaged_requests`): the prefix is
``K * 2 * SHOT_TOKENS`` random ids before each packaged prompt whose
untemplated part fits ``max_prompt_len``; a chatbot history is 1 to 3
consecutive packaged rounds (prompt ids and random answer ids of the
round's output length) before the next round's prompt, cut to the last
``max_prompt_len``.

Multi-turn chat (:func:`sharegpt_conversations`, the KV tiers' benchmark,
:mod:`experiments.serving.kv_tiers`): whole conversations, replayed turn by
turn (:func:`experiments.lib.online.run_conversations`). A conversation is a
list of turns, each the user's message as token ids in the chat template
(the end of the previous answer, the user's turn, the assistant's header)
and the length of the answer it gets: ShareGPT conversations of two or more
complete rounds, in an order shuffled with the seed, the dataset's answer
lengths capped; a conversation ends at its last round or before the turn
whose prompt and answer would pass ``max_context`` tokens. Without a
tokenizer, the turns are the packaged lengths with random ids.

Every workload is deterministic in its seed: the ShareGPT shuffle, the
drawn rounds, the random ids.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Callable, Sequence

import numpy as np

from experiments.lib.policies import NO_CACHE, POLICIES
from experiments.lib.sharegpt import (
    MAX_SEQ_LEN,
    PACKAGED_LIMIT,
    PACKAGED_REQUESTS,
    build_requests,
    conversation_rounds,
    load_conversations,
    packaged_requests,
    sample_requests,
)
from paged_jax.checks import check_choice, check_int
from paged_jax.engine.requests import Request
from paged_jax.engine.sampling import SamplingParams

PROMPT_KINDS = ("sharegpt", "prefix", "chatbot")
"""How a workload builds its prompts (the module docstring)."""
SHOT_TOKENS = 27
"""Tokens each side of a few-shot example keeps (its first ones), chosen so
that with SmolLM2's chat template the prefixes come near the paper's sizes
(seed 0: 75 and 325 tokens for one and five shots, against 80 and 341)."""
PREFIX_PROMPT_LEN = 128
"""``prefix-K``: the longest own prompt (tokens, before the template) a
request may have; longer pairs are skipped as vLLM skips prompts over
1,024."""
CHATBOT_PROMPT_LEN = 256
"""``chatbot``: prompts keep their last this many tokens. The paper's
1,024 are five times ShareGPT's mean answer (204 tokens); 256 are about
five times the serving runs' outputs, capped at 48."""
MIN_LEN = 4
"""The shortest prompt or answer kept, tokens (vLLM's rule)."""
_ROUNDS_SEED = PACKAGED_LIMIT
"""Spawn key of the generator that draws the random ids a workload adds to
the packaged requests; ``packaged_requests`` keys request ``i``'s ids by
``i < PACKAGED_LIMIT``, so the streams never meet."""


FIG14_POLICIES = ("paged", "max", "oracle")
"""The policies Figure 14's workloads compare by default: the paper's
section 6.3 states its gains over Orca (Oracle), and Max is the baseline
memory binds; Pow2 is left out to save time, since with outputs capped at a
power of two (32) it reserves what Oracle does for most requests."""


def _greedy(i: int) -> SamplingParams:
    return SamplingParams()


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """What each request of a run asks for.

    Attributes:
      name: as :func:`workload` parses it (``prefix-5``).
      description: a phrase for tables.
      sampling: request ``i``'s :class:`SamplingParams`.
      prompts: how prompts are built, one of :data:`PROMPT_KINDS`.
      shots: ``prefix``: examples in the shared prefix, >= 1; else 0.
      shot_tokens: ``prefix``: tokens each side of an example keeps.
      max_prompt_len: ``prefix``: the longest own prompt; ``chatbot``: the
        tokens a prompt keeps (its last); None for ``sharegpt`` (vLLM's
        1,024-token limit).
      policies: the policies its figure compares
        (:data:`experiments.lib.policies.ALL_POLICIES`), ``paged`` first.
    """

    name: str
    description: str
    sampling: Callable[[int], SamplingParams] = _greedy
    prompts: str = "sharegpt"
    shots: int = 0
    shot_tokens: int = SHOT_TOKENS
    max_prompt_len: int | None = None
    policies: tuple[str, ...] = POLICIES

    def __post_init__(self):
        check_choice("prompts", self.prompts, PROMPT_KINDS)
        check_int("shots", self.shots, 1 if self.prompts == "prefix" else 0, None if self.prompts == "prefix" else 1)
        check_int("shot_tokens", self.shot_tokens)
        if (self.max_prompt_len is None) != (self.prompts == "sharegpt"):
            raise ValueError(f"max_prompt_len applies to the prefix and chatbot workloads, got "
                             f"max_prompt_len={self.max_prompt_len!r} for prompts={self.prompts!r}")
        if self.max_prompt_len is not None:
            check_int("max_prompt_len", self.max_prompt_len, MIN_LEN, MAX_SEQ_LEN)

    def apply(self, requests: Sequence[Request]) -> list[Request]:
        """``requests`` with request ``i``'s sampling ``sampling(i)``."""
        return [dataclasses.replace(r, sampling=self.sampling(i)) for i, r in enumerate(requests)]

    def requests(self, tokenizer, *, vocab_size: int, num_requests: int, max_output_len: int,
                 seed: int = 0) -> tuple[list[Request], str]:
        """This workload's requests (greedy, EOS ignored, outputs of their
        true length capped at ``max_output_len``; :meth:`apply` sets the
        sampling) and a line saying what they are.

        Args:
          tokenizer: ``models.tokenizer.Tokenizer`` (``encode``,
            ``encode_batch``, ``decode``, ``apply_chat_template``), or None
            for the packaged lengths with random ids in ``[0, vocab_size)``.

        Raises:
          ValueError: an argument out of range; too few qualifying
            conversations or packaged requests; a prompt longer than the
            engine's 2,048 tokens.
        """
        check_int("num_requests", num_requests)
        check_int("max_output_len", max_output_len)
        if self.prompts == "sharegpt":
            if tokenizer is None:
                requests = packaged_requests(num_requests, max_output_len, vocab_size=vocab_size, seed=seed)
                return requests, "packaged ShareGPT request lengths, random prompt ids"
            requests, _, report = build_requests(tokenizer, num_requests, max_output_len, seed=seed)
            return requests, f"ShareGPT ({report.records} conversations recovered), shuffle seed {seed}"
        if self.prompts == "prefix":
            requests, prefix_len = prefix_requests(
                tokenizer, shots=self.shots, shot_tokens=self.shot_tokens, max_prompt_len=self.max_prompt_len,
                num_requests=num_requests, max_output_len=max_output_len, seed=seed, vocab_size=vocab_size)
            what = (f"a {self.shots}-shot prefix of {prefix_len} tokens before every request's own turn (each side "
                    f"of an example <= {self.shot_tokens} tokens), own prompts <= {self.max_prompt_len} tokens")
        else:
            requests = chatbot_requests(tokenizer, max_prompt_len=self.max_prompt_len, num_requests=num_requests,
                                        max_output_len=max_output_len, seed=seed, vocab_size=vocab_size)
            what = f"chatbot: conversation history as the prompt, its last {self.max_prompt_len} tokens"
        source = ("packaged ShareGPT lengths, random ids" if tokenizer is None
                  else f"ShareGPT, shuffle seed {seed}")
        return requests, f"{source}; {what}"


def workload(name: str, *, max_prompt_len: int | None = None) -> Workload:
    """``basic`` (greedy, one output), ``parallel-N`` (N samples at
    temperature 1, seeded per request), ``beam-W`` (beam width W),
    ``prefix-K`` (a shared K-shot prefix, Figure 16) or ``chatbot``
    (conversation histories, Figure 17).

    Args:
      max_prompt_len: for ``prefix-K`` and ``chatbot`` (default
        :data:`PREFIX_PROMPT_LEN`, :data:`CHATBOT_PROMPT_LEN`); not for the
        others.

    Raises:
      ValueError: another name, N / W / K not an int >= 1 written
        canonically (ASCII digits, no leading zero, sign or space: one name
        per workload, as results files and figure labels use it), or
        ``max_prompt_len`` given for a workload without one or out of
        range.
    """
    if not isinstance(name, str):
        raise ValueError(f"workload name must be a str ('basic', 'parallel-N', 'beam-W', 'prefix-K' or 'chatbot'), "
                         f"got {name!r}")
    kind, _, k = name.partition("-")
    if max_prompt_len is not None and kind not in ("prefix", "chatbot"):
        raise ValueError(f"max_prompt_len applies to prefix-K and chatbot, got max_prompt_len={max_prompt_len} "
                         f"for workload {name!r}")
    if name == "basic":
        return Workload(name="basic", description="greedy, one output per request")
    if name == "chatbot":
        return Workload(name=name, description="chatbot, conversation history as the prompt", prompts="chatbot",
                        max_prompt_len=CHATBOT_PROMPT_LEN if max_prompt_len is None else max_prompt_len)
    # Not str.isdigit: it takes "02" (a second name for one workload) and "²" (which int() refuses).
    if kind in ("parallel", "beam", "prefix") and re.fullmatch(r"[1-9][0-9]*", k):
        k = int(k)
        if kind == "parallel":
            return Workload(name=name, description=f"parallel sampling, n={k}, temperature 1",
                            sampling=lambda i: SamplingParams(n=k, temperature=1.0, seed=i), policies=FIG14_POLICIES)
        if kind == "beam":
            return Workload(name=name, description=f"beam search, width {k}",
                            sampling=lambda i: SamplingParams(beam_width=k), policies=FIG14_POLICIES)
        return Workload(name=name, description=f"shared {k}-shot prefix", prompts="prefix", shots=k,
                        max_prompt_len=PREFIX_PROMPT_LEN if max_prompt_len is None else max_prompt_len,
                        policies=("paged", "paged" + NO_CACHE, "oracle" + NO_CACHE))
    raise ValueError(f"workload must be 'basic', 'parallel-N', 'beam-W', 'prefix-K' or 'chatbot', with N, W, K a "
                     f"whole number >= 1 in plain digits without leading zeros, sign or spaces (e.g. 'parallel-4'), "
                     f"got {name!r}")


# -------------------------------------------------------------- the prompts

def shared_prefix_len(requests: Sequence[Request]) -> int:
    """Tokens every request's prompt begins with (the whole prompt for one
    request; 0 for none)."""
    if not requests:
        return 0
    first = requests[0].prompt_ids
    n = min(len(r.prompt_ids) for r in requests)
    for r in requests[1:]:
        n = next((i for i in range(n) if r.prompt_ids[i] != first[i]), n)
    return n


def _request(i: int, ids: list[int], output_len: int, max_output_len: int) -> Request:
    if len(ids) >= MAX_SEQ_LEN:
        raise ValueError(f"request {i}'s prompt has {len(ids)} tokens, the engine holds {MAX_SEQ_LEN} per sequence "
                         "with its output: lower shots, shot_tokens or max_prompt_len")
    return Request(request_id=i, prompt_ids=ids, max_new_tokens=min(output_len, max_output_len, MAX_SEQ_LEN - len(ids)),
                   ignore_eos=True)


def _template_overhead() -> int:
    """Tokens the chat template adds around a packaged request's prompt."""
    data = json.loads(PACKAGED_REQUESTS.read_text())
    return len(data["template_prefix_ids"]) + len(data["template_suffix_ids"])


def _short_packaged(max_prompt_len: int, vocab_size: int, seed: int) -> list[Request]:
    """The packaged requests whose prompts, less the chat template, have at most ``max_prompt_len`` tokens."""
    overhead = _template_overhead()
    base = packaged_requests(PACKAGED_LIMIT, MAX_SEQ_LEN, vocab_size=vocab_size, seed=seed)
    return [r for r in base if len(r.prompt_ids) - overhead <= max_prompt_len]


def packaged_limit(workload: Workload, *, vocab_size: int, seed: int = 0) -> int:
    """How many requests ``workload`` makes without a tokenizer (the packaged
    lengths, ids below ``vocab_size``): 1,000 for ShareGPT prompts; for
    ``prefix-K`` the packaged prompts of at most ``max_prompt_len`` tokens
    of their own (496 for the default 128); for ``chatbot`` the chats the
    packaged rounds make, each using 2 to 4 of them (329 with seed 0 and
    49,152 ids: the draws of rounds and of answer ids share a generator).

    Raises:
      ValueError: ``vocab_size`` or ``seed`` out of range.
    """
    check_int("vocab_size", vocab_size)
    check_int("seed", seed, 0)
    if workload.prompts == "sharegpt":
        return PACKAGED_LIMIT
    if workload.prompts == "prefix":
        return len(_short_packaged(workload.max_prompt_len, vocab_size, seed))
    return len(_packaged_chats(max_prompt_len=workload.max_prompt_len, max_output_len=MAX_SEQ_LEN, seed=seed,
                               vocab_size=vocab_size))

def prefix_requests(tokenizer, *, shots: int, shot_tokens: int, max_prompt_len: int, num_requests: int,
                    max_output_len: int, seed: int = 0, vocab_size: int | None = None,
                    conversations: Sequence[dict] | None = None) -> tuple[list[Request], int]:
    """Requests whose prompts all open with one ``shots``-shot prefix
    (Figure 16; the module docstring says how it is built), and the
    prefix's length in tokens: with a tokenizer the system prompt and the
    examples (every request's turn then opens with the same few tokens,
    ``<|im_start|>user\n`` in ChatML); without, the ``shots * 2 *
    shot_tokens`` random ids (the packaged prompts' template follows).
    Greedy, EOS ignored, output = the request's ShareGPT answer length
    capped at ``max_output_len``.

    Args:
      tokenizer: a chat tokenizer, or None for packaged lengths and random
        ids below ``vocab_size``.
      conversations: ShareGPT records (default
        :func:`experiments.lib.sharegpt.load_conversations`'s); not used without
        a tokenizer.

    Raises:
      ValueError: too few qualifying pairs; a prompt of 2,048 tokens or
        more; from :func:`experiments.lib.sharegpt.sample_requests`.
    """
    for name, value in (("shots", shots), ("shot_tokens", shot_tokens), ("num_requests", num_requests),
                        ("max_output_len", max_output_len), ("max_prompt_len", max_prompt_len)):
        check_int(name, value)
    check_int("seed", seed, 0)
    if tokenizer is None:
        check_int("vocab_size", vocab_size)
        prefix = np.random.default_rng([seed, _ROUNDS_SEED]).integers(0, vocab_size, shots * 2 * shot_tokens).tolist()
        own = _short_packaged(max_prompt_len, vocab_size, seed)[:num_requests]
        if len(own) < num_requests:
            raise ValueError(f"only {len(own)} packaged requests have prompts <= max_prompt_len={max_prompt_len} "
                             f"tokens, asked for num_requests={num_requests}")
        return [_request(i, prefix + r.prompt_ids, r.max_new_tokens, max_output_len)
                for i, r in enumerate(own)], len(prefix)
    if conversations is None:
        conversations, _ = load_conversations()
    sampled = sample_requests(conversations, tokenizer.encode_batch, shots + num_requests, seed=seed,
                              max_prompt_len=max_prompt_len)
    # A sampled pair names its conversation by id, which a few records share: match the prompt too.
    answers = {}
    for record in conversations:
        rounds = conversation_rounds(record)
        if rounds:
            answers.setdefault((str(record.get("id", "")), rounds[0][0]), rounds[0][1])
    examples = []
    for s in sampled[:shots]:
        answer = answers.get((s.conversation_id, s.prompt))
        if answer is None:  # a pair whose turns are not (human, gpt): vLLM's sampling does not look at roles
            raise ValueError(f"few-shot example {s.conversation_id!r} is not a human-gpt round; try another seed")
        for role, text in (("user", s.prompt), ("assistant", answer)):
            examples.append({"role": role, "content": tokenizer.decode(tokenizer.encode(text)[:shot_tokens])})
    prefix_text = tokenizer.apply_chat_template(examples, add_generation_prompt=False)
    prefix = tokenizer.encode(prefix_text)
    requests = []
    for i, s in enumerate(sampled[shots:]):
        text = tokenizer.apply_chat_template(examples + [{"role": "user", "content": s.prompt}])
        if not text.startswith(prefix_text):
            raise ValueError("the chat template renders the examples differently once a request follows them; "
                             "a prefix workload needs a template that appends each message")
        # The prefix's ids, not the whole text's encoding: equal across requests by construction (with
        # ChatML the two agree, since a special token starts the request's turn).
        requests.append(_request(i, prefix + tokenizer.encode(text[len(prefix_text):]), s.output_len,
                                 max_output_len))
    return requests, len(prefix)


def _packaged_chats(*, max_prompt_len: int, max_output_len: int, seed: int, vocab_size: int) -> list[Request]:
    """Every ``chatbot`` request the packaged lengths make without a
    tokenizer (the module docstring): each consumes 1 to 3 packaged rounds
    as its history and the next as its turn, none reused."""
    base = packaged_requests(PACKAGED_LIMIT, MAX_SEQ_LEN, vocab_size=vocab_size, seed=seed)
    rng = np.random.default_rng([seed, _ROUNDS_SEED])
    requests, cursor = [], 0
    while True:
        rounds = int(rng.integers(1, 4))
        if cursor + rounds >= len(base):
            return requests
        history = []
        for r in base[cursor:cursor + rounds]:
            history += r.prompt_ids + rng.integers(0, vocab_size, r.max_new_tokens).tolist()
        current = base[cursor + rounds]
        cursor += rounds + 1
        requests.append(_request(len(requests), (history + current.prompt_ids)[-max_prompt_len:],
                                 current.max_new_tokens, max_output_len))


def chatbot_requests(tokenizer, *, max_prompt_len: int, num_requests: int, max_output_len: int, seed: int = 0,
                     vocab_size: int | None = None, batch_size: int = 64,
                     conversations: Sequence[dict] | None = None) -> list[Request]:
    """Requests whose prompts are conversations so far (Figure 17; the
    module docstring says how they are drawn), cut to their last
    ``max_prompt_len`` tokens. Greedy, EOS ignored, output = the drawn
    round's answer length capped at ``max_output_len``.

    Args:
      tokenizer: a chat tokenizer, or None for packaged lengths and random
        ids below ``vocab_size``.
      batch_size: conversations tokenized per call.
      conversations: ShareGPT records (default
        :func:`experiments.lib.sharegpt.load_conversations`'s); not used without
        a tokenizer.

    Raises:
      ValueError: too few conversations (or packaged rounds) for
        ``num_requests``; an argument out of range.
    """
    for name, value in (("num_requests", num_requests), ("max_output_len", max_output_len),
                        ("batch_size", batch_size)):
        check_int(name, value)
    check_int("max_prompt_len", max_prompt_len, 1, MAX_SEQ_LEN)
    check_int("seed", seed, 0)
    if tokenizer is None:
        check_int("vocab_size", vocab_size)
        requests = _packaged_chats(max_prompt_len=max_prompt_len, max_output_len=max_output_len, seed=seed,
                                   vocab_size=vocab_size)
        if len(requests) < num_requests:
            raise ValueError(f"the {PACKAGED_LIMIT} packaged requests make {len(requests)} chatbot requests, asked "
                             f"for num_requests={num_requests}")
        return requests[:num_requests]
    if conversations is None:
        conversations, _ = load_conversations()
    chats = [rounds for rounds in map(conversation_rounds, conversations) if len(rounds) >= 2]
    rng = random.Random(seed)
    rng.shuffle(chats)
    picks = [rng.randrange(1, len(rounds)) for rounds in chats]
    requests: list[Request] = []
    for start in range(0, len(chats), batch_size):
        texts = []
        for rounds, k in zip(chats[start:start + batch_size], picks[start:start + batch_size]):
            messages = [{"role": role, "content": text} for pair in rounds[:k]
                        for role, text in zip(("user", "assistant"), pair)]
            texts += [tokenizer.apply_chat_template(messages + [{"role": "user", "content": rounds[k][0]}]),
                      rounds[k][1]]
        ids = tokenizer.encode_batch(texts)
        for prompt, answer in zip(ids[0::2], ids[1::2]):
            if len(prompt) < MIN_LEN or len(answer) < MIN_LEN:
                continue
            requests.append(_request(len(requests), prompt[-max_prompt_len:], len(answer), max_output_len))
            if len(requests) == num_requests:
                return requests
    raise ValueError(f"only {len(requests)} of {len(chats)} conversations of two or more rounds qualify; asked for "
                     f"num_requests={num_requests}")


# ------------------------------------------------------------ multi-turn

_SENTINEL = "\x00paged-jax-answer\x00"
"""An answer's stand-in while the template around it is rendered."""


@dataclasses.dataclass(frozen=True)
class Conversation:
    """Turns of one conversation.

    Attributes:
      conv_id: its index.
      turns: per turn, ``(user ids, answer tokens)``: the first turn's ids
        are the whole templated prompt (system prompt included), a later
        turn's the template's tokens that follow the previous answer.
    """

    conv_id: int
    turns: tuple[tuple[tuple[int, ...], int], ...]

    def context_len(self, turns: int | None = None) -> int:
        """Tokens of its context once ``turns`` turns (default all) are
        answered: every user turn's ids and every answer."""
        return sum(len(ids) + n for ids, n in self.turns[:turns])


def _continuation(tokenizer, user_text: str) -> list[int]:
    """The template's ids between an answer and the assistant's next
    answer: the answer's end, the user's turn, the assistant's header."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "x"},
                                          {"role": "assistant", "content": _SENTINEL},
                                          {"role": "user", "content": user_text}])
    return tokenizer.encode(text.split(_SENTINEL, 1)[1])


def sharegpt_conversations(tokenizer, *, num_conversations: int, max_turns: int, max_context: int,
                           max_output_len: int, seed: int = 0, vocab_size: int | None = None,
                           conversations: Sequence[dict] | None = None) -> list[Conversation]:
    """``num_conversations`` conversations of 2 to ``max_turns`` turns (the
    module docstring).

    Args:
      tokenizer: a chat tokenizer, or None for packaged lengths and random
        ids below ``vocab_size``.
      max_context: most tokens a conversation's context reaches (the
        engine's ``max_seq_len``).
      max_output_len: cap on each answer, tokens.
      conversations: ShareGPT records (default
        :func:`experiments.lib.sharegpt.load_conversations`'s).

    Raises:
      ValueError: an argument out of range, or too few conversations of two
        turns that fit.
    """
    num_conversations = check_int("num_conversations", num_conversations)
    max_turns = check_int("max_turns", max_turns, 2)
    max_context = check_int("max_context", max_context, 8)
    max_output_len = check_int("max_output_len", max_output_len)
    seed = check_int("seed", seed, 0)
    out: list[Conversation] = []

    def keep(turns):
        kept, total = [], 0
        for ids, answer in turns[:max_turns]:
            answer = min(answer, max_output_len)
            if answer < 1 or not ids or total + len(ids) + answer > max_context:
                break
            kept.append((tuple(ids), answer))
            total += len(ids) + answer
        if len(kept) >= 2:
            out.append(Conversation(len(out), tuple(kept)))
        return len(out) == num_conversations

    if tokenizer is None:
        check_int("vocab_size", vocab_size)
        base = packaged_requests(PACKAGED_LIMIT, max_context, vocab_size=vocab_size, seed=seed)
        rng = np.random.default_rng(seed)
        cursor = 0
        while cursor + max_turns <= len(base):
            n = int(rng.integers(2, max_turns + 1))
            if keep([(r.prompt_ids, r.max_new_tokens) for r in base[cursor:cursor + n]]):
                return out
            cursor += n
    else:
        if conversations is None:
            conversations, _ = load_conversations()
        chats = [rounds for rounds in map(conversation_rounds, conversations) if len(rounds) >= 2]
        random.Random(seed).shuffle(chats)
        for rounds in chats:
            rounds = rounds[:max_turns]
            first = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": rounds[0][0]}]))
            users = [first] + [_continuation(tokenizer, user) for user, _ in rounds[1:]]
            answers = [len(ids) for ids in tokenizer.encode_batch([answer for _, answer in rounds])]
            if keep(list(zip(users, answers))):
                return out
    raise ValueError(f"only {len(out)} conversations of two turns fit max_context={max_context}; asked for "
                     f"num_conversations={num_conversations}")


def describe(requests: Sequence[Request]) -> str:
    """Prompt and output lengths of ``requests`` (non-empty), in words."""
    prompts = np.array([len(r.prompt_ids) for r in requests])
    outputs = np.array([r.max_new_tokens for r in requests])
    return (f"prompts {prompts.mean():.1f} tokens on average (min {prompts.min()}, max {prompts.max()}), the first "
            f"{shared_prefix_len(requests)} shared by all; outputs {outputs.mean():.1f} on average")
