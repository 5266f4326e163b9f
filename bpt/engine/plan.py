"""The block plan: which key blocks each query block visits; per block, its O(N) mask pieces and dropout keep-mask.

The plan is made on the host, from index ranges and per-block (min, max) statistics of the padding mask and
segment ids: blocks that the masks fully exclude never reach the per-block math, and blocks no mask cuts into
run unmasked. While torch.compile traces (`host_reads_allowed`), no tensor data is read: every block the causal /
window rules allow is visited, with the padding and segment masks applied in each (dense per-block masks).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor

from bpt.compile import should_compile


@dataclass(frozen=True)
class AttentionSpec:
    """Non-tensor options of one attention call (shared by forward and backward)."""

    scale: float
    causal: bool
    window: int | None
    softcap: float | None
    q_block: int
    kv_block: int
    offset: int  # key position of query 0 (Nk - Nq on one device)
    acc_dtype: torch.dtype  # fp32, or fp64 for fp64 inputs
    groups: int  # query heads per key/value head
    use_compile: bool
    dropout: float = 0.0
    dropout_seed: int = 0
    empty_rows: str = "zeros"  # rows with no visible key: stock's rule (bpt.engine.empty_rows)

    @classmethod
    def of(cls, q: Tensor, k: Tensor, *, scale, causal, sliding_window, softcap, q_block, kv_block, compile,
           offset: int, **options) -> "AttentionSpec":
        """The spec of a call on q [B, Hq, Nq, D], k [B, Hkv, Nk, D] (validated inputs); scale None = 1 / sqrt(D);
        options: dropout, dropout_seed, empty_rows."""
        return cls(scale=float(q.shape[-1] ** -0.5 if scale is None else scale), causal=bool(causal),
                   window=sliding_window, softcap=None if softcap is None else float(softcap), q_block=q_block,
                   kv_block=kv_block, offset=offset, acc_dtype=torch.promote_types(q.dtype, torch.float32),
                   groups=q.shape[1] // k.shape[1], use_compile=should_compile(compile, q), **options)


@dataclass(frozen=True)
class KVBlock:
    """One key/value block to visit for a query block, and which masks it needs."""

    j0: int
    j1: int
    causal: bool  # the causal rule hides part of this block
    window: bool  # the sliding-window rule hides part of this block
    padding: bool  # some key of this block is padding (in some batch row)
    segments: bool  # query and key segments differ somewhere in this block


_host_reads_off = 0  # > 0 inside without_host_reads(); process-wide: autograd may run backward on another thread


def host_reads_allowed() -> bool:
    """Whether host code may read tensor data (.tolist(), bool(t), .item()) to skip work: not while torch.compile
    traces, where such a read is a data-dependent guard (a graph break, an error under fullgraph=True), nor inside
    `without_host_reads`. Callers then take the dense path, which computes the same result without looking at the
    data."""
    return not _host_reads_off and not torch.compiler.is_compiling()


@contextlib.contextmanager
def without_host_reads():
    """The dense path everywhere for the duration, as under torch.compile: for tensors that hold no data to read
    (the fake tensors of bpt.gpusim, where a read would only get an oracle's guess)."""
    global _host_reads_off
    _host_reads_off += 1
    try:
        yield
    finally:
        _host_reads_off -= 1


def make_plan(spec: AttentionSpec, b: int, nq: int, nk: int, padding_mask, segment_ids, q_segment_ids=None):
    """-> [(i0, i1, [KVBlock, ...]) per query block].

    padding_mask [B, Nk] bool, segment_ids [B, Nk] (or None); q_segment_ids [B, Nq]: the queries' own segment
    ids, for callers (bpt.sequence_parallel.ring) whose queries are not the last keys; None =
    segment_ids[:, offset:].
    """
    qb, kb, off, window = spec.q_block, spec.kv_block, spec.offset, spec.window
    # Dense (under tracing): no statistics; every block gets the padding / segment masks there are. Blocks the
    # statistics would have skipped add exactly nothing (every score hidden: probability 0, running max unchanged).
    dense = not host_reads_allowed()
    pad_stats = _block_min_max(padding_mask, kb) if padding_mask is not None and not dense else None
    seg_k = _block_min_max(segment_ids, kb) if segment_ids is not None and not dense else None
    if segment_ids is not None and q_segment_ids is None:
        q_segment_ids = segment_ids[:, off:]
    seg_q = _block_min_max(q_segment_ids, qb) if seg_k is not None else None
    plan = []
    for i0 in range(0, nq, qb):
        i1 = min(i0 + qb, nq)
        p0, p1 = i0 + off, i1 + off  # key positions of this block's first / past-last query
        lo = 0 if window is None else max(0, p0 - window + 1)  # first key any row may see
        hi = min(nk, p1) if spec.causal else nk  # past the last key any row may see
        blocks = []
        for j0 in range(lo - lo % kb, hi, kb):
            j1 = min(j0 + kb, nk)
            causal = spec.causal and j1 - 1 > p0
            windowed = window is not None and p1 - 1 - j0 >= window
            padding, segments = dense and padding_mask is not None, dense and segment_ids is not None
            if pad_stats is not None:
                lo_pad, hi_pad = pad_stats
                if not any(row[j0 // kb] for row in hi_pad):
                    continue  # every key of the block is padding, in every batch row
                padding = not all(row[j0 // kb] for row in lo_pad)
            if seg_k is not None:
                visible, segments = _segment_overlap(seg_q, i0 // qb, seg_k, j0 // kb)
                if not visible:
                    continue
            blocks.append(KVBlock(j0, j1, causal, windowed, padding, segments))
        plan.append((i0, i1, blocks))
    return plan


def _block_min_max(x: Tensor, block: int) -> tuple[list, list]:
    """[B, N] -> per-block (min, max) as nested lists [B][ceil(N / block)] (one host sync)."""
    n = x.shape[1]
    if n == 0:
        return [[] for _ in range(x.shape[0])], [[] for _ in range(x.shape[0])]
    x = x.long()
    pad = -n % block
    if pad:  # repeat the last value: it changes no block's min / max
        x = torch.cat([x, x[:, -1:].expand(-1, pad)], dim=1)
    x = x.view(x.shape[0], -1, block)  # [B, nblocks, block]
    stats = torch.stack([x.amin(-1), x.amax(-1)]).tolist()
    return stats[0], stats[1]


def _segment_overlap(seg_q, qi: int, seg_k, kj: int) -> tuple[bool, bool]:
    """(may any pair share a segment, is a segment mask needed) for query block qi x key block kj.

    Disjoint [min, max] ranges prove no query/key pair shares a segment (for any id order); one single
    shared id on both sides proves every pair does.
    """
    (q_min, q_max), (k_min, k_max) = seg_q, seg_k
    visible = needs_mask = False
    for row in range(len(q_min)):
        lo_q, hi_q, lo_k, hi_k = q_min[row][qi], q_max[row][qi], k_min[row][kj], k_max[row][kj]
        if hi_q >= lo_k and hi_k >= lo_q:
            visible = True
        if not lo_q == hi_q == lo_k == hi_k:
            needs_mask = True
    return visible, needs_mask


def block_mask_args(spec: AttentionSpec, b: int, i0: int, i1: int, blk: KVBlock, padding_mask, segment_ids, slopes,
                    q_segment_ids=None) -> tuple:
    """The O(N) pieces one block's mask / bias is built from: the trailing arguments of forward_step and
    backward_step (rel0, causal, window, slopes, pad_k, seg_q, seg_k, softcap, groups, batch).

    slopes: ALiBi slopes [Hkv, G], or a key bias [B, Hkv, G, Nk] (cut here to the block's keys), or None;
    q_segment_ids: as in make_plan (None = the queries are the last keys of segment_ids).
    """
    p0 = i0 + spec.offset  # key position of the block's first query
    pad_k = padding_mask[:, blk.j0:blk.j1] if blk.padding else None  # [B, bk]
    seg_q = None
    if blk.segments:  # [B, bq]
        seg_q = segment_ids[:, p0:p0 + i1 - i0] if q_segment_ids is None else q_segment_ids[:, i0:i1]
    seg_k = segment_ids[:, blk.j0:blk.j1] if blk.segments else None  # [B, bk]
    if slopes is not None and slopes.dim() == 4:  # key bias [B, Hkv, G, Nk] -> [B, Hkv, G, 1, bk]
        slopes = slopes[:, :, :, None, blk.j0:blk.j1]
    return (blk.j0 - p0, blk.causal, spec.window if blk.window else None, slopes, pad_k, seg_q, seg_k,
            spec.softcap, spec.groups, b)


def dropout_keep_mask(spec: AttentionSpec, i0: int, j0: int, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
    """The scaled dropout keep-mask [BH, R, bk] of the block at query row i0 / key j0 (None without dropout).

    Drawn from a generator seeded by (dropout_seed, i0, j0) alone, so backward redraws the same mask
    and no mask is ever stored. Values: 0 (dropped) or 1 / (1 - dropout).
    """
    if not spec.dropout:
        return None
    generator = torch.Generator(device=like.device)
    generator.manual_seed((spec.dropout_seed * 1_000_003 + i0) * 1_000_003 + j0 & (2 ** 63 - 1))
    draw = torch.rand(shape, generator=generator, device=like.device, dtype=like.dtype)
    return (draw >= spec.dropout).to(like.dtype).mul_(1.0 / (1.0 - spec.dropout))
