"""Lean norms (bpt/norm.py, patches/norms.py): the op against each norm's own autograd (fp32 tight, bf16 by the
low-precision rule), what it keeps for backward and what its backward allocates, its interplay with checkpointing,
autocast, frozen weights and peft's modules_to_save, and a guard that every family's per-token norms are wrapped by
the patch and unwrapped by remove()."""
from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint
from transformers.models.cohere.modeling_cohere import CohereLayerNorm
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

import patches.norms
from bpt.config import BPTConfig
from bpt.norm import lean_norm
from patches import FAMILIES, apply_bpt_patch
from patches.norms import is_lean_norm, per_token_norm_dims
from test_patches import SMALL_BLOCKS, make_batch
from tiny_models import TINY_CONFIGS, tiny_model

HIDDEN = 32
ROWS = 7  # 90 rows of a [2, 45, 32] input: 13 chunks, the last one short


def _randomised(module: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5 + (0.0 if "bias" in name else 1.0))
    return module


def _norms():
    """(name, module factory, input shape): Llama's RMSNorm, Gemma's (1 + w) in fp32, a LayerNorm with bias,
    Cohere's q-k LayerNorm over [heads, head_dim] weights, OLMo-style LayerNorm without parameters."""
    return [
        ("llama_rms", lambda: LlamaRMSNorm(HIDDEN, eps=1e-6), (2, 45, HIDDEN)),
        ("gemma_rms", lambda: GemmaRMSNorm(HIDDEN, eps=1e-6), (2, 45, HIDDEN)),
        ("layernorm_bias", lambda: torch.nn.LayerNorm(HIDDEN), (2, 45, HIDDEN)),
        ("cohere_qk", lambda: CohereLayerNorm((4, 8), eps=1e-5), (2, 45, 4, 8)),
        ("no_params", lambda: torch.nn.LayerNorm(HIDDEN, elementwise_affine=False), (2, 45, HIDDEN)),
    ]


def _run(module, x, grad, lean: bool, rows: int = ROWS):
    x = x.detach().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    if lean:
        y = lean_norm(module.forward, list(module.parameters()), x, rows=rows,
                      norm_dims=per_token_norm_dims(module))
    else:
        y = module(x)
    y.backward(grad)
    return y.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("name,factory,shape", _norms(), ids=[n for n, _, _ in _norms()])
def test_fp32_matches_stock(name, factory, shape):
    module = _randomised(factory())
    g = torch.Generator().manual_seed(0)
    x, grad = torch.randn(shape, generator=g) * 3, torch.randn(shape, generator=g)
    y0, gx0, gp0 = _run(module, x, grad, lean=False)
    y1, gx1, gp1 = _run(module, x, grad, lean=True)
    assert torch.equal(y0, y1)  # the module's own forward, a chunk of rows at a time: bitwise
    # each row's input gradient depends on that row alone: a chunk recomputes it with the same per-row math
    torch.testing.assert_close(gx1, gx0, rtol=1e-6, atol=1e-6)
    assert gp0.keys() == gp1.keys()
    for key in gp0:  # summed over chunks instead of in one reduction
        torch.testing.assert_close(gp1[key], gp0[key], rtol=1e-5, atol=1e-5)


def test_input_gradient_is_bitwise_stock_rms():
    module = _randomised(LlamaRMSNorm(HIDDEN, eps=1e-6))
    g = torch.Generator().manual_seed(0)
    x, grad = torch.randn(2, 45, HIDDEN, generator=g), torch.randn(2, 45, HIDDEN, generator=g)
    _, gx0, _ = _run(module, x, grad, lean=False)
    _, gx1, _ = _run(module, x, grad, lean=True)
    assert torch.equal(gx0, gx1)


@pytest.mark.parametrize("name,factory,shape", _norms()[:4], ids=[n for n, _, _ in _norms()[:4]])
def test_bf16_weights_no_worse_than_stock(name, factory, shape):
    """Trainable bf16 weights and bf16 input: stock and lean each against an fp32 reference on the same values;
    the lean error (input gradient, each weight gradient) is no worse than 1.5x stock's own."""
    reference = _randomised(factory())
    low = copy.deepcopy(reference).to(torch.bfloat16)
    reference.load_state_dict({k: v.float() for k, v in low.state_dict().items()})  # the same (rounded) values
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(torch.bfloat16)
    grad = torch.randn(shape, generator=g).to(torch.bfloat16)
    _, gx_ref, gp_ref = _run(reference, x.float(), grad.float(), lean=False)
    _, gx0, gp0 = _run(low, x, grad, lean=False)
    _, gx1, gp1 = _run(low, x, grad, lean=True)

    def err(a, b):
        return (a.float() - b.float()).pow(2).mean().sqrt().item()

    assert err(gx1, gx_ref) <= 1.5 * err(gx0, gx_ref) + 1e-7
    for key in gp_ref:
        assert gp1[key].dtype == torch.bfloat16
        assert err(gp1[key], gp_ref[key]) <= 1.5 * err(gp0[key], gp_ref[key]) + 1e-7, key


