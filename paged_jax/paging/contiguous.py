"""Contiguous allocators: how a pre-paging server places each reservation.

The PagedAttention paper's baselines (Kwon et al., SOSP 2023, section 6.1)
are Orca with its KV cache in contiguous memory: every sequence holds one
run of slots, sized when it is admitted, "using the buddy allocation
algorithm" (section 6.1). Two wastes follow that paging removes (section 3,
Figure 3): *internal fragmentation* (a run rounded up past what the
sequence ever holds) and *external fragmentation* (free memory cut into
runs too short for the next reservation, so a request waits while the
server reports memory free).

These allocators place runs of page ids in ``[0, capacity)``; the engine
(:class:`paged_jax.engine.kv_manager.KVCacheManager`) asks them at
admission whether a group's reservations can be placed, and counts when
they cannot though enough pages are free. The device still pages
underneath, so every policy runs the same programs: the runs are the
contiguous server's address space, and the admissions they refuse are the
ones such a server would refuse.

- :class:`BuddyAllocator`: Knuth's binary buddy system (TAOCP vol. 1,
  section 2.5): a run is rounded up to a power of two of pages, placed in
  the smallest free block that holds it (split in halves down to size),
  and merged with its buddy when both are free. A capacity that is not a
  power of two starts as its aligned power-of-two blocks.
- :class:`FirstFitAllocator`: exact sizes, the lowest free interval that
  holds the run; neighbours coalesce on free.
"""

from __future__ import annotations

import abc
import bisect
import copy

from paged_jax.checks import check_choice, check_int

ALLOCATORS = ("buddy", "first_fit")
"""The contiguous allocators (``EngineConfig.allocator``; "pages" there
means none: a reservation is a count of pages)."""


class RunAllocator(abc.ABC):
    """Runs of page ids in ``[0, capacity)``.

    Args:
      capacity: pages it places runs in (>= 1).

    Attributes:
      runs: start -> pages of each placed run (rounding included).
    """

    def __init__(self, capacity: int):
        self.capacity = check_int("capacity", capacity)
        self.runs: dict[int, int] = {}

    @abc.abstractmethod
    def run_pages(self, pages: int) -> int:
        """Pages a reservation of ``pages`` takes (buddy: the next power of
        two; first fit: ``pages``)."""

    @abc.abstractmethod
    def _place(self, pages: int) -> int | None:
        """Places a run of exactly ``pages`` (already rounded); its start, or
        None when no free run holds it (nothing changes then)."""

    @abc.abstractmethod
    def _release(self, start: int, pages: int) -> None:
        """Gives run ``[start, start + pages)`` back."""

    @abc.abstractmethod
    def largest_free(self) -> int:
        """Pages of the longest run that could be placed now."""

    @property
    def num_free(self) -> int:
        """Pages in no run."""
        return self.capacity - sum(self.runs.values())

    def allocate(self, pages: int) -> int | None:
        """Places a run for a reservation of ``pages`` pages (>= 1).

        Returns:
          its first page id, or None when no free run holds it, even if
          ``num_free`` would (external fragmentation); nothing changes then.

        Raises:
          ValueError: ``pages`` not an int >= 1.
        """
        size = self.run_pages(check_int("pages", pages))
        if size > self.capacity:
            return None
        start = self._place(size)
        if start is not None:
            self.runs[start] = size
        return start

    def free(self, start: int) -> None:
        """Gives the run starting at ``start`` back.

        Raises:
          ValueError: ``start`` not an int, or no run starts at it (nothing
            changes).
        """
        size = self.runs.pop(check_int("start", start, 0), None)
        if size is None:
            raise ValueError(f"start={start!r} is not the start of a placed run")
        self._release(start, size)

    def fits(self, sizes: list[int]) -> bool:
        """Whether reservations of ``sizes`` pages could all be placed now,
        in that order (a trial on a copy: nothing changes)."""
        trial = copy.deepcopy(self)
        return all(trial.allocate(s) is not None for s in sizes)

    def fits_empty(self, sizes: list[int]) -> bool:
        """Whether reservations of ``sizes`` pages fit when nothing else is
        placed (a group that fails this can never be admitted)."""
        return type(self)(self.capacity).fits(sizes)


