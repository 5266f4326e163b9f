"""Blockwise attention against a naive float64 reference: outputs and q/k/v gradients."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from bpt import attention, engine
from bpt.attention import blockwise_attention, segment_ids_from_position_ids

TOL = 1e-5  # fp32 error allowed, relative to the largest reference magnitude


@pytest.fixture(autouse=True)
def blockwise_only(monkeypatch):
    """Every test exercises the blockwise path unless it asks for the fused dispatch itself."""
    monkeypatch.setattr(attention, "_sdpa_handles", lambda *args: False)


def reference_visibility(b, nq, nk, causal, sliding_window, padding_mask, segment_ids):
    """-> (visible [B, 1, Nq, Nk] bool, rel [Nq, Nk] = key position - query position); queries are the last keys."""
    pos_q = torch.arange(nq) + nk - nq
    rel = torch.arange(nk)[None, :] - pos_q[:, None]
    visible = torch.ones(b, 1, nq, nk, dtype=torch.bool)
    if causal:
        visible = visible & (rel <= 0)
    if sliding_window is not None:
        visible = visible & (-rel < sliding_window)
    if padding_mask is not None:
        visible = visible & padding_mask.bool()[:, None, None, :]
    if segment_ids is not None:
        visible = visible & (segment_ids[:, pos_q][:, None, :, None] == segment_ids[:, None, None, :])
    return visible, rel


def reference(q, k, v, *, scale=None, causal=True, padding_mask=None, segment_ids=None,
              sliding_window=None, alibi_slopes=None, softcap=None):
    """Full-matrix float64 attention; rows with no visible key give 0. -> (out, visible rows [B, Hq, Nq])."""
    q, k, v = (t.double() for t in (q, k, v))
    b, hq, nq, d = q.shape
    nk = k.shape[2]
    groups = hq // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scale = d ** -0.5 if scale is None else scale
    s = scale * q @ k.transpose(-1, -2)  # [B, Hq, Nq, Nk]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    visible, rel = reference_visibility(b, nq, nk, causal, sliding_window, padding_mask, segment_ids)
    if alibi_slopes is not None:
        s = s + alibi_slopes.double()[None, :, None, None] * rel
    p = torch.softmax(s.masked_fill(~visible, -1e300), dim=-1)
    rows = visible.any(-1)  # [B, 1, Nq]
    p = p * rows[..., None]
    return p @ v, rows.expand(b, hq, nq)


def make_qkv(b=2, hq=2, hkv=2, nq=127, nk=None, d=16, dv=None, dtype=torch.float32, seed=0, std=1.0):
    gen = torch.Generator().manual_seed(seed)
    nk = nq if nk is None else nk
    dv = d if dv is None else dv
    q = torch.randn(b, hq, nq, d, generator=gen) * std
    k = torch.randn(b, hkv, nk, d, generator=gen) * std
    v = torch.randn(b, hkv, nk, dv, generator=gen)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def assert_close(actual, expected, tol=TOL, what="", scale=None):
    """max |actual - expected| <= tol * scale (default: the largest |expected|)."""
    expected = expected.double()
    err = (actual.double() - expected).abs().max().item()
    bound = tol * (expected.abs().max().item() if scale is None else scale)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def check(q, k, v, tol=TOL, q_block=32, kv_block=48, **options):
    """Compare output and q/k/v grads with the reference; check rows with no visible key are 0."""
    out = blockwise_attention(q, k, v, q_block=q_block, kv_block=kv_block, **options)
    assert out.dtype == q.dtype and out.shape == (*q.shape[:3], v.shape[-1])
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, rows = reference(q64, k64, v64, **options)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    assert_close(out[rows], ref[rows], tol, "output")
    grad_scale = max(rg.abs().max().item() for rg in ref_grads)  # dq is exactly 0 when window = 1
    for name, g, rg in zip("qkv", grads, ref_grads):
        assert_close(g, rg, tol, f"d{name}", scale=grad_scale)
    hidden = ~rows
    assert torch.equal(out[hidden], torch.zeros_like(out[hidden])), "rows with no visible key must be 0"
    assert torch.equal(grads[0][hidden], torch.zeros_like(grads[0][hidden])), "and get zero grads"
    return out, rows


# ---------------------------------------------------------------------------------------------------
# Masks and geometry
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_block,kv_block", [(32, 48), (48, 32), (13, 11), (127, 127), (256, 1000)])
def test_causal_odd_length(q_block, kv_block):
    check(*make_qkv(nq=127), q_block=q_block, kv_block=kv_block)


def test_non_causal_cross_lengths():
    check(*make_qkv(nq=50, nk=77, dv=8), causal=False)


@pytest.mark.parametrize("hkv", [2, 1], ids=["gqa", "mqa"])
def test_grouped_query_heads(hkv):
    check(*make_qkv(b=1, hq=8, hkv=hkv, nq=45, d=8), q_block=16, kv_block=16)


def lengths_mask(lengths, n, left):
    """[B, n] bool padding mask with the given number of real tokens per row."""
    ar = torch.arange(n)
    rows = [(ar >= n - length) if left else (ar < length) for length in lengths]
    return torch.stack(rows)


@pytest.mark.parametrize("left", [True, False], ids=["left", "right"])
def test_padding(left):
    mask = lengths_mask([127, 60, 9], 127, left)
    out, rows = check(*make_qkv(b=3, hq=4, hkv=2), padding_mask=mask)
    if left:  # padded queries at the start see no key under causal masking
        assert not rows[1, :, :67].any() and rows[1, :, 67:].all()


def test_integer_padding_mask_like_transformers():
    mask = lengths_mask([30, 17], 30, left=True).long()  # HF attention_mask: 1 = real, 0 = pad
    check(*make_qkv(nq=30), padding_mask=mask, q_block=8, kv_block=8)


def test_fully_padded_key_block_is_skipped_correctly():
    mask = lengths_mask([100, 100], 100, left=True)  # keys 0..31 hidden in every row: block skipped
    mask[:, 40:48] = False
    check(*make_qkv(nq=100), padding_mask=mask, q_block=16, kv_block=16)


def test_segment_ids_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [5, 6, 7, 8, 9, 10, 0, 1, 2]])
    expected = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1]])
    seg = segment_ids_from_position_ids(pos)
    assert seg.dtype == torch.int64 and torch.equal(seg, expected)
    with pytest.raises(ValueError, match="batch, seq"):
        segment_ids_from_position_ids(pos[0])


def packed_position_ids(lengths_per_row):
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in lengths_per_row])


@pytest.mark.parametrize("causal", [True, False])
def test_packed_segments(causal):
    # Segments longer than a block (unmasked blocks), shorter (masked), and blocks with no shared segment.
    pos = packed_position_ids([[50, 40, 7, 30], [3, 100, 24]])
    seg = segment_ids_from_position_ids(pos)
    check(*make_qkv(hq=4, hkv=2), segment_ids=seg, causal=causal, q_block=16, kv_block=24)


def test_segment_ids_need_not_be_sorted():
    seg = torch.tensor([[3, 3, 3, 1, 1, 1, 3, 3, 0, 0, 0, 0] * 5])
    check(*make_qkv(b=1, nq=60), segment_ids=seg, causal=False, q_block=8, kv_block=12)


@pytest.mark.parametrize("window", [1, 5, 16, 33, 200])
def test_sliding_window(window):
    check(*make_qkv(nq=127), sliding_window=window, q_block=16, kv_block=24)


def test_sliding_window_non_causal_is_one_sided():
    check(*make_qkv(nq=40), sliding_window=7, causal=False, q_block=16, kv_block=8)


def test_alibi():
    slopes = 2.0 ** -torch.arange(1, 9, dtype=torch.float32)
    check(*make_qkv(b=1, hq=8, hkv=2, nq=70), alibi_slopes=slopes, q_block=32, kv_block=16)


def test_softcap():
    q, k, v = make_qkv(nq=60, std=3.0)  # large scores, so the cap matters
    check(q, k, v, softcap=5.0, q_block=16, kv_block=16)


def test_custom_scale():
    check(*make_qkv(nq=60, d=8), scale=0.3, q_block=16, kv_block=32)


@pytest.mark.parametrize("nq", [1, 5, 40])
def test_decode_queries_align_to_the_end(nq):
    mask = lengths_mask([97, 80], 97, left=True)
    check(*make_qkv(nq=nq, nk=97), q_block=16, kv_block=32)
    check(*make_qkv(nq=nq, nk=97), padding_mask=mask, sliding_window=20, q_block=16, kv_block=32)


def test_more_queries_than_keys_causal():
    # The first queries sit before key 0: they see nothing.
    out, rows = check(*make_qkv(nq=20, nk=12), q_block=8, kv_block=8)
    assert not rows[:, :, :8].any()


def test_combination():
    q, k, v = make_qkv(b=2, hq=6, hkv=2, nq=90, d=8, dv=12, std=2.0)
    mask = lengths_mask([90, 71], 90, left=True)
    seg = segment_ids_from_position_ids(packed_position_ids([[30, 60], [40, 25, 25]]))
    slopes = torch.linspace(0.01, 0.5, 6)
    check(q, k, v, padding_mask=mask, segment_ids=seg, sliding_window=21, alibi_slopes=slopes,
          softcap=8.0, scale=0.2, q_block=16, kv_block=24)


def test_gradcheck_float64():
    q, k, v = make_qkv(b=1, hq=2, hkv=1, nq=9, d=4, dtype=torch.float64)
    mask = torch.tensor([[False, True, True, True, True, True, True, True, True]])

    def fn(q, k, v):
        return blockwise_attention(q, k, v, padding_mask=mask, sliding_window=5, softcap=2.0,
                                   alibi_slopes=torch.tensor([0.5, 0.25], dtype=torch.float64),
                                   q_block=4, kv_block=3)

    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_non_contiguous_inputs_like_transformers():
    # transformers builds q/k/v as [B, N, H, D] projections transposed to [B, H, N, D].
    q, k, v = (t.detach().transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
               for t in make_qkv(hq=4, hkv=2, nq=33))
    assert not q.is_contiguous()
    check(q, k, v, q_block=16, kv_block=16)


def test_no_grad_inference():
    q, k, v = make_qkv(nq=40)
    with torch.no_grad():
        out = blockwise_attention(q, k, v, q_block=16, kv_block=16)
    ref, _ = reference(q.detach(), k.detach(), v.detach())
    assert not out.requires_grad
    assert_close(out, ref, what="output")


def plan_of(nq, nk, block, causal=True, window=None, padding_mask=None, segment_ids=None):
    """{query block start: [(key block start, needs any mask), ...]} of the blockwise plan."""
    spec = engine.AttentionSpec(scale=1.0, causal=causal, window=window, softcap=None, q_block=block,
                                kv_block=block, offset=nk - nq, acc_dtype=torch.float32, groups=1,
                                use_compile=False)
    plan = engine.make_plan(spec, 1, nq, nk, padding_mask, segment_ids)
    return {i0: [(blk.j0, blk.causal or blk.window or blk.padding or blk.segments) for blk in blocks]
            for i0, _, blocks in plan}


def test_plan_skips_hidden_blocks_and_masks_only_edges():
    causal = plan_of(256, 256, 64)
    assert causal[128] == [(0, False), (64, False), (128, True)]  # nothing above the diagonal
    assert sum(len(b) for b in causal.values()) == 10
    window = plan_of(256, 256, 64, window=64)
    assert window[192] == [(128, True), (192, True)]  # keys before 129 are out of every row's window
    decode = plan_of(1, 256, 64)
    assert decode[0] == [(0, False), (64, False), (128, False), (192, False)]
    pad = torch.ones(1, 256, dtype=torch.bool)
    pad[0, :70] = False  # left padding: key block 0 entirely hidden, block 1 partly
    assert plan_of(256, 256, 64, padding_mask=pad)[192] == [(64, True), (128, False), (192, True)]
    seg = torch.arange(256).div(64, rounding_mode="floor")[None]  # one document per block
    diagonal_only = {i: [(i, False)] for i in range(0, 256, 64)}
    assert plan_of(256, 256, 64, causal=False, segment_ids=seg) == diagonal_only


# ---------------------------------------------------------------------------------------------------
# Low precision
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    q, k, v = make_qkv(b=1, hq=4, hkv=2, nq=70, dtype=dtype)
    mask = lengths_mask([70], 70, left=True)
    mask[0, :5] = False
    check(q, k, v, padding_mask=mask, tol=2e-2, q_block=16, kv_block=32)


# ---------------------------------------------------------------------------------------------------
# Fused-kernel dispatch
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nq,nk,causal,hkv", [(64, 64, True, 2), (64, 64, True, 4), (40, 64, False, 1),
                                              (1, 64, True, 2)])
def test_fused_path_matches_blockwise(monkeypatch, nq, nk, causal, hkv):
    monkeypatch.undo()  # real dispatch
    q, k, v = make_qkv(b=2, hq=4, hkv=hkv, nq=nq, nk=nk)
    assert attention._sdpa_handles(q, k, v, causal, None, None, None, None, None)
    fused = blockwise_attention(q, k, v, causal=causal, q_block=16, kv_block=16)
    grads = torch.autograd.grad(fused.sum(), (q, k, v))
    monkeypatch.setattr(attention, "_sdpa_handles", lambda *args: False)
    blockwise = blockwise_attention(q, k, v, causal=causal, q_block=16, kv_block=16)
    assert_close(fused, blockwise, what="output")
    for g, bg in zip(grads, torch.autograd.grad(blockwise.sum(), (q, k, v))):
        assert_close(g, bg, what="grad")


def test_fused_path_declines_what_it_cannot_do(monkeypatch):
    monkeypatch.undo()
    q, k, v = make_qkv(b=1, nq=8, nk=16)
    handles = attention._sdpa_handles
    mask = torch.ones(1, 16, dtype=torch.bool)
    assert not handles(q, k, v, True, None, None, None, None, None)  # causal, 1 < Nq < Nk: other alignment
    q16, k16, v16 = make_qkv(b=1, nq=16)
    assert handles(q16, k16, v16, True, None, None, None, None, None)
    for extra in [(mask, None, None, None, None), (None, mask.long(), None, None, None),
                  (None, None, 4, None, None), (None, None, None, torch.ones(2), None),
                  (None, None, None, None, 30.0)]:
        assert not handles(q16, k16, v16, True, *extra)


@pytest.mark.parametrize("hkv", [1, 4])
def test_one_decoded_query_runs_sdpa_with_its_mask(monkeypatch, hkv):
    """One query per row without gradients (a decoded token) over left padding and / or a window: SDPA with an explicit
    mask (no loop over key blocks, whose count a compiled decode would specialise on), against the float64
    reference; a row with no visible key is zeros. Declined with gradients, segments, ALiBi, softcap, dropout or
    another empty-rows rule."""
    monkeypatch.undo()
    taken, one_query = [], attention._one_query_sdpa
    monkeypatch.setattr(attention, "_one_query_sdpa", lambda *args: taken.append(1) or one_query(*args))
    q, k, v = (t.detach() for t in make_qkv(b=3, hq=4, hkv=hkv, nq=1, nk=97))
    mask = lengths_mask([97, 40, 0], 97, left=True)  # the last row fully padded
    for options in ({"padding_mask": mask}, {"sliding_window": 20}, {"padding_mask": mask, "sliding_window": 20}):
        out = blockwise_attention(q, k, v, q_block=16, kv_block=32, **options)
        ref, rows = reference(q, k, v, **options)
        assert_close(out[rows], ref[rows], what=str(options))
        assert torch.equal(out[~rows], torch.zeros_like(out[~rows]))
    assert len(taken) == 3
    handles = attention._one_query_handles
    assert handles(q, k, v, mask, None, None, None, 0.0, "zeros")
    assert not handles(*make_qkv(b=3, nq=1, nk=97), mask, None, None, None, 0.0, "zeros")  # gradients
    assert not handles(*make_qkv(b=3, nq=2, nk=97), mask, None, None, None, 0.0, "zeros")
    segments = torch.zeros(3, 97, dtype=torch.long)
    for extra in [(segments, None, None, 0.0, "zeros"), (None, torch.ones(4), None, 0.0, "zeros"),
                  (None, None, 30.0, 0.0, "zeros"), (None, None, None, 0.1, "zeros"),
                  (None, None, None, 0.0, "uniform")]:
        assert not handles(q, k, v, mask, *extra)


# ---------------------------------------------------------------------------------------------------
# Memory structure: nothing of N x N per head is saved or ever created
# ---------------------------------------------------------------------------------------------------


class _LargestTensor(TorchDispatchMode):
    """Records the element count of every tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.sizes.append(t.numel())
        return out


