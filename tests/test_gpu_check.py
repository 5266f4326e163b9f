"""The GPU check (python -m bpt.bench --gpu_check): its dry run on a simulated H100 runs every part the GPU run does,
the CUDA tier's failures are captured with their text, a real bitsandbytes 4-bit model trains patched as stock, and
bad flags stop before any work. (Its real run: docs/bench/gpu_check-h100-80gb.json.) The trainer part, which runs
when named, is tests/test_gpu_check_trainer.py's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from bpt.bench import gpu_check
from bpt.bench.cuda_tier import run_cuda_tier
from bpt.bench.gpu_check_table import format_table
from bpt.bench.cli import main

ROOT = gpu_check.ROOT
DRY_RUN_BUDGET = 1800
# One worker runs this module under the README's `--dist loadgroup`: the dry run is made once, where its tests run (a
# second worker reading it would wait ~4 minutes on the lock below, idle).
pytestmark = pytest.mark.xdist_group("gpu_check_dry_run")


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """The dry run, once per session: workers that run this module's tests share it (a file lock in the session's
    folder, for runs without the group above: a second waits for the first's report instead of running its own)."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    out = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "gpu_check_dry_run"
    with FileLock(f"{out}.lock"):
        if not (out / "seconds").exists():
            out.mkdir(exist_ok=True)
            start = time.time()
            # The dry run checks the code paths, not the budget's sharing (test_only_the_parts_asked_for_run does): a
            # budget a busy machine cannot run out of, so no cell is skipped for time (the default 480 s were, in CI).
            result = subprocess.run([sys.executable, "-m", "bpt.bench", "--gpu_check", "--simulate", "h100-80gb",
                                     "--output", str(out), "--time_budget", str(DRY_RUN_BUDGET)], cwd=ROOT,
                                    capture_output=True, text=True, timeout=DRY_RUN_BUDGET)
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
            (out / "seconds").write_text(f"{time.time() - start:.1f}")
    return (json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.txt").read_text(),
            float((out / "seconds").read_text()))


def test_dry_run_has_every_part(dry_run):
    report, table, seconds = dry_run
    assert report["parts_done"] == ["environment", "clock", "memory", "speed", "cuda_tier", "max_context"]
    assert report["time_budget_s"] == DRY_RUN_BUDGET and report["trainer"] is None and report["qlora_8b"] is None
    assert not report["clock"]["ok"] and "real device" in report["clock"]["error"]
    assert report["gpu_check"] == "simulated h100-80gb" and report["card"] == "h100-80gb"
    env = report["environment"]
    assert env["ok"] and env["gpu"] == "simulated h100-80gb" and env["versions"]["torch"] == torch.__version__
    assert "GPU check (simulated h100-80gb)" in table and "CUDA tier:" in table and "max context" in table
    print(f"dry run: {seconds:.0f} s")


def test_dry_run_memory_rows_are_the_simulation_on_both_paths(dry_run):
    """The cell worker (what runs on a GPU) and the simulation worker count the same step on the simulated card."""
    rows = dry_run[0]["memory"]
    cells = {(r["side"], r["seq_len"], r["bits"]) for r in rows}
    assert cells == {(s, n, 16) for s in gpu_check.MEMORY_SIDES for n in gpu_check.MEMORY_LENGTHS} | {
        ("patched", gpu_check.FOUR_BIT_LENGTH, 4)}
    for row in rows:
        assert row["ok"] and not row["measured"], row
        # equal to the byte in most runs; a 4 MiB tensor freed at a varying moment (seen at 2 or 3 layers, never in
        # one step run alone) moves a 2 -> 16 layer extrapolation by 13-14 x 4 MiB: 1-3% at 8K. 5% is the check's
        # own criterion for the real card.
        assert abs(row["measured_over_simulated"] - 1) < 0.05, row
        if row["side"] == "stock":
            assert row["measured_bytes"] == row["simulated_bytes"], row
    assert [r["quantiser"] for r in rows if r["bits"] == 4] == ["emulated"]  # bitsandbytes on a real GPU only
    stock, patched = ({r["seq_len"]: r["simulated_bytes"] for r in rows if r["side"] == side and r["bits"] == 16}
                      for side in ("stock", "patched"))
    # the patch's saving is in the rows, not only their presence (a third: at 32K on an 80 GB card the chunk budget
    # lets the MLP and loss chunks grow)
    assert patched[32768] < stock[32768] / 3


