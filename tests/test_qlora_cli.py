"""`python -m train.qlora` end to end on a tiny llama (built from a config, saved to tmp) and a generated
jsonl dataset: outputs, reload, exactness (BPT vs stock, resume vs uninterrupted, DDP vs one process),
and one-line errors for bad input.

Most runs are in-process (`run(parse_args(argv))`, the CLI's own code path) to save interpreter
start-ups; a few go through a real subprocess to check exit codes and stderr.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_helpers import ENV, REPO, accelerate_launch, base_argv, error_line, losses, metrics
from train.recipe.args import parse_args
from train.run import loop
from train.run.command import main
from train.run.qlora import run

pytestmark = pytest.mark.usefixtures("one_thread")


class Crash(Exception):
    """A simulated crash of the training process."""


def crash_after(step: int, add):
    """MetricsLog.add that raises Crash once `step` is logged."""

    def patched(self, logged_step, *args, **kwargs):
        window = add(self, logged_step, *args, **kwargs)
        if logged_step == step:
            raise Crash(f"crashed after step {step}")
        return window

    return patched


def assert_close(actual, expected, rel=1e-4):
    assert actual == pytest.approx(expected, rel=rel), f"{actual} != {expected}"


# ---------------------------------------------------------------- end to end

def test_cli_end_to_end_4bit(tiny, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "train.qlora", *base_argv(tiny, out, "--max_steps", 3, "--save_steps", 2)]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert {"step", "loss", "lr", "tokens_per_s", "peak_mem_mb"} <= row.keys()
        assert row["tokens_per_s"] > 0 and row["peak_mem_mb"] > 0
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json", "run_info.json"):
        assert (out / name).is_file(), name
    assert json.loads((out / "run_info.json").read_text())["finished"] is True
    checkpoint = out / "checkpoint-2"
    for name in ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pt", "trainer_state.json"):
        assert (checkpoint / name).is_file(), name
    assert json.loads((checkpoint / "trainer_state.json").read_text())["step"] == 2
    assert not [p for p in out.iterdir() if p.name.startswith(".tmp-")], "a temp checkpoint dir was left behind"

    # A finished run is not overwritten by accident: exit 2, one line, no traceback, with the way out.
    again = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2
    assert "Traceback" not in again.stderr
    last = again.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "--overwrite_output_dir" in last
    assert again.stderr.count("error:") == 1


@pytest.mark.parametrize("bits", [4, 16])
def test_saved_adapter_reloads_to_the_trained_model(tiny, tmp_path, bits):
    from train.recipe.model import load_trained

    out = tmp_path / "run"
    result = run(parse_args(base_argv(tiny, out, "--bits", bits, "--max_steps", 2, "--train_embeddings_and_norms",
                                      "--rope_scaling", "linear", "--rope_factor", 2)))
    probe = torch.randint(3, 60, (2, 40), generator=torch.Generator().manual_seed(1))
    result.model.eval()
    with torch.no_grad():
        expected = result.model(input_ids=probe).logits
    reloaded, tokenizer = load_trained(str(out), bits=bits)
    with torch.no_grad():
        actual = reloaded.eval()(input_ids=probe).logits
    assert reloaded.peft_config["default"].modules_to_save  # embeddings and norms travel with the adapter
    assert reloaded.get_base_model().config.rope_parameters["factor"] == 2.0
    assert tokenizer.pad_token_id is not None
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)


def test_merge_writes_a_full_model(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    result = run(parse_args(base_argv(tiny, out, "--bits", 16, "--max_steps", 1, "--merge")))
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    probe = torch.randint(3, 60, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=probe).logits, result.model.eval()(input_ids=probe).logits,
                                   rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- exactness of the loop

@pytest.fixture(scope="module")
def stock_run(tiny, tmp_path_factory):
    """Unpatched reference: padded rows (no packing), 2 rows x 2 micro-batches per step, no dropout."""
    out = tmp_path_factory.mktemp("stock") / "run"
    run(parse_args(base_argv(tiny, out, "--no_bpt", "--no_packing", "--per_device_train_batch_size", 2,
                             "--gradient_accumulation_steps", 2, "--lora_dropout", 0)))
    return losses(out)


def test_bpt_losses_equal_stock(tiny, tmp_path, stock_run):
    out = tmp_path / "run"
    run(parse_args(base_argv(tiny, out, "--bpt", "--no_packing", "--per_device_train_batch_size", 2,
                             "--gradient_accumulation_steps", 2, "--lora_dropout", 0)))
    assert len(stock_run) == 4
    assert_close(losses(out), stock_run)


def test_offload_checkpoints_trains_bitwise_as_without(tiny, tmp_path, capsys):
    runs = {}
    opening = {}
    for flag in ("--no_offload_checkpoints", "--offload_checkpoints"):
        runs[flag] = tmp_path / flag
        run(parse_args(base_argv(tiny, runs[flag], flag, "--lora_dropout", 0)))
        opening[flag] = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("trainable"))
    assert losses(runs["--offload_checkpoints"]) == losses(runs["--no_offload_checkpoints"])
    assert "; layer checkpoints offloaded to host memory;" in opening["--offload_checkpoints"]
    assert "offloaded" not in opening["--no_offload_checkpoints"]
    assert main(base_argv(tiny, tmp_path / "refused", "--offload_checkpoints", "--no_gradient_checkpointing")) == 2
    assert error_line(capsys).endswith("it needs --bpt and gradient checkpointing (drop --no_gradient_checkpointing "
                                       "/ --no_bpt)")


def test_checkpoint_stride_trains_bitwise_as_without(tiny, tmp_path, capsys):
    """Dropout on (the recipe's default): the remade layer forwards draw the masks the first ones drew."""
    runs = {stride: tmp_path / f"stride{stride}" for stride in (1, 2)}
    opening = {}
    for stride, out in runs.items():
        run(parse_args(base_argv(tiny, out, "--checkpoint_stride", stride)))
        opening[stride] = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("trainable"))
    assert losses(runs[2]) == losses(runs[1])
    assert "; one layer checkpoint in 2 kept, the others remade in backward;" in opening[2]
    assert "remade" not in opening[1]
    for flags, says in ((("--no_gradient_checkpointing",), "it needs --bpt and gradient checkpointing"),
                        (("--offload_checkpoints",), "both take the layer checkpoints off the device: choose one"),
                        (("--fsdp",), "runs on one process or data parallel")):
        assert main(base_argv(tiny, tmp_path / "refused", "--checkpoint_stride", 2, *flags)) == 2
        assert says in error_line(capsys)


