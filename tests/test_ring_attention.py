"""Ring attention (bpt.sequence_parallel.ring) over real gloo processes vs single-process blockwise_attention, fp32.

One spawn per world size (2, 3, 4) runs every case in a loop; each rank saves its output / gradient shards
and the parent unshards them and compares with blockwise_attention on the unsharded tensors. Cases with no mask but
causality take the fused path (bpt.sequence_parallel.ring_fused: torch's kernel per pair of chunks); each rank also
says which cases did.
"""
import math

import pytest
import torch

from bpt.attention import blockwise_attention
from attention_cases import blockwise_reference, case_inputs, relative_errors
from gloo_processes import results_per_world
from bpt.sequence_parallel.ring import ring_attention, zigzag_positions, zigzag_shard, zigzag_unshard

pytestmark = pytest.mark.usefixtures("one_thread")

WORLDS = (1, 2, 3, 4)
OUT_TOL, GRAD_TOL = 1e-5, 1e-4

# name -> (N, Hq, Hkv, options, q_block, kv_block); options are blockwise_attention's, with
# padding_mask / segment_ids / alibi_slopes / sinks given as the strings "padding", "segments", "alibi", "sinks".
CASES = {
    "causal": (37, 4, 4, {}, 1024, 1024),
    "causal_gqa_small_blocks": (45, 4, 2, {}, 3, 2),
    "causal_divisible": (48, 4, 2, {}, 5, 7),
    "causal_tiny_n": (5, 4, 2, {}, 1024, 1024),
    "full_mqa": (37, 4, 1, {"causal": False}, 4, 3),
    "padding": (45, 4, 2, {"padding_mask": "padding"}, 4, 3),
    "padding_full": (37, 4, 4, {"causal": False, "padding_mask": "padding"}, 1024, 1024),
    "segments": (45, 4, 2, {"segment_ids": "segments"}, 4, 4),
    "segments_full_mqa": (37, 4, 1, {"causal": False, "segment_ids": "segments"}, 3, 5),
    "window_3": (45, 4, 2, {"sliding_window": 3}, 2, 3),
    "window_13": (45, 4, 4, {"sliding_window": 13}, 1024, 1024),
    "window_30": (45, 4, 1, {"sliding_window": 30}, 4, 4),
    "window_7_full": (37, 4, 2, {"causal": False, "sliding_window": 7}, 3, 3),
    "alibi": (37, 4, 2, {"alibi_slopes": "alibi"}, 4, 3),
    "alibi_window_full": (45, 4, 4, {"causal": False, "alibi_slopes": "alibi", "sliding_window": 10}, 5, 4),
    "softcap": (45, 4, 2, {"softcap": 2.0, "scale": 0.9}, 4, 3),
    "everything_gqa": (45, 4, 2, {"padding_mask": "padding", "segment_ids": "segments", "sliding_window": 9,
                                   "alibi_slopes": "alibi", "softcap": 3.0}, 3, 5),
    "everything_mqa_full": (37, 4, 1, {"causal": False, "padding_mask": "padding", "segment_ids": "segments",
                                        "alibi_slopes": "alibi", "softcap": 3.0}, 4, 4),
    "sinks": (45, 4, 2, {"sinks": "sinks"}, 4, 5),
    "sinks_everything": (45, 4, 2, {"padding_mask": "padding", "segment_ids": "segments", "sliding_window": 9,
                                    "alibi_slopes": "alibi", "softcap": 3.0, "sinks": "sinks"}, 3, 5),
    # Rows with no visible key (the left-padded start of row 0) as stock's eager kernels compute them.
    "empty_rows_uniform": (45, 4, 2, {"padding_mask": "padding", "softcap": 3.0, "empty_rows": "uniform"}, 4, 3),
    "empty_rows_uniform_values": (37, 4, 1, {"padding_mask": "padding", "alibi_slopes": "alibi",
                                             "empty_rows": "uniform_values"}, 1024, 1024),
    "empty_rows_uniform_fused": (45, 4, 4, {"padding_mask": "padding", "segment_ids": "segments",
                                            "empty_rows": "uniform_fused"}, 3, 5),
}
FUSED = {"causal", "causal_gqa_small_blocks", "causal_divisible", "causal_tiny_n", "full_mqa", "causal_long"}
CASES["causal_long"] = (250, 8, 2, {}, 1024, 1024)  # bf16 against stock: enough rows for the error to settle
WRONG_LAYOUT = "causal_gqa_small_blocks"  # also run with a contiguous (not zigzag) split: must fail
SUBGROUP_CASE = "everything_gqa"  # also run on process subgroups (world 4 = two rings of 2)