def test_dry_run_speed_rows_say_what_ran(dry_run):
    rows = dry_run[0]["speed"]
    ran = [r for r in rows if r["side"] not in (gpu_check.PEER, "unsloth")]
    assert ran and all(r["ok"] and r["simulated"] and r["seconds_per_step"] is None for r in ran)
    assert {r["seq_len"] for r in ran if r["side"] == "patched"} >= set(gpu_check.LONG_LENGTHS)
    peer = [r for r in rows if r["side"] == gpu_check.PEER]
    assert all(not r["ok"] and "Triton" in r["error"] for r in peer)
    # the peer at every length the check times, and on the 4-bit base as the 4-bit patched row (like for like)
    assert sorted((r["seq_len"], r["bits"]) for r in peer) == sorted(
        [(n, 16) for n in gpu_check.MEMORY_LENGTHS + gpu_check.LONG_LENGTHS] + [(gpu_check.FOUR_BIT_LENGTH, 4)])
    unsloth = [r for r in rows if r["side"] == "unsloth"]
    assert [(r["ok"], r["error"]) for r in unsloth] == [(False, gpu_check.UNSLOTH_ON_A_SIMULATED_CARD)]
    assert any(line.split()[:3] == ["unsloth", "4-bit", "8192"]
               and line.endswith(gpu_check.UNSLOTH_ON_A_SIMULATED_CARD) for line in dry_run[1].splitlines())


def test_dry_run_profiles_one_step_per_side(dry_run):
    """At the profiled length every side's step ran once more under torch.profiler: its aten calls counted (the
    kernels too on a real GPU), a patched step making more calls than stock's (its chunk loops)."""
    profiles = {(r["side"], r["bits"]): r["profile"] for r in dry_run[0]["speed"]
                if r["seq_len"] in gpu_check.PROFILE_LENGTHS and r.get("profile")}
    assert set(profiles) == {(s, 16) for s in gpu_check.MEMORY_SIDES} | {("patched", 4)}, profiles
    for profile in profiles.values():
        assert "error" not in profile, profile
        assert profile["kernel_launches"] == 0 and profile["aten_calls"] > 0  # fake tensors launch nothing
    assert profiles["patched", 16]["aten_calls"] > profiles["stock", 16]["aten_calls"]
    assert "profile patched" in dry_run[1]


def test_kernel_kinds():
    from bpt.bench.cells import kernel_kind

    assert kernel_kind("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_TNT") == "matmul"
    assert kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16") == "attention"
    assert kernel_kind("Memcpy DtoH (Device -> Pinned)") == "copies"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add>") == \
        "memory_bound"


def test_runtime_calls_rank_the_host_side_cuda_calls():
    """The profiled step's CUDA runtime calls by host time, the ones that can stall the host marked; kernels (device
    events) and aten ops are not runtime calls."""
    from types import SimpleNamespace

    from bpt.bench.cells import runtime_calls

    def event(name, us, device="DeviceType.CPU"):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us))
    events = [event("cudaLaunchKernel", 5), event("cudaLaunchKernel", 5), event("cudaStreamSynchronize", 400),
              event("cudaHostAlloc", 900), event("aten::mm", 50), event("cudaMemcpyAsync", 3, "DeviceType.CUDA")]
    calls = runtime_calls(events, top=2)
    assert [(c["name"], c["calls"], c["host_wait"]) for c in calls] == [("cudaHostAlloc", 1, True),
                                                                        ("cudaStreamSynchronize", 1, True)]
    assert abs(calls[0]["seconds"] - 900e-6) < 1e-12
    assert runtime_calls(events, top=5)[-1] == {"name": "cudaLaunchKernel", "calls": 2, "seconds": 10e-6,
                                                "host_wait": False}


def test_dry_run_cuda_tier_and_max_context(dry_run):
    report = dry_run[0]
    tier = report["cuda_tier"]
    assert tier["skipped"] > 0 and tier["failed"] == tier["errors"] == 0
    context = report["max_context"]
    for side in gpu_check.MAX_CONTEXT_SIDES:
        found = context[side]
        assert found["longest"] == 65536 and found["stopped"] == "reached --max_len", found
        assert found["simulated_find_max"]["longest"] == 65536
        trials = {t["seq_len"]: t for t in found["trials"]}
        assert all(t["ok"] and t["fits"] for t in trials.values())
        simulated = found["simulated_find_max"]["peaks"]
        for n, trial in trials.items():  # the cell worker and the simulation: the same bytes
            assert abs(trial["peak_bytes"] / simulated[str(n)] - 1) < 0.02, (n, trial, simulated)