def test_resume_repeats_the_uninterrupted_run(tiny, tmp_path, monkeypatch):
    # Dropout on, so the restored RNG state matters; gradient accumulation, so the data position does.
    argv = lambda out, *extra: base_argv(tiny, out, "--save_steps", 2, "--lora_dropout", 0.1,  # noqa: E731
                                         "--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2,
                                         *extra)
    run(parse_args(argv(tmp_path / "whole")))
    expected = losses(tmp_path / "whole")

    out = tmp_path / "interrupted"
    with monkeypatch.context() as patch:  # dies after logging step 3, past its last checkpoint (2)
        patch.setattr(loop.MetricsLog, "add", crash_after(3, loop.MetricsLog.add))
        with pytest.raises(Crash):
            run(parse_args(argv(out)))
    assert (out / "checkpoint-2").is_dir() and not (out / "run_info.json").exists()
    assert main(argv(out)) == 2  # unfinished run: refuses to start over silently
    run(parse_args(argv(out, "--resume_from_checkpoint", "latest")))
    assert [m["step"] for m in metrics(out)] == [1, 2, 3, 4]
    assert losses(out)[2:] == expected[2:]  # bitwise: same weights, optimizer, RNG and data


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tiny, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    accumulate, calls = loop.accumulate, []

    def nan_at_step_3(*args, **kwargs):
        loss, tokens = accumulate(*args, **kwargs)
        calls.append(loss)
        return (float("nan") if len(calls) == 3 else loss), tokens

    monkeypatch.setattr(loop, "accumulate", nan_at_step_3)
    assert main(base_argv(tiny, out, "--save_steps", 1)) == 1
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "nan" in message and "checkpoint-2" in message and "--resume_from_checkpoint" in message
    assert (out / "checkpoint-2").is_dir()
    assert not (out / "checkpoint-3").exists() and not (out / "run_info.json").exists()


def test_two_process_ddp_equals_one_process_with_the_same_global_batch(tiny, tmp_path):
    """accelerate launch with 2 CPU processes (gloo): each takes every other row, like one process with
    twice the batch; only rank 0 writes."""
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, "--max_steps", 2, "--per_device_train_batch_size", 2, "--lora_dropout", 0)))
    two = tmp_path / "two"
    cmd = [*accelerate_launch(2), "-m", "train.qlora",
           *base_argv(tiny, two, "--max_steps", 2, "--per_device_train_batch_size", 1, "--lora_dropout", 0,
                      "--save_steps", 2)]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on 2 process(es)" in done.stderr
    assert [m["step"] for m in metrics(two)] == [1, 2]  # one writer
    assert_close(losses(two), losses(one))


# ---------------------------------------------------------------- bad input: exit 2, one line, a hint