def test_memory_is_blockwise():
    n, blk, b, hq, hkv, d = 512, 64, 1, 4, 2, 16
    q, k, v = make_qkv(b=b, hq=hq, hkv=hkv, nq=n, d=d)
    mask = lengths_mask([n - 37], n, left=True)
    slopes = torch.linspace(0.1, 0.4, hq)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    ops = _LargestTensor()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ops:
        out = blockwise_attention(q, k, v, padding_mask=mask, alibi_slopes=slopes, sliding_window=300,
                                  q_block=blk, kv_block=blk)
        out.sum().backward()
    per_row_tensor = b * hq * n * d  # q, out, their grads: O(N)
    one_block = b * hq * blk * blk  # one block's scores for all heads
    assert saved and max(saved) <= per_row_tensor < n * n
    assert max(ops.sizes) <= max(per_row_tensor, one_block) < n * n


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change,match", [
    (dict(q=torch.zeros(1, 3, 4, 8)), "multiple of key/value heads"),
    (dict(k=torch.zeros(1, 2, 4, 6)), "head_dim differ"),
    (dict(v=torch.zeros(1, 2, 5, 8)), "k and v must agree"),
    (dict(q=torch.zeros(2, 4, 4, 8)), "batch sizes differ"),
    (dict(q=torch.zeros(4, 4, 8)), "4-D"),
    (dict(v=torch.zeros(1, 2, 4, 8, dtype=torch.float64)), "one dtype"),
    (dict(q=torch.zeros(1, 4, 4, 8, dtype=torch.long)), "floating-point"),
    (dict(q_block=0), "q_block must be a positive"),
    (dict(kv_block=-3), "kv_block must be a positive"),
    (dict(sliding_window=0), "sliding_window must be an integer >= 1"),
    (dict(softcap=0.0), "softcap must be a positive"),
    (dict(padding_mask=torch.ones(1, 5, dtype=torch.bool)), r"padding_mask must be a \[batch, kv_len\]"),
    (dict(segment_ids=torch.zeros(1, 4)), "bool or integer"),
    (dict(alibi_slopes=torch.ones(2)), r"alibi_slopes must be a \[q_heads\] \(one slope per query head\) = \[4\]"),
    (dict(compile="yes"), "compile must be"),
])
def test_invalid_inputs(change, match):
    args = dict(q=torch.zeros(1, 4, 4, 8), k=torch.zeros(1, 2, 4, 8), v=torch.zeros(1, 2, 4, 8))
    args.update(change)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError, match=match):
        blockwise_attention(q, k, v, **args)


