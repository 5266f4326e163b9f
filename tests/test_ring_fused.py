"""The fused ring's plan of kernel calls (bpt.sequence_parallel.ring_fused.step_calls), checked against the global
mask with no process group: every visible (query, key) pair computed once, nothing hidden, few calls per step."""
import pytest
import torch

from bpt.sequence_parallel.ring import zigzag_positions
from bpt.sequence_parallel.ring_fused import _head_slices, step_calls


def _covered(world, rank, c, seq_len, causal):
    """[2c, 2W * 2c] counts of how often the calls of every step compute each (local query row, (src, key)) pair,
    and the calls of each step."""
    starts = lambda r: (r * c, (2 * world - 1 - r) * c)  # noqa: E731
    counts = torch.zeros(2 * c, world, 2 * c, dtype=torch.long)
    calls = []
    for step in range(world):
        src = (rank - step) % world
        step_list = step_calls(starts(rank), starts(src), c, seq_len, causal)
        calls.append(step_list)
        for r0, r1, j0, j1, is_causal in step_list:
            block = torch.ones(r1 - r0, j1 - j0, dtype=torch.long)
            if is_causal:
                assert r1 - r0 == j1 - j0  # the kernel's causal mask is the square one
                block = block.tril()
            counts[r0:r1, src, j0:j1] += block
    return counts, calls


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("seq_len_short", [0, 1, 5, 13])  # tokens of padding at the end of the layout
def test_calls_cover_exactly_the_visible_pairs(world, causal, seq_len_short):
    c = 4
    seq_len = 2 * world * c - seq_len_short
    if seq_len <= 0:
        return
    for rank in range(world):
        counts, calls = _covered(world, rank, c, seq_len, causal)
        q_pos = zigzag_positions(2 * c, rank, world)  # [2c]
        want = torch.zeros_like(counts)
        for src in range(world):
            k_pos = zigzag_positions(2 * c, src, world)
            visible = (q_pos[:, None] < seq_len) & (k_pos[None, :] < seq_len)
            if causal:
                visible &= k_pos[None, :] <= q_pos[:, None]
            want[:, src] = visible.long()
        assert torch.equal(counts, want), (world, rank)
        if seq_len_short == 0:  # the layout's own calls: one per step, three on the rank's own shard under causality
            assert len(calls[0]) == (3 if causal else 1)
            assert all(len(step) == 1 for step in calls[1:])


@pytest.mark.parametrize("groups,hq,hkv,want", [
    (1, 8, 2, [(slice(None), slice(None))]),
    (2, 8, 2, [(slice(0, 4), slice(0, 1)), (slice(4, 8), slice(1, 2))]),
    (4, 8, 2, [(slice(0, 2), slice(0, 1)), (slice(2, 4), slice(0, 1)), (slice(4, 6), slice(1, 2)),
               (slice(6, 8), slice(1, 2))]),
    (2, 4, 4, [(slice(0, 2), slice(0, 2)), (slice(2, 4), slice(2, 4))]),
])
def test_head_slices(groups, hq, hkv, want):
    assert _head_slices(groups, hq, hkv) == want


def test_head_slices_refuse_a_split_that_cuts_heads():
    with pytest.raises(ValueError, match="head groups"):
        _head_slices(3, 8, 2)