def _bad_cases(tiny, tmp: Path) -> dict:
    model, data = str(tiny / "model"), str(tiny / "data.jsonl")
    (tmp / "no_config").mkdir()
    (tmp / "empty.jsonl").write_text("")
    (tmp / "broken.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three\n{"text": "four"}\n')
    (tmp / "blank.jsonl").write_text('{"text": ""}\n' * 30)
    (tmp / "a_file").write_text("not a directory")
    (tmp / "bad.yaml").write_text("learning_rate: [1e-4\n")
    (tmp / "unknown.yaml").write_text("learning_rat: 1e-4\n")
    (tmp / "opt").mkdir()
    (tmp / "opt/config.json").write_text(json.dumps({"model_type": "opt", "max_position_embeddings": 128}))
    finished = tmp / "finished"
    finished.mkdir()
    (finished / "run_info.json").write_text("{}")
    unfinished = tmp / "unfinished"
    (unfinished / "checkpoint-2").mkdir(parents=True)
    common = ["--max_seq_len", "64", "--output_dir", str(tmp / "out")]
    return {
        "missing model": (["--model_name_or_path", str(tmp / "nope"), "--dataset", data, *common],
                          "not a model directory"),
        "model without config": (["--model_name_or_path", str(tmp / "no_config"), "--dataset", data, *common],
                                 "has no config.json"),
        "missing dataset": (["--model_name_or_path", model, "--dataset", str(tmp / "nope.jsonl"), *common],
                            "does not exist"),
        "missing text field": (["--model_name_or_path", model, "--dataset", data, "--text_field", "body", *common],
                               "available columns: text, id"),
        "empty dataset": (["--model_name_or_path", model, "--dataset", str(tmp / "empty.jsonl"), *common], "empty"),
        "broken jsonl line": (["--model_name_or_path", model, "--dataset", str(tmp / "broken.jsonl"), *common],
                              (f"{tmp / 'broken.jsonl'}: line 3 is not valid JSON", "fix or remove that line")),
        "all documents empty": (["--model_name_or_path", model, "--dataset", str(tmp / "blank.jsonl"), "--no_packing",
                                 *common], ("has an empty 'text'", "--text_field")),
        "output dir not writable": (["--model_name_or_path", model, "--dataset", data, "--max_seq_len", "64",
                                     "--output_dir", str(tmp / "a_file" / "run")],
                                    ("is not writable (Not a directory)", "choose a directory you can write to")),
        "too long, no rope": (["--model_name_or_path", model, "--dataset", data, "--output_dir", str(tmp / "o"),
                               "--max_seq_len", "512"], ("add --rope_scaling linear", "lower --max_seq_len to 128")),
        "rope factor too small": (["--model_name_or_path", model, "--dataset", data, "--output_dir", str(tmp / "o"),
                                   "--max_seq_len", "512", "--rope_scaling", "linear", "--rope_factor", "2"],
                                  "raise it to 4"),
        "unsupported family": (["--model_name_or_path", str(tmp / "opt"), "--dataset", data, *common],
                               ("--no_bpt", "opt")),
        "finished output dir": (["--model_name_or_path", model, "--dataset", data, "--max_seq_len", "64",
                                 "--output_dir", str(finished)], "--overwrite_output_dir"),
        "unfinished output dir": (["--model_name_or_path", model, "--dataset", data, "--max_seq_len", "64",
                                   "--output_dir", str(unfinished)], "--resume_from_checkpoint latest"),
        "missing checkpoint": ([*common[:2], "--model_name_or_path", model, "--output_dir", str(tmp / "o2"),
                                "--resume_from_checkpoint", "latest"], "no checkpoint-N"),
        "corrupt checkpoint": (["--model_name_or_path", model, "--max_seq_len", "64", "--output_dir", str(unfinished),
                                "--resume_from_checkpoint", str(unfinished / "checkpoint-2")],
                               "incomplete or corrupt"),
        "bad yaml": (["--config", str(tmp / "bad.yaml")], "not valid YAML"),
        "unknown yaml key": (["--config", str(tmp / "unknown.yaml")], "did you mean 'learning_rate'"),
        "unknown flag": (["--learning_rat", "1e-4"], "unrecognized arguments"),
        "bits": (["--bits", "3"], "choose from 4, 8, 16"),
        "dropout": (["--lora_dropout", "1.5"], "--lora_dropout must be in [0, 1)"),
        "tracker missing": (["--report_to", "wandb", "--output_dir", str(tmp / "o3")], "pip install wandb"),
        "passkey too short": (["--model_name_or_path", model, "--dataset", data, "--output_dir", str(tmp / "o4"),
                               "--max_seq_len", "64", "--eval_passkey"],
                              ("passkey length 64 is too short for this tokenizer", "at least")),
    }


BAD_CASE_NAMES = ["missing model", "model without config", "missing dataset", "missing text field", "empty dataset",
                  "broken jsonl line", "all documents empty", "output dir not writable",
                  "too long, no rope", "rope factor too small", "unsupported family", "finished output dir",
                  "unfinished output dir", "missing checkpoint", "corrupt checkpoint", "bad yaml", "unknown yaml key",
                  "unknown flag", "bits", "dropout", "tracker missing", "passkey too short"]


@pytest.mark.parametrize("case", BAD_CASE_NAMES)
def test_bad_input_is_one_line_exit_2(tiny, tmp_path, capsys, monkeypatch, case):
    if case == "tracker missing":  # wandb is in the test extra: make it look absent
        real_find_spec = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a, **k: None if name == "wandb" else real_find_spec(name, *a, **k))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_weights(*args, **kwargs):
        raise AssertionError("the model was loaded before the mistake was found")

    monkeypatch.setattr("train.recipe.model.build_model", no_weights)  # every mistake here is found before heavy work
    argv, hints = _bad_cases(tiny, tmp_path)[case]
    assert main(argv) == 2
    line = error_line(capsys)
    for hint in [hints] if isinstance(hints, str) else hints:
        assert hint in line
