"""The paged KV block pool, with vLLM's prefix cache: ref counts, an LRU free queue, hashes.

Owns: which block ids are free, who holds each block (a ref count), and which full blocks
are cached under the chain hash of their tokens. Pure: no I/O, no asyncio, no clock.

Must not: decide which request gets blocks (that is `scheduler`).

What it keeps from vLLM's `v1/core/block_pool.py`:
- A freed block keeps its hash and goes to the END of the free queue; allocation takes
  from the FRONT and evicts the cached hash then. So a freed block stays a cache hit until
  it is reused, and evictable cached blocks count as free (`get_num_free_blocks`).
- A request's blocks are freed tail first, so the end of a sequence is evicted before the
  prefix that other requests are more likely to share.
- A cache hit on a block with no holder takes it out of the free queue (ref count 0 -> 1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class BlockPool:
    def __init__(self, num_usable_blocks: int) -> None:
        self.num_usable_blocks = num_usable_blocks
        # OrderedDict as an LRU queue with O(1) removal from the middle (a cache hit)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_usable_blocks))
        self._ref = [0] * num_usable_blocks
        self._hash_of: list[int | None] = [None] * num_usable_blocks
        self._cached: dict[int, int] = {}  # chain hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Blocks with at least one holder."""
        return self.num_usable_blocks - len(self._free)

    def total_refs(self) -> int:
        return sum(self._ref)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_usable_blocks

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise ValueError(f"cannot allocate {count} blocks, {len(self._free)} free")
        out: list[int] = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            old_hash = self._hash_of[block]
            if old_hash is not None:  # evict: the block is about to hold other tokens
                if self._cached.get(old_hash) == block:
                    del self._cached[old_hash]
                self._hash_of[block] = None
            self._ref[block] = 1
            out.append(block)
        return out

    def free(self, blocks: Sequence[int]) -> None:
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None

    def lookup(self, hashes: Iterable[int]) -> list[int]:
        """The cached blocks for the longest prefix of `hashes`."""
        hits: list[int] = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_evictable(self, blocks: Iterable[int]) -> int:
        """How many of these cached blocks sit in the free queue (hitting them uses one)."""
        return sum(1 for b in blocks if self._ref[b] == 0)

    def touch(self, blocks: Iterable[int]) -> None:
        for block in blocks:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1

    def cache(self, block: int, chain_hash: int) -> None:
        """Register a block that just became full; the first holder of a hash keeps it."""
        if chain_hash in self._cached or self._hash_of[block] is not None:
            return
        self._cached[chain_hash] = block
        self._hash_of[block] = chain_hash

    def reset_cache(self) -> None:
        self._cached.clear()
        self._hash_of = [None] * self.num_usable_blocks


def chain_hash(parent: int, tokens: Sequence[int]) -> int:
    """The hash of a full block given its parent's: equal prefixes give equal hashes."""
    return hash((parent, *tokens))