class BuddyAllocator(RunAllocator):
    """The binary buddy system (module docstring)."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._free: dict[int, set[int]] = {}  # order -> starts of free blocks of 2**order pages
        start = 0
        while start < capacity:  # the aligned power-of-two blocks of [0, capacity)
            order = (capacity - start).bit_length() - 1
            while start % (1 << order):
                order -= 1
            self._free.setdefault(order, set()).add(start)
            start += 1 << order

    def run_pages(self, pages: int) -> int:
        return 1 << (pages - 1).bit_length()

    def _place(self, pages: int) -> int | None:
        want = pages.bit_length() - 1
        orders = [o for o, starts in self._free.items() if o >= want and starts]
        if not orders:
            return None
        order = min(orders)
        start = min(self._free[order])
        self._free[order].discard(start)
        while order > want:  # split: keep the lower half, free the upper
            order -= 1
            self._free.setdefault(order, set()).add(start + (1 << order))
        return start

    def _release(self, start: int, pages: int) -> None:
        order = pages.bit_length() - 1
        while True:
            buddy = start ^ (1 << order)
            if buddy not in self._free.get(order, ()):
                break
            self._free[order].discard(buddy)
            start, order = min(start, buddy), order + 1
        self._free.setdefault(order, set()).add(start)

    def largest_free(self) -> int:
        orders = [o for o, starts in self._free.items() if starts]
        return 1 << max(orders) if orders else 0

    def free_blocks(self) -> list[tuple[int, int]]:
        """(start, pages) of every free block, by start."""
        return sorted((s, 1 << o) for o, starts in self._free.items() for s in starts)


class FirstFitAllocator(RunAllocator):
    """First fit over free intervals (module docstring)."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._starts = [0]  # free intervals, by start
        self._lengths = [capacity]

    def run_pages(self, pages: int) -> int:
        return pages

    def _place(self, pages: int) -> int | None:
        for i, length in enumerate(self._lengths):
            if length >= pages:
                start = self._starts[i]
                if length == pages:
                    del self._starts[i], self._lengths[i]
                else:
                    self._starts[i] += pages
                    self._lengths[i] -= pages
                return start
        return None

    def _release(self, start: int, pages: int) -> None:
        i = bisect.bisect(self._starts, start)
        self._starts.insert(i, start)
        self._lengths.insert(i, pages)
        if i + 1 < len(self._starts) and start + pages == self._starts[i + 1]:  # merge with the next
            self._lengths[i] += self._lengths.pop(i + 1)
            del self._starts[i + 1]
        if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:  # and with the previous
            self._lengths[i - 1] += self._lengths.pop(i)
            del self._starts[i]

    def largest_free(self) -> int:
        return max(self._lengths, default=0)

    def free_blocks(self) -> list[tuple[int, int]]:
        """(start, pages) of every free interval, by start."""
        return list(zip(self._starts, self._lengths))


def make_allocator(name: str, capacity: int) -> RunAllocator:
    """The allocator ``name`` (one of :data:`ALLOCATORS`) over ``capacity``
    pages.

    Raises:
      ValueError: an unknown ``name`` or a ``capacity`` below 1.
    """
    check_choice("allocator", name, ALLOCATORS)
    return (BuddyAllocator if name == "buddy" else FirstFitAllocator)(capacity)


class HeldRuns:
    """The runs each owner (a sequence group: its sequences and its rows
    for samples and beams to come) holds in an allocator, one per row.

    Args:
      allocator: where the runs are placed.
    """

    def __init__(self, allocator: RunAllocator):
        self.allocator = allocator
        self._held: dict[object, list[int]] = {}  # owner -> starts of its runs

    def fits(self, sizes: list[int]) -> bool:
        """Whether runs for reservations of ``sizes`` pages fit now."""
        return self.allocator.fits(sizes)

    def place(self, owner, sizes: list[int]) -> None:
        """Places runs for reservations of ``sizes`` pages, held by ``owner``.

        Raises:
          ValueError: a size not an int >= 1 (nothing placed).
          RuntimeError: one does not fit (ask :meth:`fits` first).
        """
        for size in sizes:
            check_int("sizes", size)
        for size in sizes:
            start = self.allocator.allocate(size)
            if start is None:
                raise RuntimeError(f"internal: a run of {size} pages placed without a fit "
                                   f"({self.allocator.num_free} pages free, largest run "
                                   f"{self.allocator.largest_free()})")
            self._held.setdefault(owner, []).append(start)

    def free(self, owner, n: int = 1) -> None:
        """Gives ``n`` of ``owner``'s runs back (its last placed first;
        fewer if it holds fewer)."""
        starts = self._held.get(owner, [])
        for _ in range(min(n, len(starts))):
            self.allocator.free(starts.pop())
        if not starts:
            self._held.pop(owner, None)

    def held(self, owner) -> int:
        """Runs ``owner`` holds."""
        return len(self._held.get(owner, ()))
