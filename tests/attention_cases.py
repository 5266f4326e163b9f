"""Attention inputs of the sequence-parallel test cases (ring, Ulysses): deterministic global q / k / v / dO and
the masks a case names, to be sharded per rank and compared with single-process blockwise_attention."""
from __future__ import annotations

import torch


def case_inputs(case: tuple, seed: int):
    """case = (N, Hq, Hkv, options, ...) where options name their tensors ("padding", "segments", "alibi", "sinks",
    "key_bias") -> (q, k, v, dout, options with those tensors, N), B = 2, D = 8."""
    n, hq, hkv, options = case[:4]
    gen = torch.Generator().manual_seed(seed)
    b, d = 2, 8
    q = torch.randn(b, hq, n, d, generator=gen)
    k = torch.randn(b, hkv, n, d, generator=gen)
    v = torch.randn(b, hkv, n, d, generator=gen)
    dout = torch.randn(b, hq, n, d, generator=gen)
    options = dict(options)
    if options.get("padding_mask") == "padding":
        mask = torch.rand(b, n, generator=gen) > 0.3
        mask[0, :6] = False  # left padding: the first queries see no key (zero rows) under causal
        mask[1, n - 9:] = False  # right padding
        options["padding_mask"] = mask
    if options.get("segment_ids") == "segments":
        starts = torch.zeros(b, n, dtype=torch.long)
        starts[0, [5, 6, 17, 30]] = 1  # a one-token document, documents across shards
        starts[1, torch.randperm(n - 1, generator=gen)[:6] + 1] = 1
        options["segment_ids"] = starts.cumsum(1)
    if options.get("alibi_slopes") == "alibi":
        options["alibi_slopes"] = torch.tensor([2.0 ** (-8 * (h + 1) / hq) for h in range(hq)])
    if options.get("sinks") == "sinks":
        options["sinks"] = torch.randn(hq, generator=gen)
    if options.get("key_bias") == "key_bias":
        options["key_bias"] = torch.randn(b, hq, n, generator=gen)
    return q, k, v, dout, options, n


def blockwise_reference(q, k, v, dout, options) -> dict:
    """Single-process blockwise_attention on the global inputs: out and the gradients of q / k / v (and sinks)."""
    from bpt.attention import blockwise_attention

    options = dict(options)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    if "sinks" in options:
        options["sinks"] = options["sinks"].clone().requires_grad_()
    out = blockwise_attention(q, k, v, **options)
    out.backward(dout)
    reference = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    if "sinks" in options:
        reference["dsinks"] = options["sinks"].grad
    return reference


def relative_errors(per_rank: dict, reference: dict, unshard, n: int) -> dict:
    """{key: max abs error / max abs of the reference}: per-rank shards joined by unshard(shards, dim, seq_len=n);
    the sinks' gradient (one share per rank) summed over the ranks."""
    errors = {}
    for key, want in reference.items():
        got = (torch.stack(per_rank[key]).sum(0) if key == "dsinks"
               else unshard(per_rank[key], 2, seq_len=n)).float()
        errors[key] = ((got - want).abs().max() / want.abs().max()).item()
    return errors
