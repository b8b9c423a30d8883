"""Serving-exercise answers written apart from the notebooks (right ones and plausible wrong ones)."""

from __future__ import annotations

from paged_attention.engine.core.scheduler import SchedulingPolicy


class PolicyRight(SchedulingPolicy):
    def admits(self, seq, num_new_tokens, cache_manager):
        size = cache_manager.block_size
        total = (seq.num_computed_tokens + num_new_tokens + size - 1) // size
        cached = seq.num_computed_tokens // size  # whole blocks of the prefix-cache hit
        taken = total - cached + cache_manager.num_free_prefix_blocks(seq)
        return taken + cache_manager.watermark_blocks <= cache_manager.num_free_blocks

    def victim(self, running):
        return max(running, key=lambda s: s.order_key)


class PolicyOldestVictim(PolicyRight):
    def victim(self, running):
        return running[0]  # preempts the oldest: it may never finish


class PolicyNoWatermark(PolicyRight):
    def admits(self, seq, num_new_tokens, cache_manager):
        blocks = -(-(seq.num_computed_tokens + num_new_tokens) // cache_manager.block_size)
        return blocks <= cache_manager.num_free_blocks


class PolicyIgnoresComputed(PolicyRight):
    def admits(self, seq, num_new_tokens, cache_manager):
        blocks = -(-num_new_tokens // cache_manager.block_size)  # forgets the hit's blocks in the free queue
        return cache_manager.num_free_blocks - blocks >= cache_manager.watermark_blocks


class PolicyCountsHeldHit(PolicyRight):
    def admits(self, seq, num_new_tokens, cache_manager):
        tokens = seq.num_computed_tokens + num_new_tokens  # counts the hit's blocks, even held ones
        blocks = -(-tokens // cache_manager.block_size)
        return cache_manager.num_free_blocks - blocks >= cache_manager.watermark_blocks


class PolicyStrict(PolicyRight):
    def admits(self, seq, num_new_tokens, cache_manager):
        blocks = -(-num_new_tokens // cache_manager.block_size) + cache_manager.num_free_prefix_blocks(seq)
        return cache_manager.num_free_blocks - blocks > cache_manager.watermark_blocks  # > instead of >=


class PolicyFirstRunning(PolicyRight):
    def victim(self, running):
        return min(running, key=lambda s: s.arrival_time)  # the oldest, as PolicyOldestVictim, by time


class PolicyFloor(PolicyRight):
    def admits(self, seq, num_new_tokens, cache_manager):
        blocks = (seq.num_computed_tokens + num_new_tokens) // cache_manager.block_size  # rounds down
        return cache_manager.num_free_blocks - blocks >= cache_manager.watermark_blocks


class FirstFitRight:
    def __init__(self, num_slots):
        self.free_map = [True] * num_slots
        self.sizes = {}

    def allocate(self, size):
        run = 0
        for i, free in enumerate(self.free_map):
            run = run + 1 if free else 0
            if run == size:
                start = i - size + 1
                self.free_map[start : i + 1] = [False] * size
                self.sizes[start] = size
                return start
        return None

    def free(self, start):
        size = self.sizes.pop(start)
        self.free_map[start : start + size] = [True] * size

    def holes(self):
        out, start = [], None
        for i, free in enumerate([*self.free_map, False]):
            if free and start is None:
                start = i
            elif not free and start is not None:
                out.append((start, i - start))
                start = None
        return out


class FirstFitNoMerge:
    def __init__(self, num_slots):
        self.list_of_holes = [[0, num_slots]]
        self.sizes = {}

    def allocate(self, size):
        for hole in self.list_of_holes:
            if hole[1] >= size:
                start = hole[0]
                hole[0] += size
                hole[1] -= size
                if hole[1] == 0:
                    self.list_of_holes.remove(hole)
                self.sizes[start] = size
                return start
        return None

    def free(self, start):
        self.list_of_holes.append([start, self.sizes.pop(start)])
        self.list_of_holes.sort()  # never merges neighbours

    def holes(self):
        return [tuple(h) for h in self.list_of_holes]
