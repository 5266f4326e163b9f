"""Module bodies compiled (bpt.compile.compiled_forward): the MLP with its LoRA layers, the lean norms, the attention's
LoRA projections and the rotary embedding run through torch.compile, in chunks and in their recomputes. Exact against
stock (fp32; bf16 no worse than stock against fp32), one graph per body whatever the lengths, and on the simulated GPU
priced as compiled code.

Most tests trace with the "aot_eager" backend (dynamo and AOT autograd see exactly what inductor would be handed, in
seconds); one runs inductor's C++ backend on the MLP's chunks, the path a CUDA run takes with Triton."""
from __future__ import annotations

import copy

import pytest
import torch

from bpt import compile as bpt_compile
from bpt.mlp import chunked_mlp
from patches import apply_bpt_patch
from test_patches import SMALL_BLOCKS, assert_grads_close, lora, loss_and_grads, make_batch
from tiny_models import tiny_model

pytestmark = pytest.mark.skipif(bpt_compile.unavailable_reason("cpu") is not None,
                                reason=f"torch.compile unavailable here: {bpt_compile.unavailable_reason('cpu')}")


@pytest.fixture
def backend(monkeypatch, request):
    """torch.compile's backend for module bodies (param: "aot_eager" unless given), a fresh dynamo before and after."""
    monkeypatch.setattr(bpt_compile, "BODY_BACKEND", getattr(request, "param", "aot_eager"))
    torch._dynamo.reset()
    monkeypatch.setattr(bpt_compile, "_COMPILED", {})
    yield
    torch._dynamo.reset()


def _stock_and_compiled(checkpointing: bool):
    stock = lora(tiny_model("llama"))
    patched = copy.deepcopy(stock)
    # chunk_budget 1: the LoRA projections and the rotary embedding in chunks too (on CPU they run whole otherwise)
    apply_bpt_patch(patched, **SMALL_BLOCKS, chunk_budget=1, compile=True)
    if checkpointing:
        for model in (stock, patched):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return stock, patched


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_bodies_equal_stock(backend, checkpointing):
    stock, patched = _stock_and_compiled(checkpointing)
    inputs = make_batch("plain")  # (packed rows take the blockwise engine on a CPU: its own compile tests)
    stock_loss, stock_grads = loss_and_grads(stock, inputs)
    patched_loss, patched_grads = loss_and_grads(patched, inputs)
    assert abs(patched_loss - stock_loss) <= 1e-5 * abs(stock_loss)
    assert_grads_close(stock_grads, patched_grads)
    bodies = set(bpt_compile.compile_stats()["bodies"])
    assert {"LlamaMLP.forward", "LlamaRMSNorm.forward", "epilogue_forward", "apply_rotary_pos_emb"} <= bodies, bodies


def test_lengths_that_vary_do_not_recompile(backend):
    """Rows of other lengths and documents: after the first step (forward, recompute and backward graphs) no step
    makes a graph."""
    _, patched = _stock_and_compiled(checkpointing=True)
    graphs = []
    for length in (45, 38, 51, 29):
        loss_and_grads(patched, make_batch("plain", length=length))
        graphs.append(bpt_compile.compile_stats()["graphs"])
    assert graphs[0] > 0 and graphs[1:] == [graphs[0]] * 3, graphs


@pytest.mark.parametrize("backend", ["inductor"], indirect=True)
def test_inductor_compiled_mlp_chunks_equal_eager(backend):
    """The LoRA MLP's chunks and their recompute compiled by inductor (C++ on a CPU): fp32 equal to eager; under bf16
    autocast each no further from an fp32 reference than eager is (fusion keeps fp32 intermediates: often closer)."""
    model = lora(tiny_model("llama"))
    mlp = model.base_model.model.model.layers[0].mlp
    params = [p for p in mlp.parameters() if p.requires_grad]
    body = bpt_compile.compiled_forward(mlp.forward, True)
    x = torch.randn(2, 45, 32, generator=torch.Generator().manual_seed(0))

    def run(forward, autocast: bool):
        leaf = x.clone().requires_grad_(True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = chunked_mlp(forward, params, leaf, chunk=16)
        grads = torch.autograd.grad(y.float().square().sum(), [leaf, *params])
        return [y.float(), *(g.float() for g in grads)]

    reference = run(mlp.forward, False)
    for c, e in zip(run(body, False), reference):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
    eager, compiled = run(mlp.forward, True), run(body, True)
    for c, e, r in zip(compiled, eager, reference):
        assert (c - r).norm() <= 1.25 * (e - r).norm()
    assert bpt_compile.compile_stats()["compiling_calls"] >= 2  # the chunks' graph and the recompute's


def test_the_trainer_says_what_a_step_compiled(monkeypatch):
    """train.qlora's loop prints the first step's graphs and seconds, and any later step that compiled again."""
    from types import SimpleNamespace

    from train.run.loop import CompileWatch

    stats = {"graphs": 0, "compiling_calls": 0, "compile_seconds": 0.0, "bodies": []}
    monkeypatch.setattr(bpt_compile, "compile_stats", lambda: dict(stats))
    printed = []
    watch = CompileWatch(SimpleNamespace(print=printed.append))
    stats.update(graphs=5, compiling_calls=5, compile_seconds=12.5)
    watch.after(1, first=True)
    watch.after(2, first=False)  # nothing compiled: nothing said
    stats.update(graphs=6, compiling_calls=6, compile_seconds=14.0)
    watch.after(3, first=False)
    assert printed == ["compile: step 1 compiled 5 graph(s), 12.5 s",
                       "compile: step 3 compiled 1 graph(s) again (a shape or setting it had not seen), 1.5 s"]
