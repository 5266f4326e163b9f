"""Ulysses attention (bpt.sequence_parallel.ulysses) over real gloo processes vs single-process blockwise_attention, fp32.

One spawn per world size (2, 4) runs every case in a loop; each rank saves its output / gradient shards and the
parent unshards them and compares with blockwise_attention on the unsharded tensors.
"""

import pytest
import torch

from bpt.attention import blockwise_attention
from attention_cases import blockwise_reference, case_inputs, relative_errors
from gloo_processes import results_per_world
from bpt.sequence_parallel.ulysses import (kv_head_ranges, sequence_positions, sequence_shard, sequence_unshard,
                         ulysses_attention)

pytestmark = pytest.mark.usefixtures("one_thread")

WORLDS = (2, 4)
OUT_TOL, GRAD_TOL = 1e-5, 1e-4

# name -> (N, Hq, Hkv, options, q_block, kv_block); options are blockwise_attention's, with padding_mask /
# segment_ids / alibi_slopes / sinks / key_bias given as strings (built in _inputs).
CASES = {
    "causal": (48, 4, 4, {}, 1024, 1024),
    "causal_uneven_small_blocks": (45, 4, 4, {}, 4, 3),
    "full_uneven": (37, 4, 4, {"causal": False}, 1024, 1024),
    "tiny_n": (5, 4, 4, {}, 1024, 1024),  # W = 4: S = 2, rank 3 holds only padding
    "padding": (45, 4, 2, {"padding_mask": "padding"}, 4, 3),
    "padding_full_mqa": (37, 4, 1, {"causal": False, "padding_mask": "padding"}, 1024, 1024),
    "segments": (45, 4, 2, {"segment_ids": "segments"}, 4, 4),
    "window": (45, 4, 2, {"sliding_window": 7}, 3, 4),
    "window_full": (37, 4, 4, {"causal": False, "sliding_window": 9}, 1024, 1024),
    "alibi": (40, 4, 2, {"alibi_slopes": "alibi"}, 4, 3),
    "softcap": (45, 4, 2, {"softcap": 2.0, "scale": 0.9}, 4, 3),
    "sinks": (45, 4, 2, {"sinks": "sinks"}, 4, 5),
    "key_bias": (45, 4, 4, {"key_bias": "key_bias"}, 1024, 1024),
    "gqa": (48, 4, 2, {}, 1024, 1024),
    "mqa": (45, 4, 1, {}, 4, 4),
    "gqa_8_2": (45, 8, 2, {"segment_ids": "segments"}, 4, 4),  # W = 4: each kv head on two ranks
    "gqa_irregular": (45, 12, 3, {"padding_mask": "padding"}, 4, 4),  # a rank's q heads use kv heads 0, 1, 1
    "everything_mqa": (45, 4, 1, {"padding_mask": "padding", "segment_ids": "segments", "sliding_window": 9,
                                  "alibi_slopes": "alibi", "softcap": 3.0, "sinks": "sinks"}, 3, 5),
    # Rows with no visible key (the left-padded start of row 0) as stock's eager kernel computes them.
    "empty_rows_uniform": (45, 4, 2, {"padding_mask": "padding", "softcap": 3.0, "empty_rows": "uniform"}, 4, 3),
}
WRONG_LAYOUT = "causal_uneven_small_blocks"  # also run with the shards in reversed rank order: must fail
SUBGROUP_CASE = "everything_mqa"  # also run on process subgroups (world 4 = two groups of 2)


def _inputs(name):
    """Deterministic global inputs of a case: (q, k, v, dout, options with tensors, N)."""
    return case_inputs(CASES[name], seed=sorted(CASES).index(name) + 1)


def _reversed_shard(x, dim, rank, world, pad_value=0):
    """The contiguous layout with the shards in reversed rank order: wrong for ulysses_attention."""
    return sequence_shard(x, dim, world - 1 - rank, world, pad_value=pad_value)


