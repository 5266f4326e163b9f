"""`python -m train.qlora --fsdp` under `accelerate launch` (CPU processes over gloo): the 4-bit base and LoRA
really sharded (FSDP2), per-step losses equal to one process, the adapter saved whole in peft's format, resume
(with sequence parallelism too), and what FSDP cannot shard refused with one line before any weights load."""
from __future__ import annotations

import os
import subprocess

import pytest
import torch

from cli_helpers import ENV, REPO, accelerate_launch, base_argv, losses, save_prequantized
from train.recipe.args import parse_args
from train.run.command import main
from train.run.qlora import run

pytestmark = pytest.mark.usefixtures("one_thread")

COMMON = ("--max_steps", 3, "--lora_dropout", 0, "--save_steps", 2)


def _launch(tiny, out, *extra, crash_after: int | None = None) -> subprocess.CompletedProcess:
    """train.qlora --fsdp on 2 processes; crash_after=N: every process exits 3 once checkpoint-N is written."""
    program = (["-m", "train.qlora"] if crash_after is None
               else [str(REPO / "tests/qlora_crash_after.py"), str(crash_after)])
    cmd = [*accelerate_launch(2), *program,
           *base_argv(tiny, out, *COMMON, "--fsdp", *extra)]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=400)


def _adapter(out) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(out, "adapter_model.safetensors"))


def test_fsdp_shards_the_4bit_base_and_matches_one_process(tiny, tmp_path):
    """Data parallel over 2 processes (one row each) with every weight sharded, vs one process with both rows."""
    positions = ("--rope_scaling", "linear", "--rope_factor", 2)  # 256 positions: room for a passkey prompt
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, *COMMON, *positions, "--per_device_train_batch_size", 2)))
    two = tmp_path / "two"
    # Passkey evaluation before and after: every rank decodes (each forward gathers the shards).
    done = _launch(tiny, two, *positions, "--per_device_train_batch_size", 1, "--eval_passkey", "--eval_trials", 1,
                   "--eval_lengths", 140)
    assert done.returncode == 0, done.stderr[-3000:]
    # Each process holds half of every weight (DTensor shards), the 4-bit data included.
    assert "FSDP2 over 2 process(es), the main one holding 50.0% of the weights" in done.stderr
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    assert (two / "checkpoint-2" / "optimizer.pt").exists()
    assert "passkey accuracy after training" in done.stdout and done.stdout.count("passkey accuracy") == 2
    gathered, expected = _adapter(two), _adapter(one)  # whole tensors, peft's names
    assert gathered.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(gathered[name], expected[name], rtol=1e-4, atol=1e-6)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from train.recipe.model import read_run

    base = AutoModelForCausalLM.from_pretrained(tiny / "model", config=read_run(str(two)).config)
    loaded = PeftModel.from_pretrained(base, two)
    name = next(n for n, p in loaded.named_parameters() if "lora_B" in n)
    assert loaded.get_parameter(name).abs().sum() > 0  # trained values, not peft's zero init


def test_fsdp_with_offloaded_checkpoints_matches_one_process_without(tiny, tmp_path):
    """--fsdp with --offload_checkpoints: the checkpoints of sharded layers in host memory, per-step losses those of
    one process keeping its checkpoints (both rows of a step, one per process under FSDP)."""
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, *COMMON, "--per_device_train_batch_size", 2, "--no_offload_checkpoints")))
    two = tmp_path / "two"
    done = _launch(tiny, two, "--per_device_train_batch_size", 1, "--offload_checkpoints")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FSDP2 over 2 process(es)" in done.stderr
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)


def test_fsdp_cpu_offload_trains_as_fsdp_does(tiny, tmp_path):
    """--fsdp_cpu_offload: the shards, their gradients and the optimizer step in host memory (CPUOffloadPolicy;
    unpinned on a machine without CUDA) train bitwise as FSDP without it (which matches one process, above)."""
    runs = {}
    for offload in (False, True):
        out = tmp_path / f"offload-{offload}"
        done = _launch(tiny, out, "--per_device_train_batch_size", 1, *(["--fsdp_cpu_offload"] if offload else []))
        assert done.returncode == 0, done.stderr[-3000:]
        runs[offload] = out
    assert "the main one holding 50.0% of the weights in host memory" in done.stderr
    assert losses(runs[True]) == losses(runs[False])
    offloaded, resident = _adapter(runs[True]), _adapter(runs[False])
    assert offloaded.keys() == resident.keys()
    for name in resident:
        assert torch.equal(offloaded[name], resident[name]), name


