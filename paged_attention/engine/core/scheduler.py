"""Continuous batching: which sequences run this step, and with how many tokens each.

Static batching (what ``model.generate`` does) runs a fixed batch until its longest member ends.
Continuous batching (Orca, vLLM) decides anew at *every step*: a finished sequence leaves at once
and a waiting one takes its place in the very next step. The scheduler below does that in one pass:

1. **Running sequences first**, oldest first. Each gets the tokens it still needs (one for a
   decode step, a chunk for a prompt being prefilled) within the step's token budget. If the cache
   manager cannot find room, the scheduler **preempts the most recent arrival** among the running
   sequences, which frees memory for the older ones; if the sequence asking is itself the most
   recent, it is the one that steps back. Preemption either discards the victim's pages and puts it
   back at the *front* of the waiting queue to be recomputed (``"recompute"``), or copies its pages
   to CPU memory (``"swap"``) to be copied back later; a swap victim whose pages do not fit the CPU
   pool is recomputed instead, and counted (``num_swap_fallbacks``).
2. **Swapped sequences come back** when no one was preempted in this step and memory allows (with
   room for the rest of their prefill, if they were swapped out in the middle of one).
3. **Waiting sequences are admitted first-come first-served** while the token budget,
   ``max_num_seqs`` and free blocks (above the watermark) allow. A long prompt is split into
   chunks that fit the budget (*chunked prefill*), so one huge prompt never stalls the decodes;
   but admission asks memory for the *whole* prompt (or recompute), not its first chunk, and
   *reserves* the blocks of its later chunks (``reserve``, vLLM v0's whole-prompt allocation):
   admitted for one chunk, it would find no blocks for the next and, the latest arrival, preempt
   itself at once, again and again; merely checked for, its blocks would be taken by the sequences
   decoding beside it while its chunks ran, with the same end. A swapped sequence that comes back
   reserves the rest of its prefill the same way. So a sequence never steps back twice without
   a new token in between: after admission it samples before it can ask for a block again.
   Admission stops at the first request that does not fit: skipping ahead to smaller ones would
   let a large request starve forever. A sequence whose beginning is in the prefix cache starts
   with those tokens already computed (``lookup_prefix``) and spends budget only on the rest.

Sharing adds two rules. A request with ``n`` samples or ``beam_width`` beams is admitted as one
sequence that will fork: it takes all its seats in ``max_num_seqs`` at once, and its children join
the running set right after its prompt is computed (``StepUpdate.forks``). And a beam waits for its
siblings: once its newest token is computed it has nothing to run
(``num_uncomputed_tokens == 0``) and is *parked*, skipped, until the engine has chosen the next
beams from all of them.

**Who may join, and who steps back** is a :class:`~.policy.SchedulingPolicy`: continuous batching
by default (anyone waiting may join at any step; the latest arrival is preempted first).

**The end of a step has one owner**, :meth:`Scheduler.update_from_output` (vLLM's name). Given
what the step scheduled and what the requests decided from its logits (a :class:`StepUpdate`), it
alone, in this order: (1) advances every scheduled sequence's computed count; (2) forks the new
children, which share their parent's pages; (3) finishes the sequences dropped without a token (a
beam that did not survive); (4) appends each sequence's tokens one by one, asking the stop rules
(:mod:`.stop_rules`, which only decide) after each and finishing the sequence at the first stop, so
that nothing after a stop is kept; (5) returns what finished. Finishing is one path,
:meth:`finish`: status and reason, out of every queue, pages freed. The engine, the trace replay
and the tests' scripted model all end their steps here.

Why this cannot deadlock: a request that could never fit (its prompt plus ``max_tokens`` beyond the
whole cache) is rejected when it is added, and the oldest running sequence is never the victim
while a younger one runs, so the oldest always makes progress and eventually finishes. Parked beams
could hold memory that the sibling they wait for needs; so when a step would schedule nothing at all
while parked sequences run, they are all preempted (recomputed later, largely from the prefix
cache). Preempted sequences re-enter the waiting queue in arrival order, a request's forks
together, so the oldest request then comes back whole.
"""

from __future__ import annotations

import bisect
from collections import deque

from ..._checks import cdiv, check_positive_int
from ...memory.manager import KVCacheManager
from ..detokenizer import Detokenizer
from ..sequence import FinishReason, Sequence, SequenceStatus
from ..stop_rules import StopRules
from .policy import SchedulingPolicy
from .step import DrawnLogprob, ScheduledSequence, SchedulerOutput, StepUpdate

