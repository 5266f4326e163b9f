"""patches/rotary.py: a patched model's rotary embeddings over a long sequence run one chunk of tokens at a time, with
outputs and gradients bitwise those of transformers' whole-sequence call, in every family whose function has the
common form; other models in the process, and the model once unpatched, get the original call."""
from __future__ import annotations

import pytest
import torch
from transformers.models.llama import modeling_llama

from bpt.config import BPTConfig
from patches import apply_bpt_patch, rotary
from test_offload import deterministic_kernels
from test_patches import SMALL_BLOCKS, loss_and_grads, make_batch
from tiny_models import TINY_CONFIGS, tiny_model

# A chunk budget of 1 byte: chunks of norm_chunk's 16 tokens (a CPU has no budget unless one is set).
CHUNKED = {**SMALL_BLOCKS, "chunk_budget": 1}


@pytest.fixture
def chunked_calls(monkeypatch):
    """How many calls took the chunked path, and how many chunks they ran."""
    calls = []
    real = rotary._ChunkedRotary.apply

    def counting(q, k, cos, sin, original, rows):
        calls.append(-(-q.shape[2] // rows))
        return real(q, k, cos, sin, original, rows)

    monkeypatch.setattr(rotary._ChunkedRotary, "apply", counting)
    return calls


def whole_sequence(monkeypatch):
    monkeypatch.setattr(rotary, "_taken", lambda args, kwargs: None)


def assert_bitwise(expected, got):
    (loss, grads), (other_loss, other_grads) = expected, got
    assert torch.equal(loss, other_loss) and grads.keys() == other_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, other_grads[name]), name


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_chunked_rotary_is_bitwise_the_whole_call(name, chunked_calls, monkeypatch):
    model = tiny_model(name)
    apply_bpt_patch(model, **CHUNKED)
    inputs = make_batch("packed")
    chunked = loss_and_grads(model, inputs)
    taken = len(chunked_calls)
    with monkeypatch.context() as m:
        whole_sequence(m)
        assert_bitwise(loss_and_grads(model, inputs), chunked)
    if name in ("llama", "mistral", "qwen2", "gemma"):  # the common form: every layer's call is taken
        assert taken == model.config.num_hidden_layers and set(chunked_calls) == {3}  # 45 tokens, chunks of 16


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16_autocast", "bf16_weights"])
def test_precisions_and_checkpointing(precision, checkpointing, chunked_calls, monkeypatch):
    model = tiny_model("llama")
    if precision == "bf16_weights":
        model = model.to(torch.bfloat16)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    apply_bpt_patch(model, **CHUNKED)
    inputs = make_batch("plain")
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16_autocast"):
        chunked = loss_and_grads(model, inputs)
        with monkeypatch.context() as m:
            whole_sequence(m)
            whole = loss_and_grads(model, inputs)
    assert_bitwise(whole, chunked)
    forwards = 2 if checkpointing else 1  # the recompute inside backward takes it too
    assert len(chunked_calls) == forwards * model.config.num_hidden_layers


@pytest.mark.parametrize("cos_dtype", [torch.float32, torch.bfloat16])
def test_function_outputs_and_gradients_as_the_original(cos_dtype):
    """q / k as transformers makes them (a transposed view of the projection), cos in fp32 under autocast or in the
    weights' dtype: same values, dtype and layout as the original call, same gradients."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 45, 4, 8, generator=g, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    k = torch.randn(2, 45, 2, 8, generator=g, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
    cos, sin = (torch.randn(1, 45, 8, generator=g).to(cos_dtype) for _ in range(2))
    rotary._CONFIG_OF[cos] = BPTConfig(**CHUNKED)
    original = modeling_llama.apply_rotary_pos_emb
    if getattr(original, rotary._WRAPPED, False):  # a patch in this process wrapped it
        original = original.__wrapped__
    outs = rotary.lean_rotary(original)(q, k, cos, sin)
    expected = original(q, k, cos, sin)
    grads_out = [torch.randn(t.shape, generator=g).to(t.dtype) for t in expected]
    for got, want in zip(outs, expected):
        assert torch.equal(got, want) and got.dtype == want.dtype and got.stride() == want.stride()
    got_grads, want_grads = (torch.autograd.grad(o, (q, k), grads_out) for o in (outs, expected))
    for got, want in zip(got_grads, want_grads):
        assert torch.equal(got, want) and got.dtype == want.dtype


def test_other_models_and_the_unpatched_model_take_the_original_call(chunked_calls):
    patched, stock = tiny_model("llama"), tiny_model("llama")
    handle = apply_bpt_patch(patched, **CHUNKED)
    inputs = make_batch("plain")
    stock(**inputs).loss.backward()
    assert chunked_calls == []
    patched(**inputs).loss.backward()
    assert len(chunked_calls) == patched.config.num_hidden_layers
    handle.remove()
    chunked_calls.clear()
    patched(**inputs).loss.backward()
    assert chunked_calls == []


@pytest.mark.parametrize("options", [{**CHUNKED, "norm_chunk": 64}, SMALL_BLOCKS],
                         ids=["within_one_chunk", "no_chunk_budget"])
def test_the_whole_call_where_it_fits_or_without_a_budget(options, chunked_calls):
    model = tiny_model("llama")
    apply_bpt_patch(model, **options)  # 45 tokens within a chunk of 64; or a CPU's budget of 0
    model(**make_batch("plain")).loss.backward()
    assert chunked_calls == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU (run `python -m pytest -m cuda` on a GPU machine)")
def test_cuda_chunks_under_a_small_budget_bitwise(chunked_calls, monkeypatch):
    """On a GPU, with a chunk budget too small for the whole sequence's rotary temporaries: chunked, bitwise the
    whole call under bf16 autocast with checkpointing."""
    model = tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=4096).cuda()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    apply_bpt_patch(model, chunk_budget=1 << 20, norm_chunk=256)  # 2048 tokens x 6 KiB: over 1 MiB
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in make_batch("plain", length=2048).items()}
    with torch.autocast("cuda", dtype=torch.bfloat16), deterministic_kernels():  # flash's dq: see test_offload
        chunked = loss_and_grads(model, inputs)
        with monkeypatch.context() as m:
            whole_sequence(m)
            whole = loss_and_grads(model, inputs)
    assert chunked_calls and min(chunked_calls) > 1
    assert_bitwise(whole, chunked)
