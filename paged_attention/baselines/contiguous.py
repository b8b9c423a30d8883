"""The contiguous KV-cache manager: one reserved range per request, as systems before vLLM did.

This is the baseline the PagedAttention paper measures against (its Orca reimplementation), built
behind the same :class:`~paged_attention.memory.manager.KVCacheManager` protocol as the paged
manager, so the *same* scheduler and engine run it and the experiments compare memory managers and
nothing else.

When a request is admitted, its reservation policy (:mod:`.reservation`) says how many slots to
reserve, and a placement allocator (:mod:`.placement`) finds one unbroken range of that size. The
request then writes its tokens into consecutive slots of that range and never asks for memory
again, so it is never preempted; the price is paid up front, in memory no one else may touch.

The slot granularity is one token (``block_size = 1``): the "block table" of a request is simply
``start, start + 1, ...``, consecutive addresses, so the very same attention kernels read the
contiguous range (a paged kernel given an identity-like table reads memory exactly as a
contiguous kernel would).

Its memory report splits each reservation into the paper's Figure 2 categories:

* token states: slots written so far;
* reserved: slots the request will still fill (up to prompt + ``max_tokens``);
* internal fragmentation: the reservation beyond prompt + ``max_tokens``, never to be used;
* external fragmentation: slots lost *between* requests: the buddy allocator's rounding inside
  each chunk, and free holes too small for the request waiting at the head of the queue (first
  come, first served: while it waits, nobody behind it may use them);
* free: the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._checks import check_positive_int
from ..engine.sequence import Sequence
from ..memory.accounting import MemoryReport
from ..memory.manager import SlotAllocation
from .placement import make_placement
from .reservation import reservation_slots


@dataclass
class _Reservation:
    start: int
    slots: int  # what the policy reserved
    footprint: int  # what placement really took (>= slots)
    final_len: int  # prompt + max_tokens: the most the request will ever write
    num_tokens: int = 0  # slots written


class ContiguousKVCacheManager:
    """Reserve-at-admission contiguous KV memory over ``num_slots`` token slots."""

    block_size = 1  # slot granularity; see the module docstring
    supports_fork = False  # a reserved range is private: n samples run as n unshared sequences
    num_cpu_blocks = 0  # preemption never happens (the whole range is reserved up front)
    watermark_blocks = 0

    def __init__(
        self, num_slots: int, max_model_len: int, policy: str = "max", placement: str = "buddy"
    ) -> None:
        check_positive_int("num_slots", num_slots)
        check_positive_int("max_model_len", max_model_len)
        reservation_slots(policy, 1, 0, max_model_len)  # validates the policy name
        self.policy = policy
        self.placement_name = placement
        self.max_model_len = max_model_len
        self.placement = make_placement(placement, num_slots, max_model_len)
        # The longest range an empty arena offers: a request whose footprint exceeds it never fits.
        self._largest_range = max(length for _, length in self.placement.holes())
        self.reservations: dict[int, _Reservation] = {}
        self._admitting: dict[int, tuple[int, int]] = {}  # seq_id -> (slots, final_len), from can_admit
        self.blocked_need: int | None = None  # footprint of the request last turned away, if still waiting
        self._blocked_seq: int | None = None
        self._saved: tuple | None = None  # the state at begin, while a step is open

    @property
    def num_slots(self) -> int:
        return self.placement.num_slots

    @property
    def num_blocks(self) -> int:
        return self.num_slots

    def _size(self, seq: Sequence) -> int:
        return reservation_slots(self.policy, len(seq.prompt_token_ids), seq.params.max_tokens or 0,
                                 self.max_model_len)  # fmt: skip

    # -- the protocol ---------------------------------------------------------------------------
    def fits_at_all(self, seq: Sequence) -> bool:
        if seq.max_total_tokens > self.max_model_len:
            return False
        return self.placement.footprint(self._size(seq)) <= self._largest_range

    def unfit_reason(self, seq: Sequence) -> str:
        if seq.max_total_tokens > self.max_model_len:
            return f"it may grow to {seq.max_total_tokens} tokens, past max_model_len={self.max_model_len}"
        size = self._size(seq)
        return (
            f"the {self.policy!r} policy reserves {size} slots for it (placement {self.placement_name!r} "
            f"takes {self.placement.footprint(size)}), but the longest contiguous range of the arena "
            f"holds {self._largest_range}"
        )

    def can_admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        size = self._size(seq)
        if not self.placement.can_allocate(size):
            self.blocked_need, self._blocked_seq = self.placement.footprint(size), seq.seq_id
            return False
        self.blocked_need = self._blocked_seq = None
        self._admitting[seq.seq_id] = (size, seq.max_total_tokens)
        return True

    def lookup_prefix(self, seq: Sequence) -> int:
        """No prefix cache: a reserved range is private, nothing is ever found already computed."""
        return 0

    def num_free_prefix_blocks(self, seq: Sequence) -> int:
        """No prefix cache, so no cached block waits in a free queue."""
        return 0

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> SlotAllocation | None:
        """Slots in the sequence's reserved range; drafted (lookahead) ones too, within the range
        (a reservation cannot grow: a draft past it is refused like any token)."""
        num_new_tokens += num_lookahead_tokens
        seq_id = seq.seq_id
        res = self.reservations.get(seq_id)
        if res is None:
            if seq_id not in self._admitting:
                raise ValueError(f"sequence {seq_id} must pass can_admit before its first allocate_slots")
            size, final_len = self._admitting.pop(seq_id)
            start = self.placement.allocate(size)
            if start is None:
                return None
            res = self.reservations[seq_id] = _Reservation(
                start, size, self.placement.footprint(size), final_len
            )
        if res.num_tokens + num_new_tokens > res.slots:
            return None  # past its reservation: the range cannot grow
        first = res.start + res.num_tokens
        res.num_tokens += num_new_tokens
        return SlotAllocation(list(range(first, first + num_new_tokens)), [])

    def reserve(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Nothing to do: the range was reserved, to the request's maximum, at admission."""
        return seq.seq_id in self.reservations

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Forget the slots from ``num_tokens`` on (rejected drafts); the range stays reserved."""
        res = self.reservations[seq.seq_id]
        if not 0 <= num_tokens <= res.num_tokens:
            raise ValueError(f"num_tokens must be in [0, {res.num_tokens}], got {num_tokens}")
        res.num_tokens = num_tokens

    def free(self, seq_id: int) -> None:
        self._admitting.pop(seq_id, None)
        if seq_id == self._blocked_seq:  # the request that was waiting is gone (aborted)
            self.blocked_need = self._blocked_seq = None
        res = self.reservations.pop(seq_id, None)
        if res is not None:
            self.placement.free(res.start)

    def block_table(self, seq_id: int) -> list[int]:
        res = self.reservations[seq_id]
        return list(range(res.start, res.start + res.num_tokens))

    def memory_report(self) -> MemoryReport:
        tokens = sum(r.num_tokens for r in self.reservations.values())
        future = sum(max(0, r.final_len - r.num_tokens) for r in self.reservations.values())
        internal = sum(r.slots - max(r.final_len, r.num_tokens) for r in self.reservations.values())
        rounding = sum(r.footprint - r.slots for r in self.reservations.values())
        unusable = 0
        if self.blocked_need is not None:  # holes the waiting head-of-line request cannot use
            unusable = sum(length for _, length in self.placement.holes() if length < self.blocked_need)
        return MemoryReport(
            total_slots=self.num_slots,
            token_slots=tokens,
            reserved_slots=future,
            internal_fragmentation_slots=internal,
            external_fragmentation_slots=rounding + unusable,
            free_slots=self.placement.free_slots - unusable,
        )

    # -- what a contiguous range cannot do: share, swap, cache ----------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        raise ValueError("a contiguous KV cache cannot share memory between sequences (supports_fork=False)")

    def can_swap_out(self, seq_id: int) -> bool:
        return False

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        raise ValueError("a contiguous KV cache has no swap space")

    def can_swap_in(self, seq_id: int, num_new_tokens: int = 1) -> bool:
        return False

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        raise ValueError("a contiguous KV cache has no swap space")

    def reset_prefix_cache(self) -> int:
        return 0

    # -- a step is a transaction ----------------------------------------------------------------
    def begin(self) -> None:
        """Remember the arena as it is: the reservations and their fill, the placement's ranges
        (O(reservations), not O(slots)) and the admission notes."""
        fills = [(res, res.num_tokens) for res in self.reservations.values()]
        self._saved = (dict(self.reservations), fills, dict(self._admitting), self.blocked_need,
                       self._blocked_seq, self.placement.snapshot())  # fmt: skip

    def commit(self) -> None:
        self._saved = None

    def rollback(self) -> None:
        if self._saved is None:
            raise RuntimeError("rollback without begin")
        self.reservations, fills, self._admitting, self.blocked_need, self._blocked_seq, placement = (
            self._saved
        )
        for res, num_tokens in fills:
            res.num_tokens = num_tokens
        self.placement.restore(placement)
        self._saved = None

    def reused_blocks(self) -> tuple[list[int], list[int]]:
        """None: a range is freed only when its request ends, after the step's writes."""
        return [], []

    def segments(self) -> list[tuple[int, int, str]]:
        """``(start, length, category)`` pieces of every reservation, by address, for pictures:
        ``"tokens"``, ``"reserved"``, ``"internal"`` and ``"rounding"`` (the placement's slack)."""
        pieces = []
        for r in sorted(self.reservations.values(), key=lambda r: r.start):
            end_tokens = r.start + r.num_tokens
            end_final = r.start + max(r.final_len, r.num_tokens)
            for start, end, category in (
                (r.start, end_tokens, "tokens"),
                (end_tokens, end_final, "reserved"),
                (end_final, r.start + r.slots, "internal"),
                (r.start + r.slots, r.start + r.footprint, "rounding"),
            ):
                if end > start:
                    pieces.append((start, end - start, category))
        return pieces

    @property
    def num_free_blocks(self) -> int:
        return self.placement.free_slots

    @property
    def usage(self) -> float:
        """Share of slots handed out (reserved counts as used: no one else may touch it)."""
        return 1 - self.placement.free_slots / self.num_slots
