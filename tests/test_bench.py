"""The benchmark harness: end to end on the tiny preset, its memory measurement, its summaries and errors.

Memory and speed themselves are never asserted here (docs/DESIGN.md principle 7); only that the harness
measures and reports them.
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from argparse import Namespace

import pytest

from bpt.bench import main
from bpt.bench.cli import build_parser, run_spec, sweep, validate
from bpt.bench.measure import PROBE_MIB
from bpt.bench.report import GOALS_HEADER, format_report, summarize
from bpt.bench.workers import describe_exit, run_worker
from bpt.config import BPTConfig

SEQ_LENS = [128, 256]
# Blocks well below the lengths, so the patched side really runs blockwise (the defaults exceed 256 tokens).
SMALL_BLOCKS = ["--q_block", "64", "--kv_block", "64", "--mlp_chunk", "64", "--loss_chunk", "64"]


SIDES = ["stock", "patched"]


# One worker runs this module under `--dist loadgroup`: its module fixtures (a bench sweep, ~1 minute each) are made
# once, not once per worker.
pytestmark = pytest.mark.xdist_group("bench_report")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One sweep over the tiny preset, both sides, shared by the tests."""
    output = tmp_path_factory.mktemp("bench") / "tiny.json"
    main(["--model", "tiny", "--seq_lens", *map(str, SEQ_LENS), "--sides", *SIDES,
          "--steps", "1", "--torch_threads", "1", "--device", "cpu", "--output", str(output), *SMALL_BLOCKS])
    return output


def test_json_has_environment_rows_and_runs(report):
    data = json.loads(report.read_text())
    env = data["environment"]
    for key in ("date", "torch", "transformers", "device", "threads", "model_config", "bpt", "dtype", "memory_probe"):
        assert key in env, key
    assert env["device"] == "cpu" and env["threads"] == 1
    assert env["model_config"]["max_position_embeddings"] >= max(SEQ_LENS)
    assert env["bpt"]["mlp_chunk"] == 64
    assert [row["seq_len"] for row in data["summary"]["rows"]] == SEQ_LENS
    assert {(r["side"], r["seq_len"]) for r in data["runs"]} == {(s, n) for s in SIDES for n in SEQ_LENS}
    for run in data["runs"]:
        assert run["ok"], run
        assert run["step_mib"] > 0 and run["median_s"] > 0 and run["tokens_per_s"] > 0
        assert run["grad_mib"] > 0 and run["loss"] > 0
    for row in data["summary"]["rows"]:
        for side in SIDES:
            assert row[f"{side}_step_mib"] > 0 and row[f"{side}_tok_s"] > 0 and row[f"{side}_status"] == "ok"
    assert data["summary"]["growth"]["mib_per_1k_tokens"]["stock"] is not None


def test_csv_next_to_json(report):
    lines = report.with_suffix(".csv").read_text().splitlines()
    header = lines[0].split(",")
    for column in ("seq_len", "stock_step_mib", "patched_step_mib", "mem_ratio", "time_ratio", "torch", "q_block"):
        assert column in header
    assert len(lines) == 1 + len(SEQ_LENS)


def test_patched_side_reported(report):
    data = json.loads(report.read_text())
    assert all(r["patched"] == (r["side"] == "patched") for r in data["runs"])
    for row in data["summary"]["rows"]:
        assert row["mem_ratio"] > 0 and row["time_ratio"] > 0
        # same seeded weights and tokens: the patched loss is the stock loss
        stock, patched = (next(r["loss"] for r in data["runs"] if r["side"] == s and r["seq_len"] == row["seq_len"])
                          for s in ("stock", "patched"))
        assert patched == pytest.approx(stock, rel=1e-4)
    assert data["summary"]["growth"]["ratio"] is not None


def test_memory_measurement_sees_a_known_allocation():
    """A step that allocates 1 GiB (in 16 MiB pieces, after a previous step freed the same) measures ~1 GiB."""
    probe = run_worker({"task": "probe", "device": "cpu", "malloc": "mmap", "threads": 1})
    assert probe["ok"], probe
    assert probe["expected_mib"] == PROBE_MIB
    assert probe["measured_mib"] == pytest.approx(PROBE_MIB, rel=0.03)