# ---------------------------------------------------------------------------------------------------
# Rows with no visible key: what each stock kernel computes there (bpt.engine.empty_rows)
# ---------------------------------------------------------------------------------------------------


def stock_kernel(q, k, v, visible, mode, softcap=None):
    """Stock's arithmetic in fp32 with a mask of the dtype's minimum: added to the scores (eager, "uniform"),
    written over them (masked_fill, "uniform_values"), or given to SDPA as a float mask ("uniform_fused")."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    low = torch.finfo(q.dtype).min
    if mode == "uniform_fused":
        mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, low)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s + torch.zeros_like(s).masked_fill(~visible, low) if mode == "uniform" else s.masked_fill(~visible, low)
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("mode,softcap", [("uniform", None), ("uniform", 2.0), ("uniform_values", None),
                                          ("uniform_fused", None)])
def test_rows_with_no_visible_key_compute_what_stock_computes(mode, softcap):
    """Left padding: the first queries of row 1 see no key. Output and every gradient equal stock's fp32 kernel
    (blocks small enough that those rows span several query blocks and every key block)."""
    q, k, v = make_qkv(b=2, hq=4, hkv=2, nq=45)
    mask = lengths_mask([45, 30], 45, left=True)
    visible, _ = reference_visibility(2, 45, 45, True, None, mask, None)
    out = blockwise_attention(q, k, v, padding_mask=mask, softcap=softcap, q_block=8, kv_block=16, empty_rows=mode)
    q32, k32, v32 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want = stock_kernel(q32, k32, v32, visible, mode, softcap)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    got_grads = torch.autograd.grad(out, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q32, k32, v32), grad)
    empty = ~visible.any(-1).expand(2, 4, 45)
    assert empty[1, :, :15].all() and not empty[1, :, 15:].any()
    assert not torch.equal(want[empty], torch.zeros_like(want[empty]))  # stock does not zero them
    assert_close(out, want, what=f"{mode} output")
    for name, got, expected in zip("qkv", got_grads, want_grads):
        assert_close(got, expected, what=f"{mode} d{name}")


def test_rows_with_no_visible_key_default_to_sdpa_zeros():
    """The default ("zeros") is SDPA's: a boolean mask hiding every key gives exact zeros, as torch's kernel."""
    q, k, v = make_qkv(b=2, hq=4, hkv=2, nq=45)
    mask = lengths_mask([45, 30], 45, left=True)
    visible, _ = reference_visibility(2, 45, 45, True, None, mask, None)
    out = blockwise_attention(q, k, v, padding_mask=mask, q_block=8, kv_block=16)
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=visible)
    assert_close(out, sdpa, what="output")
    assert torch.equal(out[1, :, :15], torch.zeros_like(out[1, :, :15]))


def test_unknown_empty_rows_rule_says_the_choices():
    with pytest.raises(ValueError, match="empty_rows must be one of"):
        blockwise_attention(*make_qkv(nq=8), empty_rows="mean")
