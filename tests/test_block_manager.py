"""Prefix-cache keys (`chain_keys`) and the block manager's reference counts, free list and reuse."""

from __future__ import annotations

import pytest

from k3backend.engine.block_manager import BlockManager, chain_keys

BS = 4
A, B, C = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]


def keys(*blocks: list[int], image_keys: dict[int, bytes] | None = None) -> list[bytes]:
    ids = [t for b in blocks for t in b]
    return chain_keys(ids, BS, len(blocks), image_keys)


# ---- chain_keys ----------------------------------------------------------------------------------

def test_a_block_key_covers_every_block_before_it():
    """The same block after another prefix gets another key, so it never serves that context;
    after the same prefix it gets the same key. Changing block i changes keys i.. only."""
    assert keys(A, C)[1] != keys(B, C)[1], "block C after A and after B: same key (keys do not chain)"
    assert keys(A, C, C)[1] != keys(A, C, C)[2], "a repeated block has one key for both positions"
    assert keys(A, B, C) == keys(A, B, C)
    x, y = keys(A, B, C, A), keys(A, C, C, A)
    assert x[0] == y[0] and all(p != q for p, q in zip(x[1:], y[1:])), "keys after the changed block 1"


def test_only_full_blocks_get_keys():
    ids = A + B + [13, 14]
    assert len(chain_keys(ids, BS, 2)) == 2
    assert chain_keys(ids, BS, 2) == chain_keys(A + B, BS, 2), "the partial tail changed a full block's key"
    assert chain_keys(ids, BS, 1) == chain_keys(ids, BS, 2)[:1]


def test_image_rows_are_part_of_the_key():
    """[IMG-4]: pad positions are keyed by the image's identity and row, so the same ids with
    another image (or the same image rows in other places) share only the blocks before it."""
    pad = [21] * 4
    img = {4 + i: b"image-a" + bytes([i]) for i in range(4)}
    other = {4 + i: b"image-b" + bytes([i]) for i in range(4)}
    shifted = {4 + i: b"image-a" + bytes([(i + 1) % 4]) for i in range(4)}
    base = keys(A, pad, C, image_keys=img)
    assert keys(A, pad, C, image_keys=dict(img)) == base
    for name, other_keys in {"another image": other, "rows in another order": shifted, "no image": None}.items():
        k = keys(A, pad, C, image_keys=other_keys)
        assert k[0] == base[0], f"{name}: the block before the image changed"
        assert k[1] != base[1] and k[2] != base[2], f"{name}: shares the image block or the blocks after it"
    late = {12 + i: b"image-a" + bytes([i]) for i in range(4)}
    assert keys(A, pad, C, pad, image_keys={**img, **late})[:3] == base, "an image after block 2 changed its key"


# ---- BlockManager --------------------------------------------------------------------------------

def test_reference_counts_after_allocate_share_release():
    m = BlockManager(6, BS)
    assert m.allocate(6) is None and m.num_free == 5, "a failed allocation took blocks"
    a = m.allocate(2)
    assert 0 not in a and m.num_free == 3
    m.register(a[0], b"k0")
    assert m.cached([b"k0", b"k1"]) == [a[0]]
    m.take([a[0]])  # a second sequence shares the first block
    m.check([a, [a[0]]])
    m.release(a)
    m.check([[a[0]]], "after the first holder released: ")  # a[0] still held, a[1] free
    assert m.num_free == 4
    m.release([a[0]])
    m.check([])
    assert m.num_free == 5 and m.usage == 0


def test_a_freed_block_keeps_its_key_until_it_is_reused():
    """Freed cached blocks can be taken back; allocation evicts the least recently freed first and
    forgets the key of the block it evicts."""
    m = BlockManager(4, BS)
    a, b, c = m.allocate(3)
    m.register(a, b"ka")
    m.register(b, b"kb")
    m.release([b])
    m.release([a])  # freed after b: evicted after it
    m.release([c])
    assert m.cached([b"ka"]) == [a] and m.cached([b"kb"]) == [b]
    m.take([a])
    m.check([[a]])
    assert m.allocate(1) == [b] and m.cached([b"kb"]) == [], "the evicted block still serves its old key"
    assert m.cached([b"ka"]) == [a]


def test_a_key_is_registered_once():
    m = BlockManager(4, BS)
    a, b = m.allocate(2)
    m.register(a, b"k")
    m.register(b, b"k")  # a second copy of the same content: the first one keeps the key
    assert m.cached([b"k"]) == [a]


def test_double_free_fails_at_once():
    m = BlockManager(4, BS)
    a = m.allocate(1)
    m.release(a)
    with pytest.raises(AssertionError, match=rf"block {a[0]} released more often than taken \(a double free\)"):
        m.release(a)


def test_check_names_leaked_and_lost_blocks():
    m = BlockManager(5, BS)
    a = m.allocate(2)
    with pytest.raises(AssertionError, match=rf"^idle: block {a[0]} has 1 references but 0 holders; block {a[1]}"):
        m.check([], "idle: ")
    m.check([a])
    with pytest.raises(AssertionError, match=rf"block {a[0]} has 1 references but 2 holders"):
        m.check([a, a[:1]])


def test_the_pool_needs_a_block_besides_the_null_block():
    with pytest.raises(ValueError, match="at least 2 blocks"):
        BlockManager(1, BS)
