"""The benchmark's sequence-parallel mode: end to end on the tiny preset (real gloo groups of 1 and 2 processes,
ring and Ulysses), its traffic counter against the algorithm's formula, its launcher's failures and its errors.

Memory and speed are never asserted (docs/DESIGN.md principle 7); bytes sent are: they are counted, not timed.
"""
from __future__ import annotations

import json

import pytest

from bpt.bench import main
from bpt.bench.report import GOALS_HEADER, format_sp_report, summarize_sp
from bpt.bench.sequence_parallel import theory_bytes
from bpt.bench.workers import run_ranks

# 129: padded by both layouts (ring: to 2W chunks, the key mask travels with K/V; Ulysses: to W shards).
SEQ_LENS = [129, 256]
WORLDS = [1, 2]
MODES = ["ring", "ulysses"]
SMALL_BLOCKS = ["--q_block", "64", "--kv_block", "64", "--mlp_chunk", "64", "--loss_chunk", "64"]


# One worker runs this module under `--dist loadgroup`: its module fixtures (a bench sweep, ~1 minute each) are made
# once, not once per worker.
pytestmark = pytest.mark.xdist_group("bench_sp_report")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One sequence-parallel sweep over the tiny preset with LoRA, shared by the tests (the memory probe, the
    only single-process run of this mode, is left out: it costs a process start)."""
    output = tmp_path_factory.mktemp("bench_sp") / "tiny_sp.json"
    main(["--model", "tiny", "--lora", "--sequence_parallel", *map(str, WORLDS), "--sp_mode", *MODES,
          "--seq_lens", *map(str, SEQ_LENS), "--steps", "1", "--torch_threads", "1", "--device", "cpu",
          "--timeout", "240", "--output", str(output), *SMALL_BLOCKS],
         runner=lambda spec: {"ok": False, "error": "skipped (tests/test_bench.py checks the probe)"})
    return json.loads(output.read_text())


def test_every_run_ok_with_its_fields(report):
    env = report["environment"]
    assert env["sequence_parallel"] == WORLDS and env["sp_mode"] == MODES and env["backend"] == "gloo"
    assert env["lora"] and env["threads"] == 1 and env["gradient_checkpointing"]
    assert {(r["mode"], r["world"], r["seq_len"]) for r in report["runs"]} == \
        {(m, w, n) for m in MODES for w in WORLDS for n in SEQ_LENS}
    for run in report["runs"]:
        assert run["ok"], run
        assert len(run["step_mib_per_rank"]) == len(run["sent_bytes_per_rank"]) == run["world"]
        assert run["step_mib"] == max(run["step_mib_per_rank"]) > 0
        assert run["median_s"] > 0 and run["tokens_per_s"] > 0 and run["grad_allreduce_payload_bytes"] > 0
    for row in report["summary"]["rows"]:
        for key in ("step_mib", "step_s", "tok_s", "sent_mib", "theory_mib", "sent_over_theory"):
            assert row[key] is not None, (key, row)
    growth = report["summary"]["growth"]
    for mode in MODES:
        assert set(growth[mode]["mib_per_1k_tokens"]) == {"1", "2"}
        assert growth[mode]["ratio_to_sp1"]["1"] == 1.0
    assert {"ring_growth_ratio_sp2", "ulysses_growth_ratio_sp2", "traffic_vs_theory"} <= set(report["summary"]["targets"])


def test_bytes_sent_match_the_algorithm(report):
    for run in report["runs"]:
        if run["world"] == 1:
            assert run["sent_bytes"] == run["theory_bytes"] == 0
            continue
        assert run["theory_bytes"] > 0
        for sent, theory in zip(run["sent_bytes_per_rank"], run["theory_bytes_per_rank"]):
            assert sent == pytest.approx(theory, rel=0.10), run
    assert report["summary"]["targets"]["traffic_vs_theory"]["met"] is True


def test_sharded_loss_is_the_one_process_loss(report):
    """Same seeded model and tokens: every size and mode gives the loss of N = 1 (the group's total)."""
    for seq_len in SEQ_LENS:
        losses = [r["loss"] for r in report["runs"] if r["seq_len"] == seq_len]
        assert max(losses) == pytest.approx(min(losses), rel=1e-5)


@pytest.fixture(scope="module")
def tp_report(tmp_path_factory):
    """The same sweep (its padded length) with every layer split over 2 processes too: TP 2 alone (2 processes) and
    TP 2 x SP 2 (4)."""
    output = tmp_path_factory.mktemp("bench_tp") / "tiny_tp.json"
    main(["--model", "tiny", "--lora", "--sequence_parallel", *map(str, WORLDS), "--tensor_parallel", "2",
          "--sp_mode", *MODES, "--seq_lens", str(SEQ_LENS[0]), "--steps", "1", "--torch_threads", "1",
          "--device", "cpu", "--timeout", "240", "--output", str(output), *SMALL_BLOCKS],
         runner=lambda spec: {"ok": False, "error": "skipped (tests/test_bench.py checks the probe)"})
    return json.loads(output.read_text())


def test_tensor_parallel_groups_train_the_same_model(report, tp_report):
    """TP 2 x SP N runs N x 2 processes (per-rank memory, each rank's weights included); the seeded model and tokens
    give the loss of one process, and the sequence-parallel bytes are the formula's with each rank's own heads
    (the tiny preset's 4 query / 2 KV heads: 2 / 1 per rank)."""
    assert tp_report["environment"]["tensor_parallel"] == [2]
    whole = {(r["mode"], r["seq_len"]): r["loss"] for r in report["runs"] if r["world"] == 1}
    assert {(r["mode"], r["world"], r["seq_len"]) for r in tp_report["runs"]} == \
        {(m, w, SEQ_LENS[0]) for m in MODES for w in WORLDS}
    for run in tp_report["runs"]:
        assert run["ok"] and run["tensor_parallel"] == 2, run
        assert len(run["step_mib_per_rank"]) == len(run["peak_mib_per_rank"]) == 2 * run["world"]
        assert run["loss"] == pytest.approx(whole[run["mode"], run["seq_len"]], rel=1e-5)
        for sent, theory in zip(run["sent_bytes_per_rank"], run["theory_bytes_per_rank"]):
            assert sent == pytest.approx(theory, rel=0.10) if run["world"] > 1 else sent == theory == 0, run
        untouched = next(r for r in report["runs"] if (r["mode"], r["world"], r["seq_len"]) ==
                         (run["mode"], run["world"], run["seq_len"]))
        if run["world"] > 1:  # half the heads per rank: half the K / V bytes of the same ring / all-to-all
            assert run["theory_bytes"] < untouched["theory_bytes"]
    assert {row["tp"] for row in tp_report["summary"]["rows"]} == {2}
    assert "TP" in format_sp_report(tp_report["summary"]).splitlines()[0]


def test_theory_formula_by_hand():
    # ring, W=2, N=8 (c=2, n=4, no padding), B=1, Hkv=1, D=2, fp32, 1 layer, no checkpointing:
    # K/V shard 1*1*4*2*2 elements = 64 B; forward 1 hop, backward 1 hop + fp32 dK/dV 2 hops of 64 B
    shape = dict(batch=1, layers=1, q_heads=2, kv_heads=1, head_dim=2, elem=4)
    assert theory_bytes("ring", world=2, rank=0, seq_len=8, checkpointing=False, **shape) == 64 + 64 + 2 * 64
    # checkpointing runs the forward twice; N=7 pads to 8: the 4-byte key mask travels with each K/V hop
    assert theory_bytes("ring", world=2, rank=0, seq_len=7, checkpointing=True, **shape) == 2 * 68 + 68 + 2 * 64
    # ... unless the forward kept its attention (bpt.attention_once): ring's recompute then sends nothing
    assert theory_bytes("ring", world=2, rank=0, seq_len=7, checkpointing=True, attention_kept=True,
                        **shape) == 68 + 68 + 2 * 64
    # ulysses, W=2, N=8 (S=4), Hq=2 -> Hl=1, Hkv=2 -> 1 kv head per rank: q+k+v to the other rank 4*(2+4)*4 B,
    # the output 4*2*4 B; backward the same two
    shape["kv_heads"] = 2
    assert theory_bytes("ulysses", world=2, rank=1, seq_len=8, checkpointing=False, **shape) == 2 * (96 + 32)
    # Ulysses' recompute moves q / k / v and the output again, kept attention or not
    assert theory_bytes("ulysses", world=2, rank=1, seq_len=8, checkpointing=True, attention_kept=True,
                        **shape) == 2 * (96 + 32) + 96 + 32
    assert theory_bytes("ring", world=1, rank=0, seq_len=8, checkpointing=True, **shape) == 0


@pytest.mark.parametrize("argv, message", [
    (["--sequence_parallel", "0", "2"], "--sequence_parallel sizes must be >= 1"),
    (["--sequence_parallel", "3", "--sp_mode", "ulysses"], "every --sequence_parallel size must divide them; got (N, T) = [(3, 1)]"),
    (["--sequence_parallel", "2", "--find_max", "--max_len", "512"], "--find_max does not combine"),
    (["--sequence_parallel", "2", "--sides", "stock"], "runs the patched model only"),
    (["--sequence_parallel", "2", "--sp_mode", "bogus"], "invalid choice"),
    (["--tensor_parallel", "2", "--lora"], "--tensor_parallel needs --sequence_parallel"),
    (["--sequence_parallel", "1", "--tensor_parallel", "2"], "add --lora"),
    (["--sequence_parallel", "1", "--tensor_parallel", "3", "--lora"], "--tensor_parallel 3:"),
    (["--sequence_parallel", "4", "--tensor_parallel", "2", "--sp_mode", "ulysses", "--lora"],
     "got (N, T) = [(4, 2)]"),
])
def test_bad_input_fails_before_any_work(argv, message, capsys):
    def runner(*_):
        raise AssertionError("no work may start on bad input")

    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "tiny", "--device", "cpu", *argv], runner=runner, group_runner=runner)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


