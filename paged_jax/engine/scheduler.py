"""The scheduler: the queues, and who runs in the next call.

Iteration-level scheduling (Orca, OSDI 2022; PagedAttention, Kwon et al.,
SOSP 2023, section 4.5) with chunked prefill in mixed batches (Sarathi-Serve,
OSDI 2024; vLLM v1), under a token budget (``max_num_batched_tokens``):

1. Running groups, oldest first, get the tokens they still have to compute
   (one for a decoding sequence, a chunk of its prompt for one still
   prefilling). A group is planned whole: if the pool is short, the newest
   running group is preempted until it fits, and if none newer is left, the
   group itself is. Preemption is by *recompute* (pages freed; tokens
   prefilled again when readmitted, cached pages taken back) or by *swap*
   (pages copied to host memory and back).
2. Waiting groups are admitted first come, first served while pages, rows
   and budget last, the last of them with a partial chunk; a watermark of
   one page per running sequence whose pages are full keeps an admission
   from forcing a preemption in the very next call.

A request's sequences (parallel samples, beams: a *sequence group*) are
admitted, preempted and resumed together. Pages are the KV manager's
(:class:`paged_jax.engine.kv_manager.KVCacheManager`): the scheduler asks it what
things cost and tells it what it decided, and never reads block tables or
reference counts.
"""

from __future__ import annotations

import collections
import dataclasses

from paged_jax.attention.batch import Tiling
from paged_jax.engine.kv_manager import KVCacheManager
from paged_jax.engine.sequence import NO_SLOT, Sequence, SequenceGroup
from paged_jax.engine.stats import EngineStats


@dataclasses.dataclass(frozen=True)
class ScheduledSeq:
    """A sequence in the next call and the tokens it computes there (>= 1)."""

    seq: Sequence
    num_tokens: int


