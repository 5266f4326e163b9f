"""Ring attention: one sequence split across a process group, on the blockwise kernel's own math.

Layout (zigzag). A global sequence of N tokens is padded at its END to N_pad = 2W * c tokens, c = ceil(N / 2W),
and cut into 2W chunks of c tokens; rank r of a group of W ranks holds chunks r and 2W-1-r, concatenated
(local length 2c). Under a causal mask every rank then does the same amount of work. `zigzag_shard` /
`zigzag_unshard` / `zigzag_positions` (bpt.sequence_parallel.zigzag) convert between the layouts; every per-token
input (hidden states, padding mask, segment ids, labels, dO) is sharded the same way.

Uneven lengths: pass the true global length as `seq_len` (default: W * local length, no padding). Keys at
global positions >= seq_len are hidden from every query, and query rows there output exact zeros and get
(and give) zero gradients: the result on the real tokens is exactly that of `blockwise_attention` on the
unpadded sequence, whatever the pad tokens hold.

Algorithm (one custom autograd Function). Forward: each rank keeps the running max / sum / accumulator of its
local query rows (fp32, as on one device), and its K/V shard (with its key-side padding mask and segment ids)
travels around the ring by P2P (send to rank + 1, receive from rank - 1); the next shard's transfer is started
before the current shard is folded in and waited after, so communication overlaps compute. Each incoming
shard is folded into the same running online softmax, block by block, with `bpt.engine.forward_step`:
partial results merge through their running max / sum exactly as the single-device kernel merges key blocks.
Backward: the K/V shards travel again, each rank adds the shard's dK / dV contributions
(`bpt.engine.backward_step`, probabilities recomputed from the saved logsumexp) into an fp32 accumulator that travels
with the shard, one hop behind it (so its transfer overlaps the next step's compute); after W steps each
accumulator is back at the rank that owns the K/V. dQ stays local.

Masks are global: causal, sliding window and ALiBi use GLOBAL positions (from the zigzag layout), segment ids
and padding travel with their keys. (query chunk, key chunk) pairs that causality, the window, the padding or
the true length hide completely are skipped, and inside a pair `bpt.engine.make_plan` skips blocks as on one device.
Attention sinks (sinks [Hq], one logit per query head joining every row's normaliser): each rank starts its query
rows' running max / sum from the sink (m = sink, l = 1) as on one device, so the merged logsumexp includes it; its
gradient is each rank's share -sum over its rows of exp(sink - lse) * rowsum(dO * O), summed over the group with
the other replicated parameters' gradients (patches.sequence_parallel.reduce_gradients).
Rows with no visible key follow `empty_rows` as on one device (bpt.engine.empty_rows), over the seq_len real keys:
forward sums v over every shard as it passes, backward adds their contributions shard by shard.
Not supported (raise ValueError): key_bias (a per-key bias must be built for the global sequence), dropout.

Fused path: where no mask but causality applies and torch's fused kernel takes the shards, the pairs go to it instead,
one kernel call per rectangle of a ring step, merged by logsumexp (`bpt.sequence_parallel.ring_fused`); everything
above (layout, exchange, uneven lengths) is the same. Padding, packed documents, windows, ALiBi, softcap and sinks
keep the blockwise engine.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

from bpt.attention_inputs import autocast_inputs, validate_inputs
from bpt.engine import (AttentionSpec, SinkGrad, Workspace, autocast_off, backward_rows, backward_step,
                        block_mask_args, check_empty_rows, empty_rows_backward_step, empty_rows_of, fill_empty_rows,
                        finish_rows, forward_step, make_plan, scaled_query_rows, sink_rows, start_rows)
from bpt.sequence_parallel import traffic
from bpt.sequence_parallel.ring_fused import fused_ring_applies, fused_ring_attention
from bpt.sequence_parallel.zigzag import chunk_ids, zigzag_positions, zigzag_shard, zigzag_unshard

__all__ = ["ring_attention", "zigzag_shard", "zigzag_unshard", "zigzag_positions"]


# ----------------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------------


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    seq_len: int | None = None,
    scale: float | None = None,
    causal: bool = True,
    padding_mask: Tensor | None = None,
    segment_ids: Tensor | None = None,
    sliding_window: int | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float | None = None,
    key_bias: Tensor | None = None,
    sinks: Tensor | None = None,
    dropout: float = 0.0,
    q_block: int = 1024,
    kv_block: int = 1024,
    compile: bool | None = None,
    empty_rows: str = "zeros",
    head_groups: Callable[[], int] | None = None,
) -> Tensor:
    """Self-attention over a sequence sharded across `group` (zigzag layout, see the module docstring).

    q [B, Hq, n, D], k [B, Hkv, n, D], v [B, Hkv, n, Dv]: this rank's LOCAL shard (n = 2c, the same on every
    rank) -> this rank's output shard [B, Hq, n, Dv]. padding_mask / segment_ids: this rank's shard [B, n] of
    the global [B, N] inputs (same meaning as in blockwise_attention). seq_len: the global length before
    padding (default W * n). Every other option means what it means in blockwise_attention, on global
    positions; sinks [Hq] is global (its gradient here is this rank's share). key_bias and dropout are not
    supported and raise ValueError. head_groups: on the fused path, how many groups of query heads its backward's
    kernel calls take in turn, asked when backward runs (bpt.head_groups' rule; None: all at once).
    """
    if key_bias is not None:
        raise ValueError("ring_attention does not support key_bias (yet); use blockwise_attention on one device, or "
                         "ulysses_attention with the global bias, for it")
    if dropout:
        raise ValueError("ring_attention does not support dropout (yet): pass dropout=0.0 (attention dropout "
                         "is 0 in the models trained at long context)")
    q, k, v = autocast_inputs(q, k, v)
    validate_inputs(q, k, v, scale, padding_mask, segment_ids, sliding_window, alibi_slopes, softcap, q_block,
                    kv_block, compile, sinks=sinks)
    check_empty_rows(empty_rows)
    n = q.shape[2]
    if k.shape[2] != n or n == 0 or n % 2:
        raise ValueError(f"ring_attention needs q and k shards of one even length (two zigzag chunks, see "
                         f"zigzag_shard), got q {q.shape[2]}, k {k.shape[2]}")
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ring_attention needs an initialised torch.distributed process group")
    ring = _Ring(group, n // 2)
    padded = ring.world * n
    if seq_len is None:
        seq_len = padded
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or not 0 < seq_len <= padded:
        raise ValueError(f"seq_len must be an integer in [1, world * local length = {padded}], got {seq_len!r}")
    ring.seq_len = seq_len
    masked = any(x is not None for x in (padding_mask, segment_ids, sliding_window, alibi_slopes, softcap, sinks))
    if fused_ring_applies(q, k, v, causal, n // 2, masked):
        return fused_ring_attention(q, k, v, float(q.shape[-1] ** -0.5 if scale is None else scale), causal, ring,
                                    head_groups)
    b, hq = q.shape[:2]
    hkv = k.shape[1]
    spec = AttentionSpec.of(q, k, scale=scale, causal=causal, sliding_window=sliding_window, softcap=softcap,
                            q_block=q_block, kv_block=kv_block, compile=compile, offset=0, empty_rows=empty_rows)
    # key-side mask [B, n] (True = real key): the padding mask and the true length, or None
    key_mask = None if padding_mask is None else padding_mask != 0
    if seq_len < padded:
        real = zigzag_positions(n, ring.rank, ring.world, q.device) < seq_len  # [n]
        key_mask = real.expand(b, n) if key_mask is None else key_mask & real
    if key_mask is not None:
        key_mask = key_mask.contiguous()
    if segment_ids is not None:
        segment_ids = segment_ids.long().contiguous()
    slopes = None if alibi_slopes is None else alibi_slopes.to(spec.acc_dtype).view(hkv, hq // hkv)  # [Hkv, G]
    return _RingAttention.apply(q, k, v, key_mask, segment_ids, slopes, sinks, spec, ring)


# ----------------------------------------------------------------------------------------------------
# Communication
# ----------------------------------------------------------------------------------------------------


class _Ring:
    """Ranks and chunk geometry of one call; P2P exchange with the ring neighbours."""

    def __init__(self, group, c: int):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.c = c  # tokens per chunk
        self.seq_len = 2 * self.world * c
        as_global = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = as_global((self.rank + 1) % self.world)
        self.prev = as_global((self.rank - 1) % self.world)

    def chunk_starts(self, rank: int) -> tuple[int, int]:
        """Global positions of the first token of rank's two chunks."""
        a, b = chunk_ids(rank, self.world)
        return a * self.c, b * self.c

    def real_keys(self, rank: int) -> list[tuple[int, int]]:
        """(start, stop) in rank's shard of the keys before the true length: a prefix of each chunk."""
        spans = []
        for kc, k0 in enumerate(self.chunk_starts(rank)):
            real = min(self.c, max(0, self.seq_len - k0))
            if real:
                spans.append((kc * self.c, kc * self.c + real))
        return spans

    def exchange(self, tensors: list[Tensor]) -> tuple[list[Tensor], list]:
        """Start sending tensors to the next rank and receiving their like from the previous one.

        -> (receive buffers, works to wait on). Every rank issues the same ops in the same order, so the
        sends of rank r - 1 pair with the receives of rank r (gloo and NCCL alike).
        """
        received = [torch.empty_like(t) for t in tensors]
        ops = []
        for t, buf in zip(tensors, received):
            traffic.add("ring_p2p", t.numel() * t.element_size())
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group))
            ops.append(dist.P2POp(dist.irecv, buf, self.prev, self.group))
        if not ops:
            return received, []
        works = dist.batch_isend_irecv(ops)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)  # as much comes from prev as goes to next
        token = traffic.started("ring_p2p", {(self.rank + 1) % self.world: nbytes},
                                {(self.rank - 1) % self.world: nbytes})
        return received, works + ([] if token is None else [traffic.Waited(token)])


