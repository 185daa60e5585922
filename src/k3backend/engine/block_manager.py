"""Paged MLA latent blocks: free list, reference counts, prefix reuse by chained content hash.

One block table per sequence serves every MLA layer (the pool of each layer has the same block
ids). Block 0 is the null block padding rows point at and is never handed out. A block whose
last user released it keeps its content key until it is reused, so a later request with the same
prefix can take it back: the free list is the LRU order of eviction (nano-vllm's BlockManager).

Content keys chain (the key of block i covers blocks 0..i) and are BLAKE2b digests of the token
ids and, for image pad positions, the image's hash and the row within the image ([IMG-4]): the
same text with another image shares nothing past the image, and a crafted prompt cannot collide
with another tenant's prefix the way a non-cryptographic hash would let it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np


def chain_keys(token_ids: Sequence[int], block_size: int, num_blocks: int,
               image_keys: dict[int, bytes] | None = None) -> list[bytes]:
    """Content keys of the first `num_blocks` full blocks of `token_ids`.

    image_keys: position -> bytes identifying the image row at that position (pad positions only).
    """
    keys, prev = [], b""
    data = memoryview(np.asarray(token_ids[:num_blocks * block_size], dtype=np.int64).tobytes())  # one conversion
    width = 8 * block_size
    for b in range(num_blocks):
        lo, hi = b * block_size, (b + 1) * block_size
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(data[b * width:(b + 1) * width])
        if image_keys:
            for pos in range(lo, hi):
                if pos in image_keys:
                    h.update(pos.to_bytes(8, "little") + image_keys[pos])
        prev = h.digest()
        keys.append(prev)
    return keys


class BlockManager:
    """Block ids 1..num_blocks-1; `usage` is the fraction held by running sequences."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"the latent pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._ref = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))  # LRU first
        self._by_key: dict[bytes, int] = {}

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.capacity

    def cached(self, keys: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest prefix of `keys` (in use or free but not yet reused)."""
        out = []
        for key in keys:
            block = self._by_key.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def take(self, blocks: Sequence[int]) -> None:
        """Reuse cached blocks: one more reference each; free ones leave the free list."""
        for b in blocks:
            self._ref[b] += 1
            self._free.pop(b, None)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (evicting the least recently freed cached ones), or None if fewer are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            key = self._key[b]
            if key is not None:
                if self._by_key.get(key) == b:
                    del self._by_key[key]
                self._key[b] = None
            self._ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference per block; a block nobody holds becomes the most recently freed."""
        for b in blocks:
            assert self._ref[b] > 0, f"block {b} released more often than taken (a double free)"
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def check(self, tables: Iterable[Sequence[int]], context: str = "") -> None:
        """Internal invariant (O(num_blocks): tests, leak reports): each block's reference count is the
        number of `tables` holding it, and the free list is exactly the unreferenced blocks."""
        holders = [0] * self.num_blocks
        for table in tables:
            for b in table:
                holders[b] += 1
        wrong = [f"block {b} has {self._ref[b]} references but {holders[b]} holders"
                 for b in range(1, self.num_blocks) if self._ref[b] != holders[b]]
        assert not wrong, context + "; ".join(wrong[:8]) + (f" (and {len(wrong) - 8} more)" if len(wrong) > 8 else "")
        misplaced = [b for b in range(1, self.num_blocks) if (self._ref[b] == 0) != (b in self._free)]
        assert not misplaced, context + f"blocks {misplaced[:8]}: free-list membership disagrees with their references"

    def register(self, block: int, key: bytes) -> None:
        """The block's content is computed: later prefixes with this key may reuse it."""
        if self._key[block] is None and key not in self._by_key:
            self._key[block] = key
            self._by_key[key] = block
