"""`python -m train.qlora --sequence_parallel N` under `accelerate launch` (CPU processes over gloo): each sequence
split over the processes, per-step losses equal to one process training the same rows; bad layouts refused."""
from __future__ import annotations

import json
import subprocess

import pytest

from cli_helpers import ENV, REPO, accelerate_launch, base_argv, losses, metrics
from train.recipe.args import parse_args
from train.run.command import main
from train.run.qlora import run

pytestmark = pytest.mark.usefixtures("one_thread")

# Packed 64-token rows (documents restart their positions inside a row), two rows per step, no dropout.
COMMON = ("--max_steps", 2, "--per_device_train_batch_size", 2, "--lora_dropout", 0)


def _launch(tiny, out, *extra, processes: int = 2) -> subprocess.CompletedProcess:
    cmd = [*accelerate_launch(processes), "-m", "train.qlora",
           *base_argv(tiny, out, *COMMON, "--save_steps", 2, *extra)]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=400)


@pytest.mark.parametrize("mode,bits", [("ring", 4), ("ulysses", 16)])
def test_two_processes_split_each_sequence_and_match_one_process(tiny, tmp_path, mode, bits):
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, *COMMON, "--bits", bits)))
    two = tmp_path / "two"
    done = _launch(tiny, two, "--bits", bits, "--sequence_parallel", 2, "--sp_mode", mode)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"sequences split 2 ways ({mode})" in done.stderr
    assert [m["step"] for m in metrics(two)] == [1, 2]  # one writer
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
    assert [m["tokens"] for m in metrics(two)] == [m["tokens"] for m in metrics(one)]  # each row counted once
    assert (two / "checkpoint-2").is_dir() and (two / "adapter_model.safetensors").exists()


def test_offloaded_checkpoints_split_over_two_processes_match_one_process_without(tiny, tmp_path):
    """--offload_checkpoints with --sequence_parallel 2 (ring): the checkpointed layers recompute their sharded
    attention from host copies; per-step losses those of one process keeping its checkpoints."""
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, *COMMON, "--no_offload_checkpoints")))
    two = tmp_path / "two"
    done = _launch(tiny, two, "--sequence_parallel", 2, "--sp_mode", "ring", "--offload_checkpoints")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sequences split 2 ways (ring)" in done.stderr
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)


def test_an_alibi_family_split_over_two_processes_matches_one_process(tiny, tmp_path):
    """Bloom: its per-key ALiBi bias is built on each shard's own positions and re-based on the global ones. One
    document per row (stock Bloom cannot keep packed documents apart), so rows are right-padded."""
    from cli_helpers import save_tiny_bloom

    model = tmp_path / "bloom"
    save_tiny_bloom(model)
    bloom = ("--model_name_or_path", model, "--no_packing")
    one = tmp_path / "one"
    run(parse_args([*base_argv(tiny, one, *COMMON), *map(str, bloom)]))
    two = tmp_path / "two"
    done = _launch(tiny, two, *bloom, "--sequence_parallel", 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sequences split 2 ways (ring)" in done.stderr
    assert json.loads((two / "run_info.json").read_text())["model_name_or_path"] == str(model)
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)


def test_four_processes_as_two_sequence_parallel_groups_match_one_process(tiny, tmp_path):
    """SP 2 x DP 2: groups (0, 1) and (2, 3) each split one row per step; together the step's two rows, as one
    process with a batch of two."""
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, *COMMON)))
    four = tmp_path / "four"
    done = _launch(tiny, four, "--per_device_train_batch_size", 1, "--sequence_parallel", 2, processes=4)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on 4 process(es); sequences split 2 ways (ring)" in done.stderr
    assert losses(four) == pytest.approx(losses(one), rel=1e-5)
    assert [m["tokens"] for m in metrics(four)] == [m["tokens"] for m in metrics(one)]


@pytest.mark.parametrize("extra,message", [
    (("--sequence_parallel", 2), "error: --sequence_parallel 2 must divide the number of processes (1); launch a "
                                 "multiple of 2 processes with accelerate launch --num_processes"),
    (("--sequence_parallel", 2, "--no_bpt"), "error: --sequence_parallel needs the blockwise patch (drop --no_bpt)"),
    (("--sequence_parallel", 0), "error: --sequence_parallel must be a positive integer, got 0"),
])
def test_a_layout_that_cannot_split_is_refused_before_loading(tiny, tmp_path, capsys, extra, message):
    assert main(base_argv(tiny, tmp_path / "run", *extra)) == 2
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == message


def test_evaluation_split_over_two_processes_matches_one_process(tiny, tmp_path):
    """--eval_passkey on two processes, as SP 2 (every prompt decoded split over the group, train.evaluation.split_eval)
    and as DP 2 (the prompts shared out over the two data-parallel groups): the results those of one process. The
    shipped tiny model retrieves keys at these lengths, so the answers count."""
    from train.recipe.args import TINY_LLAMA_DIR

    evaluation = ("--model_name_or_path", TINY_LLAMA_DIR, "--eval_passkey", "--eval_lengths", 128, 256,
                  "--eval_trials", 2, "--eval_depths", 0.25, 0.75, "--max_steps", 1, "--learning_rate", 1e-4)
    one = tmp_path / "one"
    run(parse_args(base_argv(tiny, one, *COMMON, *evaluation)))
    expected = json.loads((one / "eval.json").read_text())
    assert expected["before"]["accuracy"] > 0.5  # retrieval works: a broken split decode would lose it
    for name, flags, said in [("sp", ("--sequence_parallel", 2, "--sp_mode", "ring"),
                               "each prompt split over 2 processes (ring)"),
                              ("dp", ("--per_device_train_batch_size", 1), "prompts shared over 2 data-parallel "
                                                                            "groups")]:
        done = _launch(tiny, tmp_path / name, *evaluation, *flags)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "passkey accuracy after training" in done.stdout and said in done.stdout
        assert json.loads((tmp_path / name / "eval.json").read_text()) == expected, name