def test_saves_only_the_input_shared_storage():
    module = _randomised(LlamaRMSNorm(HIDDEN))
    x = torch.randn(2, 45, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    h = x * 2  # a non-leaf, as inside a model
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        lean_norm(module.forward, list(module.parameters()), h, rows=ROWS)
    assert len(packed) == 1 and packed[0].untyped_storage().data_ptr() == h.untyped_storage().data_ptr()


class _Allocations(TorchDispatchMode):
    """Every op output's (dtype, numel)."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.outputs.append((t.dtype, t.numel()))
        return out


@pytest.mark.parametrize("factory", [lambda: LlamaRMSNorm(HIDDEN), lambda: GemmaRMSNorm(HIDDEN)])
def test_backward_holds_one_chunk_of_fp32(factory):
    """A bf16 input through an fp32-computing norm: backward creates no fp32 tensor larger than one chunk of rows
    (the full-size input gradient is in the input's dtype)."""
    module = _randomised(factory()).to(torch.bfloat16)
    x = torch.randn(4, 64, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    y = lean_norm(module.forward, list(module.parameters()), x, rows=16)
    probe = _Allocations()
    with probe:
        y.backward(torch.randn_like(y))
    largest_fp32 = max(n for dtype, n in probe.outputs if dtype == torch.float32)
    assert largest_fp32 <= 16 * HIDDEN
    assert max(n for _, n in probe.outputs) == x.numel()  # the input gradient buffer, bf16
    # stock, for contrast, keeps / makes full-size fp32 temporaries
    stock, probe = module(x), _Allocations()
    with probe:
        stock.backward(torch.randn_like(stock))
    assert max(n for dtype, n in probe.outputs if dtype == torch.float32) == x.numel()


def test_frozen_weights_get_no_gradient_and_no_grad_is_plain_forward():
    module = _randomised(LlamaRMSNorm(HIDDEN)).requires_grad_(False)
    x = torch.randn(2, 45, HIDDEN, requires_grad=True)
    y = lean_norm(module.forward, list(module.parameters()), x, rows=ROWS)
    y.sum().backward()
    assert module.weight.grad is None and x.grad is not None
    with torch.no_grad():
        assert lean_norm(module.forward, list(module.parameters()), x, rows=ROWS).grad_fn is None
    # nothing requires grad (a frozen norm on the first layer's input under QLoRA): no graph, the forward still in
    # chunks of rows (no fp32 temporary of the whole input), bitwise the module's
    x = torch.randn(4, 64, HIDDEN, dtype=torch.bfloat16)
    module.to(torch.bfloat16)
    probe = _Allocations()
    with probe:
        y = lean_norm(module.forward, list(module.parameters()), x, rows=16)
    assert y.grad_fn is None and torch.equal(y, module(x))
    assert max(n for dtype, n in probe.outputs if dtype == torch.float32) <= 16 * HIDDEN


@pytest.mark.parametrize("use_autocast", [False, True])
def test_under_non_reentrant_checkpoint_and_autocast(use_autocast):
    torch.manual_seed(0)
    linear, norm = torch.nn.Linear(HIDDEN, HIDDEN), _randomised(LlamaRMSNorm(HIDDEN))
    x = torch.randn(2, 45, HIDDEN)

    def layer(h, lean):
        h = linear(h)
        if lean:
            return h + lean_norm(norm.forward, list(norm.parameters()), h, rows=ROWS)
        return h + norm(h)

    results = []
    for lean in (False, True):
        for p in (*linear.parameters(), *norm.parameters()):
            p.grad = None
        leaf = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_autocast):
            out = checkpoint(layer, leaf, lean, use_reentrant=False)
        out.float().pow(2).sum().backward()
        results.append([leaf.grad, linear.weight.grad, norm.weight.grad])
    tol = dict(rtol=2e-2, atol=2e-2) if use_autocast else dict(rtol=1e-5, atol=1e-5)
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, **tol)


def test_which_modules_are_per_token_norms():
    assert per_token_norm_dims(torch.nn.LayerNorm(8)) == 1
    assert per_token_norm_dims(torch.nn.LayerNorm((4, 8))) == 2
    assert per_token_norm_dims(LlamaRMSNorm(8)) == 1
    assert per_token_norm_dims(CohereLayerNorm((4, 8))) == 2
    assert per_token_norm_dims(torch.nn.RMSNorm(8)) == 1
    assert per_token_norm_dims(torch.nn.GroupNorm(2, 8)) is None  # channels x tokens: mixes rows
    assert per_token_norm_dims(torch.nn.BatchNorm1d(8)) is None
    assert per_token_norm_dims(torch.nn.Linear(8, 8)) is None


def test_norm_chunk_is_validated():
    assert BPTConfig().norm_chunk > 0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="norm_chunk"):
            BPTConfig(norm_chunk=bad)


