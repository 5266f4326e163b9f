"""The chunk budget (BPTConfig.chunk_budget): chunks take more tokens where the budget holds them, balanced; the
patched step's results stay stock's; on a simulated GPU the automatic budget cuts the kernel launches."""
from __future__ import annotations

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_patches import SMALL_BLOCKS, assert_grads_close, loss_and_grads, make_batch
from tiny_models import tiny_model

from bpt.config import BPTConfig, auto_chunk_budget
from patches import apply_bpt_patch
from patches.chunk_bytes import loss_bytes_per_token, mlp_bytes_per_token

CPU = torch.device("cpu")


def test_chunk_tokens_balanced_within_the_budget():
    config = BPTConfig(mlp_chunk=16, chunk_budget=6000)
    # the budget holds 6,000 tokens: chunks of at most 16 x 2^8 = 4,096, balanced (3 x 3,334, not 4,096 x 2 + 1,808)
    assert config.chunk_tokens("mlp_chunk", 10_000, lambda: 1.0, CPU) == 3334
    # what is free moving by a fifth leaves the chunk where it was (the step's peak with it)
    assert BPTConfig(mlp_chunk=16, chunk_budget=5000).chunk_tokens("mlp_chunk", 10_000, lambda: 1.0, CPU) == 3334
    assert BPTConfig(mlp_chunk=16, chunk_budget=8192).chunk_tokens("mlp_chunk", 10_000, lambda: 1.0, CPU) == 5000
    assert config.chunk_tokens("mlp_chunk", 10_000, lambda: 200.0, CPU) == 16  # 30 tokens: not two set sizes, as set
    assert config.chunk_tokens("mlp_chunk", 10_000, lambda: 0.5, CPU) == 10_000  # the whole sequence fits the budget
    assert config.chunk_tokens("mlp_chunk", 10_000, lambda: 1000.0, CPU) == 16  # the budget holds fewer: as set
    assert config.chunk_tokens("mlp_chunk", 10_000, lambda: None, CPU) == 16  # no estimate: the size as set

    def not_asked():
        raise AssertionError("without a budget, what a token holds is not worked out")
    assert BPTConfig(mlp_chunk=16, chunk_budget=0).chunk_tokens("mlp_chunk", 10_000, not_asked, CPU) == 16
    assert BPTConfig(mlp_chunk=16).chunk_tokens("mlp_chunk", 10_000, not_asked, CPU) == 16  # auto: none on a CPU
    assert auto_chunk_budget(CPU) == 0


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1GB"])
def test_chunk_budget_is_validated(bad):
    with pytest.raises(ValueError, match="chunk_budget"):
        BPTConfig(chunk_budget=bad)


def test_bytes_per_token_read_from_the_modules():
    model = tiny_model("llama")
    config = model.config
    mlp = model.model.layers[0].mlp
    fp32, bf16 = torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)
    features = 2 * config.intermediate_size + config.hidden_size  # gate, up, down
    assert mlp_bytes_per_token(mlp, fp32) == 4 * features * 4
    assert mlp_bytes_per_token(mlp, bf16) == 4 * features * 2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert mlp_bytes_per_token(mlp, fp32) == 4 * features * 2  # autocast's dtype, not the input's
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"]))
    mlp = lora.base_model.model.model.layers[0].mlp
    adapters = 3 * 4 + features  # each adapter's A (r) and B (the layer's outputs) exist apart from the base's
    assert mlp_bytes_per_token(mlp, fp32) == 4 * (features + adapters) * 4
    assert loss_bytes_per_token(config.vocab_size, bf16) == config.vocab_size * (2 + 12)


def test_moe_experts_fused_into_3d_tensors_have_no_estimate():
    model = tiny_model("mixtral")
    assert mlp_bytes_per_token(model.model.layers[0].mlp, torch.zeros(1)) is None


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_budget_makes_fewer_larger_chunks_with_stock_results(checkpointing):
    stock = tiny_model("llama")
    patched = copy.deepcopy(stock)
    mlp = patched.model.layers[0].mlp
    per_token = mlp_bytes_per_token(mlp, torch.zeros(1))
    calls = []
    original = mlp.forward
    mlp.forward = lambda *args: (calls.append(args[0].shape[1]), original(*args))[1]
    apply_bpt_patch(patched, **SMALL_BLOCKS, chunk_budget=40 * per_token)  # 45 tokens: 32 at most, two chunks
    for model in (stock, patched):
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = make_batch("right_padded")
    stock_loss, stock_grads = loss_and_grads(stock, inputs)
    patched_loss, patched_grads = loss_and_grads(patched, inputs)
    assert calls == [23, 22, 23, 22]  # the forward's chunks, then its backward's recompute
    assert abs(patched_loss - stock_loss) <= 1e-5 * abs(stock_loss)
    assert_grads_close(stock_grads, patched_grads)


@pytest.mark.usefixtures("one_thread", "shim_library")
def test_auto_budget_on_a_simulated_h100_cuts_the_launches(tmp_path):
    """The same patched step on a simulated H100 with the automatic budget (up to 1/8 of 80 GB: every chunk of a
    2K-token step is the whole sequence) and with none (chunks of 256 tokens): the same FLOPs in fewer kernels."""
    from bpt.bench.cli import main

    runs = {}
    for budget in ("0", None):
        report = main(["--simulate", "h100-80gb", "--model", "tiny", "--seq_lens", "2048", "--sides", "patched",
                       "--mlp_chunk", "256", "--loss_chunk", "256", "--norm_chunk", "256",
                       *(["--chunk_budget", budget] if budget else []), "--output", str(tmp_path / "sim.json")])
        (runs[budget],) = report["runs"]
    assert runs[None]["kernel_launches"] < 0.75 * runs["0"]["kernel_launches"], runs
    (auto,), (fixed,) = (runs[key]["flops_by_dtype"].values() for key in (None, "0"))
    assert auto == pytest.approx(fixed, rel=0.02)  # the same work (the loss and norms in fewer, larger pieces)


def test_the_mlp_takes_the_norm_into_its_backward_past_a_quarter_of_the_largest_budget():
    """bpt.mlp.chunked_mlp's fold_norms, a rule of the shapes: past a quarter of the largest budget there can be (one
    [B, N, hidden] fewer at the backward's peak lengthens the context); never without a budget (a CPU's auto)."""
    cpu = torch.device("cpu")
    config = BPTConfig(chunk_budget=4000)
    assert config.folds_norms(1001, cpu) and not config.folds_norms(1000, cpu)
    assert not BPTConfig().folds_norms(2**40, cpu)


def test_running_whole_is_a_rule_of_the_shapes():
    """Whether the MLP runs as one piece (saving its activations) or chunked (saving its input) must not depend on
    what is free: a checkpoint's recompute would take another path than its forward and torch refuses the mismatch."""
    config = BPTConfig(mlp_chunk=16, chunk_budget=6000)
    assert config.whole_fits("mlp_chunk", 16, lambda: 1e9, CPU)  # within the size as set
    assert config.whole_fits("mlp_chunk", 6000, lambda: 1.0, CPU)  # within the largest budget
    assert not config.whole_fits("mlp_chunk", 6001, lambda: 1.0, CPU)
    assert not BPTConfig(mlp_chunk=16).whole_fits("mlp_chunk", 17, lambda: 1.0, CPU)  # auto: no budget on a CPU
    assert BPTConfig(mlp_chunk=16).largest_budget(CPU) == 0
