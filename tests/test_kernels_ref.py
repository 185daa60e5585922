"""The varlen, pool-indexed reference ops equal the per-sequence math they are built on (float64).

Odd lengths, sequences starting from zero state and from carried state, slots and blocks in a
permuted order, decode rows (one token each) and varlen prefill chunks.
"""

from __future__ import annotations

import torch

from k3backend import kernels
from tolerances import tol

F64 = torch.float64


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64) * scale


def kda_inputs(T: int, H: int, K: int, V: int, seed: int):
    q = kernels.l2_norm(randn(T, H, K, seed=seed)) * K ** -0.5
    k = kernels.l2_norm(randn(T, H, K, seed=seed + 1))
    v = randn(T, H, V, seed=seed + 2)
    g = -torch.rand(T, H, K, generator=torch.Generator().manual_seed(seed + 3), dtype=F64) * 2
    beta = torch.rand(T, H, generator=torch.Generator().manual_seed(seed + 4), dtype=F64)
    return q, k, v, g, beta


def test_kda_prefill_and_decode_equal_per_sequence_math():
    H, K, V, N = 3, 8, 5, 9
    lens = [7, 1, 13]
    slots = torch.tensor([6, 2, 4], dtype=torch.int32)  # permuted slots
    has = torch.tensor([True, False, True])
    pool = randn(N, H, K, V, seed=1, scale=0.3)
    carried = pool.clone()
    q, k, v, g, beta = kda_inputs(sum(lens), H, K, V, seed=10)
    cu = torch.tensor([0, 7, 8, 21], dtype=torch.int32)
    o = kernels.kda_prefill(q, k, v, g, beta, pool, cu, slots, has)
    for b, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        S0 = carried[slots[b]] if has[b] else torch.zeros(H, K, V, dtype=F64)
        o_ref, S_ref = kernels.kda_chunked(q[a:e], k[a:e], v[a:e], g[a:e], beta[a:e], S0)
        torch.testing.assert_close(o[a:e], o_ref, **tol(F64))
        torch.testing.assert_close(pool[slots[b]], S_ref, **tol(F64))
    untouched = [i for i in range(N) if i not in slots.tolist()]
    assert torch.equal(pool[untouched], carried[untouched])

    before = pool.clone()
    q, k, v, g, beta = kda_inputs(3, H, K, V, seed=20)
    o = kernels.kda_decode(q, k, v, g, beta, pool, slots)
    for b in range(3):
        o_ref, S_ref = kernels.kda_recurrent(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1],
                                             before[slots[b]])
        torch.testing.assert_close(o[b], o_ref[0], **tol(F64))
        torch.testing.assert_close(pool[slots[b]], S_ref, **tol(F64))


def test_short_conv_varlen_and_decode_equal_per_sequence_conv():
    C, W, N = 6, 4, 5
    weight = randn(C, W, seed=30)
    pool = randn(N, W - 1, C, seed=31)
    carried = pool.clone()
    lens = [5, 2, 1]
    x = randn(sum(lens), C, seed=32)
    slots = torch.tensor([3, 1, 4], dtype=torch.int32)
    has = torch.tensor([True, False, True])
    cu = torch.tensor([0, 5, 7, 8], dtype=torch.int32)
    y = kernels.short_conv(x, weight, pool, cu, slots, has)
    for b, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        hist = carried[slots[b]] if has[b] else torch.zeros(W - 1, C, dtype=F64)
        y_ref, h_ref = kernels.short_conv_seq(x[a:e], weight, hist)
        torch.testing.assert_close(y[a:e], y_ref, **tol(F64))
        torch.testing.assert_close(pool[slots[b]], h_ref, **tol(F64))
    before = pool.clone()
    xd = randn(3, C, seed=33)
    yd = kernels.short_conv_decode(xd, weight, pool, slots)
    for b in range(3):
        y_ref, h_ref = kernels.short_conv_seq(xd[b:b + 1], weight, before[slots[b]])
        torch.testing.assert_close(yd[b], y_ref[0], **tol(F64))
        torch.testing.assert_close(pool[slots[b]], h_ref, **tol(F64))