def _wait(works) -> None:
    for work in works:
        work.wait()


def _pack(k3: Tensor, v3: Tensor, key_mask, segment_ids) -> list[Tensor]:
    """What travels with a K/V shard: k, v, then the key-side mask (as uint8) and segment ids if present."""
    shard = [k3, v3]
    if key_mask is not None:
        shard.append(key_mask.to(torch.uint8))
    if segment_ids is not None:
        shard.append(segment_ids)
    return shard


def _unpack(shard: list[Tensor], has_mask: bool, has_seg: bool):
    k3, v3, rest = shard[0], shard[1], shard[2:]
    key_mask = rest.pop(0).bool() if has_mask else None
    segment_ids = rest.pop(0) if has_seg else None
    return k3, v3, key_mask, segment_ids


# ----------------------------------------------------------------------------------------------------
# Plan: which (query chunk, key chunk) pairs a ring step computes, and their blocks
# ----------------------------------------------------------------------------------------------------


def _step_plan(spec: AttentionSpec, ring: _Ring, src: int, b: int, key_mask, segment_ids, q_segment_ids):
    """Pairs of this rank's query chunks x src's key chunks to compute -> [(qc, kc, pair_spec, plan)].

    key_mask / segment_ids: src's key-side inputs [B, 2c] (or None); q_segment_ids: this rank's [B, 2c].
    A pair's spec has offset = first query position - first key position, so `make_plan` / `block_mask_args`
    see global positions (ALiBi, causal and window rules use only differences of positions).
    """
    c, window = ring.c, spec.window
    pairs = []
    for qc, p0 in enumerate(ring.chunk_starts(ring.rank)):
        if p0 >= ring.seq_len:
            continue  # only padding queries: their rows are zeroed
        for kc, k0 in enumerate(ring.chunk_starts(src)):
            if k0 >= ring.seq_len:
                continue  # only padding keys
            if spec.causal and k0 > p0 + c - 1:
                continue  # every key after every query
            if window is not None and p0 - (k0 + c - 1) >= window:
                continue  # every key out of every query's window
            cols = slice(kc * c, kc * c + c)
            pair_spec = dataclasses.replace(spec, offset=p0 - k0)
            plan = make_plan(pair_spec, b, c, c, None if key_mask is None else key_mask[:, cols],
                             None if segment_ids is None else segment_ids[:, cols],
                             None if q_segment_ids is None else q_segment_ids[:, qc * c:qc * c + c])
            if any(blocks for _, _, blocks in plan):
                pairs.append((qc, kc, pair_spec, plan))
    return pairs