def test_failed_or_late_rank_ends_the_group():
    spec = {"task": "no_such_task", "malloc": "mmap"}
    failed = run_ranks(spec, 2, timeout=120)
    assert not failed["ok"] and failed["error"].startswith("rank ") and "no_such_task" in failed["error"]
    late = run_ranks(spec, 2, timeout=0.01)  # still starting python when the clock runs out
    assert late == {"ok": False, "error": "timed out after 0.01 s", "ranks": []}


def test_design_goals_read_as_measurements_not_failures():
    """Memory growth of N = 2 above its goal and traffic within it: each printed as measured vs goal, no verdict."""
    def run(world, seq_len, mib, sent_over_theory):
        return {"mode": "ring", "world": world, "seq_len": seq_len, "ok": True, "step_mib": mib, "median_s": 1.0,
                "tokens_per_s": 1.0, "sent_mib": 1.0, "theory_mib": 1.0, "sent_over_theory": sent_over_theory,
                "grad_allreduce_payload_bytes": 0}

    runs = [run(1, 1024, 100.0, None), run(1, 2048, 200.0, None), run(2, 1024, 80.0, 1.0), run(2, 2048, 150.0, 1.02)]
    summary = summarize_sp(runs, [1024, 2048], [1, 2], ["ring"])
    assert summary["targets"]["ring_growth_ratio_sp2"]["met"] is False  # still in the JSON, for tools
    text = format_sp_report(summary)
    assert "NOT met" not in text and "target " not in text
    lines = text.splitlines()
    assert lines[lines.index(GOALS_HEADER) + 1:] == [
        "  ring memory growth per 1K tokens per rank, N=2 / N=1: 0.7000 (goal <= 0.55; above the goal)",
        "  bytes sent vs the algorithm's volume, largest |sent / theory - 1|: 0.0200 (goal <= 0.1; within the goal)"]