def _is_norm_class(module) -> bool:
    """The test's own view of what a norm is: 'Norm' in the class name."""
    return "Norm" in type(module).__name__


# Norm-named classes the patch must leave stock: gated norms take (x, gate); GroupNorm / BatchNorm mix tokens.
UNWRAPPED = ("Gated", "GroupNorm", "BatchNorm", "InstanceNorm")


def _expected_wrapped(model) -> list:
    return [m for m in model.modules() if _is_norm_class(m) and not any(w in type(m).__name__ for w in UNWRAPPED)]


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_every_per_token_norm_is_wrapped_and_unwrapped(monkeypatch, name):
    model = tiny_model(name)
    family = FAMILIES[model.config.model_type]
    if not family.lean_norms:
        pytest.skip(f"{model.config.model_type}: row says lean_norms=False")
    norms = _expected_wrapped(model)
    assert norms, f"{name}: no norm found"
    # which norm instances a stock training forward calls, and how often. Norms inside the MLP (BitNet's
    # ffn_sub_norm) run in the chunked MLP: no grad in its forward, one chunk at a time in its backward recompute.
    layers = getattr(getattr(model, family.base), family.layers)
    in_mlp = {id(m) for layer in layers for m in getattr(layer, family.mlp).modules()}
    stock_calls = []
    hooks = [m.register_forward_hook(lambda mod, args, out: stock_calls.append(mod)) for m in norms
             if id(m) not in in_mlp]
    batch = make_batch("right_padded")
    model(**batch)
    for hook in hooks:
        hook.remove()
    handle = apply_bpt_patch(model, **SMALL_BLOCKS)
    unwrapped = [type(m).__name__ for m in norms if not is_lean_norm(m)]
    assert not unwrapped, f"{name}: norms left stock: {unwrapped}"
    calls = []
    original = patches.norms.lean_norm

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(patches.norms, "lean_norm", counted)
    model(**batch)
    assert len(calls) == len(stock_calls)  # every norm call of a training forward goes through the lean op
    handle.remove()
    assert not any("forward" in vars(m) for m in norms)
    assert not any(is_lean_norm(m) for m in model.modules())


def test_modules_to_save_norm_still_matches_stock():
    peft = pytest.importorskip("peft")
    from test_patches import loss_and_grads

    def build():
        model = tiny_model("llama")
        config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["norm"])
        return peft.get_peft_model(model, config)

    stock, patched = build(), build()
    patched.load_state_dict(stock.state_dict())
    apply_bpt_patch(patched, **SMALL_BLOCKS)
    wrapper = patched.get_base_model().model.norm
    assert type(wrapper).__name__ == "ModulesToSaveWrapper"
    assert is_lean_norm(wrapper.modules_to_save["default"])
    batch = make_batch("plain")
    loss0, grads0 = loss_and_grads(stock, batch)
    loss1, grads1 = loss_and_grads(patched, batch)
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    assert grads0.keys() == grads1.keys() and any("modules_to_save" in k for k in grads0)
    for key in grads0:
        torch.testing.assert_close(grads1[key], grads0[key], rtol=1e-4, atol=1e-5)


def test_norm_source_only_while_output_and_input_are_unchanged():
    """A lean norm's output names its input while both are as the norm left them: changed in place, or the input
    gone, and a consumer keeps the output itself (bpt.mlp.chunked_mlp)."""
    from bpt.norm import lean_norm, norm_source

    norm = torch.nn.RMSNorm(8)
    x = torch.randn(2, 5, 8, requires_grad=True)
    y = lean_norm(norm.forward, list(norm.parameters()), x, rows=3)
    forward, params, source = norm_source(y)
    assert source is x and torch.equal(forward(x[:, 1:4]), y[:, 1:4])
    assert [id(p) for p in params] == [id(p) for p in norm.parameters()]
    with torch.no_grad():
        y.mul_(2)
    assert norm_source(y) is None
    h = x.detach().clone()
    z = lean_norm(norm.forward, list(norm.parameters()), h, rows=3)
    h.add_(1)
    assert norm_source(z) is None
    frozen = torch.nn.RMSNorm(8).requires_grad_(False)  # nothing requires grad: the norm saves nothing
    w = lean_norm(frozen.forward, list(frozen.parameters()), x.detach().clone(), rows=3)
    assert norm_source(w) is None  # its input died at once
    with torch.no_grad():
        assert norm_source(lean_norm(norm.forward, list(norm.parameters()), x, rows=3)) is None  # no grad: untagged
