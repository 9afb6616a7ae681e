"""A fixed pool of KV-cache blocks with reference counts and a content-addressed prefix cache.

A block whose reference count falls to 0 goes to the free queue but keeps its content and hash, so a
later request with the same prefix can take it back; the free queue evicts least recently freed first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[Hashable | None] = [None] * num_blocks
        self._cached: dict[Hashable, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        return self._hash_of[block_id] is not None

    def allocate(self) -> int:
        """Take the least recently freed block, evicting its cached content."""
        if not self._free:
            raise RuntimeError("KV block pool exhausted")
        block_id, _ = self._free.popitem(last=False)
        self.uncache(block_id)
        self._ref_counts[block_id] = 1
        return block_id

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
