"""Query rows: their running online-softmax state, how it starts (from the sinks) and ends, and backward's inputs.

Layout: query heads are grouped under their kv head, q3 [BH, G, N, D] (BH = batch * kv heads, G = query heads per
kv head); a query block of bq rows is handled as R = G * bq rows [BH, R, ...], so the G query heads that share a
kv head go through one matmul with it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from bpt.engine.plan import AttentionSpec

_MAX_INIT = torch.finfo(torch.float32).min  # running-max start: finite, so no inf - inf


def scaled_query_rows(q3: Tensor, i0: int, i1: int, spec: AttentionSpec) -> Tensor:
    """Query rows i0:i1 times scale, [BH, G * bq, D] in the accumulation dtype (a fresh copy)."""
    blk = q3[:, :, i0:i1]
    return (blk.to(spec.acc_dtype) * spec.scale).reshape(blk.shape[0], -1, blk.shape[-1])


def _group_rows(x3: Tensor, i0: int, i1: int, dtype: torch.dtype) -> Tensor:
    """[BH, G, N, E] -> rows i0:i1 of every group as [BH, G * (i1 - i0), E] in dtype."""
    blk = x3[:, :, i0:i1]
    return blk.to(dtype).reshape(blk.shape[0], -1, blk.shape[-1])


def sink_rows(sinks: Tensor | None, b: int, hkv: int, g: int, dtype: torch.dtype) -> Tensor | None:
    """sinks [Hq] -> [BH, G, 1] in dtype (query head h = kv head * G + group index), or None."""
    if sinks is None:
        return None
    return sinks.detach().to(dtype).view(1, hkv, g).expand(b, hkv, g).reshape(b * hkv, g, 1)


def start_rows(like: Tensor, bh: int, g: int, bq: int, dv: int, dtype: torch.dtype,
               sinks3: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Fresh running stats of R = G * bq rows: (m [BH, R] running max, l [BH, R] running sum of exp(s - m),
    acc [BH, R, Dv] running sum of exp(s - m) @ v), in dtype on like's device.

    sinks3 [BH, G, 1] (from sink_rows) or None. The sink is a virtual first key with value 0: the rows start
    from it, m = sink and l = exp(sink - m) = 1, so it joins the normaliser without an extra pass.
    """
    rows = g * bq
    if sinks3 is None:
        m = like.new_full((bh, rows), _MAX_INIT, dtype=dtype)
        l = like.new_zeros((bh, rows), dtype=dtype)
    else:
        m = sinks3.expand(bh, g, bq).reshape(bh, rows).clone()
        l = like.new_ones((bh, rows), dtype=dtype)
    acc = like.new_zeros((bh, rows, dv), dtype=dtype)
    return m, l, acc


def finish_rows(m: Tensor, l: Tensor, acc: Tensor, out3: Tensor, lse: Tensor, r0: int, r1: int) -> None:
    """Running stats of rows r0:r1 -> out3[:, :, r0:r1] ([BH, G, N, Dv]) and lse[:, :, r0:r1] ([BH, G, N]).

    A row with no visible key (l = 0) gets output 0 and logsumexp +inf: backward's exp(s - lse) is then exactly
    0 there, hence zero gradients. With sinks l >= exp(sink - m) > 0, so no row is empty: a row with no visible
    key gives acc / 1 = 0 and lse = sink (finite); backward's hidden-score masking keeps its q/k/v gradients zero.
    """
    empty = l == 0
    out = acc / l.masked_fill(empty, 1.0).unsqueeze(-1)  # [BH, R, Dv]
    lse_rows = (m + l.log()).masked_fill_(empty, float("inf"))  # [BH, R]
    bh, g = lse.shape[:2]
    out3[:, :, r0:r1] = out.view(bh, g, r1 - r0, out.shape[-1])
    lse[:, :, r0:r1] = lse_rows.view(bh, g, r1 - r0)


def backward_rows(do3: Tensor, o3: Tensor, lse: Tensor, r0: int, r1: int,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """What backward_step needs of rows r0:r1: (dO rows [BH, R, Dv], -logsumexp [BH, R], -delta [BH, R]).

    do3, o3 [BH, G, N, Dv] output gradient and output; lse [BH, G, N]; delta = rowsum(dO * O).
    """
    dob = _group_rows(do3, r0, r1, dtype)
    neg_lse = -lse[:, :, r0:r1].reshape(dob.shape[0], -1)
    neg_delta = -(dob * _group_rows(o3, r0, r1, dtype)).sum(-1)
    return dob, neg_lse, neg_delta


class SinkGrad:
    """The gradient of sinks [Hq], summed over query blocks as they are visited:
    d sink_h = -sum over rows (and batch) of exp(sink_h - lse) * rowsum(dO * O)."""

    def __init__(self, sinks: Tensor, b: int, hkv: int, g: int, dtype: torch.dtype):
        self.logits = sink_rows(sinks, b, hkv, g, dtype)  # [BH, G, 1]
        self.acc = torch.zeros((b * hkv, g), dtype=dtype, device=sinks.device)  # [BH, G]
        self.batch, self.dtype = b, sinks.dtype

    def add_rows(self, neg_lse: Tensor, neg_delta: Tensor) -> None:
        """Add the share of R = G * bq rows; neg_lse, neg_delta [BH, R] as from backward_rows."""
        bh, g = self.acc.shape
        p_sink = (self.logits + neg_lse.view(bh, g, -1)).exp_()  # [BH, G, bq], p_sink = exp(sink - lse)
        self.acc.add_((p_sink * neg_delta.view(bh, g, -1)).sum(-1))

    def total(self) -> Tensor:
        """d sinks [Hq] in the sinks' dtype."""
        return self.acc.view(self.batch, -1).sum(0).to(self.dtype)
