"""`python -m train.qlora` under `accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml` (CPU
processes over gloo): the 4-bit base and LoRA partitioned by DeepSpeed ZeRO-3, per-step losses and gradient norms
equal to one process (gradient accumulation, clipping and the lr schedule included), the adapter saved whole in peft's
format, the optimizer state gathered in the common format, param + optimizer offload, resume, sequence parallelism
inside the ZeRO world, and what ZeRO-3 cannot run refused with one line before any weights load.

The first launch on a fresh machine JIT-builds DeepSpeed's shared-memory communication op (~60 s, then cached under
~/.cache/torch_extensions); the optimizer is torch's AdamW, so no cpu_adam build."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

pytest.importorskip("deepspeed")

from cli_helpers import ENV, REPO, accelerate_launch, base_argv, metrics, save_prequantized  # noqa: E402
from train.recipe.args import parse_args  # noqa: E402
from train.run.command import main
from train.run.qlora import run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = ("--max_steps", 3, "--lora_dropout", 0, "--save_steps", 2)
CONFIG = REPO / "configs/accelerate/deepspeed_zero3.yaml"
OFFLOAD_CONFIG = REPO / "configs/accelerate/deepspeed_zero3_offload.yaml"


def _launch(tiny, out, *extra, config=CONFIG, crash_after: int | None = None,
            processes: int = 2) -> subprocess.CompletedProcess:
    """train.qlora on `processes` processes under the DeepSpeed launch config; crash_after=N: every process exits 3
    once checkpoint-N is written."""
    program = (["-m", "train.qlora"] if crash_after is None
               else [str(REPO / "tests/qlora_crash_after.py"), str(crash_after)])
    cmd = [*accelerate_launch(processes, config), *program, *base_argv(tiny, out, *COMMON, *extra)]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=400)


def _adapter(out) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "adapter_model.safetensors"))


def _assert_same_steps(out, reference) -> None:
    """Per-step loss and gradient norm (before clipping) within 1e-5 relative of the reference run's."""
    got, expected = metrics(out), metrics(reference)
    assert [m["step"] for m in got] == [m["step"] for m in expected] == [1, 2, 3]
    for key in ("loss", "grad_norm", "lr"):
        assert [m[key] for m in got] == pytest.approx([m[key] for m in expected], rel=1e-5), key


def _assert_close_tensors(got: dict, expected: dict, relative: float | None = None) -> None:
    """Every element within 1e-5 (absolute and relative: LoRA weights are ~0.1), or with `relative`, within that
    fraction of the tensor's largest magnitude (optimizer moments, whose scale is far from 1)."""
    assert got.keys() == expected.keys() and expected
    for name in expected:
        if relative is None:
            torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-5, msg=name)
        else:
            scale = expected[name].abs().max().clamp_min(1e-30)
            assert float((got[name] - expected[name]).abs().max() / scale) <= relative, name