def _inputs(name):
    """Deterministic global inputs of a case: (q, k, v, dout, options with tensors, N)."""
    return case_inputs(CASES[name], seed=sorted(CASES).index(name) + 1)


def _contiguous_shard(x, dim, rank, world, pad_value=0):
    """A plain contiguous split, padded like zigzag_shard: the wrong layout for ring_attention."""
    padded = zigzag_unshard([zigzag_shard(x, dim, r, world, pad_value=pad_value) for r in range(world)], dim)
    n = padded.shape[dim] // world
    return padded.narrow(dim, rank * n, n)


def _run_case(name, rank, world, shard, group=None, dtype=torch.float32, head_groups=None):
    q, k, v, dout, options, n = _inputs(name)
    q, k, v, dout = (t.to(dtype) for t in (q, k, v, dout))
    _, _, _, _, q_block, kv_block = CASES[name]
    sinks = options.get("sinks")
    if sinks is not None:
        options["sinks"] = sinks = sinks.clone().requires_grad_()
    # Tokens past N (when 2W does not divide N) get inputs that WOULD change the result if seq_len did not
    # hide them: real-looking keys (padding_mask True, segment 0), large q/k/v values and output gradients.
    local = {key: shard(value, 1, rank, world, pad_value=1 if key == "padding_mask" else 0)
             if key in ("padding_mask", "segment_ids") else value for key, value in options.items()}
    qs, ks, vs = (shard(t, 2, rank, world, pad_value=3.0).requires_grad_() for t in (q, k, v))
    out = ring_attention(qs, ks, vs, group=group, seq_len=n, q_block=q_block, kv_block=kv_block,
                         head_groups=head_groups, **local)
    out.backward(shard(dout, 2, rank, world, pad_value=5.0))
    assert out.dtype == dtype and qs.grad.dtype == ks.grad.dtype == vs.grad.dtype == dtype
    result = {"out": out.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}
    if sinks is not None:
        result["dsinks"] = sinks.grad  # this rank's share
    return result


ATTENTION_ONCE = "causal_gqa_small_blocks"


def _checkpointed_case(name, rank, world, keep):
    """The fused ring inside a non-reentrant checkpoint whose recompute takes what the forward kept (keep True,
    bpt.attention_once) or runs the ring again (False); with the bytes it sent over the step."""
    from torch.utils.checkpoint import checkpoint

    from bpt import attention_once
    from bpt.sequence_parallel import traffic

    q, k, v, dout, _, n = _inputs(name)
    qs, ks, vs = (zigzag_shard(t, 2, rank, world).requires_grad_() for t in (q, k, v))
    traffic.reset()
    out = checkpoint(lambda a, b, c: ring_attention(a, b, c, seq_len=n).mul(1.0), qs, ks, vs, use_reentrant=False,
                     context_fn=attention_once.context_fn(attention_once.KeepRule(keep, 1)))
    out.backward(zigzag_shard(dout, 2, rank, world))
    return {"out": out.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad,
            "sent": torch.tensor(traffic.sent()["ring_p2p"])}