def test_dead_worker_is_a_failed_run_and_the_sweep_goes_on(capsys):
    """The runner reports a killed worker as failed; the sweep records it and runs the other lengths."""
    def runner(spec):
        if spec["task"] == "probe":
            return {"ok": True, "expected_mib": 1024.0, "measured_mib": 1024.0}
        if spec["seq_len"] == 256:
            return {"ok": False, "error": describe_exit(-signal.SIGKILL, "")}
        return {"ok": True, "step_mib": spec["seq_len"] / 10, "median_s": 1.0, "tokens_per_s": spec["seq_len"],
                "loss": 1.0, "threads": 1}

    args = build_parser().parse_args(["--model", "tiny", "--seq_lens", "128", "256", "512", "--sides", "stock"])
    validate(build_parser(), args)
    runs, _ = sweep(args, {}, runner)
    assert [(r["seq_len"], r["ok"]) for r in runs] == [(128, True), (256, False), (512, True)]
    assert "OOM killer" in runs[1]["error"]
    summary = summarize(runs, [128, 256, 512])
    assert summary["rows"][1]["stock_step_mib"] is None
    assert summary["rows"][1]["stock_status"].startswith("failed: killed by SIGKILL")
    assert summary["growth"]["mib_per_1k_tokens"]["stock"] == pytest.approx((51.2 - 12.8) / (384 / 1024))


def test_describe_exit():
    assert describe_exit(1, "Traceback ...\nRuntimeError: boom\n") == "exit status 1: RuntimeError: boom"
    assert describe_exit(-signal.SIGTERM, "").startswith("killed by SIGTERM")


def test_find_max_doubles_until_failure():
    def runner(spec):
        ok = spec["seq_len"] <= 1024
        return ({"ok": True, "step_mib": 1.0, "median_s": 1.0, "tokens_per_s": 1.0, "loss": 1.0, "threads": 1}
                if ok else {"ok": False, "error": "out of memory"})

    args = Namespace(**{**vars(build_parser().parse_args(["--sides", "stock"])),
                        "seq_lens": [128, 256], "sides": ["stock"], "find_max": True, "max_len": 8192,
                        "bpt": BPTConfig(), "device": "cpu"})
    runs, found = sweep(args, {}, runner)
    assert [r["seq_len"] for r in runs] == [128, 256, 512, 1024, 2048]
    assert found["stock"] == {"longest_ok": 1024, "first_failed": 2048, "reason": "out of memory"}

    args.max_len = 512
    _, found = sweep(args, {}, runner)
    assert found["stock"] == {"longest_ok": 512, "first_failed": None, "reason": "reached --max_len 512"}


def test_summary_ratios_and_targets():
    runs = [{"side": s, "seq_len": n, "ok": True, "step_mib": mib, "median_s": t, "tokens_per_s": n / t}
            for s, n, mib, t in [("stock", 4096, 1000.0, 2.0), ("stock", 8192, 2000.0, 4.0),
                                 ("patched", 4096, 100.0, 1.0), ("patched", 8192, 150.0, 4.0)]]
    summary = summarize(runs, [4096, 8192])
    row = summary["rows"][1]
    assert row["mem_ratio"] == pytest.approx(0.075) and row["time_ratio"] == 1.0 and row["speedup"] == 1.0
    growth = summary["growth"]
    assert growth["mib_per_1k_tokens"] == {"stock": 250.0, "patched": 12.5}
    assert growth["ratio"] == pytest.approx(0.05)
    assert summary["targets"]["mem_ratio_at_8192"]["met"] is True
    assert summary["targets"]["time_ratio_at_8192"]["met"] is True
    assert "seq_len" in format_report(summary, {})


def test_design_goals_read_as_measurements_not_failures():
    """A value above a design goal is printed as what was measured next to the goal, not as a failed check."""
    runs = [{"side": s, "seq_len": n, "ok": True, "step_mib": mib, "median_s": t, "tokens_per_s": n / t}
            for s, n, mib, t in [("stock", 4096, 1000.0, 2.0), ("stock", 8192, 2000.0, 4.0),
                                 ("patched", 4096, 100.0, 1.0), ("patched", 8192, 400.0, 4.4)]]
    summary = summarize(runs, [4096, 8192])
    assert summary["targets"]["growth_ratio"]["met"] is False  # still in the JSON, for tools
    text = format_report(summary, {})
    assert "NOT met" not in text and "target " not in text
    lines = text.splitlines()
    goals = lines[lines.index(GOALS_HEADER) + 1:]
    assert goals == ["  step memory at 8192 tokens, patched / stock: 0.2000 (goal <= 0.15; above the goal)",
                     "  memory growth per 1K tokens, patched / stock: 0.3000 (goal <= 0.05; above the goal)",
                     "  step time at 8192 tokens, patched / stock: 1.1000 (goal <= 1; above the goal)"]
    summary = summarize(runs[:2], [4096, 8192])  # stock only: no ratio measured
    assert "  step time at 8192 tokens, patched / stock: - (goal <= 1; not measured in this run)" in \
        format_report(summary, {}).splitlines()