def _pair_blocks(pair, ring: _Ring, b: int, key_mask, segment_ids, q_segment_ids, slopes):
    """-> (qc, i0, i1, key offset of the block in the shard, block length, mask args) per block of a pair."""
    qc, kc, pair_spec, plan = pair
    c = ring.c
    cols = slice(kc * c, kc * c + c)
    pad = None if key_mask is None else key_mask[:, cols]
    seg = None if segment_ids is None else segment_ids[:, cols]
    q_seg = None if q_segment_ids is None else q_segment_ids[:, qc * c:qc * c + c]
    for i0, i1, blocks in plan:
        for blk in blocks:
            yield (qc, i0, i1, kc * c + blk.j0, blk.j1 - blk.j0,
                   block_mask_args(pair_spec, b, i0, i1, blk, pad, seg, slopes, q_segment_ids=q_seg))


def _query_blocks(spec: AttentionSpec, c: int) -> list[tuple[int, int, int]]:
    """(query chunk, i0, i1) of every query block; rows of chunk qc sit at qc * c + i0 : qc * c + i1."""
    return [(qc, i0, min(i0 + spec.q_block, c)) for qc in (0, 1) for i0 in range(0, c, spec.q_block)]


def _padding_rows(ring: _Ring, n: int, device) -> Tensor | None:
    """Local rows past the true length [n] bool, or None when there are none."""
    if ring.seq_len >= 2 * ring.world * ring.c:
        return None
    return zigzag_positions(n, ring.rank, ring.world, device) >= ring.seq_len


