"""bpt.mlp.chunked_mlp against the plain transformers modules: outputs and every gradient, fp32."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from probes import LargestOutput
from torch.utils.checkpoint import checkpoint

from bpt.mlp import chunked_mlp
from transformers import BloomConfig, GemmaConfig, GPT2Config, GPTNeoXConfig, LlamaConfig, MixtralConfig
from transformers.models.bloom.modeling_bloom import BloomMLP
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP
from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXMLP
from transformers.models.llama.modeling_llama import LlamaMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

B, N, H, I = 2, 127, 16, 40
CHUNK = 50  # does not divide N: chunks of 50, 50, 27
HEADS = dict(hidden_size=H, num_attention_heads=2, num_key_value_heads=2)


def _init(module: nn.Module, seed: int = 0) -> nn.Module:
    """Deterministic non-trivial weights (Mixtral's expert tensors start uninitialized)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return module


def _mixtral(jitter: float = 0.0) -> nn.Module:
    config = MixtralConfig(intermediate_size=I, num_local_experts=4, num_experts_per_tok=2,
                           router_jitter_noise=jitter, **HEADS)
    config._experts_implementation = "eager"
    return MixtralSparseMoeBlock(config)


def _bloom(dropout: float = 0.0) -> nn.Module:
    return BloomMLP(BloomConfig(hidden_size=H, n_head=2, hidden_dropout=dropout))


def _gpt2(dropout: float = 0.0) -> nn.Module:
    return GPT2MLP(4 * H, GPT2Config(n_embd=H, n_head=2, resid_pdrop=dropout))


FAMILIES = {
    "llama": lambda: LlamaMLP(LlamaConfig(intermediate_size=I, **HEADS)),
    "gemma": lambda: GemmaMLP(GemmaConfig(intermediate_size=I, head_dim=8, **HEADS)),
    "gpt2": _gpt2,
    "gpt_neox": lambda: GPTNeoXMLP(GPTNeoXConfig(hidden_size=H, num_attention_heads=2, intermediate_size=I)),
    "mixtral": _mixtral,
    "bloom": _bloom,
}


def _inputs(module: nn.Module, seed: int = 1, batch: int = B) -> list[torch.Tensor]:
    """[B, N, H] hidden (and BloomMLP's residual), leaves requiring grad."""
    gen = torch.Generator().manual_seed(seed)
    count = 2 if isinstance(module, BloomMLP) else 1
    return [torch.randn(batch, N, H, generator=gen).requires_grad_() for _ in range(count)]


def _grads(module, inputs, out, grad_out):
    """Gradients of <out, grad_out> w.r.t. the inputs and every trainable parameter."""
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.autograd.grad(out, [*inputs, *params], grad_out)


def _assert_close(actual, expected, rel=1e-5):
    for a, e in zip(actual, expected, strict=True):
        scale = e.abs().max().item() or 1.0
        assert (a - e).abs().max().item() <= rel * scale, (a - e).abs().max().item() / scale


def _chunked(module, inputs, chunk=CHUNK):
    return chunked_mlp(module.forward, list(module.parameters()), *inputs, chunk=chunk)


def _check_against_plain(module, chunk=CHUNK):
    inputs = _inputs(module)
    grad_out = torch.randn(B, N, H, generator=torch.Generator().manual_seed(2))
    expected_out = module(*inputs)
    expected = _grads(module, inputs, expected_out, grad_out)
    out = _chunked(module, inputs, chunk)
    _assert_close([out], [expected_out])
    _assert_close(_grads(module, inputs, out, grad_out), expected)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_matches_plain_module(family):
    _check_against_plain(_init(FAMILIES[family]()))


def test_chunk_longer_than_sequence():
    _check_against_plain(_init(FAMILIES["llama"]()), chunk=4 * N)


def _per_chunk_reference(module, inputs, chunk=CHUNK):
    """The same chunks through the plain module with ordinary autograd: what chunked_mlp's forward draws
    (one dropout mask / jitter per chunk, in order) and therefore the gradients its recompute must give."""
    pieces = [module(*[x[:, s:s + chunk].clone() for x in inputs]) for s in range(0, N, chunk)]
    return torch.cat(pieces, dim=1)


@pytest.mark.parametrize("build, batch", [(lambda: _gpt2(0.3), B), (lambda: _bloom(0.3), B),
                                          (lambda: _mixtral(0.2), B), (lambda: _mixtral(0.2), 1)],
                         ids=["gpt2_dropout", "bloom_dropout", "mixtral_jitter", "mixtral_jitter_batch1"])
def test_randomness_replayed_in_recompute(build, batch):
    # Unchunked draws one mask for all N tokens, chunked one per chunk, so they cannot be compared.
    # Instead: with the same seed, chunked forward == per-chunk reference (same draws in forward), and the
    # gradients equal the reference's, which is only possible if backward's recompute drew the forward's
    # masks again (a fresh draw would give different masks and different gradients).
    # Mixtral's jitter multiplies its input in place: with batch 1 a chunk is a view of the caller's tensor,
    # which must not be modified (it is also what backward recomputes from).
    module = _init(build()).train()
    inputs = _inputs(module, batch=batch)
    originals = [x.detach().clone() for x in inputs]
    grad_out = torch.randn(batch, N, H)
    torch.manual_seed(123)
    expected_out = _per_chunk_reference(module, inputs)
    expected = _grads(module, inputs, expected_out, grad_out)
    torch.manual_seed(123)
    out = _chunked(module, inputs)
    assert all(torch.equal(x, x0) for x, x0 in zip(inputs, originals))
    _assert_close([out], [expected_out])
    _assert_close(_grads(module, inputs, out, grad_out), expected)
    with torch.no_grad():  # the randomness is really there
        assert not torch.allclose(out, module.eval()(*inputs), atol=1e-4)


def test_caller_rng_stream_untouched_by_backward():
    module = _init(_gpt2(0.3)).train()
    inputs = _inputs(module)
    torch.manual_seed(7)
    with torch.no_grad():
        _per_chunk_reference(module, inputs)
    expected_state = torch.get_rng_state()  # what the forward alone consumes
    torch.manual_seed(7)
    out = _chunked(module, inputs)
    assert torch.equal(torch.get_rng_state(), expected_state)
    torch.rand(3)  # the caller moves on; backward must leave its stream where it is now
    after_draw = torch.get_rng_state()
    out.sum().backward()
    assert torch.equal(torch.get_rng_state(), after_draw)


def test_inside_activation_checkpoint_with_dropout():
    module = _init(_gpt2(0.3)).train()
    inputs = _inputs(module)

    def block(x, use_chunks):
        y = torch.tanh(x)
        mlp_out = _chunked(module, [y]) if use_chunks else _per_chunk_reference(module, [y])
        return x + mlp_out

    torch.manual_seed(5)
    expected_out = block(inputs[0], use_chunks=False)
    expected = _grads(module, inputs, expected_out, torch.ones_like(expected_out))
    torch.manual_seed(5)
    out = checkpoint(block, inputs[0], True, use_reentrant=False)
    _assert_close([out], [expected_out])
    _assert_close(_grads(module, inputs, out, torch.ones_like(out)), expected)


def test_autocast_replayed_in_backward():
    # Backward runs outside the caller's autocast region; the recompute must still run in bf16
    # (an fp32 recompute gives input gradients off by bf16 rounding, ~1e-3, and could re-route MoE tokens).
    module = _init(FAMILIES["llama"]())
    inputs = _inputs(module)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_out = _per_chunk_reference(module, inputs)
        out = _chunked(module, inputs)
    _assert_close([out.float()], [expected_out.float()])
    grads = _grads(module, inputs, out, torch.ones_like(out))
    expected = _grads(module, inputs, expected_out, torch.ones_like(expected_out))
    _assert_close(grads[:1], expected[:1])
    # Parameter gradients: the reference sums its chunks in bf16 (autocast caches one bf16 weight copy),
    # chunked_mlp sums them in fp32, so they agree to bf16 precision only.
    _assert_close(grads[1:], expected[1:], rel=1e-2)


def _lora(module: nn.Module) -> nn.Module:
    import peft

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"],
                             init_lora_weights=False)  # random lora_B, so lora_A gets nonzero gradients
    return peft.inject_adapter_in_model(config, module)