def test_cuda_tier_keeps_each_failure_with_its_text(tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "test_probe.py").write_text(
        "import pytest\n\n@pytest.mark.cuda\ndef test_ok():\n    pass\n\n"
        "@pytest.mark.cuda\ndef test_wrong():\n    assert 1 + 1 == 3, 'arithmetic'\n\n"
        "def test_not_cuda():\n    raise AssertionError('deselected: never runs')\n")
    (checkout / "test_broken.py").write_text("import no_such_package_here\n")
    tier = run_cuda_tier(checkout, tmp_path, 120.0)
    assert (tier["passed"], tier["failed"], tier["errors"]) == (1, 1, 0), tier
    assert tier["verdicts"] == {"test_ok": "passed", "test_wrong": "failed"}
    assert "arithmetic" in tier["failures"][0]["detail"]
    assert len(tier["not_collected"]) == 1 and "no_such_package_here" in tier["not_collected"][0]
    assert "test_wrong" in format_table({
        "gpu_check": "measured", "model": "m", "lora_r": 16, "parts_done": [], "memory": [], "speed": [],
        "cuda_tier": tier})


def _dry_run_of_parts(tmp_path, *parts) -> tuple[dict, list]:
    """The dry run of `parts` with a runner that answers only the environment worker: -> (the report, the tasks
    asked of workers)."""
    asked = []

    def runner(spec, timeout=None):
        asked.append(spec["task"])
        return {"ok": True, "gpu": "simulated h100-80gb", "memory_bytes": 80 << 30, "versions": {}}
    main(["--gpu_check", "--simulate", "h100-80gb", "--output", str(tmp_path), "--gpu_check_parts", *parts],
         runner=runner)
    return json.loads((tmp_path / "gpu_check.json").read_text()), asked


def test_only_the_parts_asked_for_run(tmp_path):
    """--gpu_check_parts: the environment, then the parts named, none other started (no cell, no simulation); the
    time each keeps for the later parts counts only those that run (all eight: 1,000 s after the clock)."""
    from types import SimpleNamespace

    report, asked = _dry_run_of_parts(tmp_path, "clock")
    assert report["parts_done"] == ["environment", "clock"] and asked == ["environment"]

    def reserve(part, parts):
        return gpu_check.Check.reserve_after(SimpleNamespace(args=SimpleNamespace(gpu_check_parts=parts)), part)
    assert reserve("clock", gpu_check.PARTS) == 1000 and reserve("cuda_tier", gpu_check.PARTS) == 650
    assert reserve("speed", ["speed", "max_context"]) == 50 and reserve("max_context", gpu_check.PARTS) == 605
    assert reserve("trainer", gpu_check.PARTS) == 245 and reserve("qlora_8b", gpu_check.PARTS) == 5
    assert report["time_budget_s"] == gpu_check.BUDGET_SECONDS


def test_the_decode_part_runs_when_named_and_says_why_not_on_a_simulated_card(tmp_path):
    from bpt.bench.decode_check import NOT_ON_A_SIMULATED_CARD, SIDES

    report, asked = _dry_run_of_parts(tmp_path, "decode")
    assert report["parts_done"] == ["environment", "decode"] and asked == ["environment"]
    assert [(row["side"], row["ok"], row["error"]) for row in report["decode"]] == \
        [(side, False, NOT_ON_A_SIMULATED_CARD) for side in SIDES]
    assert f"  patched         {NOT_ON_A_SIMULATED_CARD}" in (tmp_path / "gpu_check.txt").read_text()
    assert "decode" not in gpu_check.DEFAULT_PARTS


def test_the_decode_worker_times_a_second_generate_call_on_the_cpu():
    """The decode part's worker (bpt.bench.decode_check.run_decode) in a process of its own on the CPU, the tiny
    llama, eager (tests/test_generation.py counts the compiled graphs): both sides decode the same tokens, the second
    call is timed, nothing is compiled."""
    from bpt.bench.decode_check import SIDES
    from bpt.bench.workers import run_worker
    from tiny_models import tiny_config

    spec = {"task": "decode", "model_config": tiny_config("llama").to_dict(), "device": "cpu", "dtype": "fp32",
            "prompt_tokens": 20, "new_tokens": 6, "compile": False, "seed": 0, "malloc": "default"}
    rows = {side: run_worker({**spec, "side": side}, timeout=300) for side in SIDES}
    assert all(row["ok"] for row in rows.values()), rows
    assert rows["stock"]["last_tokens"] == rows["patched"]["last_tokens"]
    for row in rows.values():
        assert row["tokens_per_s"] > 0 and row["seconds"] > 0 and row["new_tokens"] == 6
        assert row["graphs_first_call"] == row["graphs_second_call"] == 0