def _empty_rows_backward(spec: AttentionSpec, ring: _Ring, rows_of: dict, src: int, kb3, vb3, dk, dv) -> None:
    """The contributions of src's real keys to this rank's rows with no visible key (bpt.engine.empty_rows)."""
    for qs, dob, _, neg_delta, dqb, empty in rows_of.values():
        if empty is None:
            continue
        for start, stop in ring.real_keys(src):
            for j0 in range(start, stop, spec.kv_block):
                j1 = min(j0 + spec.kv_block, stop)
                empty_rows_backward_step(qs, kb3[:, j0:j1], vb3[:, j0:j1], dob, neg_delta, empty, ring.seq_len, dqb,
                                         dk[:, j0:j1], dv[:, j0:j1], spec.softcap, spec.empty_rows)


# ----------------------------------------------------------------------------------------------------
# Autograd Function
# ----------------------------------------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    @staticmethod
    @autocast_off
    def forward(ctx, q, k, v, key_mask, segment_ids, slopes, sinks, spec: AttentionSpec, ring: _Ring):
        b, hq, n, d = q.shape
        hkv, dv = k.shape[1], v.shape[3]
        bh, g, c, acc_dtype = b * hkv, spec.groups, ring.c, spec.acc_dtype
        q3 = q.reshape(bh, g, n, d)  # query heads grouped under their kv head
        k3 = k.reshape(bh, n, d).contiguous()
        v3 = v.reshape(bh, n, dv).contiguous()
        has_mask, has_seg = key_mask is not None, segment_ids is not None
        qblocks = _query_blocks(spec, c)
        sinks3 = sink_rows(sinks, b, hkv, g, acc_dtype)  # [BH, G, 1] or None
        state = {}  # (qc, i0) -> (qs [BH, R, D], m [BH, R], l [BH, R], acc [BH, R, Dv])
        for qc, i0, i1 in qblocks:
            state[qc, i0] = (scaled_query_rows(q3, qc * c + i0, qc * c + i1, spec),
                             *start_rows(q, bh, g, i1 - i0, dv, acc_dtype, sinks3))
        work = Workspace(enabled=not spec.use_compile)
        shard = _pack(k3, v3, key_mask, segment_ids)
        plans = []
        value_sum = q.new_zeros(bh, dv, dtype=acc_dtype)  # sum of v over the real keys, for rows with none visible
        for step in range(ring.world):
            incoming, works = ring.exchange(shard) if step + 1 < ring.world else (None, [])  # overlaps compute
            kb3, vb3, mask_s, seg_s = _unpack(shard, has_mask, has_seg)
            src = (ring.rank - step) % ring.world
            if spec.empty_rows != "zeros":
                for j0, j1 in ring.real_keys(src):
                    value_sum.add_(vb3[:, j0:j1].sum(1, dtype=acc_dtype))
            pairs = _step_plan(spec, ring, src, b, mask_s, seg_s, segment_ids)
            plans.append(pairs)
            for pair in pairs:
                for qc, i0, i1, j0, bk, margs in _pair_blocks(pair, ring, b, mask_s, seg_s, segment_ids, slopes):
                    qs, m, l, acc = state[qc, i0]
                    forward_step(qs, kb3[:, j0:j0 + bk], vb3[:, j0:j0 + bk], m, l, acc,
                                 work.get("s", (bh, qs.shape[1], bk), qs), None, *margs,
                                 use_compile=spec.use_compile)
            _wait(works)
            shard = incoming
        out = q.new_empty(b, hq, n, dv)
        out3 = out.view(bh, g, n, dv)
        lse = q.new_empty(bh, g, n, dtype=acc_dtype)  # per-row logsumexp, +inf for empty rows
        for qc, i0, i1 in qblocks:
            _, m, l, acc = state.pop((qc, i0))
            finish_rows(m, l, acc, out3, lse, qc * c + i0, qc * c + i1)
        fill_empty_rows(out3, lse, value_sum, ring.seq_len, spec.empty_rows)
        pad_rows = _padding_rows(ring, n, q.device)
        if pad_rows is not None:  # rows past the true length: exact zeros, no gradient (like empty rows)
            out3[:, :, pad_rows] = 0
            lse[:, :, pad_rows] = float("inf")
        ctx.save_for_backward(q3, k3, v3, out, lse, key_mask, segment_ids, slopes, sinks)
        ctx.spec, ctx.ring, ctx.plans, ctx.shapes = spec, ring, plans, (q.shape, k.shape, v.shape)
        return out

    @staticmethod
    @once_differentiable
    @autocast_off
    def backward(ctx, dout):
        q3, k3, v3, out, lse, key_mask, segment_ids, slopes, sinks = ctx.saved_tensors
        spec, ring, plans = ctx.spec, ctx.ring, ctx.plans
        q_shape, k_shape, v_shape = ctx.shapes
        bh, g, n, d = q3.shape
        dv_dim, b, c, acc_dtype = v3.shape[-1], q_shape[0], ring.c, spec.acc_dtype
        do3 = dout.reshape(bh, g, n, dv_dim)
        pad_rows = _padding_rows(ring, n, q3.device)
        if pad_rows is not None:  # their outputs are constant zeros
            do3 = do3.clone()
            do3[:, :, pad_rows] = 0
        o3 = out.view(bh, g, n, dv_dim)
        has_mask, has_seg = key_mask is not None, segment_ids is not None
        sink_grad = None if sinks is None else SinkGrad(sinks, b, k_shape[1], g, acc_dtype)  # this rank's share
        rows_of = {}  # (qc, i0) -> (qs, dO rows, -lse, -delta, dq accumulator)
        for qc, i0, i1 in _query_blocks(spec, c):
            r0, r1 = qc * c + i0, qc * c + i1
            dob, neg_lse, neg_delta = backward_rows(do3, o3, lse, r0, r1, acc_dtype)  # [BH, R, Dv], [BH, R] x 2
            empty = None  # rows with no visible key that stock's rule gives gradients (pad rows' dO is 0)
            if spec.empty_rows != "zeros":
                empty = empty_rows_of(lse[:, :, r0:r1]).reshape(bh, -1)
                empty = empty if bool(empty.any()) else None
            rows_of[qc, i0] = (scaled_query_rows(q3, r0, r1, spec), dob, neg_lse, neg_delta,
                               torch.zeros((bh, g * (i1 - i0), d), dtype=acc_dtype, device=q3.device), empty)
            if sink_grad is not None:  # pad rows add 0: their lse is +inf
                sink_grad.add_rows(neg_lse, neg_delta)
        work = Workspace(enabled=not spec.use_compile)
        shard = _pack(k3, v3, key_mask, segment_ids)
        grads = None  # the dK / dV accumulator finished in the previous step, to pass on
        for step in range(ring.world):
            # K/V for the next step, and the previous step's accumulator to its next holder (who needs it
            # after this step's compute): both in flight while this step computes.
            outgoing = (shard if step + 1 < ring.world else []) + ([] if grads is None else grads)
            incoming, works = ring.exchange(outgoing)
            kb3, vb3, mask_s, seg_s = _unpack(shard, has_mask, has_seg)
            dk = torch.zeros(k3.shape, dtype=acc_dtype, device=k3.device)  # [BH, n, D]
            dv = torch.zeros(v3.shape, dtype=acc_dtype, device=v3.device)  # [BH, n, Dv]
            for pair in plans[step]:
                for qc, i0, i1, j0, bk, margs in _pair_blocks(pair, ring, b, mask_s, seg_s, segment_ids, slopes):
                    qs, dob, neg_lse, neg_delta, dqb, _ = rows_of[qc, i0]
                    shape = (bh, qs.shape[1], bk)
                    backward_step(qs, kb3[:, j0:j0 + bk], vb3[:, j0:j0 + bk], dob, neg_lse, neg_delta, dqb,
                                  dk[:, j0:j0 + bk], dv[:, j0:j0 + bk], work.get("s", shape, qs),
                                  work.get("ds", shape, qs), None, *margs, use_compile=spec.use_compile)
            _empty_rows_backward(spec, ring, rows_of, (ring.rank - step) % ring.world, kb3, vb3, dk, dv)
            _wait(works)
            if grads is not None:  # the accumulator of this step's shard, from the previous rank
                dk.add_(incoming[-2])
                dv.add_(incoming[-1])
                incoming = incoming[:-2]
            grads, shard = [dk, dv], incoming
        if ring.world > 1:  # the last accumulator goes home: rank r + 1 owns the shard rank r held last
            received, works = ring.exchange(grads)
            _wait(works)
            grads = received
        dk, dv = grads
        dq = torch.empty(q3.shape, dtype=acc_dtype, device=q3.device)  # [BH, G, n, D]
        for qc, i0, i1 in _query_blocks(spec, c):
            dq[:, :, qc * c + i0:qc * c + i1] = rows_of[qc, i0][4].view(bh, g, i1 - i0, d)
        dq.mul_(spec.scale)  # s = (scale * q) . k
        dtype = q3.dtype
        dsinks = None if sink_grad is None else sink_grad.total()  # [Hq]
        return (dq.view(q_shape).to(dtype), dk.view(k_shape).to(dtype), dv.view(v_shape).to(dtype),
                None, None, None, dsinks, None, None)
