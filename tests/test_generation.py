"""Generation with a static cache, patched vs stock transformers (fp32, greedy).

A static cache hands attention all of its max_cache_len key slots, most of them empty, and generate()
builds the masks ahead of each forward (then calls `.contiguous()` on them). The patched model must
drop the empty slots and keep the queries at their cache offset, or a prefill sees its own future.
"""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import StaticCache

from patches import apply_bpt_patch
from test_patches import SMALL_BLOCKS, make_batch
from tiny_models import tiny_model

PROMPT = 20  # > q_block (16): the prefill runs blockwise; > mistral's / gemma2's window (7)

# One family per code path: llama-like, sliding window (mistral), per-layer-type masks handed over as a
# dict + softcap (gemma2), GPT-2 (reshapes any mask it is given), ALiBi bound forward (bloom), Falcon's
# bound forward with RoPE. Falcon with ALiBi is not here: stock transformers cannot generate with a static
# cache for it (its ALiBi is sized from the 2-D mask, the SDPA mask from the cache).
STATIC_GENERATE = ["llama", "mistral", "gemma2", "gpt2", "bloom", "falcon"]


def pair(name, blocks=SMALL_BLOCKS, **overrides):
    """(stock in eval mode, a patched copy with `blocks`); overrides go to the tiny config."""
    stock = tiny_model(name, **overrides).eval()
    patched = copy.deepcopy(stock)
    apply_bpt_patch(patched, **blocks)
    return stock, patched


def prompt(left_padded: bool, length: int = PROMPT, pads: int = 6):
    """(input_ids, attention_mask) [2, length]; left_padded: row 0 starts with `pads` pad tokens (id 0)."""
    input_ids = make_batch("plain", batch=2, length=length)["input_ids"]
    attention_mask = torch.ones_like(input_ids)
    if left_padded:
        attention_mask[0, :pads] = 0
        input_ids[0, :pads] = 0
    return input_ids, attention_mask


@pytest.mark.parametrize("left_padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("name", STATIC_GENERATE)
def test_static_cache_generate_matches_stock(name, left_padded):
    stock, patched = pair(name)
    input_ids, attention_mask = prompt(left_padded)
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
                  cache_implementation="static", output_scores=True, output_logits=True,
                  return_dict_in_generate=True)
    expected = stock.generate(input_ids, **kwargs)
    got = patched.generate(input_ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)
    assert len(got.scores) == len(expected.scores) == len(got.logits) == len(expected.logits) == 8
    for step, (g, e) in enumerate(zip(got.scores, expected.scores)):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6, msg=lambda m: f"scores of step {step}: {m}")
    for step, (g, e) in enumerate(zip(got.logits, expected.logits)):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-6, msg=lambda m: f"logits of step {step}: {m}")


@pytest.mark.parametrize("left_padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("name", ["llama", "mistral", "bloom"])
def test_static_cache_forward_matches_stock(name, left_padded):
    """A StaticCache used by hand: prefill, a multi-token continuation at an offset, one decode step.
    Every query must see exactly the keys before it, not the whole filled part of the cache."""
    stock, patched = pair(name)
    input_ids, attention_mask = prompt(left_padded)
    extra = make_batch("plain", batch=2, length=7, seed=1)["input_ids"]
    input_ids = torch.cat([input_ids, extra], dim=1)  # [2, 27]
    attention_mask = torch.cat([attention_mask, torch.ones_like(extra)], dim=1)
    steps = [(0, PROMPT), (PROMPT, PROMPT + 6), (PROMPT + 6, PROMPT + 7)]
    masks = [attention_mask[:, :b] for _, b in steps]
    if name == "bloom":  # stock Bloom sizes its ALiBi from the mask: it needs one over every cache slot
        masks = [torch.nn.functional.pad(mask, (0, 48 - mask.shape[1])) for mask in masks]
    outputs = {}
    for label, model in (("stock", stock), ("patched", patched)):
        cache = StaticCache(config=model.config, max_cache_len=48)
        with torch.no_grad():
            outputs[label] = [model(input_ids=input_ids[:, a:b], attention_mask=mask, past_key_values=cache,
                                    use_cache=True).logits for (a, b), mask in zip(steps, masks)]
    valid = attention_mask.bool()
    for (a, b), got, expected in zip(steps, outputs["patched"], outputs["stock"]):
        rows = valid[:, a:b]  # left-padded query rows are garbage in stock, zeros patched
        torch.testing.assert_close(got[rows], expected[rows], rtol=1e-6, atol=1e-6)


def test_static_cache_prefill_is_causal():
    """Changing later prompt tokens must not change earlier logits (the prefill's queries sit at
    offset 0 of a 48-slot cache, not at its end)."""
    _, patched = pair("llama")
    input_ids, _ = prompt(False)
    changed = input_ids.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % 97
    logits = []
    for ids in (input_ids, changed):
        with torch.no_grad():
            cache = StaticCache(config=patched.config, max_cache_len=48)
            logits.append(patched(input_ids=ids, past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(logits[0][:, :12], logits[1][:, :12], rtol=0, atol=0)


def test_compiled_static_cache_decoding_compiles_per_shape_not_per_token():
    """generate() with a static cache and the model's forward under torch.compile (inductor's C++ backend here), as
    compiled decoding runs: see assert_compiled_decoding_compiles_per_shape. Measured: 40 s for the first call here
    (stock's 2 graphs: 19 s)."""
    from bpt.compile import unavailable_reason

    if unavailable_reason("cpu"):
        pytest.skip(f"torch.compile unavailable here: {unavailable_reason('cpu')}")
    assert_compiled_decoding_compiles_per_shape("cpu")


def assert_compiled_decoding_compiles_per_shape(device: str) -> None:
    """The patched tiny llama, left-padded prompts, 12 tokens (fp32; the CUDA tier runs it on a GPU too): it decodes
    stock eager's tokens, and dynamo makes a graph for the prefill, one for the decode step and one more when the
    filled cache length first changes (then dynamic): 3, none per token, and a second generate() compiles nothing."""
    from torch._dynamo.utils import counters

    stock, patched = (model.to(device) for model in pair("llama"))
    input_ids, attention_mask = (t.to(device) for t in prompt(left_padded=True))
    kwargs = dict(attention_mask=attention_mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                  pad_token_id=0, cache_implementation="static")
    expected = stock.generate(input_ids, **kwargs)
    patched.forward = torch.compile(patched.forward)
    graphs = counters["stats"]["unique_graphs"]
    assert torch.equal(patched.generate(input_ids, **kwargs), expected)
    first = counters["stats"]["unique_graphs"] - graphs
    assert torch.equal(patched.generate(input_ids, **kwargs), expected)
    assert (first, counters["stats"]["unique_graphs"] - graphs) == (3, 3)