class Scheduler:
    """Queues and policy.

    Args:
      max_seqs: page-state rows (sequences running at once).
      max_num_batched_tokens: tokens per call.
      tiling: how many prefill chunks (of 2+ tokens) one call carries.
      preemption_mode: "recompute" or "swap".
      kv: the KV manager asked for costs.
      stats: counters it adds to.

    Attributes:
      waiting: sequences waiting, the head first; a group's live sequences
        stand together.
      running: running sequences, oldest group first, a group's together.
    """

    def __init__(self, *, max_seqs: int, max_num_batched_tokens: int, tiling: Tiling, preemption_mode: str,
                 kv: KVCacheManager, stats: EngineStats):
        self.max_num_batched_tokens = max_num_batched_tokens
        self.tiling = tiling
        self.preemption_mode = preemption_mode
        self.kv = kv
        self.stats = stats
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.free_slots = list(range(max_seqs - 1, -1, -1))  # pop() gives 0 first

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, group: SequenceGroup) -> None:
        self.waiting.extend(group.live)

    # ------------------------------------------------------------- policy

    def schedule(self) -> list[ScheduledSeq]:
        """Who runs in the next call and how many tokens each computes;
        preempts and admits on the way (the KV manager plans their pages)."""
        budget = self.max_num_batched_tokens
        chunks = self.tiling.max_prefill_chunks  # chunks of 2+ tokens left for this call
        out: list[ScheduledSeq] = []
        self.kv.slide(list(self.running))  # pages out of a sliding window first: they are free for this round
        i = 0
        while i < len(self.running) and budget > 0:
            group = self.running[i].group
            end = i + 1
            while end < len(self.running) and self.running[end].group is group:  # a group's sequences stand together
                end += 1
            members = self.running[i:end]
            plan, budget, chunks = self._plan(members, budget, chunks)
            need = sum(self.kv.grow_cost(s, n) for s, n in plan)
            while need > self.kv.num_free and self.running[-1].group is not group:
                self.preempt(self.running[-1].group)  # the newest group
            if need > self.kv.num_free:  # nothing newer is left: the group itself waits
                self.preempt(group)
                break
            for seq, n in plan:
                self.kv.reserve(seq, n)
                out.append(ScheduledSeq(seq, n))
            i += len(members)
        watermark = sum(1 for e in out if self.kv.fills_page(e.seq, e.num_tokens))
        while self.waiting and budget > 0:
            group = self.waiting[0].group
            members = group.live  # waiting together at the queue's head (gang scheduling)
            if any(s.pending for s in members) or len(members) + group.spare_slots > len(self.free_slots):
                break  # a preempted group waits for its tokens in flight
            adm = self.kv.admission(group, members)
            if (min(adm.first_chunk, budget) > 1 and not chunks) or adm.cost + watermark > self.kv.num_free:
                break
            if not self.kv.runs_fit(group, members):  # pages enough, but no run fits: external fragmentation
                self.stats.fragmentation_blocked_steps += 1
                if not group.blocked_by_fragmentation:
                    group.blocked_by_fragmentation = True
                    self.stats.fragmentation_blocked_requests += 1
                break
            for seq in members:
                self.waiting.popleft()
                seq.slot = self.free_slots.pop()
                self.running.append(seq)
            sizes = []
            for seq, start in zip(members, adm.computed):
                n = min(seq.num_tokens - start, budget)
                if n > 1 and not chunks:
                    n = 0  # admitted; computes from the next call on
                budget -= n
                chunks -= n > 1
                sizes.append(n)
            self.kv.admit(group, adm, sizes)
            out.extend(ScheduledSeq(s, n) for s, n in zip(members, sizes) if n)
            group.child_slots = [self.free_slots.pop() for _ in range(group.spare_slots)]
        planned = {id(e.seq) for e in out}
        for seq in self.running:
            if seq.draft and id(seq) not in planned:  # not in the call: its proposals are stale by the next
                seq.draft.clear()
        return out

    def _plan(self, members: list[Sequence], budget: int, chunks: int) -> tuple[list[tuple[Sequence, int]], int, int]:
        """The tokens each of a running group's sequences computes next,
        within ``budget`` tokens and ``chunks`` prefill chunks."""
        plan = []
        for seq in members:
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.num_computed, budget)
            if seq.draft and (n == 1 or not chunks):  # proposals need a chunk and a token of budget each
                n = 1  # none fit: it decodes as usual
            if seq.draft:
                del seq.draft[n - 1:]  # those past the budget are not verified
            if (seq.num_generated + seq.pending >= seq.request.max_new_tokens or n == 0 or (n > 1 and not chunks)
                    or (seq.pending and seq.group.beam)):
                continue  # finishes when its token in flight is read; waits for the next call; or (a beam)
            plan.append((seq, n))  # waits for the host to choose its next token
            budget -= n
            chunks -= n > 1
        return plan, budget, chunks

    # ------------------------------------------------------------ changes

    def preempt(self, group: SequenceGroup, *, recompute: bool = False) -> None:
        """Frees every running sequence of ``group`` and puts them back at
        the head of the queue: by swap, their pages are copied out first
        (recompute when the swap space is full, or with ``recompute``)."""
        members = [s for s in group.live if s.running]
        swapped = not recompute and self.preemption_mode == "swap" and self.kv.swap_out(group, members)
        for seq in members:
            self.release(seq)
            if not swapped:
                seq.num_computed = 0
            seq.num_keyed = 0  # its pages come anew (or from the cache) when readmitted
            seq.fork_pre = None  # a beam not forked yet: gets its own pages back
            seq.draft.clear()  # proposed again once it runs
        self.return_child_slots(group)
        group.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.extendleft(reversed(members))

    def release(self, seq: Sequence, *, keep_run: bool = False) -> None:
        """Takes running ``seq`` out: its row back, its pages released (its
        contiguous run too, unless ``keep_run``)."""
        self.running.remove(seq)
        self.kv.release(seq, keep_run=keep_run)
        self.free_slots.append(seq.slot)
        seq.slot = NO_SLOT

    def remove(self, seq: Sequence) -> None:
        """Takes ``seq`` out of whichever queue holds it."""
        if seq.running:
            self.release(seq)
        else:
            self.waiting.remove(seq)

    def return_child_slots(self, group: SequenceGroup) -> None:
        """The rows ``group`` held for samples and beams to come go back
        (it finished, was aborted or preempted), with any pages the KV
        manager counted for them."""
        self.kv.return_child_rows(group)
        self.free_slots.extend(reversed(group.child_slots))
        group.child_slots = []

    def prune(self, seq: Sequence) -> None:
        """A beam with no continuation leaves; a running one's row stays
        with its group for the beams to come."""
        if seq.running:
            self.release(seq, keep_run=True)  # the row's run stays with the group, for a beam to come
            seq.group.child_slots.append(self.free_slots.pop())
            self.kv.keep_for_beams(seq.group, seq.group.child_slots[-1])
        else:
            self.waiting.remove(seq)

    def add_forks(self, group: SequenceGroup, forks: list[tuple[Sequence, Sequence]]) -> None:
        """New beams ``(parent, child)`` join right after their group's
        sequences; a running child takes a row of the group's and forks its
        parent's pages in the next call."""
        queue = self.running if group.live[0].running else self.waiting
        at = max(i for i, s in enumerate(queue) if s.group is group) + 1
        for parent, child in forks:
            if parent.running:
                child.slot, child.fork_pre = group.child_slots.pop(), parent
            queue.insert(at, child)
            at += 1

    def add_children(self, parent: Sequence, children: list[Sequence]) -> None:
        """Parallel samples forked from ``parent`` in a dispatched call join
        the running queue right after it."""
        at = self.running.index(parent) + 1
        self.running[at:at] = children