def test_mla_paged_ops_equal_the_two_forms_on_gathered_rows():
    N, dn, dr, dv, r, bs = 2, 8, 4, 6, 10, 3
    num_blocks = 12
    pool = torch.zeros(num_blocks, bs, r + dr, dtype=F64)
    kv_b = randn(N * (dn + dv), r, seed=40, scale=r ** -0.5)
    w = kv_b.view(N, dn + dv, r)
    w_kc, w_vc = w[:, :dn], w[:, dn:].transpose(1, 2)
    scale = (dn + dr) ** -0.5
    tables = [[7, 2, 9, 4], [5, 11], [3, 1, 8]]  # permuted block ids per sequence
    prefix = [0, 4, 5]  # sequence 0 fresh, 1 and 2 with a cached prefix
    chunk = [8, 2, 4]
    rows = {b: randn(prefix[b] + chunk[b], r + dr, seed=41 + b) for b in range(3)}
    slot = lambda b, p: tables[b][p // bs] * bs + p % bs  # noqa: E731
    for b in range(3):  # the cached prefixes are already in the pool
        for p in range(prefix[b]):
            pool.view(-1, r + dr)[slot(b, p)] = rows[b][p]
    mapping = torch.tensor([slot(b, p) for b in range(3) for p in range(prefix[b], prefix[b] + chunk[b])])
    new = torch.cat([rows[b][prefix[b]:] for b in range(3)])
    kernels.mla_write(new, pool, mapping)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    ctx = torch.tensor([prefix[b] + chunk[b] for b in range(3)], dtype=torch.int32)
    cu = torch.tensor([0, 8, 10, 14], dtype=torch.int32)
    q_nope, q_pe = randn(14, N, dn, seed=50), randn(14, N, dr, seed=51)
    out = kernels.mla_prefill(q_nope, q_pe, pool, cu, bt, ctx, kv_b, w_kc, w_vc, scale)
    for b, (a, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        c_kv, k_pe = rows[b][:, :r], rows[b][:, r:]
        form = kernels.mla_mha(q_nope[a:e], q_pe[a:e], c_kv, k_pe, kv_b, scale) if prefix[b] == 0 else \
            kernels.mla_absorbed(q_nope[a:e], q_pe[a:e], c_kv, k_pe, w_kc, w_vc, scale)
        torch.testing.assert_close(out[a:e], form, **tol(F64))
    dec = kernels.mla_decode(q_nope[:3], q_pe[:3], pool, bt, ctx, w_kc, w_vc, scale)
    for b in range(3):
        c_kv, k_pe = rows[b][:, :r], rows[b][:, r:]
        want = kernels.mla_absorbed(q_nope[b:b + 1], q_pe[b:b + 1], c_kv, k_pe, w_kc, w_vc, scale)
        torch.testing.assert_close(dec[b:b + 1], want, **tol(F64))


def test_mla_forms_in_query_blocks_equal_one_block(monkeypatch):
    """Bounded score memory: queries in blocks give the one-block result (each row's softmax is its own)."""
    from k3backend.kernels import mla_ref

    T, N, dn, dr, dv, r, S = 37, 3, 8, 4, 6, 10, 50
    qn, qp = randn(T, N, dn, seed=60), randn(T, N, dr, seed=61)
    c_kv, k_pe = randn(S, r, seed=62), randn(S, dr, seed=63)
    kv_b = randn(N * (dn + dv), r, seed=64, scale=r ** -0.5)
    w = kv_b.view(N, dn + dv, r)
    w_kc, w_vc = w[:, :dn], w[:, dn:].transpose(1, 2)
    whole = (mla_ref.mla_mha(qn, qp, c_kv, k_pe, kv_b, 0.3), mla_ref.mla_absorbed(qn, qp, c_kv, k_pe, w_kc, w_vc, 0.3))
    monkeypatch.setattr(mla_ref, "MAX_SCORES", N * S * 5)  # blocks of 5 query rows
    assert len(mla_ref._query_blocks(T, N, S)) == 8
    torch.testing.assert_close(mla_ref.mla_mha(qn, qp, c_kv, k_pe, kv_b, 0.3), whole[0], **tol(F64))
    torch.testing.assert_close(mla_ref.mla_absorbed(qn, qp, c_kv, k_pe, w_kc, w_vc, 0.3), whole[1], **tol(F64))


def test_every_fast_op_has_its_reference_signature():
    """kernels/__init__.py hands a fast op the reference's arguments: each registered module's op
    and its verifier take exactly the reference's parameters (no triton launch: import only)."""
    import importlib
    import inspect

    from k3backend import kernels

    for name, module in kernels.FAST_OPS.items():
        mod = importlib.import_module(module)
        ref = getattr(kernels, name)
        want = list(inspect.signature(getattr(ref, "__wrapped__", ref)).parameters)
        assert list(inspect.signature(getattr(mod, name)).parameters) == want, name
        assert list(inspect.signature(getattr(mod, f"{name}_supports")).parameters) == want, name
