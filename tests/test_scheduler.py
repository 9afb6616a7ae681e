"""Property tests for the scheduler over a small paged KV cache.

Random adds, steps and aborts drive `Scheduler` the way the engine does: schedule, run the block copies,
"compute" every chunk (advance), append a sampled token to each chunk that reaches the end of its
sequence, and finish requests at max_tokens or when a random stop fires. A shadow model of the KV
blocks (each slot holds the token prefix its KV was computed from) checks end to end that copies and
prefix hits hand every running request exactly the KV of its own tokens.
"""

from __future__ import annotations

import itertools
import random

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tritonllm.engine.kv_cache_manager import KVCacheManager
from tritonllm.engine.sampling_params import SamplingParams
from tritonllm.engine.scheduler import Scheduler, SchedulerOutput
from tritonllm.engine.sequence import FinishReason, Sequence, SequenceStatus

VOCAB = 5
_ids = itertools.count()

configs = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(4, 8),
        "tokens_per_block": st.integers(2, 4),
        "max_num_seqs": st.integers(1, 4),
        "max_num_batched_tokens": st.integers(1, 16),
        "prefix_caching": st.sampled_from([True, True, True, False]),
    }
)
# Prompts often start with one of a few stems, so requests share prefixes and whole prompts hit.
STEMS = [[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1], [1, 1, 1, 1, 1, 1, 1, 1], [2, 3, 2, 3, 2, 3]]
prompts = st.builds(
    lambda stem, cut, tail: (stem[:cut] + tail) or [0],
    st.sampled_from(STEMS),
    st.integers(0, 12),
    st.one_of(st.just([]), st.lists(st.integers(0, VOCAB - 1), max_size=8)),
)
requests = st.tuples(prompts, st.integers(1, 10), st.integers(0, 2))  # prompt, max_tokens, priority


def make_scheduler(cfg: dict) -> Scheduler:
    kv = KVCacheManager(cfg["num_blocks"], cfg["tokens_per_block"], cfg["prefix_caching"])
    return Scheduler(kv, cfg["max_num_seqs"], cfg["max_num_batched_tokens"], max_waiting=1000)


def make_seq(sched: Scheduler, prompt: list[int], max_tokens: int, priority: int) -> Sequence:
    """A request the engine would accept: prompt + max_tokens within the KV pool's capacity."""
    capacity = sched.kv.pool.num_blocks * sched.kv.tokens_per_block
    prompt = prompt[: capacity - 1]
    max_tokens = min(max_tokens, capacity - len(prompt))
    # A fixed seed: without one, Sequence calls torch.seed(), which reseeds torch's global RNG.
    params = SamplingParams(max_tokens=max_tokens, seed=0)
    return Sequence(f"r{next(_ids)}", prompt, params, priority)


def check_step(sched: Scheduler, out: SchedulerOutput, running_before: list[Sequence], waiting_before):
    """Budget, batch size, priorities and preemption order of one `schedule()` call."""
    assert out.num_tokens <= sched.max_num_batched_tokens
    assert len(sched.running) <= sched.max_num_seqs
    seqs = [c.seq for c in out.chunks]
    assert len({id(s) for s in seqs}) == len(seqs), "a request was scheduled twice in one step"
    assert len({id(s) for s in sched.running}) == len(sched.running)
    for chunk in out.chunks:
        assert 1 <= chunk.num_tokens <= chunk.seq.num_uncomputed_tokens
        assert chunk.seq.status is SequenceStatus.RUNNING and chunk.seq in sched.running
        table = sched.kv.block_table(chunk.seq.request_id)
        assert len(table) >= sched.kv.num_blocks_needed(chunk.seq.num_computed_tokens + chunk.num_tokens)

    # Preemption victims are the lowest-priority running requests: a suffix of the running order.
    ordered = sorted(running_before, key=Sequence.sort_key)
    victims = out.preempted
    assert len({id(s) for s in victims}) == len(victims)
    assert sorted(victims, key=Sequence.sort_key) == ordered[len(ordered) - len(victims) :]
    for seq in victims:
        assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
        assert sched.kv.block_table(seq.request_id) == []
        assert seq not in seqs
    kept = [s for s in running_before if s not in victims]
    admitted = [s for s in seqs if s in waiting_before]
    assert {id(s) for s in sched.running} == {id(s) for s in kept + admitted}
    if victims:
        # Only a better-priority request may start in a step that preempted one (it made the room).
        worst_kept = min(v.priority for v in victims)
        assert all(s.priority < worst_kept for s in admitted), (
            "admitted a request in a step that preempted one"
        )

    # Admission goes by priority: in order, and no better waiting request is left behind.
    keys = [s.sort_key() for s in admitted]
    assert keys == sorted(keys)
    left_behind = [s.sort_key() for s in waiting_before if s.status is SequenceStatus.WAITING]
    if keys and left_behind:
        assert max(keys) < min(left_behind), "a waiting request was passed over by a worse one"