def _worker(rank, world):
    import torch.distributed as dist

    import bpt.sequence_parallel.ring as ring_module

    fused, inner = [], ring_module.fused_ring_attention
    ring_module.fused_ring_attention = lambda *args, **kwargs: fused.append(1) or inner(*args, **kwargs)
    results, paths = {}, {}
    for name in CASES:
        before = len(fused)
        results[name] = _run_case(name, rank, world, zigzag_shard)
        paths[name] = len(fused) - before
    results["fused_calls"] = paths
    # the fused backward a query head at a time (the head-group rule asks for 4 groups of the 4 query heads)
    results["head_groups"] = _run_case("causal_gqa_small_blocks", rank, world, zigzag_shard, head_groups=lambda: 4)
    results["bf16_fused"] = _run_case("causal_long", rank, world, zigzag_shard, dtype=torch.bfloat16)
    for keep in (True, False):
        results[f"attention_once_{keep}"] = _checkpointed_case(ATTENTION_ONCE, rank, world, keep)
    results["wrong_layout"] = _run_case(WRONG_LAYOUT, rank, world, _contiguous_shard)
    results["bf16"] = _run_case(SUBGROUP_CASE, rank, world, zigzag_shard, dtype=torch.bfloat16)
    if world == 4:  # two rings of 2 in one world: group ranks are not global ranks (0, 2 and 1, 3)
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        results["subgroup"] = _run_case(SUBGROUP_CASE, rank // 2, 2, zigzag_shard, group=groups[rank % 2])
    return results


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory):
    """world -> {case -> {key -> [shard per rank]}}, spawning each world size once (lazily)."""
    return results_per_world(_worker, tmp_path_factory, "ring")


_REFERENCE = {}


def _reference(name):
    if name not in _REFERENCE:
        _REFERENCE[name] = blockwise_reference(*_inputs(name)[:5])
    return _REFERENCE[name]


def _errors(got_shards, ref_name, n):
    return relative_errors(got_shards, _reference(ref_name), zigzag_unshard, n)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_ring_matches_blockwise(ring_results, world, name):
    n = CASES[name][0]
    shards = ring_results(world)[name]
    for key, got in shards.items():  # rows past N: exact zeros (outputs, and gradients of pad tokens)
        assert key == "dsinks" or not zigzag_unshard(got, 2)[:, :, n:].any(), key
    errors = _errors(shards, name, n)
    print(f"W={world} {name}: " + " ".join(f"{key}={err:.1e}" for key, err in errors.items()))
    assert errors["out"] <= OUT_TOL, errors
    for key in ("dq", "dk", "dv", "dsinks") if "sinks" in name else ("dq", "dk", "dv"):
        assert errors[key] <= GRAD_TOL, errors


def test_ring_on_subgroups(ring_results):
    """group= a subgroup: the ring's neighbours are the group's ranks 0, 2 (and 1, 3), not global ranks."""
    results = ring_results(4)["subgroup"]
    for members in ((0, 2), (1, 3)):
        errors = _errors({key: [shards[r] for r in members] for key, shards in results.items()}, SUBGROUP_CASE,
                         CASES[SUBGROUP_CASE][0])
        assert errors["out"] <= OUT_TOL and max(errors.values()) <= GRAD_TOL, (members, errors)


@pytest.mark.parametrize("world", WORLDS[1:])
def test_bf16_no_worse_than_one_device(ring_results, world):
    """bf16 inputs: error vs the fp32 reference about that of single-device blockwise_attention in bf16."""
    q, k, v, dout, options, n = _inputs(SUBGROUP_CASE)
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    out = blockwise_attention(q, k, v, **options)
    out.backward(dout.to(torch.bfloat16))
    ref = _reference(SUBGROUP_CASE)
    one_device = {key: ((got.float() - ref[key]).abs().max() / ref[key].abs().max()).item()
                  for key, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}
    ring = _errors(ring_results(world)["bf16"], SUBGROUP_CASE, n)
    print(f"bf16 W={world} ring {ring} one device {one_device}")
    for key in ring:
        assert ring[key] <= 1.5 * one_device[key] + 1e-3, (key, ring, one_device)


