"""Full-graph torch.compile (issue 18, bug 3): nothing on a patched model's path reads tensor data while torch.compile
traces it, and the traced (dense) computation equals the eager one and stock transformers'.

Eagerly, the block plan reads per-block padding / segment statistics on the host to skip blocks
(bpt.engine.plan.make_plan), and the mask builder drops all-True masks (patches/masks.py); under tracing each read
is a data-dependent guard, which fullgraph=True turns into an error. The compiled runs use torch.compile's
"aot_eager" backend: dynamo and AOT autograd trace exactly what inductor would be handed (the data-dependent reads
fail there), in seconds rather than the minutes inductor's C++ builds take on two cores.
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from bpt import compile as bpt_compile
from bpt.attention import blockwise_attention
from bpt.engine import AttentionSpec, make_plan
from test_generation import pair, prompt

BACKEND = "eager"
BLOCKS = dict(q_block=4, kv_block=4, mlp_chunk=4, loss_chunk=4)  # several blocks in 10-token sequences

pytestmark = pytest.mark.skipif(bpt_compile.unavailable_reason("cpu") is not None,
                                reason=f"torch.compile unavailable here: {bpt_compile.unavailable_reason('cpu')}")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()  # no graph compiled by an earlier test is reused
    yield
    torch._dynamo.reset()


def compiled(fn):
    return torch.compile(fn, fullgraph=True, backend=BACKEND)


# ----------------------------------------------------------------------------------------------------
# The plan while tracing: no data read, every block the causal / window rules allow, masks in each
# ----------------------------------------------------------------------------------------------------


def _spec(window=None, nq=13, nk=13):
    return AttentionSpec(scale=1.0, causal=True, window=window, softcap=None, q_block=4, kv_block=4, offset=nk - nq,
                         acc_dtype=torch.float32, groups=1, use_compile=False)


@pytest.mark.parametrize("window", [None, 5])
def test_plan_while_compiling_reads_no_data_and_is_dense(window):
    """Masks on the meta device have no data: any host read (.tolist(), bool()) raises."""
    spec, b, n = _spec(window), 2, 13
    padding = torch.empty(b, n, dtype=torch.bool, device="meta")
    segments = torch.empty(b, n, dtype=torch.long, device="meta")
    rules_only = make_plan(spec, b, n, n, None, None)  # causal / window blocks, no data involved
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        plan = make_plan(spec, b, n, n, padding, segments)
    assert [(i0, i1, [(k.j0, k.j1, k.causal, k.window) for k in blocks]) for i0, i1, blocks in plan] \
        == [(i0, i1, [(k.j0, k.j1, k.causal, k.window) for k in blocks]) for i0, i1, blocks in rules_only]
    assert all(k.padding and k.segments for _, _, blocks in plan for k in blocks)


def test_masks_while_compiling_read_no_data():
    """The O(N) mask builder traced: meta tensors (no data) pass; the all-True shortcuts are not taken (the masks
    stay, dense); a chunked-attention mask (Llama 4) is told by the config, not by inspecting closures, and gives the
    chunk segments the eager inspection gives."""
    from types import SimpleNamespace

    from transformers.masking_utils import causal_mask_function, chunked_causal_mask_function

    from patches.masks import bpt_mask

    b, n, chunk = 2, 10, 4
    config = SimpleNamespace(attention_chunk_size=chunk, sliding_window=None)
    padding = torch.ones(b, n, dtype=torch.bool, device="meta")
    chunked = chunked_causal_mask_function(chunk, torch.zeros(b, dtype=torch.long, device="meta"))
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        plain = bpt_mask(b, n, n, mask_function=causal_mask_function, attention_mask=padding, device="meta",
                         config=config)
        no_mask = bpt_mask(b, n, n, mask_function=causal_mask_function, device="meta", config=config)
        chunks = bpt_mask(b, n, n, mask_function=chunked, local_size=chunk, device="meta", config=config)
        on_cpu = bpt_mask(b, n, n, mask_function=chunked_causal_mask_function(chunk, torch.zeros(b, dtype=torch.long)),
                          local_size=chunk, config=config)
    assert plain.padding_mask is not None and plain.padding_mask.shape == (b, n)  # eagerly: None (all True)
    assert bpt_mask(b, n, n, mask_function=causal_mask_function, attention_mask=torch.ones(b, n)).padding_mask is None
    assert no_mask.segment_ids.shape == (b, n)  # one document per row, kept as ids
    assert chunks.segment_ids.shape == (b, n) and chunks.sliding_window is None
    eager = bpt_mask(b, n, n, mask_function=chunked_causal_mask_function(chunk, torch.zeros(b, dtype=torch.long)),
                     local_size=chunk, config=config)
    assert torch.equal(on_cpu.segment_ids, eager.segment_ids) and on_cpu.sliding_window is None


def _attention_inputs():
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, n, d = 2, 4, 2, 10, 8
    q, k, v = (torch.randn(b, h, n, d, generator=g, requires_grad=True) for h in (hq, hkv, hkv))
    padding = torch.ones(b, n, dtype=torch.bool)
    padding[0, :6] = False  # left padding: key block 0 fully hidden in row 0, so the eager plan skips work
    segments = torch.tensor([[0] * 7 + [1] * 3, [0] * 3 + [1] * 7])  # packed documents
    return q, k, v, padding, segments


@pytest.mark.parametrize("empty_rows", ["zeros", "uniform"])
def test_blockwise_attention_fullgraph_equals_eager(empty_rows):
    """Padding (with rows that see no key) + packed documents, forward and q/k/v gradients: compiled (dense plan,
    and backward's empty-row check skipped) vs eager (data-driven skipping)."""
    q, k, v, padding, segments = _attention_inputs()
    dout = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3], generator=torch.Generator().manual_seed(1))

    def attend(q, k, v, padding, segments):
        return blockwise_attention(q, k, v, padding_mask=padding, segment_ids=segments, q_block=4, kv_block=4,
                                   compile=False, empty_rows=empty_rows)

    results = []
    for fn in (attend, compiled(attend)):
        out = fn(q, k, v, padding, segments)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        results.append((out, *grads))
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# A patched model compiled with fullgraph=True, against stock transformers (eager)
# ----------------------------------------------------------------------------------------------------


