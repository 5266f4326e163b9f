"""`python -m train.eval` under `accelerate launch` (2 CPU processes over gloo) in training's layouts: each prompt and
document split over a sequence-parallel group (ring, Ulysses) with the weights sharded by FSDP2, the layers sliced
over a tensor-parallel group, or the prompts and documents shared out over 2 data-parallel groups (with and without
FSDP2, whose sharded forwards keep every rank in step). The results are those of one process (task answers, perplexity
and its position buckets); each rank's count of what it evaluated shows the sharing. A launch it cannot split is
refused with training's own line."""
from __future__ import annotations

import json
import random
import subprocess

import pytest

from cli_helpers import ENV, REPO, accelerate_launch
from train.evaluation.eval import main
from train.recipe.args import TINY_LLAMA_DIR

pytestmark = pytest.mark.usefixtures("one_thread")


def _documents(path):
    rng = random.Random(0)
    words = "the pass key is hidden in a long text and the grass is green while the sky is blue".split()
    path.write_text("\n".join(json.dumps({"text": " ".join(rng.choice(words) for _ in range(85))})
                              for _ in range(3)))


def _argv(data, out, *extra) -> list[str]:
    return ["--model_name_or_path", str(TINY_LLAMA_DIR), "--lengths", "128", "256", "--depths", "0.25", "0.75",
            "--trials", "2", "--batch_size", "2", "--dataset", str(data), "--max_seq_len", "256",
            "--ppl_buckets", "2", "--output_json", str(out), *map(str, extra)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """(documents file, one process's results)."""
    root = tmp_path_factory.mktemp("eval_one")
    _documents(root / "docs.jsonl")
    assert main(_argv(root / "docs.jsonl", root / "one.json")) == 0
    return root / "docs.jsonl", json.loads((root / "one.json").read_text())


LAYOUTS = {  # name: (flags, what the main process says about the layout: train.qlora's words, layout_text)
    "ring_fsdp": (("--sequence_parallel", 2, "--sp_mode", "ring", "--fsdp"),
                  "1 data-parallel group(s); sequences split 2 ways (ring); FSDP2 over 2 process(es), the main one "
                  "holding 5"),
    "ulysses_fsdp": (("--sequence_parallel", 2, "--sp_mode", "ulysses", "--fsdp"),
                     "sequences split 2 ways (ulysses); FSDP2 over 2 process(es)"),
    "tensor_parallel": (("--tensor_parallel", 2,), "1 data-parallel group(s); layers split 2 ways (tensor parallel)"),
    "data_parallel": ((), "2 data-parallel group(s)"),
    "data_parallel_fsdp": (("--fsdp",), "2 data-parallel group(s); FSDP2 over 2 process(es)"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_two_processes_in_a_training_layout_equal_one_process(tmp_path, one_process, layout):
    data, one = one_process
    flags, said = LAYOUTS[layout]
    cmd = [*accelerate_launch(2), "-m", "train.eval", *_argv(data, tmp_path / "two.json", *flags)]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    assert said in done.stderr
    assert done.stdout.count("passkey accuracy") == 1  # the main process reports
    two = json.loads((tmp_path / "two.json").read_text())
    assert one["accuracy"] > 0.5  # the shipped model retrieves at these lengths: the answers count
    assert two["tasks"] == one["tasks"]
    assert two["perplexity"] == pytest.approx(one["perplexity"], rel=1e-5)
    for split, whole in zip(two["perplexity_by_position"], one["perplexity_by_position"]):
        assert split["tokens"] == whole["tokens"] and split["nll"] == pytest.approx(whole["nll"], rel=1e-5)
    work = two["work_by_rank"]
    forwards = 9  # scoring forwards of the 3 documents (351-376 tokens): 2 chunks each, 3 position buckets in all
    if layout.startswith("data_parallel"):  # 8 prompts in 4 batches and 9 forwards, dealt in turn (under FSDP rank 1
        # repeats a forward to keep in step with rank 0: not counted)
        assert work == [{"prompts": 4, "forwards": 5}, {"prompts": 4, "forwards": 4}]
    else:  # both ranks take part in every prompt and forward
        assert work == [{"prompts": 8, "forwards": forwards}] * 2


@pytest.mark.parametrize("world,extra,message", [
    (1, ("--sequence_parallel", 2), "error: --sequence_parallel 2 must divide the number of processes (1); launch a "
                                    "multiple of 2 processes with accelerate launch --num_processes"),
    (4, ("--tensor_parallel", 2, "--sequence_parallel", 3),
     "error: --tensor_parallel 2 x --sequence_parallel 3 must divide the number of processes (4); launch a multiple "
     "of 6 processes with accelerate launch --num_processes"),
    (2, ("--fsdp", "--bits", 8), "error: --fsdp shards 4-bit (--bits 4) or unquantised (--bits 16) bases; "
                                 "bitsandbytes int8 weights cannot be sharded: choose --bits 4"),
    (16, ("--tensor_parallel", 2, "--sequence_parallel", 8, "--sp_mode", "ulysses"),
     "error: --sp_mode ulysses splits each rank's 4 query heads (8 / --tensor_parallel 2) over --sequence_parallel 8, "
     "so they must divide by 8; use --sp_mode ring or fewer tensor-parallel ranks"),
], ids=["sp_world", "tp_x_sp_world", "fsdp_int8", "ulysses_local_heads"])
def test_what_training_refuses_is_refused_with_its_line(tmp_path, capsys, monkeypatch, world, extra, message):
    """training's own checks and messages (train.parallel, train.parallel.fsdp), before any weights are read. The
    launcher's WORLD_SIZE is all the checks read, so one process stands for a launch of `world`."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    data = tmp_path / "docs.jsonl"
    _documents(data)
    assert main(_argv(data, tmp_path / "out.json", *extra)) == 2
    err = capsys.readouterr().err
    assert "Loading weights" not in err and "Traceback" not in err
    assert err.strip().splitlines()[-1] == message


def test_a_deepspeed_launch_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert main(_argv(tmp_path / "docs.jsonl", tmp_path / "out.json")) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: train.eval does not run under a DeepSpeed launch; launch with configs/accelerate/cpu_ddp.yaml or "
        "multi_gpu.yaml and pass --fsdp to shard the weights over the processes")
