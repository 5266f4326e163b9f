"""Query rows with no visible key (left-padded queries, with no attention sink): what stock computes there.

Which answer is stock's depends on the kernel stock runs, so it is an option of every attention call
(`empty_rows`):

- "zeros": torch's SDPA (and every fused kernel) outputs 0 for a row whose boolean mask hides every key, with zero
  gradients. The engine's own result for such a row (finish_rows), so nothing more happens.
- "uniform": eager attention adds a mask of the dtype's minimum to the scores. Where every key is hidden, every
  score rounds to that minimum, so softmax is uniform over all Nk keys (hidden and future ones too) and the row
  outputs the mean of v. Softmax's backward then runs at that uniform point: dS = P * (dP - delta) with P = 1 / Nk,
  and dS reaches q and k through the addition (and through the softcap's derivative, if any).
- "uniform_values": eager attention that replaces hidden scores (masked_fill, MPT): the same uniform output, but
  the replaced scores pass no gradient back, so only v gets one.
- "uniform_fused": a float mask of the dtype's minimum in a fused SDPA kernel (Falcon's ALiBi): forward normalises
  by the running sum (the mean of v), but backward recomputes probabilities from the logsumexp, min + log(Nk), which
  rounds to min: every key gets probability 1, not 1 / Nk (measured on torch 2.13's CPU kernel: stock Falcon-ALiBi's
  gradients equal this to 8e-7, and differ from the 1 / Nk form by 1.1x their largest value).

Models read such rows: with the usual labels (-100 on padding) the last left-padded position predicts the first real
token. The forward pass fills the rows from a running sum of v (fill_empty_rows); backward visits every key block for
them (empty_rows_backward_step), so a sequence-parallel caller can feed it key blocks as they arrive.
"""
from __future__ import annotations

import torch
from torch import Tensor

EMPTY_ROWS = ("zeros", "uniform", "uniform_values", "uniform_fused")


def check_empty_rows(mode: str) -> None:
    if mode not in EMPTY_ROWS:
        raise ValueError(f"empty_rows must be one of {EMPTY_ROWS} (how rows with no visible key are computed), "
                         f"got {mode!r}")


def empty_rows_of(lse: Tensor) -> Tensor:
    """Which rows saw no key: logsumexp +inf (finish_rows' mark), same shape as lse."""
    return torch.isinf(lse) & (lse > 0)


def fill_empty_rows(out3: Tensor, lse: Tensor, value_sum: Tensor, n_keys: int, mode: str) -> None:
    """Rows of out3 [BH, G, N, Dv] that saw no key get stock's output: the mean of every value, value_sum [BH, Dv]
    (the sum of v over all n_keys keys, accumulation dtype) / n_keys, unless mode is "zeros"."""
    if mode == "zeros" or n_keys == 0:
        return
    empty = empty_rows_of(lse)  # [BH, G, N]; no host check of it: nothing here reads tensor data
    mean = (value_sum / n_keys).to(out3.dtype)[:, None, None, :]  # [BH, 1, 1, Dv]
    out3.copy_(torch.where(empty.unsqueeze(-1), mean, out3))


def empty_rows_backward_step(qs: Tensor, kb: Tensor, vb: Tensor, dob: Tensor, neg_delta: Tensor, empty: Tensor,
                             n_keys: int, dq: Tensor, dk: Tensor, dv: Tensor, softcap: float | None,
                             mode: str) -> None:
    """Add one key block's gradient contributions of the empty rows (any mode but "zeros").

    qs [BH, R, D] pre-scaled query rows, kb [BH, bk, D], vb [BH, bk, Dv], dob [BH, R, Dv], neg_delta [BH, R]
    (-rowsum(dO * O), O the mean of v), empty [BH, R] bool; dq [BH, R, D] (w.r.t. the pre-scaled query, as
    backward_step's), dk [BH, bk, D], dv [BH, bk, Dv] accumulated in place. Rows not empty are untouched.
    """
    kb, vb = kb.to(qs.dtype), vb.to(qs.dtype)
    p = empty.to(qs.dtype).div_(1 if mode == "uniform_fused" else n_keys)  # [BH, R]: 1 / Nk (or 1) on empty rows
    dv.add_((p.unsqueeze(-1) * dob).sum(1, keepdim=True))  # P^T dO: every key of the block gets the same
    if mode == "uniform_values":
        return
    ds = torch.baddbmm(neg_delta.unsqueeze(-1), dob, vb.transpose(1, 2)).mul_(p.unsqueeze(-1))  # [BH, R, bk]
    if softcap is not None:  # d(c * tanh(x / c)) / dx = 1 - tanh^2, at the row's raw scores
        ds.mul_(torch.bmm(qs, kb.transpose(1, 2)).div_(softcap).tanh_().square_().neg_().add_(1))
    dq.baddbmm_(ds, kb)
    dk.baddbmm_(ds.transpose(1, 2), qs)