def test_peft_lora_mlp():
    module = _lora(_init(FAMILIES["llama"]()))
    frozen = [p for n, p in module.named_parameters() if "lora_" not in n]
    assert frozen and not any(p.requires_grad for p in frozen)
    _check_against_plain(module)


def test_bnb_4bit_base_with_lora():
    bnb = pytest.importorskip("bitsandbytes")
    module = _init(FAMILIES["llama"]())
    for name in ("gate_proj", "up_proj", "down_proj"):
        linear = getattr(module, name)
        quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False,
                                      compute_dtype=torch.float32, quant_type="nf4")
        quantized.weight = bnb.nn.Params4bit(linear.weight.data.clone(), requires_grad=False, quant_type="nf4")
        setattr(module, name, quantized.to("cpu"))  # .to() quantizes
    assert module.gate_proj.weight.dtype == torch.uint8
    module.is_loaded_in_4bit = True  # what peft reads on a HF model to pick its bnb LoRA layer
    module = _lora(module)
    assert {type(m).__module__ for m in module.modules() if hasattr(m, "lora_A")} == {"peft.tuners.lora.bnb"}
    _check_against_plain(module)


def test_no_sequence_by_intermediate_tensor_saved_or_created():
    module = _init(FAMILIES["llama"]())
    inputs = _inputs(module)
    chunk = 16
    params = {p.data_ptr() for p in module.parameters()}
    saved = []

    def pack(t):
        saved.append(t)
        return t

    for use_chunks, bound in ((False, B * N * I), (True, max(B * chunk * I, B * N * H))):
        saved.clear()
        recorder = LargestOutput()
        with recorder:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = _chunked(module, inputs, chunk) if use_chunks else module(*inputs)
            out.backward(torch.ones_like(out))
        activations = [t for t in saved if t.data_ptr() not in params]
        largest_saved = max(t.numel() for t in activations)
        if use_chunks:  # only the [B, N, H] input is kept, and nothing N x I ever exists
            assert largest_saved == B * N * H
            assert recorder.largest <= bound < B * N * I
        else:  # the recorders do see N x I in the plain module
            assert largest_saved == recorder.largest == bound