def _run_case(name, rank, world, shard, group=None):
    q, k, v, dout, options, n = _inputs(name)
    _, _, _, _, q_block, kv_block = CASES[name]
    sinks = options.get("sinks")
    if sinks is not None:
        options["sinks"] = sinks = sinks.clone().requires_grad_()
    # Tokens past N (when W does not divide N) get inputs that WOULD change the result if they were not cut
    # off: large q / k / v values and output gradients.
    qs, ks, vs = (shard(t, 2, rank, world, pad_value=3.0).requires_grad_() for t in (q, k, v))
    out = ulysses_attention(qs, ks, vs, group=group, seq_len=n, q_block=q_block, kv_block=kv_block, **options)
    out.backward(shard(dout, 2, rank, world, pad_value=5.0))
    result = {"out": out.detach(), "dq": qs.grad, "dk": ks.grad, "dv": vs.grad}
    if sinks is not None:
        result["dsinks"] = sinks.grad
    return result


def _worker(rank, world):
    import torch.distributed as dist

    from bpt.sequence_parallel.ulysses import gather_sequence

    results = {name: _run_case(name, rank, world, sequence_shard) for name in CASES}
    results["wrong_layout"] = _run_case(WRONG_LAYOUT, rank, world, _reversed_shard)
    mask = _inputs("padding")[4]["padding_mask"]  # bool: gloo gathers it as uint8
    results["gather"] = {"mask": gather_sequence(sequence_shard(mask, 1, rank, world), 1, seq_len=45)}
    if world == 4:  # two groups of 2 in one world: group ranks are not global ranks (0, 2 and 1, 3)
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        results["subgroup"] = _run_case(SUBGROUP_CASE, rank // 2, 2, sequence_shard, group=groups[rank % 2])
    return results


@pytest.fixture(scope="module")
def ulysses_results(tmp_path_factory):
    """world -> {case -> {key -> [result per rank]}}, spawning each world size once (lazily)."""
    return results_per_world(_worker, tmp_path_factory, "ulysses")


_REFERENCE = {}


def _reference(name):
    if name not in _REFERENCE:
        _REFERENCE[name] = blockwise_reference(*_inputs(name)[:5])
    return _REFERENCE[name]


def _errors(got, ref_name, n):
    return relative_errors(got, _reference(ref_name), sequence_unshard, n)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_ulysses_matches_blockwise(ulysses_results, world, name):
    n = CASES[name][0]
    results = ulysses_results(world)[name]
    for key in ("out", "dq", "dk", "dv"):  # rows past N: exact zeros (outputs, and gradients of pad tokens)
        assert not sequence_unshard(results[key], 2)[:, :, n:].any(), key
    errors = _errors(results, name, n)
    print(f"W={world} {name}: " + " ".join(f"{key}={err:.1e}" for key, err in errors.items()))
    assert errors["out"] <= OUT_TOL, errors
    for key in errors.keys() - {"out"}:
        assert errors[key] <= GRAD_TOL, errors


def test_ulysses_on_subgroups(ulysses_results):
    """group= a subgroup: the all-to-all runs among the group's ranks 0, 2 (and 1, 3), not global ranks."""
    results = ulysses_results(4)["subgroup"]
    for members in ((0, 2), (1, 3)):
        errors = _errors({key: [shards[r] for r in members] for key, shards in results.items()}, SUBGROUP_CASE,
                         CASES[SUBGROUP_CASE][0])
        assert errors["out"] <= OUT_TOL and max(errors.values()) <= GRAD_TOL, (members, errors)


@pytest.mark.parametrize("world", WORLDS)
def test_wrong_layout_fails(ulysses_results, world):
    """Sanity of the harness: shards in reversed rank order give a wrong answer."""
    errors = _errors(ulysses_results(world)["wrong_layout"], WRONG_LAYOUT, CASES[WRONG_LAYOUT][0])
    assert errors["out"] > 1e-2, errors


@pytest.mark.parametrize("world", WORLDS)
def test_gather_sequence(ulysses_results, world):
    want = _inputs("padding")[4]["padding_mask"]
    for got in ulysses_results(world)["gather"]["mask"]:
        assert got.dtype == torch.bool and torch.equal(got, want)


@pytest.mark.parametrize("n", [1, 5, 37, 48])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_roundtrip_and_positions(n, world):
    x = torch.arange(n).view(1, n).expand(3, n) + 100
    shards = [sequence_shard(x, 1, r, world, pad_value=-1) for r in range(world)]
    s = -(-n // world)
    assert all(sh.shape == (3, s) for sh in shards)
    assert torch.equal(sequence_unshard(shards, 1, seq_len=n), x)
    for r, sh in enumerate(shards):
        pos = sequence_positions(s, r, world)
        assert pos.tolist() == list(range(r * s, (r + 1) * s))
        assert torch.equal(sh[0], torch.where(pos < n, pos + 100, -1))


def test_kv_head_ranges():
    assert kv_head_ranges(8, 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]  # plain split
    assert kv_head_ranges(8, 2, 4) == [(0, 1), (0, 1), (1, 2), (1, 2)]  # each kv head on two ranks
    assert kv_head_ranges(4, 1, 4) == [(0, 1)] * 4  # MQA: the one kv head on every rank
    assert kv_head_ranges(12, 3, 4) == [(0, 1), (0, 2), (1, 3), (2, 3)]  # irregular


def test_single_process_matches_blockwise():
    """No process group: blockwise_attention on the local tensors, cut to seq_len and padded back with zeros."""
    q, k, v, _, options, n = _inputs("everything_mqa")
    want = blockwise_attention(q, k, v, **options)
    got = ulysses_attention(*(sequence_shard(t, 2, 0, 1) for t in (q, k, v)), **options)
    assert torch.equal(got, want)
    padded = [torch.cat([t, torch.full_like(t[:, :, :3], 7.0)], 2) for t in (q, k, v)]
    got = ulysses_attention(*padded, seq_len=n, **options)
    assert torch.equal(got[:, :, :n], want) and not got[:, :, n:].any()


def test_the_head_groups_rule_is_asked_of_the_attention_the_rank_runs(monkeypatch):
    """head_groups_rule gets the (q, k) attended (cut to seq_len) and its answer splits the fused backward: one
    query head at a time over the single key / value head gives the gradients of one backward (fp32: within 1e-6)."""
    import bpt.head_groups as head_groups

    split = []
    backward = head_groups._HeadGroupedAttention.backward
    monkeypatch.setattr(head_groups._HeadGroupedAttention, "backward",
                        staticmethod(lambda ctx, dout: (split.append(ctx.groups_now()), backward(ctx, dout))[1]))
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, 40, 16, requires_grad=True) for h in (4, 1, 1))
    asked = []

    def rule(q_seen, k_seen):
        asked.append((tuple(q_seen.shape), tuple(k_seen.shape)))
        return lambda: q_seen.shape[1]

    grads = []
    for head_groups_rule in (None, rule):
        out = ulysses_attention(q, k, v, seq_len=37, causal=True, head_groups_rule=head_groups_rule)
        grads.append(torch.autograd.grad(out, (q, k, v), torch.linspace(-1, 1, out.numel()).view(out.shape)))
    assert asked == [((1, 4, 37, 16), (1, 1, 37, 16))] and split == [4]
    for whole, grouped in zip(*grads):
        assert (whole - grouped).abs().max() <= 1e-6 * whole.abs().max()


@pytest.mark.parametrize("option, match", [({"dropout": 0.1}, "dropout"), ({"seq_len": 9}, "seq_len"),
                                           ({"padding_mask": torch.ones(1, 5, dtype=torch.bool)}, "GLOBAL"),
                                           ({"sinks": torch.zeros(3)}, "sinks")])
def test_invalid_options_raise(option, match):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=match):
        ulysses_attention(q, q, q, **option)