def test_zero3_partitions_the_4bit_base_and_matches_one_process(tiny, tmp_path):
    """Data parallel over 2 processes (one row per micro-batch, 2 micro-batches a step) with every weight partitioned,
    vs one process with both rows per micro-batch: losses, gradient norms (clipped at the default 1.0: the norms are
    above it), the adapter and the optimizer state of checkpoint-2."""
    # Passkey evaluation before and after training: every rank decodes (each forward gathers the partitions).
    passkey = ("--rope_scaling", "linear", "--rope_factor", 2, "--eval_passkey", "--eval_trials", 1,
               "--eval_lengths", 140)  # 256 positions: room for a passkey prompt
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, *COMMON, *passkey, "--per_device_train_batch_size", 2,
                             "--gradient_accumulation_steps", 2)))
    two = tmp_path / "two"
    done = _launch(tiny, two, *passkey, "--per_device_train_batch_size", 1, "--gradient_accumulation_steps", 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "passkey accuracy after training" in done.stdout and done.stdout.count("passkey accuracy") == 2
    assert json.loads((two / "eval.json").read_text()) == json.loads((one / "eval.json").read_text())
    # Every parameter partitioned, the 4-bit data (float storage) included: each process holds half.
    assert "DeepSpeed ZeRO-3 over 2 process(es), the main one holding 50.0% of the weights" in done.stderr
    # No library noise from the workers: DeepSpeed's deprecated torch collectives (FutureWarning, two lines per rank per
    # filter change), its shared-memory op's "built successfully" per rank, transformers' past_key_values rename.
    # (The launcher's own "Setting accelerator to CPU" is accelerate's process, not ours.)
    output = done.stdout + done.stderr
    assert "FutureWarning" not in output and "built successfully" not in output, output[-4000:]
    assert "past_key_values" not in output and output.count("Setting accelerator to CPU") <= 1, output[-4000:]
    _assert_same_steps(two, one)
    assert max(m["grad_norm"] for m in metrics(one)) > 1.0  # clipping took part
    _assert_close_tensors(_adapter(two), _adapter(one))  # whole tensors, peft's names

    # The optimizer state, gathered from the partitions, in the format a one-process checkpoint has.
    saved = torch.load(two / "checkpoint-2" / "optimizer.pt", weights_only=False)
    reference = torch.load(one / "checkpoint-2" / "optimizer.pt", weights_only=False)
    assert saved["param_groups"][0]["params"] == reference["param_groups"][0]["params"]
    assert saved["param_groups"][0]["lr"] == pytest.approx(reference["param_groups"][0]["lr"])
    assert saved["state"].keys() == reference["state"].keys()
    for name, state in reference["state"].items():
        assert float(saved["state"][name]["step"]) == float(state["step"]) == 2
        _assert_close_tensors({k: saved["state"][name][k] for k in ("exp_avg", "exp_avg_sq")},
                              {k: state[k] for k in ("exp_avg", "exp_avg_sq")}, relative=1e-4)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from train.recipe.model import read_run

    base = AutoModelForCausalLM.from_pretrained(tiny / "model", config=read_run(str(two)).config)
    loaded = PeftModel.from_pretrained(base, two)
    name = next(n for n, p in loaded.named_parameters() if "lora_B" in n)
    assert loaded.get_parameter(name).abs().sum() > 0  # trained values, not peft's zero init


def test_zero3_with_param_and_optimizer_offload_matches_one_process(tiny, tmp_path):
    """deepspeed_zero3_offload.yaml: partitions, gradients and the (torch AdamW) step in host memory; clipping at a
    --max_grad_norm that is not DeepSpeed's default."""
    clip = ("--max_grad_norm", 2.5)  # not DeepSpeed's default 1.0: step 1's norm (~2.2) is clipped by that only
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, *COMMON, *clip, "--per_device_train_batch_size", 2)))
    out = tmp_path / "offload"
    done = _launch(tiny, out, *clip, "--per_device_train_batch_size", 1, config=OFFLOAD_CONFIG)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("the main one holding 50.0% of the weights in host memory, its optimizer state in host memory"
            in done.stderr)
    _assert_same_steps(out, one)
    _assert_close_tensors(_adapter(out), _adapter(one))