def test_a_length_not_run_is_not_reported_as_over_the_card(tmp_path):
    """Out of time before max_context's first length: nothing fits, and nothing was found too long either."""
    def runner(spec, timeout=None):
        if spec["task"] == "environment":
            return {"ok": True, "gpu": "simulated h100-80gb", "memory_bytes": 80 << 30, "versions": {}}
        return {"ok": True, "peak_bytes": 1 << 30}
    main(["--gpu_check", "--simulate", "h100-80gb", "--output", str(tmp_path), "--gpu_check_parts", "max_context",
          "--time_budget", "1"], runner=runner)  # less than it keeps for writing the report
    context = json.loads((tmp_path / "gpu_check.json").read_text())["max_context"]
    for side in gpu_check.MAX_CONTEXT_SIDES:
        assert context[side]["longest"] is None and context[side]["first_over"] is None, context[side]
        assert "not run" in context[side]["stopped"]


@pytest.mark.parametrize("name, memory, card", [
    ("NVIDIA H100 80GB HBM3", 85017493504, "h100-80gb"), ("NVIDIA H200", 150 << 30, "h200-141gb"),
    ("NVIDIA A100-SXM4-40GB", 40 << 30, "a100-40gb"), ("NVIDIA A100-SXM4-80GB", 80 << 30, "a100-80gb"),
    ("Some future card", 80 << 30, "h100-80gb")])
def test_card_of(name, memory, card):
    assert gpu_check.card_of(name, memory) == card


@pytest.mark.parametrize("argv, message", [
    (["--gpu_check", "--simulate", "h100-80gb"], "--gpu_check writes a folder"),
    (["--gpu_check", "--simulate", "cpu", "--output", "x"], "--gpu_check --simulate takes a GPU"),
    (["--gpu_check", "--simulate", "h100-80gb", "--output", "x", "--find_max"], "drop --find_max"),
    (["--gpu_check", "--simulate", "h100-80gb", "--output", "x", "--time_budget", "0"], "--time_budget must be"),
] + ([] if torch.cuda.is_available() else [(["--gpu_check", "--output", "x"], "run the dry run")]))
def test_bad_flags_stop_before_any_work(argv, message, capsys):
    def runner(spec, timeout=None):
        raise AssertionError("no work may start on bad input")

    with pytest.raises(SystemExit) as stop:
        main(argv, runner=runner)
    assert stop.value.code == 2 and message in capsys.readouterr().err


def test_bitsandbytes_model_trains_patched_as_stock():
    """The GPU check's 4-bit row uses bitsandbytes' own Linear4bit (quantised in place, bf16 compute as the recipe's),
    prepared, LoRA-wrapped by peft's bitsandbytes class and patched as the recipe does: its loss and LoRA gradients
    are no further from the same 4-bit model computing in fp32 than stock's (CPU kernels here; bf16 rounding differs
    by CPU kind, so a fixed tolerance passed on one and failed on another)."""
    pytest.importorskip("bitsandbytes")
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    from bpt.bench.models import quantise_with_bitsandbytes
    from patches import apply_bpt_patch
    from patches.kbit import prepare_kbit_model
    from test_mixed_precision import assert_no_worse_than_stock
    from tiny_models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("llama")
    assert quantise_with_bitsandbytes(model) == 7 * model.config.num_hidden_layers
    model.is_loaded_in_4bit = True
    model = prepare_kbit_model(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    assert isinstance(model.base_model.model.model.layers[0].mlp.down_proj, LoraLinear4bit)
    quantised = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]

    def loss_and_grads(ids, compute_dtype=torch.bfloat16):
        for layer in quantised:
            layer.compute_dtype = compute_dtype
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    squared, norms = {"patched": {}, "stock": {}}, {}
    for seed in range(4):
        ids = torch.randint(0, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(seed))
        reference = loss_and_grads(ids, torch.float32)
        runs = {"stock": loss_and_grads(ids)}
        with apply_bpt_patch(model, q_block=32, kv_block=32, mlp_chunk=32, loss_chunk=32):
            runs["patched"] = loss_and_grads(ids)
        runs = {side: {"loss": loss, **grads} for side, (loss, grads) in runs.items()}
        for name, ref in {"loss": reference[0], **reference[1]}.items():
            norms[name] = norms.get(name, 0.0) + ref.pow(2).sum().item()
            for side, got in runs.items():
                squared[side][name] = squared[side].get(name, 0.0) + (got[name] - ref).pow(2).sum().item()
    errors = {name: ((squared["patched"][name] / norms[name]) ** 0.5, (squared["stock"][name] / norms[name]) ** 0.5)
              for name in norms}
    assert_no_worse_than_stock(errors, batches=4)


def test_liger_side_refused_in_one_line_without_the_package(monkeypatch):
    from bpt.bench.models import apply_liger
    from tiny_models import tiny_model

    monkeypatch.setitem(sys.modules, "liger_kernel", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", None)
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)
    with pytest.raises(ValueError, match="pip install liger-kernel"):
        apply_liger(tiny_model("llama"))