def test_resume_under_sequence_parallelism_matches_one_process(tiny, tmp_path):
    """SP 2 with FSDP over both processes: stopped after step 2, resumed from checkpoint-2 (whole adapter loaded
    before sharding, the optimizer's full state into its shards); the three losses equal one process training the
    same rows. (With DDP instead of FSDP the same steps run without the sharding.)"""
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, *COMMON, "--per_device_train_batch_size", 1)))
    out = tmp_path / "sp"
    extra = ["--per_device_train_batch_size", 1, "--sequence_parallel", 2]
    stopped = _launch(tiny, out, *extra, crash_after=2)
    assert "crashing after step 2" in stopped.stderr and stopped.returncode != 0, stopped.stderr[-3000:]
    assert not (out / "run_info.json").exists()
    resumed = _launch(tiny, out, *extra, "--resume_from_checkpoint", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr and "checkpoint-2 at step 2" in resumed.stderr
    assert "FSDP2 over 2" in resumed.stderr
    assert losses(out) == pytest.approx(losses(one), rel=1e-5)


@pytest.mark.parametrize("extra,message", [
    (("--bits", 8), "error: --fsdp shards 4-bit (--bits 4) or unquantised (--bits 16) bases; bitsandbytes int8 "
                    "weights cannot be sharded: choose --bits 4"),
    (("--optim", "paged_adamw_8bit"), "error: --optim paged_adamw_8bit keeps bitsandbytes states that FSDP cannot "
                                      "shard; use --optim adamw with --fsdp"),
    ("prequantized", "in uint8 storage, which FSDP cannot shard (training would run at loss 0 with NaN gradients); "
                     "use the unquantised base (this recipe quantises it for FSDP) or drop --fsdp"),
])
def test_what_fsdp_cannot_shard_is_refused_before_loading(tiny, tmp_path, capsys, monkeypatch, extra, message):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under accelerate launch (refused before any process group is needed)
    argv = base_argv(tiny, tmp_path / "run", "--fsdp")
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
    assert err.strip().splitlines()[-1].endswith(message)


def test_shard_model_refuses_uint8_4bit_storage(tiny):
    """The library guard (a user's own loop): 4-bit data in uint8 tensors would train at loss 0 under FSDP."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from train.parallel.fsdp import shard_model

    model = AutoModelForCausalLM.from_pretrained(tiny / "model", quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    with pytest.raises(ValueError, match=r"keeps its 4-bit data in torch.uint8, which FSDP cannot shard .*"
                                         r"bnb_4bit_quant_storage"):
        shard_model(model)


def test_an_accelerate_fsdp_launch_turns_on_fsdp_and_keeps_accelerate_from_wrapping(monkeypatch):
    from train.parallel.fsdp import LAUNCHER_FSDP_ENV, use_launcher_fsdp

    args = parse_args(["--max_steps", "1"])
    assert args.fsdp is False
    monkeypatch.setenv(LAUNCHER_FSDP_ENV, "true")  # what `accelerate launch` sets for distributed_type: FSDP
    use_launcher_fsdp(args)
    assert args.fsdp is True and os.environ[LAUNCHER_FSDP_ENV] == "false"


def test_trainable_parameters_are_kept_in_one_dtype_for_fsdp():
    """A 16-bit base's trainable norms next to fp32 LoRA would stop FSDP ("uniform original parameter dtype")."""
    from train.parallel.fsdp import trainable_in_fp32

    model = torch.nn.Sequential(torch.nn.Linear(4, 4).bfloat16(), torch.nn.LayerNorm(4).bfloat16())
    model[0].requires_grad_(False)
    trainable_in_fp32(model)
    assert model[0].weight.dtype == torch.bfloat16  # frozen: untouched
    assert {p.dtype for p in model[1].parameters()} == {torch.float32}


def test_fsdp_with_one_process_trains_unsharded_with_a_note(tiny, tmp_path, capsys):
    plain = run(parse_args(base_argv(tiny, tmp_path / "plain", *COMMON)))
    capsys.readouterr()
    noted = run(parse_args(base_argv(tiny, tmp_path / "fsdp", *COMMON, "--fsdp")))
    assert "note: --fsdp with one process has nothing to shard over; running unsharded" in capsys.readouterr().err
    assert noted.losses == plain.losses


def test_cpu_offload_without_fsdp_is_refused_before_loading(tiny, tmp_path, capsys):
    assert main([*base_argv(tiny, tmp_path / "run"), "--fsdp_cpu_offload"]) == 2
    err = capsys.readouterr().err
    assert "Loading weights" not in err
    assert err.strip().splitlines()[-1] == ("error: --fsdp_cpu_offload offloads FSDP's shards: add --fsdp (and launch "
                                            "several processes)")
