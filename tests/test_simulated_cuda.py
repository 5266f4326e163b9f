"""The CUDA dry-run tier (issue 14, item 3): every attention path and option, the chunked MLP and loss, patched tiny
models (LoRA, emulated 4-bit) and the ring / Ulysses kernels, forward + backward on a simulated H100 (and L40S, T4),
in bf16 / fp16 autocast and bf16 weights, next to stock on the same simulated device. No GPU needed.

tests/cuda_dry_run.py runs every case in ONE process started with the bpt.gpusim shim (it must be loaded before
torch, so never in this pytest process) and writes a JSON of per-case facts and problems; each test below asserts on
one group of cases, so a failure names the case and says what differed (or shows its traceback).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import cuda_dry_run
from bpt.gpusim import shim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 600  # seconds for the whole dry run (about 1.5 minutes on a 2-core machine)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """{"group/name": case} of one dry run."""
    try:
        command = shim.boot_command("cuda_dry_run", str(tmp_path_factory.mktemp("dry_run") / "results.json"))
    except shim.ShimError as error:  # no C++ compiler for the shim
        pytest.skip(f"the simulated GPU cannot be set up here: {error}")
    out = command[-1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.join(ROOT, "tests"), ROOT, *filter(None, [os.environ.get("PYTHONPATH")])]))
    try:
        run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the CUDA dry run took more than {TIMEOUT} s")
    if run.returncode or not os.path.exists(out):
        pytest.fail(f"the CUDA dry run failed (exit {run.returncode}):\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}")
    with open(out) as f:
        report = json.load(f)
    print(f"CUDA dry run: {len(report['cases'])} cases in {report['seconds']:.1f} s", file=sys.stderr)
    return {f"{case['group']}/{case['name']}": case for case in report["cases"]}


def cases_of(results: dict, prefix: str) -> dict:
    chosen = {name: case for name, case in results.items() if name.startswith(prefix)}
    assert chosen, f"no case under {prefix!r}"
    return chosen


def assert_passed(cases: dict) -> None:
    failed = [f"{name}: {'; '.join(case['problems'])}" + (f"\n{case['error']}" if case.get("error") else "")
              for name, case in cases.items() if not case["ok"]]
    assert not failed, "\n".join(failed)


def test_every_case_ran(results):
    assert set(results) == {f"{group}/{name}" for group, name, _ in cuda_dry_run.CASES}


def test_attention_every_option_on_h100(results):
    cases = cases_of(results, "attention/")
    assert_passed(cases)
    for name, case in cases.items():  # what the tier is for, restated: no math kernel, no N x N, dtypes as stock
        assert "sdpa-math" not in case["paths"] and not case["wide"], name
        assert case["out"]["dtype"] == case["stock_out"]["dtype"] and case["out"]["device"] == "cuda", name
    for mode in cuda_dry_run.TRAINING_MODES:  # plain causal with GQA: FlashAttention, as on a real H100
        assert cases[f"attention/plain-gqa/{mode}"]["paths"] == {"sdpa-flash": 1}


def test_attention_sm89_head_dim_256(results):
    cases = cases_of(results, "attention-sm89/")
    assert_passed(cases)
    assert cases["attention-sm89/head-dim-256-gqa/bf16-autocast"]["paths"] == {"blockwise": 1}


def test_attention_sm75_without_flash(results):
    assert_passed(cases_of(results, "attention-sm75/"))


@pytest.mark.parametrize("group", ["mlp", "loss"])
def test_chunked_mlp_and_loss(results, group):
    cases = cases_of(results, f"{group}/")
    assert_passed(cases)
    for name, case in cases.items():
        assert not case["wide"] and case["stock_wide"], name


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss", "bloom", "mixtral", "bamba", "llama-hd256"])
def test_patched_models(results, family):
    cases = cases_of(results, f"models/{family}/")
    assert_passed(cases)
    for name, case in cases.items():
        patched, stock = case["patched"], case["stock"]
        assert patched["logits"] is None and not patched["wide"], name
        assert any(w.endswith("(N x V)") for w in stock["wide"]), name  # stock's logits, seen by the same probe
        assert "sdpa-math" not in patched["paths"], name


def test_sequence_parallel_kernels_on_a_fake_process_group(results):
    cases = cases_of(results, "sequence-parallel/")
    assert_passed(cases)
    ring = {name: case["paths"] for name, case in cases.items() if name.startswith("sequence-parallel/ring/")}
    # one ring call per case: on the fused kernel where it can (no mask, no bias), else block by block
    assert ring and all(paths in ({"ring": 1}, {"ring-fused": 1}) for paths in ring.values()), ring
    assert {"ring-fused": 1} in ring.values() and {"ring": 1} in ring.values(), ring


def test_probe_catches_stock(results):
    """The structural probe is not blind: the math kernel's N x N, a whole-sequence chunk's N x I / N x V, and in every
    model case stock's N x V logits (and on the L40S its math-kernel N x N) show up in it."""
    assert_passed(cases_of(results, "probe-catches-stock/"))
    l40s = results["models/llama-hd256/lora/bf16-autocast/l40s"]["stock"]
    assert l40s["paths"] == {"sdpa-math": 1} and any(w.endswith("(N x N)") for w in l40s["wide"])
