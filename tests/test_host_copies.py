"""bpt.host_copies: a tensor with a registered host copy (checkpoint offload's layer input) is saved as that copy by the
lean norm and the chunked projections after it, fetched once when their backward first needs it."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

from bpt import host_copies
from bpt.mlp import chunked_mlp
from bpt.norm import lean_norm

B, N, H = 1, 96, 16


def _modules(dtype):
    torch.manual_seed(0)
    norm = LlamaRMSNorm(H)
    projections = [torch.nn.Linear(H, H, bias=False) for _ in range(3)]  # q, k, v: one norm feeding three
    mlp = LlamaMLP(LlamaConfig(hidden_size=H, intermediate_size=40, num_attention_heads=2, num_key_value_heads=2))
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    return [m.to(dtype) for m in (norm, *projections, mlp)]


def _step(modules, leaf, grad, register: bool, fetches: list):
    """A layer's input (a non-leaf, as inside a model) through a lean norm into three chunked projections, and their
    sum through a second lean norm into the chunked MLP; returns the gradients and whether a saved tensor shares the
    input's storage (what the autograd graph keeps of it on its device)."""
    norm, *projections, mlp = modules
    x = leaf * 1.0
    if register:
        host, device = x.detach().to("cpu", copy=True), x.device

        def fetch():
            fetches.append(1)
            return host.to(device, copy=True)

        host_copies.register(x, host_copies.HostCopy(fetch))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = lean_norm(norm.forward, list(norm.parameters()), x, rows=32)
        h = sum(chunked_mlp(p.forward, list(p.parameters()), y, chunk=32, fold_norms=False) for p in projections)
        h = h + x
        z = lean_norm(norm.forward, list(norm.parameters()), h, rows=32)
        out = chunked_mlp(mlp.forward, list(mlp.parameters()), z, chunk=32) + h
    holds_x = any(t.untyped_storage() is x.untyped_storage() for t in saved)
    del x, y, h, z, saved
    params = [leaf, *[p for m in modules for p in m.parameters()]]
    return torch.autograd.grad(out, params, grad), holds_x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_registered_input_is_saved_as_its_host_copy_and_fetched_once(dtype):
    modules = _modules(dtype)
    leaf = torch.randn(B, N, H, dtype=dtype, generator=torch.Generator().manual_seed(1)).requires_grad_()
    grad = torch.randn(B, N, H, dtype=dtype, generator=torch.Generator().manual_seed(2))
    expected, held = _step(modules, leaf, grad, register=False, fetches=[])
    assert held  # kept on its device by the norm and the projections
    fetches = []
    grads, held = _step(modules, leaf, grad, register=True, fetches=fetches)
    assert not held
    assert len(fetches) == 1  # one copy back, shared by the norm and the three projections
    assert all(torch.equal(g, e) for g, e in zip(grads, expected, strict=True))


def test_a_view_or_a_changed_tensor_of_that_storage_is_saved_itself():
    """Only the registered tensor, as registered, is its host copy (known by its storage: a checkpoint's recompute is
    given a detached tensor); a view of that storage, or the tensor changed in place since, is saved as usual."""
    x = torch.randn(4, 8)
    copy = host_copies.HostCopy(lambda: pytest.fail("nothing is fetched here"))
    host_copies.register(x, copy)

    class Save(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            host_copies.save(ctx, t)
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            return g

    def saved_as(t):
        return Save.apply(t.detach().requires_grad_()).grad_fn.host_copies[0]

    assert saved_as(x) is copy
    assert saved_as(x[1:]) is None and saved_as(x.view(8, 4)) is None
    x.add_(1)
    assert saved_as(x) is None