def check_blocks(sched: Scheduler, seqs: list[Sequence]) -> None:
    """Reference counts match the running requests' block tables; the others hold nothing."""
    pool = sched.kv.pool
    pool.check_invariants()
    tables = [sched.kv.block_table(s.request_id) for s in sched.running]
    for block in range(pool.num_blocks):
        assert pool.ref_count(block) == sum(block in t for t in tables)
    for seq in seqs:
        if seq.status is not SequenceStatus.RUNNING:
            assert sched.kv.block_table(seq.request_id) == []


class KVShadow:
    """What each block slot holds: the token prefix its KV was computed from."""

    def __init__(self, sched: Scheduler):
        self.kv = sched.kv
        self.bs = sched.kv.tokens_per_block
        self.content: dict[int, list] = {}

    def before(self, running: list[Sequence]):
        pool = self.kv.pool
        tables = {s.request_id: set(self.kv.block_table(s.request_id)) for s in running}
        return tables, {b for b in range(pool.num_blocks) if pool.is_cached(b)}

    def run(self, out: SchedulerOutput, running: list[Sequence], before) -> None:
        """Apply a step: copies (all read before any write, as the model runner does), then chunks."""
        pool, bs = self.kv.pool, self.bs
        tables_before, cached_before = before
        sources = {src: list(self.content.get(src, [None] * bs)) for src, _ in out.block_copies}
        for seq in running:
            # Blocks a prefix hit revived (they hold the tokens computed before this step) keep their KV,
            # even one taken over in place, no longer cached.
            num_hit_blocks = -(-seq.num_computed_tokens // bs) if seq.request_id not in tables_before else 0
            for i, block in enumerate(self.kv.block_table(seq.request_id)):
                # A block the request held, or a revived one, keeps its KV; a newly allocated one holds
                # garbage until written (copy destinations are set just below).
                kept = block in tables_before.get(seq.request_id, ())
                revived = block in cached_before and (pool.is_cached(block) or i < num_hit_blocks)
                if not kept and not revived:
                    self.content[block] = [None] * bs
        for src, dst in out.block_copies:
            self.content[dst] = sources[src]
        written = set()
        for chunk in out.chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            table = self.kv.block_table(seq.request_id)
            for p in range(start, start + chunk.num_tokens):
                block, slot = table[p // bs], p % bs
                assert pool.ref_count(block) == 1 and not pool.is_cached(block), (
                    f"{seq} writes position {p} into shared or cached block {block}"
                )
                assert (block, slot) not in written
                written.add((block, slot))
                self.content[block][slot] = tuple(seq.token_ids[: p + 1])

    def check(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            table = self.kv.block_table(seq.request_id)
            for p in range(seq.num_computed_tokens):
                held = self.content.get(table[p // self.bs], [None] * self.bs)[p % self.bs]
                assert held == tuple(seq.token_ids[: p + 1]), f"{seq}: wrong KV at position {p}"


def run_step(sched: Scheduler, shadow: KVShadow, seqs: list[Sequence], sample) -> SchedulerOutput:
    """One engine step; `sample(seq)` returns (token, stop)."""
    running_before = list(sched.running)
    waiting_before = [s for s in seqs if s.status is SequenceStatus.WAITING]
    before = shadow.before(running_before)
    out = sched.schedule()
    check_step(sched, out, running_before, waiting_before)
    shadow.run(out, sched.running, before)
    sampling = [c.samples for c in out.chunks]
    for chunk in out.chunks:
        sched.advance(chunk)
    for chunk, samples in zip(out.chunks, sampling, strict=True):
        if samples:
            seq = chunk.seq
            token, stop = sample(seq)
            seq.token_ids.append(token)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, FinishReason.LENGTH)
            elif stop:
                sched.finish(seq, FinishReason.STOP)
    shadow.check(sched.running)
    check_blocks(sched, seqs)
    if out.preempted:
        event("preemption")
    if out.block_copies:
        event("copy on write")
    return out


def finish_all(sched: Scheduler, seqs: list[Sequence]) -> None:
    for seq in seqs:
        sched.finish(seq, FinishReason.ABORT)
    assert not sched.has_work and not sched.running and sched.num_waiting == 0
    pool = sched.kv.pool
    assert pool.num_free == pool.num_blocks, "blocks leaked"
    pool.check_invariants()


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(cfg=configs, first=st.lists(requests, min_size=1, max_size=4))
    def setup(self, cfg, first):
        self.sched = make_scheduler(cfg)
        self.shadow = KVShadow(self.sched)
        self.seqs: list[Sequence] = []
        for request in first:
            self._add(*request)

    def _add(self, prompt, max_tokens, priority):
        seq = make_seq(self.sched, prompt, max_tokens, priority)
        self.sched.add(seq)
        self.seqs.append(seq)

    @rule(data=st.data(), request=requests)
    def add(self, data, request):
        prompt, max_tokens, priority = request
        if self.seqs and data.draw(st.booleans()):  # share a prefix with an earlier request
            base = data.draw(st.sampled_from(self.seqs)).token_ids
            prompt = base[: data.draw(st.integers(1, len(base)))]
        self._add(prompt, max_tokens, priority)

    @rule(num_steps=st.integers(1, 10), seed=st.integers(0, 2**16))
    def step(self, num_steps, seed):
        """A few engine steps; sampled tokens are random, and one in ten stops its request."""
        rng = random.Random(seed)
        for _ in range(num_steps):
            run_step(
                self.sched, self.shadow, self.seqs, lambda seq: (rng.randrange(VOCAB), rng.random() < 0.1)
            )

    @rule(selector=st.integers(0, 1000))
    def abort(self, selector):
        live = [s for s in self.seqs if not s.is_finished]
        if live:
            seq = live[selector % len(live)]
            self.sched.finish(seq, FinishReason.ABORT)
            assert seq.is_finished and self.sched.kv.block_table(seq.request_id) == []

    @invariant()
    def blocks_consistent(self):
        check_blocks(self.sched, self.seqs)

    def teardown(self):
        if hasattr(self, "sched"):
            finish_all(self.sched, self.seqs)


SchedulerMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestScheduler = SchedulerMachine.TestCase


@settings(max_examples=100, deadline=None)
@given(cfg=configs, reqs=st.lists(requests, min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_all_requests_complete(cfg, reqs, seed):
    """Scheduling in a loop finishes every request when the pool holds the longest one."""
    sched = make_scheduler(cfg)
    shadow = KVShadow(sched)
    rng = random.Random(seed)
    seqs = [make_seq(sched, *r) for r in reqs]
    for seq in seqs:
        sched.add(seq)
    total = sum(len(s) + s.params.max_tokens for s in seqs)
    for _ in range(20 * total + 100):
        if not sched.has_work:
            break
        run_step(sched, shadow, seqs, lambda seq: (rng.randrange(VOCAB), False))
    assert not sched.has_work, f"no progress: running={sched.running}, waiting={sched.num_waiting}"
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert all(s.num_output_tokens == s.params.max_tokens for s in seqs)
    finish_all(sched, seqs)


def test_a_waiting_high_priority_request_preempts_a_running_low_priority_one() -> None:
    """max_num_seqs full of priority-1 requests: a priority-0 arrival starts at once, the newest 1 waits."""
    sched = make_scheduler(
        {
            "num_blocks": 16,
            "tokens_per_block": 4,
            "max_num_seqs": 2,
            "max_num_batched_tokens": 16,
            "prefix_caching": True,
        }
    )
    low = [make_seq(sched, [1, 2, 3], 8, priority=1) for _ in range(2)]
    for seq in low:
        sched.add(seq)
    sched.schedule()
    assert sched.running == low
    high = make_seq(sched, [4, 3, 2], 8, priority=0)
    sched.add(high)
    out = sched.schedule()
    assert out.preempted == [low[1]] and high in sched.running and low[1].status is SequenceStatus.WAITING
    # Equal priority never preempts.
    peer = make_seq(sched, [4, 4], 8, priority=1)
    sched.add(peer)
    assert sched.schedule().preempted == [] and peer.status is SequenceStatus.WAITING
