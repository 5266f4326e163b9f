"""`python -m train.qlora ... --plan GPU`: this run's training step simulated on a GPU before any download
(train/run/plan.py). The plan prints a verdict and trains nothing; its peak is run_simulation's for the very spec a
hand-built description of the run gives; models resolve offline (directory, hub cache, built-in hub shapes); the
longest --max_seq_len search is exact to its resolution; mistakes are one line with exit status 2."""
from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from cli_helpers import ENV, REPO, base_argv, error_line
from train.recipe.args import PLAN_DEVICES, TrainArguments, parse_args
from train.run.plan import (OPTIMIZER_STATE_BYTES, RESOLUTION, format_verdict, longest_fitting_length, model_config,
                        print_plan, step_spec)
from train.run.command import main

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA_8B_64K = REPO / "configs" / "llama-8b-64k.yaml"


def _verdict(text: str) -> str:
    return re.search(r"^  verdict  (.*)$", text, re.M).group(1)


def test_plan_of_a_tiny_local_model_prints_a_verdict_and_trains_nothing(tiny, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(base_argv(tiny, out, "--plan", "rtx4090-24gb")) == 0
    text = capsys.readouterr().out
    assert text.startswith("--plan rtx4090-24gb: simulated, not measured; no weights loaded, no training\n"), text
    assert f"config.json of {tiny / 'model'}" in text
    assert _verdict(text).startswith("FITS, ") and _verdict(text).endswith("(simulated)")
    assert "optimizer state: adamw, 8 B x" in text and "measured on one H100" in text
    assert len(re.findall(r"^    .* (float32|bfloat16) \[", text, re.M)) == 5  # the five largest at the peak
    # The model positions 128 tokens and no --rope_scaling is set: the longest allowed, and it fits.
    assert "  longest  --max_seq_len 128 fits, the longest allowed (the model's positions" in text
    assert not out.exists()  # no output directory, no checkpoint, no training


def test_the_plan_simulates_this_very_run(tiny, tmp_path):
    """Non-default flags all reach the simulated step: its peak equals run_simulation's of the spec written out by
    hand from the run's flags (the tiny model's config, 16-bit, q/v adapters, embeddings and norms trained, two
    rows per device, one rank of two splitting --max_seq_len (ring), no packing, the block sizes, checkpoints offloaded:
    the host bytes are reported)."""
    from bpt.bench.workers import run_worker
    from bpt.config import BPTConfig

    argv = base_argv(tiny, tmp_path / "run", "--plan", "a100-40gb", "--bits", 16, "--lora_target_modules", "q_proj,v_proj",
                     "--train_embeddings_and_norms", "--per_device_train_batch_size", 2, "--sequence_parallel", 2,
                     "--no_packing", "--lora_dropout", 0.1, "--gradient_accumulation_steps", 2,
                     "--offload_checkpoints")
    args = parse_args(argv)
    planned = print_plan(args, echo=lambda line: None)
    config = json.loads((tiny / "model" / "config.json").read_text())
    by_hand = dict(task="simulate", simulate="a100-40gb", side="patched+offload", seq_len=64, sequence_parallel=2,
                   sp_mode="ring", model_config=config, bits=16,
                   lora=True, lora_r=4, lora_targets=["q_proj", "v_proj"], lora_dropout=0.1,
                   modules_to_save=["embed_tokens", "input_layernorm", "norm", "post_attention_layernorm"],
                   batch_size=2, gradient_checkpointing=True,
                   bpt=dataclasses.asdict(BPTConfig(q_block=16, kv_block=16, mlp_chunk=16, loss_chunk=16)),
                   layers=None, packed_documents=0, top=5, malloc="mmap")
    direct = run_worker(by_hand, 600)
    assert direct["ok"], direct
    assert planned.row["peak_bytes"] == direct["peak_bytes"]
    assert planned.row["host_peak_bytes"] == direct["host_peak_bytes"] > 0
    verdict = format_verdict(args, planned)
    assert any(line.startswith("  host     ") for line in verdict)
    assert any(line.startswith("  note     fits without --offload_checkpoints too (at most ") for line in verdict)
    assert any("2 x 32 tokens per device (--max_seq_len 64 split 2 ways, ring: one rank's step" in line
               for line in verdict)
    assert direct["tokens_per_rank"] == 32 and direct["sent_bytes"] > 0  # the ring's exchanges ran
    assert any(line.startswith("           of it exchanging shards: ") for line in verdict)  # and were timed
    assert any("per machine (2 processes of this run on one) of the machine's 1024.00 GiB" in line for line in verdict)
    # the ring rank kept its attention for the recompute (auto: a few KiB of an 80 GB card), and says so
    assert planned.row["attention_once"]["kept"] and any(
        line.startswith("           attention computed once per step: its outputs kept for the recompute, ")
        and line.endswith("over the depth (in the peak; auto)") for line in verdict), verdict
    assert planned.row["trainable_params"] == direct["trainable_params"]
    # Added analytically: AdamW's two fp32 moments and the gradients kept between the two micro-batches.
    trainable = direct["trainable_params"]
    assert planned.peak_bytes == direct["peak_bytes"] + 8 * trainable + 4 * trainable
    assert planned.longest == 128 and planned.first_over is None  # the model's positions


def test_the_plan_simulates_the_checkpoint_stride(tiny, tmp_path):
    """--checkpoint_stride reaches the simulated step: the layer forwards it remakes are in the step's ops."""
    planned = {stride: print_plan(parse_args(base_argv(tiny, tmp_path / "run", "--plan", "a100-40gb",
                                                       "--checkpoint_stride", stride)), echo=lambda line: None)
               for stride in (1, 2)}
    assert planned[2].spec["bpt"]["checkpoint_stride"] == 2 and planned[2].spec["side"] == "patched"
    assert planned[2].row["ops"] > planned[1].row["ops"]
    run_line = next(line for line in format_verdict(parse_args(base_argv(tiny, tmp_path / "run", "--plan", "a100-40gb",
                                                                         "--checkpoint_stride", 2)), planned[2])
                    if line.startswith("  run "))
    assert ", checkpointing, one layer checkpoint in 2 kept;" in run_line


def test_offload_is_called_unneeded_only_where_the_offloaded_bytes_fit_back():
    """The note's bound: the plan's peak plus every offloaded byte back on the device, against the usable memory;
    nothing without --offload_checkpoints."""
    from types import SimpleNamespace

    from train.run.plan import Planned, offload_notes

    def notes(peak, offloaded, usable, offload=True):
        planned = Planned("h100-80gb", "", {}, {"host_peak_bytes": offloaded}, [], peak, usable)
        return offload_notes(SimpleNamespace(offload_checkpoints=offload), planned)
    assert notes(40, 60, 100) and "at most 100.0 B" not in notes(40, 60, 100)[0]
    assert notes(41, 60, 100) == []
    assert notes(40, 0, 100) == [] and notes(40, 60, 100, offload=False) == []


def test_a_run_over_the_card_hears_of_the_checkpoint_stride():
    """Over the card, patched and every checkpoint kept: the stride's estimate (32 layers: 15 bf16 layer inputs of
    1 x 1000 tokens x 8 hidden); nothing where it fits, with offload, or with a stride already."""
    from types import SimpleNamespace

    from train.run.plan import Planned, stride_notes

    def notes(peak, usable=100, **flags):
        options = dict(bpt=True, gradient_checkpointing=True, offload_checkpoints=False, checkpoint_stride=1,
                       per_device_train_batch_size=1) | flags
        planned = Planned("h100-80gb", "", {"model_config": {"hidden_size": 8}},
                          {"tokens_per_rank": 1000, "depth": 32}, [], peak, usable)
        return stride_notes(SimpleNamespace(**options), planned)
    (note,) = notes(101)
    assert note.startswith("--checkpoint_stride 2 keeps one layer checkpoint in two: about 234.4 KiB less")
    assert notes(100) == [] and notes(101, offload_checkpoints=True) == [] and notes(101, checkpoint_stride=2) == []
    assert notes(101, bpt=False) == []


def test_a_hub_name_with_a_built_in_shape_plans_offline(tmp_path):
    """The model of configs/llama-8b-64k.yaml, gated, not in the hub cache, not downloadable: its built-in shape,
    2 and 3 of 32 layers simulated and extrapolated (at its own 8192 positions: one simulated step, ~30 s)."""
    done = subprocess.run(
        [sys.executable, "-m", "train.qlora", "--model_name_or_path", "meta-llama/Meta-Llama-3-8B", "--max_seq_len",
         "8192", "--output_dir", str(tmp_path / "run"), "--plan", "h100-80gb"], cwd=REPO,
        env={**ENV, "HF_HUB_CACHE": str(tmp_path / "empty-cache")}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    text = done.stdout
    assert "meta-llama/Meta-Llama-3-8B: built-in shape llama-3-8b" in text
    assert "(2 and 3 of 32 layers run, extrapolated)" in text and "2-layer extrapolation" in text
    assert _verdict(text).startswith("FITS, ")
    assert "  longest  --max_seq_len 8192 fits, the longest allowed (the model's positions" in text
    assert not (tmp_path / "run").exists()


def test_the_llama_8b_64k_preset_is_planned_as_it_would_train():
    """configs/llama-8b-64k.yaml (a gated hub model): its built-in shape with the run's RoPE scaling, and the step
    spec of the run (not simulated here: that takes minutes on a CPU; the tests above run the same path)."""
    args = parse_args(["--config", str(LLAMA_8B_64K), "--plan", "h100-80gb"])
    config, source = model_config(args.model_name_or_path, False)
    assert source.startswith("built-in shape llama-3-8b")
    spec = step_spec(args, config, args.max_seq_len, (args.lora_target_modules, ["embed_tokens"]))
    model = spec["model_config"]
    assert model["rope_parameters"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 500000.0}
    assert model["max_position_embeddings"] == 65536 and model["num_hidden_layers"] == 32
    assert (spec["seq_len"], spec["bits"], spec["lora_r"], spec["layers"], spec["side"]) == (65536, 4, 8, 2, "patched")
    assert spec["packed_documents"] > 1 and spec["gradient_checkpointing"]


def test_a_config_in_the_hub_cache_is_used(tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants

    snapshot = tmp_path / "models--someone--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((tiny / "model" / "config.json").read_text())
    (tmp_path / "models--someone--tiny" / "refs").mkdir()
    (tmp_path / "models--someone--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    config, source = model_config("someone/tiny", False)
    assert source == "config.json from the hub cache" and config.hidden_size == 64


@pytest.mark.parametrize("argv, message", [
    (["--model_name_or_path", "nobody/unknown-model"],
     "error: --plan: no config for model nobody/unknown-model: not a local directory, not in the hub cache"),
    (["--config", str(LLAMA_8B_64K), "--bits", "8"], "error: --plan simulates --bits 4"),
    (["--config", str(LLAMA_8B_64K), "--fsdp"], "error: --plan does not model --fsdp"),
    (["--config", str(LLAMA_8B_64K), "--max_seq_len", "65537", "--rope_factor", "8"],
     "error: --rope_factor 8 stretches 8192 positions to 65536"),
], ids=["unknown-model", "8-bit", "fsdp", "positions"])
def test_what_cannot_be_planned_is_one_line(argv, message, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    assert main([*argv, "--output_dir", tmp_path / "run", "--plan", "h100-80gb"]) == 2
    assert error_line(capsys).startswith(message)
    assert not (tmp_path / "run").exists()


def test_an_unknown_gpu_is_one_line(capsys):
    assert main(["--config", LLAMA_8B_64K, "--plan", "h100"]) == 2
    line = error_line(capsys)
    assert "--plan: invalid choice: 'h100'" in line and "'h100-80gb'" in line
    assert "cpu" not in PLAN_DEVICES and "h100-80gb" in PLAN_DEVICES


def test_every_optimizer_has_its_state_size():
    optim = next(f for f in dataclasses.fields(TrainArguments) if f.name == "optim")
    assert set(optim.metadata["choices"]) == set(OPTIMIZER_STATE_BYTES)


def test_every_built_in_hub_shape_builds():
    from transformers import AutoConfig

    from bpt.bench.models import HUB_MODELS, PRESETS

    for name, (preset, overrides) in HUB_MODELS.items():
        assert preset in PRESETS and "/" in name
        config = AutoConfig.for_model(**{**PRESETS[preset], **overrides})
        assert config.max_position_embeddings >= 8192, name


@pytest.mark.parametrize("shape", ["linear", "convex", "steps"])
@pytest.mark.parametrize("limit, cap", [(5_000_000, 1 << 20), (90_000_000, 1 << 20), (90_000_000, 70_000),
                                        (90_000_000, 500), (400, 1 << 20), (123_456_789, 1 << 20)])
def test_the_longest_length_search_is_exact_to_its_resolution(shape, limit, cap):
    def peak(n):
        return {"linear": 1000 + 700 * n, "convex": 1000 + 600 * n + n * n // 10_000,
                "steps": 1000 + 700 * (-(-n // 4096) * 4096)}[shape]

    candidates = [n for n in range(RESOLUTION, cap + 1, RESOLUTION)] + [cap]
    fitting = [n for n in candidates if peak(n) <= limit]
    expected = max(fitting, default=None)
    start = min(65536, cap)
    probed = []
    longest, first_over = longest_fitting_length(lambda n: probed.append(n) or peak(n), limit, cap,
                                                 {start: peak(start)})
    assert longest == expected, (longest, first_over, probed)
    if expected != cap:
        assert first_over == min(n for n in candidates if peak(n) > limit)
    else:
        assert first_over is None
    assert len(probed) <= 12, probed
    if shape == "linear":
        assert len(probed) <= 4, probed


def test_a_long_ring_plan_says_it_will_take_long(tiny, tmp_path, capsys, monkeypatch):
    """Ring attention over packed documents is simulated block by block: past RING_QUICK tokens a rank the plan says
    so before it starts (unpacked rows take the fused kernel, and Ulysses does not need to)."""
    import train.run.plan as plan

    def stop(spec):
        raise plan.PlanFailed("stopped by the test")

    monkeypatch.setattr(plan, "simulate", stop)
    for mode, packing, said in (("ring", [], True), ("ring", ["--no_packing"], False), ("ulysses", [], False)):
        args = parse_args(base_argv(tiny, tmp_path / f"{mode}{len(packing)}", "--plan", "h100-80gb",
                                    "--sequence_parallel", 2, "--sp_mode", mode, "--max_seq_len",
                                    2 * plan.RING_QUICK + 2, "--rope_scaling", "linear", *packing))
        with pytest.raises(plan.PlanFailed):
            plan.print_plan(args, echo=lambda line: None)
        assert ("is simulated block by block" in capsys.readouterr().err) == said, (mode, packing)


def _linear_step(calls: list):
    """A stand-in for the simulated step of the 8B preset (minutes on a CPU): a peak linear in the length, 12 GiB
    plus 0.3 MiB a token (longest fitting on an 80 GB card: ~221K tokens), and the fields the plan prints."""
    def simulate(spec):
        calls.append(spec["seq_len"])
        return {"ok": True, "peak_bytes": (12 << 30) + spec["seq_len"] * 300 * 1024, "trainable_params": 526_667_776,
                "tokens_per_rank": spec["seq_len"], "layers": 2, "depth": 32, "extrapolated": True,
                "peak_holders": []}
    return simulate


def test_the_8b_preset_plan_estimates_its_search_shows_each_length_and_can_skip_it(monkeypatch, capsys):
    import train.run.plan as plan
    from bpt.gpusim.gpus import device

    calls = []
    monkeypatch.setattr(plan, "simulate", _linear_step(calls))
    assert main(["--config", str(LLAMA_8B_64K), "--plan", "h100-80gb"]) == 0
    captured = capsys.readouterr()
    assert re.search(rf"searching the longest --max_seq_len that fits: ~{plan.SEARCH_STEPS} more simulated steps of "
                     r"~\d+ s, ~\d+ s \(--no_plan_longest: stop after the verdict\)", captured.err)
    progress = re.findall(r"^plan:   --max_seq_len ([\d,]+): ([\d.]+) GiB, (fits|does not fit) \(", captured.err, re.M)
    assert [int(n.replace(",", "")) for n, _, _ in progress] == calls[1:] and len(progress) >= 2
    usable = device("h100-80gb").usable_bytes / (1 << 30)
    for _, gib, verdict in progress:  # each length's peak (the optimizer state with it) against the card
        assert verdict == ("fits" if float(gib) <= usable else "does not fit")
    assert {verdict for _, _, verdict in progress} == {"fits", "does not fit"}
    assert re.search(r"^  longest  --max_seq_len \d+ fits, \d+ does not", captured.out, re.M)

    calls.clear()
    assert main(["--config", str(LLAMA_8B_64K), "--plan", "h100-80gb", "--no_plan_longest"]) == 0
    captured = capsys.readouterr()
    assert calls == [65536]  # the verdict's step, no search
    assert captured.out.rstrip().endswith("  longest  not searched (--no_plan_longest); no training was run")
    assert "searching" not in captured.err and "plan:   --max_seq_len" not in captured.err


def test_a_stopped_plan_does_not_talk_of_checkpoints(monkeypatch, capsys):
    import signal

    import train.run.plan as plan
    from train.recipe.lifecycle import Interrupted

    def stopped(spec):
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr(plan, "simulate", stopped)
    assert main(["--config", str(LLAMA_8B_64K), "--plan", "h100-80gb"]) == 143
    line = error_line(capsys)
    assert line == "error: the plan was stopped by SIGTERM; nothing was trained or written"


def test_a_plan_over_the_machines_host_memory_does_not_fit(monkeypatch, capsys):
    """Offloaded checkpoints live in host memory, which a machine's processes share (bpt/gpusim/gpus.py MACHINES: an
    H100 node of eight has 2 TB, 256 GiB a GPU): a layout over it is refused, and the longest length is the one the
    host holds where the device would hold more. A stand-in step: 40 MiB of host memory a token of the rank's shard
    (8 ranks on one machine: 52,428 whole tokens fit 2,048 GiB), a device peak far under the card."""
    import train.run.plan as plan
    from bpt.bench.host_limit import host_memory

    def simulate(spec):
        share = spec["seq_len"] // spec["sequence_parallel"]
        row = {"ok": True, "peak_bytes": (12 << 30) + share * 300 * 1024, "trainable_params": 526_667_776,
               "tokens_per_rank": share, "layers": 2, "depth": 32, "extrapolated": True, "peak_holders": [],
               "host_peak_bytes": share * (40 << 20)}
        return {**row, **host_memory(spec, row["host_peak_bytes"])}

    monkeypatch.setattr(plan, "simulate", simulate)
    assert main(["--config", str(LLAMA_8B_64K), "--plan", "h100-80gb", "--offload_checkpoints",
                 "--sequence_parallel", "8", "--max_seq_len", "65536"]) == 0
    out = capsys.readouterr().out
    assert _verdict(out) == "DOES NOT FIT: host memory, 512.00 GiB over the machine's (simulated)"
    assert re.search(r"2560\.00 GiB per machine \(8 processes of this run on one\) of the machine's 2048\.00 GiB "
                     r"\(bpt/gpusim/gpus.py MACHINES\): DOES NOT FIT", out)
    longest = int(re.search(r"^  longest  --max_seq_len (\d+) fits", out, re.M).group(1))
    assert longest <= (2048 << 30) // 8 // (40 << 20) * 8 < longest + RESOLUTION  # 52,428: 52,224 to 1K tokens


def test_a_plan_over_the_machines_host_memory_keeps_the_last_tensors_on_the_device(monkeypatch, capsys):
    """Where the offloaded bytes are over the machine's host memory, the simulation keeps the last saved tensors on
    the device (bpt.bench.host_limit): the plan fits and names the flag. A stand-in step: 8 ranks of 8,192 tokens,
    300 GiB of host memory a rank, each kept [tokens, 4096] tensor 64 MiB less of it and more on the device."""
    import train.run.plan as plan
    from bpt.bench.host_limit import host_memory, kept_where_the_host_is_over

    def simulate(spec):
        keep = spec["bpt"]["offload_keep_last"]
        per_tensor = spec["seq_len"] // spec["sequence_parallel"] * 4096 * 2
        host = (256 << 30) + (100 << 20) - keep * per_tensor
        row = {"ok": True, "peak_bytes": (12 << 30) + keep * per_tensor, "trainable_params": 526_667_776,
               "tokens_per_rank": spec["seq_len"] // spec["sequence_parallel"], "layers": 2, "depth": 32,
               "extrapolated": True, "peak_holders": [], "host_peak_bytes": host}
        row = {**row, **host_memory(spec, row["host_peak_bytes"])}
        return kept_where_the_host_is_over(spec, row, simulate)

    monkeypatch.setattr(plan, "simulate", simulate)
    assert main(["--config", str(LLAMA_8B_64K), "--plan", "h100-80gb", "--offload_checkpoints",
                 "--sequence_parallel", "8", "--max_seq_len", "65536"]) == 0
    out = capsys.readouterr().out
    assert _verdict(out).startswith("FITS")
    assert "DOES NOT FIT" not in out and "with the last 2 saved tensors kept on the device: add --offload_keep_last 2" \
        in out
