"""Block tables per request on top of the block pool: allocation, prefix hits, copy-on-write, freeing.

The scheduler talks to this class only through request ids and token counts; the block ids it hands
out are for the model runner's block tables and copy operations.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from tritonllm.engine.block_pool import BlockPool
from tritonllm.engine.sequence import Sequence


@dataclass(frozen=True)
class PrefixHit:
    """Cached blocks that hold the KV of a request's first `num_tokens` tokens."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, tokens_per_block: int, enable_prefix_caching: bool = True):
        self.pool = BlockPool(num_blocks)
        self.tokens_per_block = tokens_per_block
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[str, list[int]] = {}
        self._block_keys: dict[str, list[Hashable]] = {}
        self.prefix_hit_tokens = 0
        self.prefix_queried_tokens = 0
        self.num_copied_blocks = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)

    def find_prefix_hit(self, seq: Sequence) -> PrefixHit:
        """The longest run of full cached blocks matching the start of `seq`.

        At least one token is always left to compute, so the model produces logits: when every token
        hits, the last one is recomputed, and its block is copied on write.
        """
        if not self.enable_prefix_caching:
            return PrefixHit()
        keys = self._keys_for(seq)
        block_ids = []
        for key in keys:
            block_id = self.pool.lookup(key)
            if block_id is None:
                break
            block_ids.append(block_id)
        num_tokens = min(len(block_ids) * self.tokens_per_block, len(seq) - 1)
        return PrefixHit(tuple(block_ids), num_tokens)

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit | None = None) -> list | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        Returns the (source, destination) block copies to run before the forward pass, or None when
        the pool can't hold them (nothing is changed then).
        """
        hit = hit or PrefixHit()
        rid = seq.request_id
        table = self._tables.get(rid, [])
        if hit.block_ids:
            assert not table, "prefix hits apply only to a request without blocks"
            table = list(hit.block_ids)
        start = seq.num_computed_tokens if not hit.block_ids else hit.num_tokens
        end = start + num_new_tokens
        bs = self.tokens_per_block
        # A cached block about to be written is copied first if anyone else holds it; if nobody
        # does, it is taken over in place (a whole-prompt hit must not need more blocks than a miss).
        written = range(start // bs, min(len(table), self.num_blocks_needed(end)))
        shared = [i for i in written if self.pool.ref_count(table[i]) > (0 if i < len(hit.block_ids) else 1)]
        taken = [i for i in written if i not in shared and self.pool.is_cached(table[i])]
        num_new_blocks = max(0, self.num_blocks_needed(end) - len(table))
        revived = sum(self.pool.ref_count(b) == 0 for b in hit.block_ids)
        if num_new_blocks + len(shared) > self.pool.num_free - revived:
            return None
        if rid not in self._tables:
            self.prefix_queried_tokens += len(seq)
            self.prefix_hit_tokens += hit.num_tokens
        for block_id in hit.block_ids:
            self.pool.touch(block_id)
        for i in taken:
            self.pool.uncache(table[i])
        copies = []
        for i in shared:
            new_block = self.pool.allocate(after=table[i - 1] if i else None)
            copies.append((table[i], new_block))
            self.num_copied_blocks += 1
            self.pool.release(table[i])
            table[i] = new_block
        for _ in range(num_new_blocks):
            table.append(self.pool.allocate(after=table[-1] if table else None))
        self._tables[rid] = table
        return copies

    def cache_full_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register the blocks that are now full of computed KV so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[seq.request_id]
        keys = self._keys_for(seq)
        for i in range(min(num_computed_tokens // self.tokens_per_block, len(table), len(keys))):
            self.pool.register(table[i], keys[i])

    def free(self, request_id: str) -> None:
        """Return a request's blocks; tail blocks first so they are evicted before shared prefixes."""
        for block_id in reversed(self._tables.pop(request_id, [])):
            self.pool.release(block_id)
        self._block_keys.pop(request_id, None)

    def _keys_for(self, seq: Sequence) -> list[Hashable]:
        """Content keys of the full blocks of `seq`: (key hash of the prefix, tokens of the block)."""
        keys = self._block_keys.setdefault(seq.request_id, [])
        bs = self.tokens_per_block
        tokens = seq.token_ids
        for i in range(len(keys), len(tokens) // bs):
            parent = hash(keys[-1]) if keys else None
            keys.append((parent, tuple(tokens[i * bs : (i + 1) * bs])))
        return keys