@pytest.mark.parametrize("world", WORLDS)
def test_fused_path_where_no_mask_but_causality(ring_results, world):
    """Unmasked and causal cases take torch's fused kernel (one call of ring_attention each), every masked one the
    blockwise engine; the fused cases are exact to 1e-5 in outputs and gradients, and so with the backward one query
    head at a time."""
    calls = ring_results(world)["fused_calls"]
    for name in CASES:
        assert calls[name] == [1 if name in FUSED else 0] * world, name
    for name in FUSED:
        errors = _errors(ring_results(world)[name], name, CASES[name][0])
        assert max(errors.values()) <= 1e-5, (name, errors)
    grouped = ring_results(world)["head_groups"]
    errors = _errors(grouped, "causal_gqa_small_blocks", CASES["causal_gqa_small_blocks"][0])
    assert max(errors.values()) <= 1e-5, errors


@pytest.mark.parametrize("world", WORLDS)
def test_fused_ring_attention_once(ring_results, world):
    """In a checkpointed layer, the recompute takes the forward's output and logsumexp (bpt.attention_once): the
    gradients are bitwise those of recomputing the ring, and the recompute sends nothing (one forward's hops fewer)."""
    kept, recomputed = ring_results(world)["attention_once_True"], ring_results(world)["attention_once_False"]
    for key in ("out", "dq", "dk", "dv"):
        assert all(torch.equal(a, b) for a, b in zip(kept[key], recomputed[key])), key
    errors = _errors({key: kept[key] for key in ("out", "dq", "dk", "dv")}, ATTENTION_ONCE, CASES[ATTENTION_ONCE][0])
    assert max(errors.values()) <= 1e-5, errors
    n, hkv = CASES[ATTENTION_ONCE][0], CASES[ATTENTION_ONCE][2]
    shard = 2 * 2 * hkv * (2 * -(-n // (2 * world))) * 8 * 4  # k and v of a rank's shard: B 2, D 8, fp32
    for sent_kept, sent_again in zip(kept["sent"], recomputed["sent"]):
        assert int(sent_again) - int(sent_kept) == (world - 1) * shard


@pytest.mark.parametrize("world", WORLDS)
def test_fused_bf16_no_worse_than_stock(ring_results, world):
    """bf16 on the fused path: error vs the fp32 reference no worse than stock's (torch's SDPA in bf16 on one
    device; each key shard's partial output and gradients are rounded to bf16 once, as the kernel rounds its own)."""
    q, k, v, dout, options, n = _inputs("causal_long")
    q, k, v = (t.to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout.to(torch.bfloat16))
    ref = _reference("causal_long")
    stock = {key: ((got.float() - ref[key]).abs().max() / ref[key].abs().max()).item()
             for key, got in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}
    ring = _errors(ring_results(world)["bf16_fused"], "causal_long", n)
    print(f"bf16 fused W={world} ring {ring} stock {stock}")
    for key in ring:
        assert ring[key] <= 1.25 * stock[key], (key, ring, stock)


@pytest.mark.parametrize("world", WORLDS[1:])
def test_wrong_layout_fails(ring_results, world):
    """Sanity of the harness: a contiguous split fed to ring_attention gives a wrong answer."""
    errors = _errors(ring_results(world)["wrong_layout"], WRONG_LAYOUT, CASES[WRONG_LAYOUT][0])
    assert errors["out"] > 1e-2, errors


@pytest.mark.parametrize("n", [1, 5, 37, 48])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_zigzag_roundtrip_and_positions(n, world):
    x = torch.arange(n).view(1, n).expand(3, n) + 100
    shards = [zigzag_shard(x, 1, r, world, pad_value=-1) for r in range(world)]
    c = math.ceil(n / (2 * world))
    assert all(s.shape == (3, 2 * c) for s in shards)
    assert torch.equal(zigzag_unshard(shards, 1, seq_len=n), x)
    for r, s in enumerate(shards):
        pos = zigzag_positions(2 * c, r, world)
        assert torch.equal(s[0], torch.where(pos < n, pos + 100, -1))
        assert pos.tolist() == list(range(r * c, r * c + c)) + list(range((2 * world - 1 - r) * c, (2 * world - r) * c))


@pytest.mark.parametrize("option", [{"key_bias": torch.zeros(1, 2, 4)}, {"dropout": 0.1}])
def test_unsupported_options_raise(option):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=next(iter(option))):
        ring_attention(q, q, q, **option)


def test_odd_local_length_raises():
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="even length"):
        ring_attention(q, q, q)