def test_resume_under_zero3_matches_the_uninterrupted_run(tiny, tmp_path):
    """Stopped after checkpoint-2 is written, resumed from it (adapter loaded before partitioning, the optimizer's full
    state scattered into the partitions): the three losses are those of an uninterrupted run (one process, same rows;
    which the uninterrupted ZeRO-3 run matches, above). A fresh optimizer at step 3 would give another loss."""
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, *COMMON, "--per_device_train_batch_size", 2)))
    out = tmp_path / "zero3"
    stopped = _launch(tiny, out, "--per_device_train_batch_size", 1, crash_after=2)
    assert "crashing after step 2" in stopped.stderr and stopped.returncode != 0, stopped.stderr[-3000:]
    assert (out / "checkpoint-2").is_dir() and not (out / "run_info.json").exists()
    resumed = _launch(tiny, out, "--per_device_train_batch_size", 1, "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint-2 at step 2" in resumed.stderr and "DeepSpeed ZeRO-3 over 2" in resumed.stderr
    assert (out / "checkpoint-2").is_dir() and (out / "checkpoint-3").is_dir()  # the finished one kept
    _assert_same_steps(out, one)
    _assert_close_tensors(_adapter(out), _adapter(one))


def test_a_ddp_checkpoint_resumes_under_zero3(tiny, tmp_path):
    """The checkpoint format is common: a run stopped under plain DDP (torch's full optimizer state dict) goes on
    under ZeRO-3 (that state scattered into the partitions) with the losses of the uninterrupted run."""
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, *COMMON, "--per_device_train_batch_size", 2)))
    out = tmp_path / "ddp-then-zero3"
    stopped = _launch(tiny, out, "--per_device_train_batch_size", 1, config=REPO / "configs/accelerate/cpu_ddp.yaml",
                      crash_after=2)
    assert "crashing after step 2" in stopped.stderr and "ZeRO-3 over" not in stopped.stderr, stopped.stderr[-3000:]
    resumed = _launch(tiny, out, "--per_device_train_batch_size", 1, "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "checkpoint-2 at step 2" in resumed.stderr and "DeepSpeed ZeRO-3 over 2" in resumed.stderr
    _assert_same_steps(out, one)


def test_sequence_parallel_inside_zero3_matches_one_process(tiny, tmp_path):
    """--sequence_parallel 2 on 2 processes: both ranks split each sequence (ring attention) and form the ZeRO-3
    world; a 16-bit base with LoRA. One process trains the same rows."""
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, *COMMON, "--per_device_train_batch_size", 1, "--bits", 16)))
    out = tmp_path / "sp"
    done = _launch(tiny, out, "--per_device_train_batch_size", 1, "--bits", 16, "--sequence_parallel", 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sequences split 2 ways" in done.stderr and "DeepSpeed ZeRO-3 over 2 process(es)" in done.stderr
    _assert_same_steps(out, one)
    _assert_close_tensors(_adapter(out), _adapter(one))


def test_sequence_parallel_groups_inside_the_zero3_world_match_one_process(tiny, tmp_path):
    """SP 2 x data parallel 2 on 4 processes: ranks 0-1 and 2-3 each split their rows' sequences, ZeRO-3 partitions
    over all 4 (a quarter each); 4-bit base. One process trains both groups' rows at once."""
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, *COMMON, "--per_device_train_batch_size", 2)))
    out = tmp_path / "sp-dp"
    done = _launch(tiny, out, "--per_device_train_batch_size", 1, "--sequence_parallel", 2, processes=4)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("sequences split 2 ways (ring); DeepSpeed ZeRO-3 over 4 process(es), the main one holding 25.0% of the "
            "weights") in done.stderr
    _assert_same_steps(out, one)


