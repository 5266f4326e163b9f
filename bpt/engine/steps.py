"""Per-block math: fold one key/value block into query rows' online softmax (forward), or add its gradients
(backward); these are the torch.compile candidates. Also how they run: autocast off, reused score buffers, and in
which dtype the block matmuls take their inputs (`low_precision_matmuls`).
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor

from bpt.compile import compilable

# Hidden scores are set to a finite minimum (not -inf) before the row max, and their probabilities to
# exactly 0 after the exp. Before exp, shifted scores are clamped at _EXP_FLOOR: torch's vectorised CPU
# exp takes a ~15x slower path for inputs below about -87 (measured: 2M elements 1.8 ms, 26-90 ms with
# half of them at -90, -200, finfo.min; 8 ms at -inf). exp(-80) = 2e-35 is nothing next to the row
# max's exp(0) = 1, so the clamp changes no result beyond rounding.
_HIDDEN = torch.finfo(torch.float32).min
_EXP_FLOOR = -80.0


def autocast_off(fn):
    """Run an engine Function's forward / backward with autocast off on its first tensor's device: the engine
    chooses every dtype itself, and an enclosing autocast (in forward, or around a backward call) must not
    recast its matmuls to low precision."""
    @functools.wraps(fn)
    def wrapper(ctx, first: Tensor, *args):
        with torch.autocast(device_type=first.device.type, enabled=False):
            return fn(ctx, first, *args)

    return wrapper


class Workspace:
    """Reused buffers for the per-block score-sized temporaries (eager mode).

    Fresh large CPU allocations page-fault on first touch every time; measured on the dev box:
    allocating + filling a 32 MB block costs 28 ms, refilling a reused one 1.5 ms, and a 2048 x 1024
    block's matmul ran 2x faster into a reused output. Disabled (None buffers) under torch.compile.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor | None:
        """A buffer of shape (its contents undefined) in like's dtype / device, or None when disabled."""
        if not self.enabled:
            return None
        numel = 1
        for size in shape:
            numel *= size
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel:
            buf = self.buffers[name] = like.new_empty(numel)
        return buf[:numel].view(shape)


def low_precision_matmuls(k: Tensor) -> bool:
    """Whether the block matmuls take fp16 / bf16 inputs into fp32 products (tensor cores, FlashAttention's
    precision: probabilities and dS rounded to the inputs' dtype before their matmuls): on CUDA. Elsewhere inputs are
    upcast first (the CPU has no such kernel, and a bf16 CPU matmul rounds its output)."""
    return k.is_cuda and k.dtype in (torch.float16, torch.bfloat16)


def _matmul_dtype(qs: Tensor, kb: Tensor) -> torch.dtype:
    return kb.dtype if low_precision_matmuls(kb) else qs.dtype


def _matmul(a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """Batched a @ b in fp32 (fp64 for fp64): low-precision inputs give an fp32 product."""
    if a.dtype not in (torch.float16, torch.bfloat16):
        return torch.bmm(a, b, out=out)
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32, out=out)
    return torch.bmm(a.float(), b.float(), out=out)  # the exact products a tensor core sums (tests on CPU)


def _bias_matmul(bias: Tensor, a: Tensor, b: Tensor, out: Tensor | None = None) -> Tensor:
    """bias + a @ b (bias in the accumulation dtype)."""
    if a.dtype == bias.dtype:
        return torch.baddbmm(bias, a, b, out=out)
    return _matmul(a, b, out).add_(bias)  # (baddbmm has no out_dtype that fake tensors take)


