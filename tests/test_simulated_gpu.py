"""The simulated GPU (bpt.gpusim) and the bench's --simulate mode: the counts equal real tensors' to the byte,
4-bit storage equals bitsandbytes', depth extrapolation is exact, --find_max bisects, bad flags fail first.
(The CUDA dry-run tier of every attention path and family is tests/test_simulated_cuda.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import pytest
import torch

from bpt.bench.cli import main
from bpt.bench.models import resolve_model_config
from bpt.bench.simulate import longest_fitting, run_simulation
from bpt.config import BPTConfig
from bpt.gpusim import shim
from bpt.gpusim.device import SimulationError, simulate
from bpt.gpusim.gpus import device

pytestmark = pytest.mark.usefixtures("one_thread")
BLOCKS = asdict(BPTConfig(q_block=64, kv_block=64, mlp_chunk=64, loss_chunk=64, chunk_budget=0))


def _spec(**overrides) -> dict:
    spec = dict(simulate="cpu", side="patched", seq_len=300, model_config=resolve_model_config("tiny", 300), bits=32,
                lora=False, lora_r=4, batch_size=2, gradient_checkpointing=True, bpt=BLOCKS)
    return spec | overrides


@pytest.mark.parametrize("side", ["stock", "patched"])
@pytest.mark.parametrize("lora", [False, True])
def test_fake_tensors_allocate_what_real_tensors_allocate_to_the_byte(side, lora):
    fake = run_simulation(_spec(side=side, lora=lora))
    real = run_simulation(_spec(side=side, lora=lora, real=True))
    assert fake["device"] == "simulated cpu" and real["device"] == "real cpu"
    for key in ("peak_bytes", "before_bytes", "step_bytes", "weight_bytes"):
        assert fake[key] == real[key], key
    assert fake["peak_holders"] == real["peak_holders"]
    assert fake["step_bytes"] > 0 and fake["flops_by_dtype"]["float32"] > 0


def test_depth_extrapolation_equals_the_full_depth():
    config = resolve_model_config("tiny", 300) | {"num_hidden_layers": 4}
    full = run_simulation(_spec(model_config=config))
    extrapolated = run_simulation(_spec(model_config=config, layers=1))
    assert not full["extrapolated"] and extrapolated["extrapolated"] and extrapolated["layers"] == 1
    for key in ("peak_bytes", "before_bytes", "step_bytes", "weight_bytes", "ops", "flops_by_dtype"):
        assert extrapolated[key] == full[key], key


@pytest.mark.parametrize("stride", [2, 3])
def test_depth_extrapolation_with_a_checkpoint_stride_equals_the_full_depth(stride):
    """With one layer input kept in k the figures are linear in the depth in steps of k: the simulated depth is
    raised to one whole steps away from the full depth, and the next one is k deeper. (The attention recomputed: with
    it kept, a 1-layer step at stride 2 holds 21 KB less than the slope of the deeper ones, 0.7% off at depth 7; the
    bench extrapolates from 2 and 3 layers.)"""
    config = resolve_model_config("tiny", 300) | {"num_hidden_layers": 7}
    bpt = BLOCKS | {"checkpoint_stride": stride, "attention_once": False}
    full = run_simulation(_spec(model_config=config, bpt=bpt))
    extrapolated = run_simulation(_spec(model_config=config, bpt=bpt, layers=1))
    assert extrapolated["extrapolated"] and (7 - extrapolated["layers"]) % stride == 0
    for key in ("peak_bytes", "before_bytes", "step_bytes", "weight_bytes", "ops", "flops_by_dtype"):
        assert extrapolated[key] == full[key], key
    every = run_simulation(_spec(model_config=config))
    assert full["ops"] > every["ops"]  # the remade forwards (the memory: the next test)


def test_emulated_4bit_layer_stores_what_bitsandbytes_stores():
    """The same quantised bytes as a real bitsandbytes NF4 layer with double quantisation (runs on CPU)."""
    bnb = pytest.importorskip("bitsandbytes")
    from bpt.gpusim.quant4 import Emulated4bitLinear

    linear = torch.nn.Linear(512, 384, bias=False)
    real = bnb.nn.Linear4bit(512, 384, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True,
                             quant_type="nf4")
    real.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False, compress_statistics=True,
                                    quant_type="nf4")
    real.weight = real.weight._quantize("cpu") if hasattr(real.weight, "_quantize") else real.weight
    state = real.weight.quant_state
    real_bytes = sum(t.numel() * t.element_size() for t in
                     (real.weight.data, state.absmax, state.state2.absmax, state.state2.code))
    emulated = Emulated4bitLinear(linear)
    ours = sum(t.numel() * t.element_size() for t in (emulated.weight, emulated.absmax, emulated.absmax2,
                                                       emulated.code))
    assert tuple(emulated.weight.shape) == tuple(real.weight.data.shape)
    assert ours == real_bytes


def test_longest_fitting_doubles_then_bisects_to_the_resolution():
    limit = 300_000
    asked = []

    def fits(n):
        asked.append(n)
        return n <= limit

    longest, first_over = longest_fitting(fits, 16384, 1 << 22)
    assert longest == 299_008 and first_over - longest <= 1024 and first_over > limit  # 292K: the last 1K multiple
    assert asked[:5] == [16384, 32768, 65536, 131072, 262144]
    assert longest_fitting(lambda n: False, 16384, 1 << 20) == (None, 16384)
    assert longest_fitting(lambda n: True, 16384, 65536) == (65536, None)


def test_simulated_cuda_needs_the_shim_in_the_process():
    """This pytest process imported torch before any shim: simulated CUDA says what to do instead of aborting."""
    if torch.cuda._is_compiled():
        pytest.skip("a CUDA build of torch has CUDA of its own")
    with pytest.raises(SimulationError, match="boot_command"):
        with simulate(device("h100-80gb")):
            pass


def test_a_process_booted_with_the_shim_runs_fake_cuda_backward(shim_library):
    code = ("import torch; from bpt.gpusim.shim import active; from bpt.gpusim.device import simulate; "
            "from bpt.gpusim.gpus import device\n"
            "with simulate(device('a100-40gb')) as sim:\n"
            "    w = torch.randn(8, 8, device='cuda', requires_grad=True)\n"
            "    with torch.autocast('cuda', dtype=torch.bfloat16):\n"
            "        y = w @ w\n"
            "    y.float().sum().backward()\n"
            "print(active(), y.dtype, w.grad.device, w.grad.dtype)\n")
    module = "bpt_gpusim_probe"
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, module + ".py"), "w") as f:
            f.write(code)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp, os.getcwd(), os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run(shim.boot_command(module), capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "torch.bfloat16", "cuda:0", "torch.float32"]


def test_bench_simulate_rows_on_a_simulated_h100(tmp_path, capsys, shim_library):
    """Real workers (shim-booted processes): every row is labelled simulated, the patched side's step at 8K
    tokens holds no N x V logits, plain causal attention takes a flash kernel on both sides."""
    output = tmp_path / "sim.json"
    report = main(["--simulate", "h100-80gb", "--model", "tiny", "--seq_lens", "8192", "--bits", "4", "--lora",
                   "--lora_r", "4", "--lora_targets", "q_proj,v_proj", "--chunk_budget", "0", "--output", str(output)])
    runs = {r["side"]: r for r in report["runs"]}
    assert all(r["ok"] for r in runs.values()), runs
    for side, run in runs.items():
        assert run["device"] == "simulated h100-80gb" and run["bits"] == 4 and run["lora_r"] == 4
        # 2 layers, + recompute; patched: the flash kernel whose results a checkpointed forward keeps (attention once)
        path = "flash-head-groups" if side == "patched" else "sdpa-flash"
        assert run["attention_paths"] == {path: 4}, run["attention_paths"]
        assert run["peak_gib"] == run["peak_bytes"] / 2**30 and run["fits"] is True
        assert {"op", "shape", "dtype", "bytes"} <= set(run["peak_holders"][0])
    vocab, n = 1024, 8192
    assert any(h["shape"] == [n, vocab] for h in runs["stock"]["peak_holders"])
    assert not any(vocab in h["shape"] and n in h["shape"] for h in runs["patched"]["peak_holders"])
    assert runs["patched"]["step_bytes"] < runs["stock"]["step_bytes"] / 2
    saved = json.loads(output.read_text())
    assert saved["environment"]["simulated"] and saved["environment"]["lora_targets"] == ["q_proj", "v_proj"]
    assert "simulated h100-80gb" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--bits", "4"], "go with --simulate"),
    (["--simulate", "h100-80gb", "--lora_targets", "q_proj"], "need --lora"),
    (["--simulate", "cpu", "--bits", "4"], "follows --dtype"),
    (["--simulate", "h100-80gb", "--layers", "0"], "--layers must be positive"),
    (["--simulate", "h100-80gb", "--sequence_parallel", "0"], "must be >= 1"),
    (["--simulate", "tpu-v5"], "invalid choice"),
])
def test_bad_simulate_flags_fail_before_any_work(argv, message, capsys):
    def runner(spec):
        raise AssertionError("no run may start")

    with pytest.raises(SystemExit) as exit_info:
        main(["--model", "tiny", *argv], runner=runner)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_calibrate_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: --calibrate runs (tests/test_cuda.py)")
    with pytest.raises(SystemExit):
        main(["--model", "tiny", "--simulate", "h100-80gb", "--calibrate"], runner=None)
    assert "needs a CUDA GPU" in capsys.readouterr().err


def _linear_runner(per_token: dict, lengths: list | None = None):
    """A stand-in worker on a simulated a100-40gb whose peak is 1 GiB plus `per_token[side]` bytes a token; the
    lengths it is asked for go to `lengths`."""
    usable = device("a100-40gb").usable_bytes

    def runner(spec):
        if lengths is not None:
            lengths.append(spec["seq_len"])
        peak = 2**30 + per_token[spec["side"]] * spec["seq_len"]
        return {"ok": True, "device": "simulated a100-40gb", "layers": 2, "depth": 2, "extrapolated": False,
                "peak_bytes": peak, "step_bytes": peak, "bytes_per_token": peak / spec["seq_len"],
                "fits": peak <= usable, "attention_paths": {}, "peak_holders": [], "threads": 1}
    return runner


def test_find_max_on_the_simulated_device_bisects_per_side(tmp_path):
    """--find_max with a stand-in runner whose peak grows linearly: the longest fitting length per side."""
    usable = device("a100-40gb").usable_bytes
    per_token = {"stock": 400_000, "patched": 100_000}
    runner = _linear_runner(per_token)
    report = main(["--model", "tiny", "--simulate", "a100-40gb", "--seq_lens", "16384", "--find_max", "--output",
                   str(tmp_path / "find_max.json")], runner=runner)
    for side, rate in per_token.items():
        exact = (usable - 2**30) // rate
        found = report["find_max"][side]["max_context_tokens"]
        assert found <= exact < found + 1024, (side, found, exact)


def test_find_max_starts_from_the_longest_sweep_length_that_fits(tmp_path):
    """The longest sweep length that fits is where the search starts (with the cap 1K above it, one run more
    decides), and the shortest longer one that does not is where it ends."""
    usable = device("a100-40gb").usable_bytes
    lengths = []
    runner = _linear_runner({"patched": 100_000}, lengths)
    longest = (usable - 2**30) // 100_000 // 1024 * 1024
    report = main(["--model", "tiny", "--simulate", "a100-40gb", "--sides", "patched", "--seq_lens", "16384",
                   str(longest), "--find_max", "--max_len", str(longest + 1024), "--output",
                   str(tmp_path / "find_max.json")], runner=runner)
    assert lengths == [16384, longest, longest + 1024]
    assert report["find_max"]["patched"]["max_context_tokens"] == longest
    lengths.clear()  # a sweep length that does not fit bounds the search from above: here, no run more
    report = main(["--model", "tiny", "--simulate", "a100-40gb", "--sides", "patched", "--seq_lens",
                   str(longest - 1024), str(longest), str(longest + 1024), "--find_max", "--max_len", str(8 * longest),
                   "--output", str(tmp_path / "find_max.json")], runner=runner)
    assert lengths == [longest - 1024, longest, longest + 1024]
    assert report["find_max"]["patched"]["max_context_tokens"] == longest


def test_offload_side_moves_the_checkpoints_to_host(tmp_path, shim_library):
    """patched+offload: the bf16 layer checkpoints (and the final norm's and loss's inputs) are host bytes, counted
    apart; the device peak drops by the checkpoints, less what a backward still holds of that size (the layer input
    in use, the next one prefetched, the embedding output that peft's input-grad hook makes a leaf): at most four; and
    by the frozen embeddings, away through the backward."""
    layers = 8
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": layers,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 176,
                                  "vocab_size": 256, "max_position_embeddings": 8192}))
    report = main(["--simulate", "h100-80gb", "--model", str(config), "--seq_lens", "8192", "--lora", "--lora_r", "4",
                   "--sides", "patched", "patched+offload", "--output", str(tmp_path / "sim.json")])
    runs = {r["side"]: r for r in report["runs"]}
    assert all(r["ok"] for r in runs.values()), runs
    one = 8192 * 64 * 2  # tokens x hidden x bf16
    resident, offloaded = runs["patched"], runs["patched+offload"]
    assert resident["host_peak_bytes"] < 1024  # a few host scalars (RNG state)
    # + the final norm's and loss's inputs, and the frozen embedding and LM head (a layer input is larger: they wait on
    # the host through the backward)
    embeddings = 2 * 256 * 64 * 2
    assert 0 <= offloaded["host_peak_bytes"] - (layers + 2) * one - embeddings < 1024
    assert offloaded["peak_bytes"] <= resident["peak_bytes"] - (layers - 4) * one - embeddings


def test_checkpoint_stride_takes_the_layer_inputs_off_the_device(tmp_path, shim_library):
    """--checkpoint_stride 2: of 8 bf16 layer inputs and the final norm's, those of layers 1, 3, 5, 7 are remade in
    backward instead of kept; at the peak (the last layer's backward) the one remade there is alive: three fewer."""
    layers = 8
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": layers,
                                  "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 176,
                                  "vocab_size": 256, "max_position_embeddings": 8192}))
    runs = {}
    for stride in (1, 2):
        report = main(["--simulate", "h100-80gb", "--model", str(config), "--seq_lens", "8192", "--lora", "--lora_r",
                       "4", "--sides", "patched", "--checkpoint_stride", str(stride),
                       "--output", str(tmp_path / f"sim{stride}.json")])
        (runs[stride],) = report["runs"]
        assert runs[stride]["ok"], runs[stride]
    one = 8192 * 64 * 2  # tokens x hidden x bf16
    assert runs[2]["peak_bytes"] <= runs[1]["peak_bytes"] - 3 * one
    assert runs[2]["step_seconds"] > runs[1]["step_seconds"]  # four layer forwards more, on the clock


def test_flops_of_grouped_sdpa_count_the_query_heads():
    """torch < 2.13's flop formula refuses grouped key / value heads; the tracker hands it the query's head count,
    which is what the kernel computes: the same FLOPs as with the key / value heads repeated."""
    from torch.utils.flop_counter import flop_registry

    from bpt.gpusim.tracker import _query_heads

    formula = flop_registry[torch.ops.aten._scaled_dot_product_flash_attention]
    q = torch.empty(1, 8, 64, 16, device="meta")
    k = v = torch.empty(1, 2, 64, 16, device="meta")
    repeated = torch.empty(1, 8, 64, 16, device="meta")
    grouped = formula(*_query_heads([q, k, v]), out_val=None)
    assert grouped == formula(q, repeated, repeated, out_val=None) == 4 * 8 * 64 * 64 * 16