@pytest.mark.parametrize("extra,env,message", [
    (("--fsdp",), {}, "error: a DeepSpeed ZeRO-3 launch partitions the model with DeepSpeed; --fsdp would shard it "
                      "again with FSDP2: drop --fsdp (or launch with configs/accelerate/cpu_ddp.yaml or "
                      "fsdp2_qlora.yaml to use FSDP2)"),
    ("prequantized", {}, "in uint8 storage, which ZeRO-3 cannot partition; use the unquantised base (this recipe "
                         "quantises it in a float storage for ZeRO-3) or launch without DeepSpeed"),
    (("--bits", 8), {}, "error: ZeRO-3 partitions 4-bit (--bits 4) or unquantised (--bits 16) bases; bitsandbytes "
                        "int8 weights cannot be partitioned: choose --bits 4"),
    (("--optim", "paged_adamw_8bit"), {}, "error: --optim paged_adamw_8bit keeps bitsandbytes states that ZeRO-3 "
                                          "cannot partition; use --optim adamw under DeepSpeed"),
    ((), {"ACCELERATE_DEEPSPEED_ZERO_STAGE": "2"}, "error: the DeepSpeed launch asks for ZeRO stage 2; train.qlora "
                                                   "runs ZeRO stage 3 (set zero_stage: 3), or use "
                                                   "configs/accelerate/cpu_ddp.yaml / multi_gpu.yaml for plain data "
                                                   "parallelism"),
    ((), {"ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "nvme"}, "error: offload_param_device nvme: train.qlora "
                                                               "offloads ZeRO-3 partitions to cpu or not at all "
                                                               "(none)"),
    ((), {"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"}, "error: the DeepSpeed launch config sets "
                                                          "gradient_accumulation_steps: 4, and this run has "
                                                          "--gradient_accumulation_steps 1: train.qlora takes it from "
                                                          "--gradient_accumulation_steps only"),
    (("--max_grad_norm", 0.5), {"ACCELERATE_GRADIENT_CLIPPING": "1.0"}, "error: the DeepSpeed launch config sets "
                                                                        "gradient_clipping: 1.0, and this run has "
                                                                        "--max_grad_norm 0.5"),
    ((), {"ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds.json"}, "error: train.qlora builds the DeepSpeed config from its own "
                                                          "flags and does not read deepspeed_config_file (ds.json)"),
])
def test_what_zero3_cannot_run_is_refused_before_loading(tiny, tmp_path, capsys, monkeypatch, extra, env, message):
    # As `accelerate launch` sets them for a DeepSpeed config with 2 processes (refused before any process group).
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    argv = base_argv(tiny, tmp_path / "run")
    if extra == "prequantized":
        model = tiny / "model-bnb-4bit"
        if not model.exists():
            save_prequantized(model)
        argv[argv.index("--model_name_or_path") + 1] = str(model)
        extra = ()
    capsys.readouterr()
    assert main([*argv, *map(str, extra)]) == 2
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, last
    assert os.environ["ACCELERATE_USE_DEEPSPEED"] == "false"  # accelerate never builds its own engine


def test_initialize_refuses_uint8_4bit_storage(tiny):
    """The library guard (a model built outside train.qlora): 4-bit data in uint8 tensors is not partitioned."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from train.parallel.deepspeed import Zero3, initialize

    model = AutoModelForCausalLM.from_pretrained(tiny / "model",
                                                 quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    args = parse_args(["--max_steps", "1"])
    with pytest.raises(ValueError, match=r"keeps its 4-bit data in torch.uint8, which ZeRO-3 cannot shard; .*"
                                         r"bnb_4bit_quant_storage"):
        initialize(model, torch.optim.AdamW(model.parameters()), args, Zero3(), world=2)


def test_deepspeed_config_follows_the_flags():
    """Clipping is --max_grad_norm (DeepSpeed's own default would be 1.0 when the key is absent, also for 0 = off);
    batch keys agree with each other; offload blocks only when asked; no DeepSpeed mixed precision."""
    from train.parallel.deepspeed import Zero3, ds_config

    args = parse_args(["--max_steps", "1", "--max_grad_norm", "0", "--per_device_train_batch_size", "3",
                       "--gradient_accumulation_steps", "5"])
    config = ds_config(args, Zero3(), world=4)
    assert config["gradient_clipping"] == 0.0
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (3, 5, 60)
    assert config["zero_optimization"]["stage"] == 3
    assert "offload_param" not in config["zero_optimization"] and "offload_optimizer" not in config["zero_optimization"]
    assert not config["bf16"]["enabled"] and not config["fp16"]["enabled"]
    offloaded = ds_config(parse_args(["--max_steps", "1"]), Zero3(offload_param=True, offload_optimizer=True), 2)
    assert offloaded["gradient_clipping"] == 1.0
    assert offloaded["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert offloaded["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_a_deepspeed_launch_with_one_process_trains_unsharded_with_a_note(tiny, tmp_path, capsys, monkeypatch):
    plain = run(parse_args(base_argv(tiny, tmp_path / "plain", *COMMON)))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    capsys.readouterr()
    noted = run(parse_args(base_argv(tiny, tmp_path / "zero3", *COMMON)))
    assert ("note: DeepSpeed ZeRO-3 with one process has nothing to partition over; training unsharded"
            in capsys.readouterr().err)
    assert noted.losses == plain.losses


def test_launch_config_values_equal_to_the_flags_are_accepted(monkeypatch, capsys):
    """`accelerate config` writes gradient_accumulation_steps: 1 and gradient_clipping: 1.0 by default: equal to the
    flags they pass; zero3_init_flag gets a note."""
    from train.parallel.deepspeed import Zero3, check_zero3

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2")
    monkeypatch.setenv("ACCELERATE_GRADIENT_CLIPPING", "1.0")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO3_INIT", "true")
    args = parse_args(["--max_steps", "1", "--gradient_accumulation_steps", "2"])
    assert check_zero3(args, None, Zero3(offload_param=True)) == Zero3(offload_param=True)
    assert "note: zero3_init_flag is not used" in capsys.readouterr().err
