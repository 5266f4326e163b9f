"""`python -m train.eval --sequence_parallel 2` under `accelerate launch` (2 CPU processes over gloo): every prompt
and document split over the group, the results those of one process (passkey answers, perplexity and its position
buckets); a launch it cannot split is refused with one line."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from cli_helpers import ENV, REPO
from gloo_processes import free_port
from train.args import TINY_LLAMA_DIR
from train.eval import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _documents(path):
    rng = random.Random(0)
    words = "the pass key is hidden in a long text and the grass is green while the sky is blue".split()
    path.write_text("\n".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(90))})
                              for _ in range(2)))


def _argv(data, out, *extra) -> list[str]:
    return ["--model_name_or_path", str(TINY_LLAMA_DIR), "--lengths", "128", "256", "--depths", "0.25", "0.75",
            "--trials", "2", "--dataset", str(data), "--max_seq_len", "256", "--ppl_buckets", "2",
            "--output_json", str(out), *map(str, extra)]


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_split_over_two_processes_equals_one_process(tmp_path, mode):
    data = tmp_path / "docs.jsonl"
    _documents(data)
    assert main(_argv(data, tmp_path / "one.json")) == 0
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "configs/accelerate/cpu_ddp.yaml"), "--num_processes", "2", "--main_process_port",
           str(free_port()), "-m", "train.eval", *_argv(data, tmp_path / "two.json", "--sequence_parallel", 2,
                                                         "--sp_mode", mode)]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("passkey accuracy") == 1  # the main process reports
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert one["accuracy"] > 0.5  # the shipped model retrieves at these lengths: the answers count
    assert two["tasks"] == one["tasks"]
    assert two["perplexity"] == pytest.approx(one["perplexity"], rel=1e-5)
    for split, whole in zip(two["perplexity_by_position"], one["perplexity_by_position"]):
        assert split["tokens"] == whole["tokens"] and split["nll"] == pytest.approx(whole["nll"], rel=1e-5)


def test_a_launch_it_cannot_split_is_refused(tmp_path, capsys):
    data = tmp_path / "docs.jsonl"
    _documents(data)
    assert main(_argv(data, tmp_path / "out.json", "--sequence_parallel", 2)) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: --sequence_parallel 2 must divide the number of processes (1); launch a multiple of 2 with "
        "accelerate launch --num_processes (or torchrun --nproc_per_node)")
