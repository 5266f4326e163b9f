"""`python -m train.qlora` in the setups that used to crash: bf16 mixed precision over 16-bit and 8-bit
bases, and a GPT-2 checkpoint with its usual attention dropout (attn_pdrop=0.1)."""
from __future__ import annotations

import math

import pytest
import torch

from cli_helpers import base_argv, losses
from train.recipe.args import parse_args
from train.run.qlora import run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("bits", [16, 8])
def test_bf16_mixed_precision_trains_patched_like_stock(tiny, tmp_path, bits):
    runs = {}
    for side, extra in (("stock", ["--no_bpt"]), ("patched", [])):
        out = tmp_path / side
        run(parse_args(base_argv(tiny, out, "--bits", bits, "--mixed_precision", "bf16", *extra)))
        runs[side] = losses(out)
    assert len(runs["patched"]) == 4 and all(math.isfinite(x) for x in runs["patched"])
    # Same precision, different attention kernels: equal up to bf16 resolution (2^-7) per step.
    assert runs["patched"] == pytest.approx(runs["stock"], rel=2 ** -7)


def test_gpt2_checkpoint_with_attention_dropout_trains(tiny, tmp_path):
    """A real GPT-2 config keeps attn_pdrop=0.1: the patched model trains with that dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from train.pretrain_tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=128, attn_pdrop=0.1,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    tokenizer.save_pretrained(tmp_path / "gpt2")
    argv = base_argv(tiny, tmp_path / "out", "--bits", 16)
    argv[argv.index("--model_name_or_path") + 1] = str(tmp_path / "gpt2")
    run(parse_args(argv))
    assert len(losses(tmp_path / "out")) == 4 and all(math.isfinite(x) for x in losses(tmp_path / "out"))


def test_run_twice_in_one_process_with_other_precision(tiny, tmp_path):
    """A notebook re-runs the training cell with other flags: the second run must not trip over the first
    run's accelerate state (it refused another mixed precision)."""
    for i, precision in enumerate(["bf16", "no", "bf16"]):
        out = tmp_path / f"run{i}"
        run(parse_args(base_argv(tiny, out, "--bits", 16, "--mixed_precision", precision, "--max_steps", 1)))
        assert len(losses(out)) == 1