@pytest.mark.parametrize("family", ["gpt_neox", "mixtral"])  # mixtral: .view() needs contiguous chunks
def test_no_grad_and_frozen_paths(family):
    module = _init(FAMILIES[family]())
    inputs = _inputs(module)
    with torch.no_grad():
        expected = module(*inputs)
        out = _chunked(module, inputs)
    assert out.grad_fn is None
    _assert_close([out], [expected])
    module.requires_grad_(False)  # frozen module: only the input gets a gradient
    out = _chunked(module, inputs)
    _assert_close(torch.autograd.grad(out.sum(), inputs), torch.autograd.grad(module(*inputs).sum(), inputs))


def test_non_tensor_output_raises():
    module = _init(FAMILIES["llama"]())
    inputs = _inputs(module)
    with pytest.raises(TypeError, match="single tensor"):
        chunked_mlp(lambda x: (module(x), None), list(module.parameters()), *inputs, chunk=CHUNK)
    with pytest.raises(ValueError, match="positive integer"):
        chunked_mlp(module.forward, list(module.parameters()), *inputs, chunk=0)
    out = chunked_mlp(module.forward, list(module.gate_proj.parameters()), *inputs, chunk=CHUNK)
    with pytest.raises(RuntimeError, match="not passed in params"):  # up/down weights would get no grad
        out.sum().backward()


