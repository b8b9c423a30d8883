"""Where a contiguous reservation goes: buddy allocation and first-fit over one arena of slots.

A contiguous KV cache is one long arena of token slots. Each request gets one unbroken range of it,
so the placement policy decides how much memory is lost *between* ranges: external fragmentation.

* :class:`BuddyAllocator`, what the PagedAttention paper assumed for its Orca baselines (§6.1).
  Sizes are rounded up to a power of two; a free chunk of size ``2s`` is split into two *buddies*
  of size ``s``, and two free buddies merge back. Finding a chunk and merging are cheap, but the
  rounding wastes up to half of each chunk, and free chunks of the wrong sizes cannot be combined.
* :class:`FirstFitAllocator`, a stronger baseline: the first free hole big enough, no rounding,
  neighbouring holes merged on free. It still fragments: a 900-slot request cannot use two
  separate 500-slot holes.

Both expose the same small interface (``allocate``, ``free``, ``footprint``, ``holes``) so the
contiguous manager can use either, and the experiments can show that paging's advantage does not
hinge on a weak allocator.
"""

from __future__ import annotations

import bisect
from typing import Protocol

from .._checks import check_int, check_positive_int


class Placement(Protocol):
    """A contiguous allocator over ``num_slots`` slots."""

    num_slots: int

    def allocate(self, size: int) -> int | None:
        """Start of a free range for ``size`` slots, or ``None`` if no hole is big enough."""

    def can_allocate(self, size: int) -> bool: ...

    def free(self, start: int) -> None:
        """Give back the range that starts at ``start``."""

    def footprint(self, size: int) -> int:
        """Slots a ``size``-slot request really takes (buddy rounds up to a power of two)."""

    def holes(self) -> list[tuple[int, int]]:
        """Free ``(start, length)`` pieces, by address; a request can only use one piece."""

    @property
    def free_slots(self) -> int: ...

    def snapshot(self) -> object:
        """The free and used ranges (O(ranges), not O(slots)), for :meth:`restore` to put back."""

    def restore(self, state: object) -> None: ...


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1)."""
    return 1 << (n - 1).bit_length()


class BuddyAllocator:
    """Binary buddy allocation with chunks of at most ``max_chunk`` slots (a power of two).

    The arena need not be a power of two: it is carved into as many ``max_chunk`` chunks as fit,
    then the remainder into ever smaller powers of two, each aligned to its own size. The paper's
    OPT-13B budget is 15,728 slots; with ``max_chunk = 2048`` that is seven 2048-slot chunks, then
    1024 + 256 + 64 + 32 + 16 slots of chunks too small for a 2048-token reservation.
    """

    def __init__(self, num_slots: int, max_chunk: int) -> None:
        self.num_slots = check_positive_int("num_slots", num_slots)
        check_positive_int("max_chunk", max_chunk)
        if max_chunk & (max_chunk - 1):
            raise ValueError(f"max_chunk must be a power of two, got {max_chunk}")
        self.max_chunk = max_chunk
        self._free: dict[int, list[int]] = {}  # chunk size -> sorted starts of free chunks
        self._used: dict[int, int] = {}  # start -> chunk size
        start, size = 0, max_chunk
        while size >= 1:
            while start + size <= num_slots and (size == max_chunk or start % size == 0):
                self._free.setdefault(size, []).append(start)
                start += size
                if size < max_chunk:
                    break
            size //= 2

    def footprint(self, size: int) -> int:
        return next_power_of_two(check_positive_int("size", size))

    def can_allocate(self, size: int) -> bool:
        chunk = self.footprint(size)
        return any(starts for s, starts in self._free.items() if s >= chunk)

    def allocate(self, size: int) -> int | None:
        chunk = self.footprint(size)
        if chunk > self.max_chunk:
            return None
        fitting = [s for s, starts in self._free.items() if s >= chunk and starts]
        if not fitting:
            return None
        size_found = min(fitting)  # the smallest free chunk that fits: split as little as possible
        start = self._free[size_found].pop(0)  # lowest address first, so runs are reproducible
        while size_found > chunk:  # split: keep the lower half, free the upper buddy
            size_found //= 2
            bisect.insort(self._free.setdefault(size_found, []), start + size_found)
        self._used[start] = chunk
        return start

    def free(self, start: int) -> None:
        if start not in self._used:
            raise ValueError(f"no allocated chunk starts at slot {start}")
        size = self._used.pop(start)
        while size < self.max_chunk:  # merge with the buddy while it is free and of the same size
            buddy = start ^ size
            starts = self._free.get(size, [])
            i = bisect.bisect_left(starts, buddy)
            if i == len(starts) or starts[i] != buddy:
                break
            starts.pop(i)
            start, size = min(start, buddy), size * 2
        bisect.insort(self._free.setdefault(size, []), start)

    def holes(self) -> list[tuple[int, int]]:
        return sorted((start, size) for size, starts in self._free.items() for start in starts)

    @property
    def free_slots(self) -> int:
        return sum(size * len(starts) for size, starts in self._free.items())

    def snapshot(self) -> tuple[dict[int, list[int]], dict[int, int]]:
        return {size: list(starts) for size, starts in self._free.items()}, dict(self._used)

    def restore(self, state: tuple[dict[int, list[int]], dict[int, int]]) -> None:
        free, used = state
        self._free = {size: list(starts) for size, starts in free.items()}
        self._used = dict(used)


class FirstFitAllocator:
    """First fit: the lowest-addressed hole that is big enough; adjacent holes merge on free."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = check_positive_int("num_slots", num_slots)
        self._holes: list[list[int]] = [[0, num_slots]]  # [start, length], sorted, never adjacent
        self._used: dict[int, int] = {}

    def footprint(self, size: int) -> int:
        return check_positive_int("size", size)

    def can_allocate(self, size: int) -> bool:
        check_positive_int("size", size)
        return any(length >= size for _, length in self._holes)

    def allocate(self, size: int) -> int | None:
        check_positive_int("size", size)
        for i, (start, length) in enumerate(self._holes):
            if length >= size:
                if length == size:
                    del self._holes[i]
                else:
                    self._holes[i] = [start + size, length - size]
                self._used[start] = size
                return start
        return None

    def free(self, start: int) -> None:
        check_int("start", start, minimum=0)
        if start not in self._used:
            raise ValueError(f"no allocated range starts at slot {start}")
        size = self._used.pop(start)
        i = bisect.bisect_left(self._holes, [start, 0])
        self._holes.insert(i, [start, size])
        if i + 1 < len(self._holes) and start + size == self._holes[i + 1][0]:  # merge with the next
            self._holes[i][1] += self._holes.pop(i + 1)[1]
        if i > 0 and self._holes[i - 1][0] + self._holes[i - 1][1] == start:  # and with the previous
            self._holes[i - 1][1] += self._holes.pop(i)[1]

    def holes(self) -> list[tuple[int, int]]:
        return [(start, length) for start, length in self._holes]

    @property
    def free_slots(self) -> int:
        return sum(length for _, length in self._holes)

    def snapshot(self) -> tuple[list[list[int]], dict[int, int]]:
        return [list(hole) for hole in self._holes], dict(self._used)

    def restore(self, state: tuple[list[list[int]], dict[int, int]]) -> None:
        holes, used = state
        self._holes = [list(hole) for hole in holes]
        self._used = dict(used)


PLACEMENTS = ("buddy", "first-fit")


def make_placement(name: str, num_slots: int, max_chunk: int) -> Placement:
    """``"buddy"`` (chunks up to ``max_chunk``, rounded up to a power of two) or ``"first-fit"``."""
    if name == "buddy":
        return BuddyAllocator(num_slots, next_power_of_two(max_chunk))
    if name == "first-fit":
        return FirstFitAllocator(num_slots)
    raise ValueError(f"placement must be one of {PLACEMENTS}, got {name!r}")