def _add_matmul_(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """acc += a @ b, a cast to b's dtype (acc in the accumulation dtype)."""
    if b.dtype == acc.dtype:
        acc.baddbmm_(a, b)
    else:
        acc.add_(_matmul(a.to(b.dtype), b))


def _view5(s: Tensor, groups: int, batch: int) -> Tensor:
    """[BH, G * bq, bk] -> [B, Hkv, G, bq, bk] (a view)."""
    return s.view(batch, s.shape[0] // batch, groups, s.shape[1] // groups, s.shape[2])


def _add_alibi_(s5: Tensor, slopes: Tensor, rel0: int) -> None:
    """s5 [B, Hkv, G, bq, bk] += slope * (key position - query position), in place.

    `slopes` [Hkv, G], or a key bias block [B, Hkv, G, 1, bk] (from block_mask_args), added as it is.
    """
    if slopes.dim() == 5:
        s5.add_(slopes)
        return
    bq, bk = s5.shape[-2:]
    rel = (torch.arange(bk, device=s5.device, dtype=s5.dtype) + rel0).unsqueeze(0) \
        - torch.arange(bq, device=s5.device, dtype=s5.dtype).unsqueeze(1)  # [bq, bk]
    s5.addcmul_(slopes[:, :, None, None], rel)


def _hidden(bq: int, bk: int, device, rel0: int, causal: bool, window, pad_k, seg_q, seg_k):
    """Which keys one block hides: bool (True = hidden) broadcastable to [B, Hkv, G, bq, bk], or None.

    Built from O(block) pieces only: rel0 = first key position - first query position,
    pad_k [B, bk], seg_q [B, bq] / seg_k [B, bk].
    """
    hidden = None
    if causal or window is not None:
        key = torch.arange(rel0, rel0 + bk, device=device).unsqueeze(0)  # [1, bk] relative to query 0
        query = torch.arange(bq, device=device).unsqueeze(1)  # [bq, 1]
        if causal:
            hidden = key > query  # j > p
        if window is not None:
            hidden = _either(hidden, key + window <= query)  # p - j >= window
    if pad_k is not None:
        hidden = _either(hidden, ~pad_k[:, None, None, None, :])
    if seg_q is not None:
        hidden = _either(hidden, seg_q[:, None, None, :, None] != seg_k[:, None, None, None, :])
    return hidden


def _either(a, b):
    return b if a is None else a | b


@compilable
def forward_step(qs, kb, vb, m, l, acc, s_buf, keep, rel0, causal, window, slopes, pad_k, seg_q, seg_k,
                 softcap, groups, batch):
    """Fold one kv block into the running softmax stats (in place).

    qs [BH, R, D] pre-scaled query rows (R = G * bq), kb [BH, bk, D], vb [BH, bk, Dv];
    m, l [BH, R] running max / sum of exp; acc [BH, R, Dv] running sum of exp(s - m) @ v;
    s_buf: None or a reusable [BH, R, bk] buffer for the scores; keep: None or the block's scaled
    dropout keep-mask [BH, R, bk]; the rest from block_mask_args.
    """
    mm = _matmul_dtype(qs, kb)
    s = _matmul(qs.to(mm), kb.to(mm).transpose(1, 2), out=s_buf)  # [BH, R, bk], accumulation dtype
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    s5 = _view5(s, groups, batch)
    if slopes is not None:
        _add_alibi_(s5, slopes, rel0)
    hidden = _hidden(s5.shape[3], s5.shape[4], s.device, rel0, causal, window, pad_k, seg_q, seg_k)
    if hidden is not None:
        s5.masked_fill_(hidden, _HIDDEN)
    m_new = torch.maximum(m, s.amax(-1))  # [BH, R]
    p = s.sub_(m_new.unsqueeze(-1)).clamp_min_(_EXP_FLOOR).exp_()  # [BH, R, bk], in the scores' memory
    if hidden is not None:
        s5.masked_fill_(hidden, 0.0)
    alpha = (m - m_new).exp_()  # rescales what was accumulated under the old max
    l.mul_(alpha).add_(p.sum(-1))  # the normaliser counts dropped probabilities too
    if keep is not None:
        p.mul_(keep)
    _add_matmul_(acc.mul_(alpha.unsqueeze(-1)), p, vb.to(mm))
    m.copy_(m_new)


@compilable
def backward_step(qs, kb, vb, dob, neg_lse, neg_delta, dq, dk, dv, s_buf, ds_buf, keep, rel0, causal, window,
                  slopes, pad_k, seg_q, seg_k, softcap, groups, batch):
    """Add one block's gradient contributions into dq [BH, R, D], dk [BH, bk, D], dv [BH, bk, Dv].

    dob [BH, R, Dv] output-grad rows; neg_lse = -logsumexp, neg_delta = -rowsum(dO * O), both [BH, R].
    dq is w.r.t. the pre-scaled query (the caller multiplies by scale once); dk and dv sum over the
    query heads of a group through the rows of qs. s_buf / ds_buf: None or reusable [BH, R, bk] buffers.
    keep: None or the forward's dropout keep-mask Z (scaled): dV = (P Z)^T dO, dP = (dO V^T) Z, and
    delta = rowsum(dO * O) still equals rowsum(P * dP) because O was computed with the same Z.
    """
    mm = _matmul_dtype(qs, kb)
    kb, vb, qm, dom = kb.to(mm), vb.to(mm), qs.to(mm), dob.to(mm)  # matmul inputs
    dcap = None
    if softcap is None:
        s = _bias_matmul(neg_lse.unsqueeze(-1), qm, kb.transpose(1, 2), out=s_buf)  # s - lse, [BH, R, bk]
    else:
        tanh = _matmul(qm, kb.transpose(1, 2)).div_(softcap).tanh_()
        s = torch.mul(tanh, softcap, out=s_buf).add_(neg_lse.unsqueeze(-1))
        dcap = tanh.mul_(tanh).neg_().add_(1)  # d(c * tanh(x / c)) / dx = 1 - tanh^2
    s5 = _view5(s, groups, batch)
    if slopes is not None:
        _add_alibi_(s5, slopes, rel0)
    p = s.clamp_min_(_EXP_FLOOR).exp_()  # probabilities, in the scores' memory
    hidden = _hidden(s5.shape[3], s5.shape[4], s.device, rel0, causal, window, pad_k, seg_q, seg_k)
    if hidden is not None:
        s5.masked_fill_(hidden, 0.0)
    # dS = P * (dP - delta), dP = dO @ V^T (times the keep-mask under dropout)
    if keep is None:
        _add_matmul_(dv, p.transpose(1, 2), dom)
        ds = _bias_matmul(neg_delta.unsqueeze(-1), dom, vb.transpose(1, 2), out=ds_buf).mul_(p)
    else:
        ds = _matmul(dom, vb.transpose(1, 2), out=ds_buf).mul_(keep).add_(neg_delta.unsqueeze(-1)).mul_(p)
        _add_matmul_(dv, p.mul_(keep).transpose(1, 2), dom)
    if dcap is not None:
        ds.mul_(dcap)
    _add_matmul_(dq, ds, kb)
    _add_matmul_(dk, ds.transpose(1, 2), qm)
