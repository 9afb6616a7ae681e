"""Continuous batching: which requests run this step and how many tokens each computes.

Every step takes the running requests (decodes get their one token first, prefills are chunked
into the rest of the token budget), then admits waiting requests, best priority first, while the
token budget, `max_num_seqs` and free KV blocks allow. When a running request can't get a block, the
lowest-priority, newest running request is preempted: its blocks are freed and it is recomputed later.
A waiting request with a better priority than running ones also preempts them when it could not
start otherwise (no free slot or too few free blocks), so a high-priority request never waits for
low-priority ones to finish; requests of equal priority never preempt each other.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from tritonllm.engine.errors import EngineBusyError
from tritonllm.engine.kv_cache_manager import KVCacheManager, PrefixHit
from tritonllm.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `seq` to compute from `seq.num_computed_tokens` on."""

    seq: Sequence
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the sequence, so a next token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq)


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, max_waiting: int):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_waiting = max_waiting
        self._waiting: list[tuple[tuple[int, int], Sequence]] = []  # heap by (priority, arrival)
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self.running)

    def add(self, seq: Sequence) -> None:
        if len(self._waiting) >= self.max_waiting:
            raise EngineBusyError(f"server busy: {len(self._waiting)} requests already waiting")
        heapq.heappush(self._waiting, (seq.sort_key(), seq))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.running.sort(key=Sequence.sort_key)
        self._preempt_for_priority(out)
        preempted_for_priority = len(out.preempted)
        decodes_left = sum(seq.num_uncomputed_tokens == 1 for seq in self.running)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            is_decode = seq.num_uncomputed_tokens == 1
            decodes_left -= is_decode
            num_tokens = min(seq.num_uncomputed_tokens, budget - (0 if is_decode else decodes_left))
            if num_tokens <= 0:
                i += 1
                continue
            copies = self.kv.allocate(seq, num_tokens)
            while copies is None and self.running[-1] is not seq:
                out.preempted.append(self._preempt(self.running.pop()))
                copies = self.kv.allocate(seq, num_tokens)
            if copies is None:
                out.preempted.append(self._preempt(self.running.pop()))
                break
            self._take(out, seq, num_tokens, copies)
            budget -= num_tokens
            i += 1
        # A request preempted for lack of blocks means none is free for newcomers this step.
        out_of_blocks = len(out.preempted) > preempted_for_priority
        while self._waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out_of_blocks:
            seq = self._waiting[0][1]
            if any(seq is v for v in out.preempted):
                break  # preempted this step to make room: not back before the next one
            hit = self.kv.find_prefix_hit(seq) if seq.num_computed_tokens == 0 else PrefixHit()
            num_tokens = min(len(seq) - hit.num_tokens, budget)
            copies = self.kv.allocate(seq, num_tokens, hit)
            if copies is None:
                break
            heapq.heappop(self._waiting)
            seq.num_computed_tokens = hit.num_tokens
            if seq.first_scheduled_time_ns == 0:
                seq.num_cached_prompt_tokens = hit.num_tokens
                seq.first_scheduled_time_ns = time.time_ns()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._take(out, seq, num_tokens, copies)
            budget -= num_tokens
        return out

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Preempt the worst running requests for a better waiting one that could not start otherwise.

        Only requests of strictly worse priority, newest first, and only as many as free the slot and
        the blocks the waiting request's first chunk needs; none if even all of them would not do.
        """
        if not self._waiting or not self.running:
            return
        head = self._waiting[0][1]
        needed = self.kv.num_blocks_needed(min(len(head), self.max_num_batched_tokens))
        free = self.kv.num_free_blocks
        victims: list[Sequence] = []
        for seq in reversed(self.running):
            if len(self.running) - len(victims) < self.max_num_seqs and free >= needed:
                break
            if seq.priority <= head.priority:
                return  # only worse-priority requests may make room, and there are not enough
            victims.append(seq)
            free += len(self.kv.block_table(seq.request_id))
        if len(self.running) - len(victims) >= self.max_num_seqs or free < needed:
            return
        for seq in victims:
            self.running.remove(seq)
            out.preempted.append(self._preempt(seq))

    def _take(self, out: SchedulerOutput, seq: Sequence, num_tokens: int, copies: list) -> None:
        out.chunks.append(ScheduledChunk(seq, num_tokens))
        out.block_copies.extend(copies)

    def _preempt(self, seq: Sequence) -> Sequence:
        """Free a running request's blocks and queue it again; it is recomputed from scratch."""
        self.kv.free(seq.request_id)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.num_preemptions += 1
        heapq.heappush(self._waiting, (seq.sort_key(), seq))
        return seq

    def advance(self, chunk: ScheduledChunk) -> None:
        """Record that a chunk's KV is now in the cache."""
        chunk.seq.num_computed_tokens += chunk.num_tokens
        self.kv.cache_full_blocks(chunk.seq, chunk.seq.num_computed_tokens)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End a request wherever it is (waiting or running) and free its blocks at once."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self._waiting = [item for item in self._waiting if item[1] is not seq]
            heapq.heapify(self._waiting)
        self.kv.free(seq.request_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
