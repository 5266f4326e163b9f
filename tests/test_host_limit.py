"""bpt.bench.host_limit: where a row's offloaded bytes are over the machine's host memory, the step is simulated again
with as many of the last saved tensors kept on the device as the excess asks (offload_keep_last), deep enough that the
kept ones are the simulated layers' last."""
from __future__ import annotations

import pytest

from bpt.bench.host_limit import host_memory, kept_where_the_host_is_over

GIB = 1 << 30
HIDDEN, SHARE = 4096, 1 << 20  # one kept tensor: 8 GiB
PER_TENSOR = SHARE * HIDDEN * 2


def spec(**overrides) -> dict:
    return {"simulate": "h100-80gb", "side": "patched+offload", "sequence_parallel": 8, "batch_size": 1,
            "dtype": "bf16", "layers": 2, "model_config": {"hidden_size": HIDDEN, "num_hidden_layers": 32},
            "bpt": {"offload_keep_last": 0}, **overrides}


def stand_in(host_without_keeping: int, calls: list):
    """A simulation whose host peak falls by one tensor per kept one (and whose device holds them)."""

    def simulate(spec: dict) -> dict:
        calls.append(spec)
        keep = spec["bpt"]["offload_keep_last"]
        host = host_without_keeping - keep * PER_TENSOR
        row = {"tokens_per_rank": SHARE, "host_peak_bytes": host, "peak_bytes": 50 * GIB + keep * PER_TENSOR}
        row.update(host_memory(spec, host))
        return row

    return simulate


@pytest.mark.parametrize("over_gib,keep", [(1, 1), (8, 1), (9, 2), (30, 4)])
def test_the_excess_in_tensors_kept(over_gib, keep):
    calls = []
    simulate = stand_in((256 + over_gib) * GIB, calls)
    first = simulate(spec())
    row = kept_where_the_host_is_over(spec(), first, simulate)
    assert row["host_fits"] and row["offload_keep_last"] == keep
    assert row["host_bytes_per_machine"] <= row["host_memory_per_machine"] == 2048 * GIB
    assert calls[-1]["layers"] == max(2, keep) and calls[-1]["bpt"]["offload_keep_last"] == keep


def test_rows_that_fit_or_do_not_offload_are_left_as_they_are():
    calls = []
    simulate = stand_in(200 * GIB, calls)
    fitting = simulate(spec())
    assert kept_where_the_host_is_over(spec(), fitting, simulate) is fitting
    over = stand_in(300 * GIB, calls)(spec())
    for other in (spec(side="patched"), spec(bpt={"offload_keep_last": 3})):
        assert kept_where_the_host_is_over(other, over, simulate) is over
    assert len(calls) == 2


def test_a_guess_short_of_the_excess_keeps_more():
    """The kept tensors free less host memory than a whole tensor each (here half): the count grows until it fits."""
    calls = []

    def simulate(spec):
        calls.append(spec)
        host = 300 * GIB - spec["bpt"]["offload_keep_last"] * PER_TENSOR // 2
        return {"tokens_per_rank": SHARE, "host_peak_bytes": host, **host_memory(spec, host)}

    row = kept_where_the_host_is_over(spec(), simulate(spec()), simulate)
    assert row["host_fits"] and row["offload_keep_last"] == 11  # 44 GiB over: 6, then 3, 1 and 1 more
