"""bpt/varlen.py: packed documents and windows routed to torch's variable-length flash attention on CUDA. There is no
CPU kernel, so the routing is forced here onto a pure-torch stand-in with varlen_attn's contract (flattened tokens,
cu_seqlens, longest document, window_size=(left, 0), GQA): what our wrapper passes is checked, and its output and
gradients equal the blockwise path's. The simulated-CUDA tier checks which inputs torch's own predicates route."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.attention.varlen as torch_varlen

import bpt.attention as attention
import bpt.varlen as varlen
from bpt.attention import blockwise_attention, segment_ids_from_position_ids


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                          enable_gqa=False, **_):
    """varlen_attn's result computed per document: query [T, Hq, D], key / value [T, Hkv, D]."""
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32 and max_q == max_k
    group = query.shape[1] // key.shape[1]
    assert enable_gqa == (group > 1)
    out = torch.empty_like(query)
    for start, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        assert end - start <= max_q
        q, k, v = (t[start:end].transpose(0, 1) for t in (query, key, value))  # [H, n, D]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        n = end - start
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        left = window_size[0]
        visible = (j <= i) & ((i - j <= left) if left >= 0 else True)
        scores = (q @ k.transpose(1, 2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
        out[start:end] = (scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v).transpose(0, 1)
    return out


@pytest.fixture
def routed(monkeypatch):
    """Force the varlen route on CPU with the stand-in; record what it was called with."""
    calls = []

    @functools.wraps(reference_varlen_attn)  # its signature: the wrapper reads which options torch takes
    def stand_in(*args, **kwargs):
        calls.append((args, kwargs))
        return reference_varlen_attn(*args, **kwargs)

    def on_any_device(q, k, v, causal, padding_mask, segment_ids, window, slopes, softcap, dropout):
        return ((segment_ids is not None or window is not None) and causal and padding_mask is None
                and slopes is None and softcap is None and not dropout)

    monkeypatch.setattr(attention, "_varlen_handles", on_any_device)
    monkeypatch.setattr(torch_varlen, "varlen_attn", stand_in)
    return calls


def qkv(batch=2, heads=4, kv_heads=2, n=40, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, h, n, d, generator=g, requires_grad=True) for h in (heads, kv_heads, kv_heads)]


POSITIONS = torch.tensor([list(range(15)) + list(range(20)) + list(range(5)),
                          list(range(40))])  # three documents in row 0, one in row 1


@pytest.mark.parametrize("packed,window", [(True, None), (True, 7), (False, 7)])
def test_routed_case_equals_the_blockwise_path(routed, packed, window):
    segments = segment_ids_from_position_ids(POSITIONS) if packed else None
    q, k, v = qkv()
    out = blockwise_attention(q, k, v, segment_ids=segments, sliding_window=window, scale=0.3)
    assert len(routed) == 1
    (query, key, value, cu_q, cu_k, max_q, max_k), options = routed[0]
    assert query.shape == (80, 4, 16) and key.shape == (80, 2, 16)
    expected_cu = [0, 15, 35, 40, 80] if packed else [0, 40, 80]
    assert cu_q.tolist() == expected_cu and max_q == 40
    assert options == {"scale": 0.3, "window_size": (-1, 0) if window is None else (window - 1, 0), "enable_gqa": True}
    assert_equals_blockwise(out, q, k, v, segments, window)


def test_a_torch_without_grouped_heads_gets_keys_per_query_head(routed, monkeypatch):
    """torch 2.11's varlen_attn has no `enable_gqa` and wants as many key / value heads as query heads."""
    monkeypatch.setattr(varlen, "_takes_grouped_heads", lambda: False)
    segments = segment_ids_from_position_ids(POSITIONS)
    q, k, v = qkv()
    out = blockwise_attention(q, k, v, segment_ids=segments, scale=0.3)
    (query, key, value, *_), options = routed[0]
    assert query.shape == key.shape == value.shape == (80, 4, 16) and "enable_gqa" not in options
    assert_equals_blockwise(out, q, k, v, segments, None)


def assert_equals_blockwise(out, q, k, v, segments, window):
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected_out = attention._blockwise(q, k, v, scale=0.3, causal=True, padding_mask=None, segment_ids=segments,
                                        sliding_window=window, alibi_slopes=None, softcap=None, q_block=16,
                                        kv_block=16, compile=False)
    expected = torch.autograd.grad(expected_out, (q, k, v), grad)
    for a, b in zip((out, *got), (expected_out, *expected)):  # fp32: within 1e-5 of each tensor's largest value
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_documents_are_read_once_per_segment_tensor(routed, monkeypatch):
    segments = segment_ids_from_position_ids(POSITIONS)
    reads = []
    real_stack = torch.stack
    monkeypatch.setattr(torch, "stack", lambda *a, **k: reads.append(1) or real_stack(*a, **k))
    for _ in range(3):  # three layers of one forward
        q, k, v = qkv()
        blockwise_attention(q, k, v, segment_ids=segments)
    assert len(routed) == 3 and len(reads) == 1


def test_ids_that_repeat_apart_stay_blockwise(routed):
    segments = torch.tensor([[0] * 10 + [1] * 10 + [0] * 20, [0] * 40])  # document 0 resumes: not one run
    q, k, v = qkv()
    blockwise_attention(q, k, v, segment_ids=segments)
    assert routed == []


def test_what_varlen_cannot_take_is_not_routed():
    """The real predicate: CPU, fp32, ALiBi, softcap, padding, dropout, or no documents and no window."""
    q, k, v = qkv()
    segments = segment_ids_from_position_ids(POSITIONS)
    base = dict(causal=True, padding_mask=None, segment_ids=segments, window=None, slopes=None, softcap=None,
                dropout=0.0)
    assert not attention._varlen_handles(q, k, v, *base.values())  # CPU tensors
    meta = [t.detach().to("meta", torch.bfloat16) for t in (q, k, v)]
    assert not attention._varlen_handles(*meta, *base.values())  # not CUDA


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (run `python -m pytest -m cuda` on a GPU machine)")
def test_cuda_packed_bf16_takes_varlen_and_is_no_worse_than_blockwise(monkeypatch):
    """On a GPU: packed bf16 documents go to varlen; output and gradient errors against fp32 are no worse than 1.5x
    the blockwise kernel's on the same bf16 inputs."""
    calls = []
    real = attention.varlen_causal
    monkeypatch.setattr(attention, "varlen_causal", lambda *a, **k: calls.append(1) or real(*a, **k))
    segments = segment_ids_from_position_ids(POSITIONS.repeat(1, 32)).cuda()  # 1280 tokens: 96 and 32 documents
    q, k, v = (t.detach().cuda().repeat(1, 1, 32, 4) for t in qkv())  # head dim 64
    grad = torch.randn_like(q)

    def run(dtype, path):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]  # fresh leaves for every run
        if path == "blockwise":
            out = attention._blockwise(*leaves, scale=0.125, causal=True, padding_mask=None, segment_ids=segments,
                                       sliding_window=None, alibi_slopes=None, softcap=None, q_block=128,
                                       kv_block=128, compile=False)
        else:
            out = blockwise_attention(*leaves, segment_ids=segments, scale=0.125)
        out.backward(grad.to(dtype))
        return [t.float() for t in (out, *(leaf.grad for leaf in leaves))]

    reference = run(torch.float32, "blockwise")
    fused, blockwise = run(torch.bfloat16, "varlen"), run(torch.bfloat16, "blockwise")
    assert calls
    for got, loop, ref in zip(fused, blockwise, reference):
        assert (got - ref).norm() <= 1.5 * (loop - ref).norm()
