"""Helpers shared by the `python -m train.qlora` tests: the environment and argv of a tiny run, and what a
run wrote. The tiny model itself is the `tiny` fixture (conftest.py)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# One intra-op thread: these models are tiny, and on a shared CPU extra threads mostly wait on each other
# (a 64-token step measured 0.1 s with one thread, 0.5-12 s with two).
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


CPU_DDP = REPO / "configs/accelerate/cpu_ddp.yaml"


def accelerate_launch(processes: int, config: Path = CPU_DDP) -> list[str]:
    """`accelerate launch` of `processes` CPU processes, on a port free now: two pytest workers launching at once
    would both take torchrun's default 29500 (EADDRINUSE; CI saw it under ZeRO-3)."""
    from gloo_processes import free_port

    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config), "--num_processes",
            str(processes), "--main_process_port", str(free_port())]


def save_tiny_llama(directory: Path, **overrides) -> None:
    """A tiny llama (128 positions) with the char-level tokenizer of train.pretrain_tiny, saved to `directory`;
    `overrides` replace config fields (hidden_size, ...)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from train.pretrain_tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def save_tiny_bloom(directory: Path) -> None:
    """A tiny Bloom (ALiBi, no position limit) with the same char-level tokenizer, saved to `directory`."""
    import torch
    from transformers import BloomConfig, BloomForCausalLM

    from train.pretrain_tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = BloomConfig(vocab_size=len(tokenizer), hidden_size=64, n_layer=2, n_head=4,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    BloomForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def save_prequantized(directory) -> None:
    """The tiny model of `directory.parent / "model"` saved already quantised to 4 bits in the default uint8 storage
    (as hub '-bnb-4bit' models)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    quantized = AutoModelForCausalLM.from_pretrained(
        directory.parent / "model", quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    quantized.save_pretrained(directory)
    AutoTokenizer.from_pretrained(directory.parent / "model").save_pretrained(directory)


def base_argv(tiny, out, *extra) -> list[str]:
    return ["--model_name_or_path", str(tiny / "model"), "--dataset", str(tiny / "data.jsonl"),
            "--output_dir", str(out), "--max_seq_len", "64", "--max_steps", "4", "--lora_r", "4",
            "--learning_rate", "1e-2", "--save_steps", "0", "--logging_steps", "1",
            "--q_block", "16", "--kv_block", "16", "--mlp_chunk", "16", "--loss_chunk", "16", *map(str, extra)]


def metrics(out) -> list[dict]:
    with open(Path(out) / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def losses(out) -> list[float]:
    return [m["loss"] for m in metrics(out)]


def error_line(capsys) -> str:
    """The one `error:` line a CLI printed for bad input (no traceback, nothing after it)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err
    return lines[0]


def first_rows_match_the_committed_run(argv: list, out: Path, committed: Path, first_steps: int, minutes: float,
                                       regenerate: str) -> None:
    """`python -m train.qlora *argv --output_dir out`, stopped by SIGTERM once step `first_steps` is logged (a graceful
    stop: the rows before it are the uninterrupted run's): its "before" evaluation and its first logged rows equal the
    committed run's in `committed` (eval.json, metrics.jsonl; the same kernels give the same arithmetic, a little
    slack for another CPU model of the same kind). `regenerate` says how, in the failure."""
    import time

    import pytest

    from bpt.bench.trainer_runs import Run, wait_all

    run = Run("run", [*map(str, argv), "--output_dir", str(out)], out, out.parent / f"{out.name}.log").start(REPO, ENV)
    wait_all([run], time.monotonic() + 60 * minutes, stop_at={"run": first_steps})
    assert run.signalled_after is not None and run.signalled_after >= first_steps and run.returncode == 143, \
        (run.notes, run.log.read_text()[-3000:])
    rows_file = out / "metrics.jsonl"
    assert json.loads((out / "eval.json").read_text())["before"] == \
        json.loads((committed / "eval.json").read_text())["before"]
    rows = {r["step"]: r for r in map(json.loads, rows_file.read_text().splitlines())}
    expected = [r for r in map(json.loads, (committed / "metrics.jsonl").read_text().splitlines())
                if r["step"] <= first_steps]
    assert len(expected) == 2
    for row in expected:
        got = rows[row["step"]]
        assert got["tokens"] == row["tokens"] and got["lr"] == pytest.approx(row["lr"], rel=1e-12)
        assert (got["loss"], got["grad_norm"]) == pytest.approx((row["loss"], row["grad_norm"]), rel=1e-4), \
            f"step {row['step']}: regenerate {committed} ({regenerate})"