def _help_of_each_flag(parser) -> dict[str, str]:
    """--help text -> {flag: its help text, joined over its lines}."""
    blocks, flag = {}, None
    options = parser.format_help().split("\noptions:\n", 1)[1]
    for line in options.splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            blocks[flag] = " ".join(line.split()[1:])
        elif flag is not None:
            blocks[flag] += " " + line.strip()
    return blocks


def test_every_flag_has_help_with_its_default():
    parser = build_parser()
    shown = _help_of_each_flag(parser)
    hidden = {"--worker", "--threads", "--compile"}  # internal, and the deprecated spellings
    flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")} - {"--help"} - hidden
    assert set(shown) - {"-h"} == flags
    for flag in flags:
        assert "default:" in shown[flag], (flag, shown[flag])
    assert "(default: 1024, bpt.config.BPTConfig's)" in shown["--q_block"]
    assert "default: torch's own" in shown["--torch_threads"]


def test_flag_names_are_the_trainers():
    """--torch_threads and --bpt_compile / --no_bpt_compile as in python -m train.qlora, with its value sets."""
    from train.recipe.args import schema_fields

    trainer = schema_fields()
    assert trainer["torch_threads"].type == "int | None" and trainer["bpt_compile"].type == "bool | None"
    parse = build_parser().parse_args
    assert (parse([]).torch_threads, parse([]).bpt_compile) == (None, None)
    assert parse(["--bpt_compile"]).bpt_compile is True
    args = parse(["--torch_threads", "2", "--no_bpt_compile"])
    validate(build_parser(), args)
    spec = run_spec(args, {}, "patched", 128)
    assert spec["threads"] == 2 and spec["bpt"]["compile"] is False


def test_old_flag_spellings_still_work_with_a_warning(capsys):
    args = build_parser().parse_args(["--threads", "3", "--compile", "on"])
    assert args.torch_threads == 3 and args.bpt_compile is True
    err = capsys.readouterr().err
    assert "--threads is deprecated; use --torch_threads" in err and "--compile is deprecated" in err
    assert build_parser().parse_args(["--compile", "auto"]).bpt_compile is None


@pytest.mark.parametrize("argv, message", [
    (["--model", "no-such-preset"], "neither a preset"),
    (["--seq_lens", "1024", "0"], "--seq_lens must be positive"),
    (["--seq_lens", "-5"], "--seq_lens must be positive"),
    (["--q_block", "0"], "q_block must be a positive integer"),
    (["--find_max"], "--find_max needs --max_len"),
    (["--steps", "0"], "--steps must be positive"),
])
def test_bad_input_fails_before_any_work(argv, message, capsys):
    def runner(spec):
        raise AssertionError("no work may start on bad input")

    with pytest.raises(SystemExit) as exit_info:
        main(["--sides", "stock", *argv], runner=runner)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_gradient_checkpointing_flags():
    parse = build_parser().parse_args
    assert parse([]).gradient_checkpointing is True
    assert parse(["--no_gradient_checkpointing"]).gradient_checkpointing is False


def test_bad_config_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(SystemExit):
        main(["--sides", "stock", "--model", str(path)], runner=None)
    assert "needs a 'model_type' key" in capsys.readouterr().err


def test_bpt_imports_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None; sys.modules['peft'] = None\n"
            "import bpt, bpt.bench, bpt.config")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_without_output_the_results_go_to_bench_results_here_and_it_says_so(tmp_path, monkeypatch, capsys):
    def runner(spec):
        if spec["task"] == "probe":
            return {"ok": True, "expected_mib": 1024.0, "measured_mib": 1024.0}
        return {"ok": True, "step_mib": 1.0, "median_s": 1.0, "tokens_per_s": 1.0, "loss": 1.0, "threads": 1}

    monkeypatch.chdir(tmp_path)
    main(["--model", "tiny", "--seq_lens", "128", "--sides", "stock"], runner=runner)
    [written] = (tmp_path / "bench_results").glob("tiny-*.json")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"results will be written to {written} (without --output: bench_results/ in the current "
                        "directory)")
    assert lines[-1] == f"wrote {written} and {written.with_suffix('.csv').name} beside it"
    help_text = _help_of_each_flag(build_parser())["--output"]
    assert "bench_results/<model>-<time>.json in the current directory" in help_text


def test_plot_draws_beside_the_report_without_output(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from pathlib import Path

    from bpt.bench.plot import main as plot_main

    report = tmp_path / "sim.json"
    report.write_text((Path(__file__).parent.parent / "docs/bench/llama-3.1-8b-qlora-h100.json").read_text())
    plot_main([str(report)])
    assert (tmp_path / "sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'sim.png'}"