__all__ = ["DrawnLogprob", "ScheduledSequence", "Scheduler", "SchedulerOutput", "SchedulingPolicy",
           "StepUpdate"]  # fmt: skip

PREEMPTION_MODES = ("recompute", "swap")


class Scheduler:
    """FCFS continuous batching with chunked prefill and preemption (see the module docstring)."""

    def __init__(
        self,
        cache_manager: KVCacheManager,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        preemption_mode: str = "recompute",
        scheduling_policy: SchedulingPolicy | None = None,
        stop_rules: StopRules | None = None,
        detokenizer: Detokenizer | None = None,
    ) -> None:
        """``stop_rules``: the engine's (its EOS tokens, ``max_model_len``); by default only
        ``max_tokens`` ends a sequence. ``detokenizer``: needed by sequences with stop strings."""
        check_positive_int("max_num_seqs", max_num_seqs)
        check_positive_int("max_num_batched_tokens", max_num_batched_tokens)
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if preemption_mode == "swap" and not cache_manager.num_cpu_blocks:
            raise ValueError(
                "preemption_mode='swap' needs a cache manager with CPU blocks (num_cpu_blocks > 0)"
            )
        if scheduling_policy is not None and not isinstance(scheduling_policy, SchedulingPolicy):
            raise TypeError(
                f"scheduling_policy must be a SchedulingPolicy, got {type(scheduling_policy).__name__}"
            )
        self.cache_manager = cache_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.scheduling_policy = scheduling_policy or SchedulingPolicy()
        self.stop_rules = stop_rules or StopRules()
        self.detokenizer = detokenizer
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order: the last one is the next victim
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_self_preemptions = 0  # preemptions of the very sequence that asked for memory
        self.num_swap_fallbacks = 0  # swap-mode victims recomputed instead: the CPU pool was too full
        self._saved: tuple | None = None  # the open step's undo

    # -- queues ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if not self.cache_manager.fits_at_all(seq):
            raise ValueError(
                f"request {seq.request_id!r} can never fit: {self.cache_manager.unfit_reason(seq)}"
            )
        if seq.num_seats > self.max_num_seqs:
            raise ValueError(
                f"request {seq.request_id!r} will run {seq.num_seats} sequences at once "
                f"but max_num_seqs={self.max_num_seqs}"
            )
        if seq.params.stop_strings and self.detokenizer is None:
            raise ValueError(f"request {seq.request_id!r} has stop strings but this scheduler no detokenizer")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        now: float,
        stop_reason: int | str | None = None,
        hide_token: bool = False,
    ) -> None:
        """The one way a sequence ends (a stop, a length, an abort, a beam dropped): it records why
        and when, leaves every queue, and its blocks go back (or stay with their other owners); its
        text is completed unless it was aborted (an aborted sequence reports nothing more), without
        the last token's text if ``hide_token`` (a stop token's)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason, seq.finish_time = reason, stop_reason, now
        for queue in (self.waiting, self.swapped):
            if seq in queue:
                queue.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self.cache_manager.free(seq.seq_id)
        if self.detokenizer is not None and reason is not FinishReason.ABORTED:
            self.detokenizer.flush(seq, hide_token)

    # -- the end of a step (see the module docstring) -------------------------------------------
    def update_from_output(self, out: SchedulerOutput, update: StepUpdate, now: float) -> list[Sequence]:
        """Apply one step's results, in the documented order; returns the sequences it finished."""
        for s in out.scheduled:  # (1) the step's K/V are in the cache from here on
            rejected = update.rejected.get(s.seq.seq_id, 0)  # but not the rejected drafts'
            s.seq.num_computed_tokens += s.num_new_tokens - rejected
            if rejected:
                self.cache_manager.truncate(s.seq, s.seq.num_computed_tokens)
        for seq, entries in update.prompt_logprobs:
            seq.prompt_logprobs += entries
        for parent, child in update.forks:  # (2) the parent's prompt is computed: share its pages
            child.num_computed_tokens = parent.num_computed_tokens
            self.cache_manager.fork(parent, child)
            self._run(child)
        finished = []
        for seq in update.dropped:  # (3)
            self.finish(seq, FinishReason.ABORTED, now)
            finished.append(seq)
        rules, detokenizer = self.stop_rules, self.detokenizer
        for index, (seq, tokens) in enumerate(update.tokens):  # (4) one at a time: nothing after a stop
            drawn = update.logprobs.get(seq.seq_id)
            for k, token in enumerate(tokens):
                seq.output_token_ids.append(token)
                if drawn is not None:
                    if drawn[k].logprob is not None:
                        seq.cumulative_logprob += drawn[k].logprob
                    if drawn[k].entry is not None:
                        seq.logprobs.append(drawn[k].entry)
                stop = rules.check(seq, detokenizer)
                if stop is not None:
                    if stop.cut is not None:
                        seq.output_text = seq.output_text[: stop.cut]
                        seq.read_offset = seq.prefix_offset = len(seq.output_token_ids)  # text is final
                    self.finish(seq, stop.reason, now, stop.stop_reason, stop.hide_token)
                    finished.append(seq)
                    update.tokens[index] = (seq, tokens[: k + 1])  # what was appended (metrics count it)
                    seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)  # drafts past it
                    break
        return finished  # (5)

    # -- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._schedule_running(out, budget)
        budget -= out.num_tokens
        if not out.preempted:
            self._swap_in(out)
            budget = self._schedule_swapped_in(out, budget)
        admission = self.scheduling_policy.opens_admission(self.running, self.waiting)
        if not out.preempted and not self.swapped and admission:
            self.scheduling_policy.admission_ended(self._admit_waiting(out, budget))
        if out.is_empty and not (out.preempted or out.swap_in) and (self.waiting or self.swapped):
            # Nothing could run: parked beams must be holding the memory that the rest need.
            parked = [s for s in self.running if s.num_uncomputed_tokens == 0]
            for seq in reversed(parked):
                self._preempt(seq, out, recompute=True)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> None:
        running, manager = self.running, self.cache_manager  # (_preempt removes from this same list)
        index = 0
        while index < len(running) and budget > 0:
            seq = running[index]
            uncomputed = seq.num_uncomputed_tokens
            n = min(uncomputed, budget)
            if n == 0:  # parked: a beam waiting for its siblings
                index += 1
                continue
            # Drafted tokens ride along a decode step when the budget and free memory allow; they
            # never cost anyone a preemption (without them the step still makes its one token).
            drafts: tuple[int, ...] = ()
            if seq.draft_token_ids and n == uncomputed == 1:
                drafts = tuple(seq.draft_token_ids[: budget - 1])
                drafts = drafts[: self._draft_room(seq, len(drafts), len(running) - index - 1)]
            allocation = manager.allocate_slots(seq, n, len(drafts)) if drafts else None
            if allocation is None:
                drafts = ()
                allocation = manager.allocate_slots(seq, n)
            while allocation is None:
                victim = self.scheduling_policy.victim(running)
                self._preempt(victim, out)
                if victim is seq:
                    self.num_self_preemptions += 1  # it was the latest arrival: it stepped back
                    break
                allocation = manager.allocate_slots(seq, n)
            if allocation is None:
                break  # seq itself stepped back; everyone after it was preempted already
            if allocation.copies:
                out.block_copies += allocation.copies
            out.scheduled.append(ScheduledSequence.of(seq, n + len(drafts), allocation.slot_mapping, drafts))
            budget -= n + len(drafts)
            index += 1

    def _draft_room(self, seq: Sequence, num_drafts: int, younger: int) -> int:
        """How many of ``num_drafts`` drafts ``seq`` may write: the blocks they take must leave the
        watermark, and a block for each younger running sequence, free (a draft must never cost
        anyone a preemption)."""
        manager, size = self.cache_manager, self.cache_manager.block_size
        spare = manager.num_free_blocks - manager.watermark_blocks - younger
        first = seq.num_computed_tokens + 1  # the decode token's slot comes first
        while num_drafts and cdiv(first + num_drafts, size) - cdiv(first, size) > spare:
            num_drafts -= 1
        return num_drafts

    def preempt_running(self) -> int:
        """Between steps: send every running sequence back to the waiting queue, to be recomputed
        (``reset_prefix_cache(reset_running_requests=True)``, as vLLM's); returns how many."""
        out = SchedulerOutput()
        victims = list(self.running)
        for seq in reversed(victims):  # the latest first, so that the queue's front keeps arrival order
            self._preempt(seq, out, recompute=True)
        return len(victims)

    def _preempt(self, seq: Sequence, out: SchedulerOutput, recompute: bool = False) -> None:
        self.running.remove(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        seq.draft_token_ids = []  # proposed for a step it will not take
        seq.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted.append(seq)
        cache_manager = self.cache_manager
        if self.preemption_mode == "swap" and not recompute:
            if cache_manager.can_swap_out(seq.seq_id):
                out.swap_out += cache_manager.swap_out(seq.seq_id)
                seq.status = SequenceStatus.SWAPPED
                self.swapped.append(seq)
                return
            self.num_swap_fallbacks += 1  # its blocks do not fit the CPU pool: recomputed instead
        cache_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        # Back to the front of the queue, but behind any older preempted sequence, so that the
        # front stays in arrival order and a request's forks stay together.
        index = 0
        while index < len(self.waiting) and self.waiting[index].order_key < seq.order_key:
            index += 1
        self.waiting.insert(index, seq)

    def _swap_in(self, out: SchedulerOutput) -> None:
        cache_manager = self.cache_manager
        while self.swapped and self._seats_in_use() + self.swapped[0].num_seats <= self.max_num_seqs:
            seq = self.swapped[0]
            if not cache_manager.can_swap_in(seq.seq_id, seq.num_uncomputed_tokens):
                return
            self.swapped.popleft()
            out.swap_in += cache_manager.swap_in(seq.seq_id)
            cache_manager.reserve(seq, seq.num_uncomputed_tokens)  # can_swap_in saw room for it
            self._run(seq)

    def _schedule_swapped_in(self, out: SchedulerOutput, budget: int) -> int:
        """Give sequences swapped in this step their decode token, if memory and budget allow."""
        scheduled = {s.seq.seq_id for s in out.scheduled}
        for seq in self.running:
            if seq.seq_id in scheduled or budget <= 0 or seq.num_uncomputed_tokens == 0:
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            allocation = self.cache_manager.allocate_slots(seq, n)
            if allocation is None:
                continue  # it runs next step (a smaller one behind it may still fit now)
            out.block_copies += allocation.copies
            out.scheduled.append(ScheduledSequence.of(seq, n, allocation.slot_mapping))
            budget -= n
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> bool:
        """Admit from the head of the queue; returns whether only the token budget stopped it."""
        seats = self._seats_in_use()
        while self.waiting and budget > 0 and seats + self.waiting[0].num_seats <= self.max_num_seqs:
            seq = self.waiting[0]
            if not self.scheduling_policy.may_admit(seq):
                return False
            # A prefix-cache hit is computed already (unless its prompt logits are wanted: vLLM v1's rule).
            cached = 0 if seq.prompt_logit_positions else self.cache_manager.lookup_prefix(seq)
            seq.num_computed_tokens = cached
            n = min(seq.num_uncomputed_tokens, budget)
            # Admission checks the blocks of every token it must compute before it samples, not only
            # this step's chunk (checked for its first chunk alone, it could need blocks for the next
            # one at once and, the latest arrival, preempt itself, over and over); it allocates the
            # chunk's slots and reserves the blocks of the rest (see the module docstring). A policy
            # that admits beyond memory gets no reservation: its chunks then take blocks as they run.
            allocation = (
                self.cache_manager.allocate_slots(seq, n)
                if self.scheduling_policy.admits(seq, seq.num_uncomputed_tokens, self.cache_manager)
                else None
            )
            if allocation is None:
                seq.num_computed_tokens = 0
                return False
            self.cache_manager.reserve(seq, seq.num_uncomputed_tokens - n)
            self.waiting.popleft()
            if seq.num_cached_tokens < 0:  # what vLLM reports: the hit of its first admission
                seq.num_cached_tokens = cached
            self._run(seq)
            out.block_copies += allocation.copies
            out.scheduled.append(ScheduledSequence.of(seq, n, allocation.slot_mapping))
            budget -= n
            seats += seq.num_seats
        return bool(self.waiting) and budget <= 0 and seats < self.max_num_seqs

    def _seats_in_use(self) -> int:
        """Places in ``max_num_seqs`` taken: one per running sequence, plus the forks they will make."""
        return sum(s.num_seats for s in self.running)

    def _run(self, seq: Sequence) -> None:
        """Join the running set in arrival order (forks behind their parent), so that ``running[-1]``
        is always the latest arrival."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.order_key)

    # -- a step is a transaction (:mod:`.transaction`) -------------------------------------------
    def begin(self) -> None:
        """Keep the queues (references to live sequences: a step visits the running ones anyway)
        and the counters; the policy keeps its own."""
        counters = (self.num_preemptions, self.num_self_preemptions, self.num_swap_fallbacks)
        self._saved = (self.waiting.copy(), self.running.copy(), self.swapped.copy(), counters)
        self.scheduling_policy.begin()

    def commit(self) -> None:
        self._saved = None
        self.scheduling_policy.commit()

    def rollback(self) -> None:
        if self._saved is not None:
            self.waiting, self.running, self.swapped, counters = self._saved
            self.num_preemptions, self.num_self_preemptions, self.num_swap_fallbacks = counters
        self._saved = None
        self.scheduling_policy.rollback()