def _pair():
    return pair("llama", BLOCKS, num_hidden_layers=1)  # one layer: tracing time is per layer


def _prompt(left_padded: bool):
    return prompt(left_padded, length=10, pads=3)


@pytest.mark.parametrize("left_padded", [False, True], ids=["no_mask", "left_padded"])
def test_fullgraph_forward_equals_stock(left_padded):
    """Forward with labels (inference): logits and loss as stock's. With no attention mask the mask builder probes
    transformers' mask function for packed documents and chunks (traced: no data read, no closure inspection)."""
    stock, patched = _pair()
    input_ids, attention_mask = _prompt(left_padded)
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    mask = {"attention_mask": attention_mask} if left_padded else {}
    patched.forward = compiled(patched.forward)
    with torch.no_grad():
        expected = stock(input_ids=input_ids, labels=labels, use_cache=False, **mask)
        got = patched(input_ids=input_ids, labels=labels, use_cache=False, **mask)
    torch.testing.assert_close(got.logits, expected.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-5)


def test_fullgraph_generate_equals_stock():
    """Left-padded generate() through a forward compiled with fullgraph=True (a dynamic cache: the prefill and the
    decode step are traced): the same tokens as stock, the same scores to fp32 tolerance."""
    stock, patched = _pair()
    input_ids, attention_mask = _prompt(left_padded=True)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=2, do_sample=False, pad_token_id=0,
                  output_scores=True, return_dict_in_generate=True)
    expected = stock.generate(input_ids, **kwargs)
    patched.forward = compiled(patched.forward)
    got = patched.generate(input_ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    for g, e in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_static_cache_compiled_generate_equals_stock():
    """transformers' own mechanism (test_generate_compile_model_forward_fullgraph): a static cache and a
    CompileConfig with fullgraph=True compile the decode steps; the masks come in built by generate()."""
    from transformers import CompileConfig

    stock, patched = _pair()
    input_ids, attention_mask = _prompt(left_padded=True)
    compile_config = CompileConfig(fullgraph=True, dynamic=False, backend=BACKEND)
    compile_config._compile_all_devices = True  # compile on CPU too, as transformers' test does
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                  cache_implementation="static", output_scores=True, return_dict_in_generate=True)
    expected = stock.generate(input_ids, **kwargs)
    got = patched.generate(input_ids, compile_config=compile_config, **kwargs)
    assert hasattr(patched, "_compiled_call")  # the decode steps did run compiled
    assert torch.equal(got.sequences, expected.sequences)
    for g, e in zip(got.scores, expected.scores, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