@pytest.mark.parametrize("name,expected", [("llama", 2), ("gpt2", 2), ("bloom", 2), ("gemma2", 3)])
def test_mlp_forwards_per_step_under_gradient_checkpointing(name, expected):
    """Non-reentrant checkpointing stops its recompute at the chunked MLP's saved input, so the MLP runs twice
    per step (forward, and the chunk recompute in its backward), not three times. Gemma 2's post-MLP norm saves
    the MLP output, so its recompute must run the MLP (3). Gradients equal stock's either way."""
    import copy

    from patches import apply_bpt_patch
    from test_patches import SMALL_BLOCKS, assert_grads_close, loss_and_grads, make_batch
    from tiny_models import tiny_model

    stock = tiny_model(name)
    patched = copy.deepcopy(stock)
    base = getattr(patched, "model", None) or patched.transformer
    mlp = (getattr(base, "layers", None) or base.h)[0].mlp
    calls = []
    original = mlp.forward
    mlp.forward = lambda *args: (calls.append(args[0].shape[1]), original(*args))[1]
    apply_bpt_patch(patched, **SMALL_BLOCKS)
    for model in (stock, patched):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = make_batch("right_padded")
    stock_loss, stock_grads = loss_and_grads(stock, inputs)
    patched_loss, patched_grads = loss_and_grads(patched, inputs)
    chunks = -(-inputs["input_ids"].shape[1] // SMALL_BLOCKS["mlp_chunk"])
    assert len(calls) == expected * chunks
    assert abs(patched_loss - stock_loss) <= 1e-5 * abs(stock_loss)
    assert_grads_close(stock_grads, patched_grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lean_norm_before_the_mlp_runs_its_backward_inside_each_chunk(dtype):
    """A lean norm feeding the chunked MLP, its only consumer, is folded into the chunks' backward: the gradients of
    the norm's input, its weight and the MLP's weights are bitwise those of the norm's own backward after the MLP's
    (same chunks of rows), and the backward's peak is one whole [B, N, H] gradient lower (the MLP's input's)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from bpt.gpusim.tracker import AllocationTracker
    from bpt.norm import lean_norm

    norm, mlp = _init(LlamaRMSNorm(H), seed=3).to(dtype), _init(FAMILIES["llama"]()).to(dtype)
    tokens, chunk = 1000, 10  # a whole [1, N, H] buffer well above a chunk's [1, chunk, I] temporaries
    x = torch.randn(1, tokens, H, dtype=dtype, generator=torch.Generator().manual_seed(1)).requires_grad_()
    grad_out = torch.randn(1, tokens, H, dtype=dtype, generator=torch.Generator().manual_seed(2))
    params, whole = [x, *norm.parameters(), *mlp.parameters()], x.numel() * x.element_size()
    results = {}
    for fold in (True, False):
        y = lean_norm(norm.forward, list(norm.parameters()), x, rows=chunk)
        out = chunked_mlp(mlp.forward, list(mlp.parameters()), y, chunk=chunk, fold_norms=fold)
        del y
        with AllocationTracker() as tracker:
            grads = torch.autograd.grad(out, params, grad_out)
        # whole [1, N, H] buffers the backward made (x and grad_out are there too, as slices' storages)
        made = [h for h in tracker.peak_holders if h["bytes"] == whole and h["op"] != "slice"]
        results[fold] = out, grads, (tracker.peak, len(made))
    (out, grads, peak), (out_ref, grads_ref, peak_ref) = results[True], results[False]
    assert torch.equal(out, out_ref)
    assert all(torch.equal(g, r) for g, r in zip(grads, grads_ref, strict=True))
    assert peak[1] == 1 and peak_ref[1] == 2 and peak[0] < peak_ref[0]
    if dtype == torch.float32:  # and stock's, to float tolerance
        stock = mlp(norm(x))
        _assert_close([out, *grads], [stock, *torch.autograd.grad(stock, params, grad_out)])
