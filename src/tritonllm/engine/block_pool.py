"""A fixed pool of KV-cache blocks with reference counts and a content-addressed prefix cache.

A block whose reference count falls to 0 goes to the free queue but keeps its content and hash, so a
later request with the same prefix can take it back; the free queue evicts least recently freed first.

A request's blocks are laid end to end where that bends the eviction order only a little: on a CPU,
decode attention over blocks scattered across the pool takes ~1.4x the time of neighbouring ones (the
prefetchers lose their stream at every block), and a pool that has cycled hands its least recently
freed blocks out scattered. So an allocation takes the block after the request's last one, or starts
where the run of free blocks holding the least recently freed one starts, when that block holds no
cached content or is in the older half of the free queue; the younger half, where a recent
conversation's prefix waits for its next turn, is evicted in strict order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

_MAX_WALK_BACK = 64  # blocks an allocation looks back for the start of a free run (bounds its cost)


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[Hashable | None] = [None] * num_blocks
        self._cached: dict[Hashable, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # When each block last joined the free queue: a free block is at most its stamp minus the
        # head's stamp places behind the head.
        self._freed_at = list(range(num_blocks))
        self._clock = num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._hash_of[block_id] is not None

    def allocate(self, after: int | None = None) -> int:
        """Take a free block, evicting its cached content: block `after + 1` (`after`: the requester's
        last block) or the start of the least recently freed block's free run, where either may go out
        of order (see the module's docstring), else the least recently freed block itself."""
        if not self._free:
            raise RuntimeError("KV block pool exhausted")
        head = next(iter(self._free))
        # Free blocks stamped below this are in the older half of the free queue.
        older_than = self._freed_at[head] + len(self._free) / 2
        if after is not None and self._may_take_out_of_order(after + 1, older_than):
            block_id = after + 1
        else:
            block_id = head
            for _ in range(_MAX_WALK_BACK):
                if not self._may_take_out_of_order(block_id - 1, older_than):
                    break
                block_id -= 1
        del self._free[block_id]
        self.uncache(block_id)
        self._ref_counts[block_id] = 1
        return block_id

    def _may_take_out_of_order(self, block_id: int, older_than: float) -> bool:
        """Free, and holding no cached content or stamped below `older_than`."""
        if not (0 <= block_id < self.num_blocks and block_id in self._free):
            return False
        return self._hash_of[block_id] is None or self._freed_at[block_id] < older_than

    def touch(self, block_id: int) -> None:
        """Add a reference to a cached block (a prefix hit), reviving it if it was free."""
        if self._ref_counts[block_id] == 0:
            del self._free[block_id]
        self._ref_counts[block_id] += 1

    def release(self, block_id: int) -> None:
        count = self._ref_counts[block_id]
        if count <= 0:
            raise RuntimeError(f"double free of KV block {block_id}")
        self._ref_counts[block_id] = count - 1
        if count == 1:
            self._free[block_id] = None
            self._freed_at[block_id] = self._clock
            self._clock += 1

    def lookup(self, key: Hashable) -> int | None:
        return self._cached.get(key)

    def register(self, block_id: int, key: Hashable) -> None:
        """Make a full block findable by its content key; a duplicate of cached content stays private."""
        if key in self._cached or self._hash_of[block_id] is not None:
            return
        self._cached[key] = block_id
        self._hash_of[block_id] = key

    def uncache(self, block_id: int) -> None:
        """Forget a block's prefix-cache key (it is reallocated, or its owner is about to overwrite it)."""
        key = self._hash_of[block_id]
        if key is not None:
            del self._cached[key]
            self._hash_of[block_id] = None

    def check_invariants(self) -> None:
        """For tests: free queue == blocks with no reference; cache map and reverse map agree."""
        assert all(count >= 0 for count in self._ref_counts)
        assert set(self._free) == {b for b, c in enumerate(self._ref_counts) if c == 0}
        assert all(self._hash_of[b] == key for key, b in self._cached.items())
        assert sum(key is not None for key in self._hash_of) == len(self._cached)
