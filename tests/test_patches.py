"""Each supported family, patched vs stock transformers: loss, logits and every gradient (fp32)."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, OPTConfig

from patches import FAMILIES, UnsupportedModelError, apply_bpt_patch, is_patched
from patches.masks import BlockMaskInputs
from tiny_models import TINY_CONFIGS, VOCAB, tiny_config, tiny_model

# Small blocks so that every op really runs blockwise on a 45-token sequence.
SMALL_BLOCKS = dict(q_block=16, kv_block=16, mlp_chunk=16, loss_chunk=16, norm_chunk=16)
LENGTH = 45


def make_batch(kind: str, batch: int = 2, length: int = LENGTH, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    labels = input_ids.clone()
    labels[:, :5] = -100
    # use_cache=False as in training (our CLI, TRL): with a cache, transformers skips its packed-document detection.
    inputs = {"input_ids": input_ids, "labels": labels, "use_cache": False}
    if kind in ("right_padded", "left_padded"):
        mask = torch.ones(batch, length, dtype=torch.long)
        if kind == "right_padded":
            mask[0, -9:] = 0
        else:  # the padded queries see no key; the last of them predicts the first real token (stock counts it)
            mask[0, :9] = 0
        labels[mask == 0] = -100
        inputs["attention_mask"] = mask
    elif kind == "packed":  # three documents in each row: positions restart
        inputs["position_ids"] = torch.cat([torch.arange(17), torch.arange(20), torch.arange(length - 37)]).repeat(batch, 1)
    return inputs


def loss_and_grads(model, inputs):
    model.zero_grad(set_to_none=True)
    loss = model(**inputs).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_grads_close(stock: dict, patched: dict):
    assert stock.keys() == patched.keys()
    for name, expected in stock.items():
        scale = expected.abs().max().clamp_min(1e-12)
        err = (patched[name] - expected).abs().max() / scale
        assert err < 1e-4, f"gradient of {name} differs by {err:.2e} of its largest magnitude"


def test_every_family_has_a_test_config():
    """Registry sync: each table row is exercised by at least one tiny config, and vice versa."""
    tested = {model_type for model_type, _ in TINY_CONFIGS.values()}
    assert tested == set(FAMILIES)


@pytest.mark.parametrize("kind", ["plain", "right_padded", "left_padded", "packed"])
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_patched_matches_stock(name, kind):
    stock = tiny_model(name)
    patched = copy.deepcopy(stock)
    apply_bpt_patch(patched, **SMALL_BLOCKS)
    inputs = make_batch(kind)
    stock_loss, stock_grads = loss_and_grads(stock, inputs)
    patched_loss, patched_grads = loss_and_grads(patched, inputs)
    assert torch.isfinite(stock_loss)
    assert abs(patched_loss - stock_loss) <= 1e-5 * abs(stock_loss)
    assert_grads_close(stock_grads, patched_grads)


@pytest.mark.parametrize("name", ["llama", "gpt2", "bloom", "falcon_alibi", "gemma2"])
def test_logits_without_labels_match_stock(name):
    stock = tiny_model(name).eval()
    patched = copy.deepcopy(stock)
    apply_bpt_patch(patched, **SMALL_BLOCKS)
    inputs = make_batch("right_padded")
    inputs.pop("labels")
    with torch.no_grad():
        expected = stock(**inputs).logits
        got = patched(**inputs).logits
    valid = inputs["attention_mask"].bool()
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-5)


def test_labels_give_loss_without_logits():
    model = tiny_model("llama")
    apply_bpt_patch(model, **SMALL_BLOCKS)
    out = model(**make_batch("plain"))
    assert out.logits is None and out.loss is not None


def test_gradient_checkpointing_matches_stock():
    stock = tiny_model("llama")
    patched = copy.deepcopy(stock)
    for model in (stock, patched):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    apply_bpt_patch(patched, **SMALL_BLOCKS)
    inputs = make_batch("packed")
    stock_loss, stock_grads = loss_and_grads(stock, inputs)
    patched_loss, patched_grads = loss_and_grads(patched, inputs)
    assert abs(patched_loss - stock_loss) <= 1e-5 * abs(stock_loss)
    assert_grads_close(stock_grads, patched_grads)


def test_causality_kept():
    """A custom attention name without a mask entry would get mask None and lose causality."""
    model = tiny_model("llama").eval()
    apply_bpt_patch(model, **SMALL_BLOCKS)
    inputs = make_batch("plain")
    changed = inputs["input_ids"].clone()
    changed[:, 30:] = (changed[:, 30:] + 1) % VOCAB
    with torch.no_grad():
        before = model(input_ids=inputs["input_ids"]).logits
        after = model(input_ids=changed).logits
    torch.testing.assert_close(before[:, :30], after[:, :30], rtol=0, atol=0)
    assert not torch.allclose(before[:, 30:], after[:, 30:])


def test_mask_is_o_n():
    """The patched model's mask creation returns O(N) inputs, never an N x N tensor."""
    from transformers.masking_utils import create_causal_mask

    model = tiny_model("llama")
    apply_bpt_patch(model)
    embeds = torch.zeros(2, LENGTH, 32)
    mask = create_causal_mask(model.config, embeds, torch.ones(2, LENGTH, dtype=torch.long), None,
                              position_ids=torch.arange(LENGTH)[None])
    assert isinstance(mask, BlockMaskInputs)
    packed = create_causal_mask(model.config, embeds, None, None, position_ids=make_batch("packed")["position_ids"])
    assert packed.segment_ids.tolist()[0] == [0] * 17 + [1] * 20 + [2] * 8


def _dense_from_inputs(mask: BlockMaskInputs, batch: int) -> torch.Tensor:
    """[B, q_length, kv_length] bool: the mask BlockMaskInputs stand for (causal; queries are the last keys)."""
    nq, nk = mask.q_length, mask.kv_length
    q_pos = torch.arange(nk - nq, nk)[:, None]  # [Nq, 1] key index of each query
    k_pos = torch.arange(nk)[None, :]  # [1, Nk]
    dense = (k_pos <= q_pos).expand(batch, nq, nk).clone()
    if mask.sliding_window is not None:
        dense &= q_pos - k_pos < mask.sliding_window
    if mask.segment_ids is not None:
        seg = mask.segment_ids.expand(batch, nk)
        dense &= seg[:, None, :] == seg[:, nk - nq:, None]
    if mask.padding_mask is not None:
        dense &= mask.padding_mask[:, None, :]
    return dense


def _packed_as_stock_builds_it(mask_function, position_ids, document_ids):
    """transformers' mask function for packed documents: positions restarted per document, and the same document."""
    import transformers.masking_utils as masking

    if hasattr(masking, "packed_sequence_compatibility_function"):  # transformers < 5.24
        return masking.packed_sequence_compatibility_function(mask_function, position_ids, document_ids)
    return masking.and_masks(masking.remap_positions_for_packed_sequence(mask_function, position_ids),
                             masking.packed_sequence_mask_function(document_ids))


@pytest.mark.parametrize("case", ["plain", "left_padded", "right_padded", "packed", "cache_offset"])
def test_chunked_mask_is_not_a_window(case):
    """Llama 4's chunked attention (attention_chunk_size C: causal and same chunk) is handed to the mask interface
    with local_size=C, like a sliding window; bpt_mask must build the chunked mask (segment ids per chunk), not a
    window of C. Compared with transformers' own dense mask for the same arguments."""
    from transformers.masking_utils import chunked_causal_mask_function, sdpa_mask

    from patches.masks import bpt_mask

    chunk, batch, length = 8, 2, 45
    attention_mask, q_length, q_offset = None, length, 0
    left_padding = torch.zeros(batch, dtype=torch.long)
    if case == "left_padded":
        attention_mask = torch.ones(batch, length, dtype=torch.long)
        attention_mask[0, :5] = 0
        left_padding = (attention_mask.cumsum(-1) == 0).sum(-1)
    elif case == "right_padded":
        attention_mask = torch.ones(batch, length, dtype=torch.long)
        attention_mask[0, -9:] = 0
    mask_function = chunked_causal_mask_function(chunk, left_padding)
    if case == "packed":
        position_ids = make_batch("packed", batch=batch)["position_ids"]
        starts = torch.nn.functional.pad(position_ids[:, 1:] != position_ids[:, :-1] + 1, (1, 0))
        mask_function = _packed_as_stock_builds_it(mask_function, position_ids, starts.cumsum(-1))
    elif case == "cache_offset":  # 13 new queries after 32 cached keys
        q_length, q_offset = 13, 32
    args = dict(batch_size=batch, q_length=q_length, kv_length=length, q_offset=q_offset, kv_offset=0,
                mask_function=mask_function, attention_mask=attention_mask, local_size=chunk)
    ours = bpt_mask(**args)
    assert ours.sliding_window is None and ours.segment_ids is not None
    expected = sdpa_mask(**args, allow_is_causal_skip=False)[:, 0]  # [B, Nq, Nk]
    got = _dense_from_inputs(ours, batch)
    real_queries = torch.ones(batch, q_length, dtype=torch.bool) if attention_mask is None else \
        attention_mask[:, length - q_length:].bool()
    assert torch.equal(got[real_queries], expected[real_queries])
    # The same arguments read as a sliding window of C would differ (the test can tell them apart).
    windowed = _dense_from_inputs(BlockMaskInputs(ours.padding_mask, None, chunk, q_length, length), batch)
    assert not torch.equal(windowed[real_queries], expected[real_queries])


@pytest.mark.parametrize("name", ["llama", "bloom", "falcon_alibi"])
def test_remove_restores_bit_identical_outputs(name):
    model = tiny_model(name).eval()
    inputs = make_batch("right_padded")
    with torch.no_grad():
        before = model(**inputs)
    implementation = model.config._attn_implementation
    handle = apply_bpt_patch(model, **SMALL_BLOCKS)
    assert is_patched(model) and model.config._attn_implementation == "bpt"
    handle.remove()
    assert not is_patched(model) and model.config._attn_implementation == implementation
    assert "forward" not in vars(model)
    with torch.no_grad():
        after = model(**inputs)
    assert torch.equal(before.logits, after.logits) and torch.equal(before.loss, after.loss)


def test_generate_matches_stock():
    """KV-cache decoding (queries aligned to the end of the keys) gives the stock greedy tokens."""
    stock = tiny_model("mistral").eval()
    patched = copy.deepcopy(stock)
    apply_bpt_patch(patched, **SMALL_BLOCKS)
    prompt = make_batch("plain", batch=1)["input_ids"][:, :20]
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(stock.generate(prompt, **kwargs), patched.generate(prompt, **kwargs))


def test_unsupported_family_is_refused():
    model = AutoModelForCausalLM.from_config(OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1,
                                                       ffn_dim=48, num_attention_heads=4, word_embed_proj_dim=32))
    with pytest.raises(UnsupportedModelError, match=r"does not support 'opt' models: .*MLP.*docs/families\.md"):
        apply_bpt_patch(model)
    assert not is_patched(model)


def test_bad_options_are_refused():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="q_block"):
        apply_bpt_patch(model, q_block=0)
    with pytest.raises(TypeError, match="valid options"):
        apply_bpt_patch(model, block=64)
    assert not is_patched(model)


def test_patch_models_loaded_later(tmp_path):
    tiny_model("qwen2").save_pretrained(tmp_path)
    handle = apply_bpt_patch(**SMALL_BLOCKS)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
        built = AutoModelForCausalLM.from_config(tiny_config("gpt2"))
        assert is_patched(loaded) and is_patched(built)
    finally:
        handle.remove()
    assert not is_patched(loaded) and not is_patched(built)
    assert not is_patched(AutoModelForCausalLM.from_pretrained(tmp_path))


def lora(model, seed=0, targets=("q_proj", "v_proj", "gate_proj", "down_proj")):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, target_modules=list(targets))
    return get_peft_model(model, config)


def test_lora_matches_stock():
    stock = lora(tiny_model("llama"))
    patched = copy.deepcopy(stock)
    handle = apply_bpt_patch(patched, **SMALL_BLOCKS)  # patching through the peft wrapper
    assert is_patched(patched)
    inputs = make_batch("packed")
    stock_loss, stock_grads = loss_and_grads(stock, inputs)
    patched_loss, patched_grads = loss_and_grads(patched, inputs)
    assert stock_grads and all("lora_" in name for name in stock_grads)
    assert abs(patched_loss - stock_loss) <= 1e-5 * abs(stock_loss)
    assert_grads_close(stock_grads, patched_grads)
    handle.remove()
    assert not is_patched(patched)


@pytest.mark.parametrize("chunk_budget", [None, 1])  # 1: the LoRA projections in chunks, the norms' outputs rebuilt
def test_4bit_qlora_matches_stock(tmp_path, chunk_budget):
    from peft import prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig

    tiny_model("llama", hidden_size=64, intermediate_size=128).save_pretrained(tmp_path)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.float32)

    def load():
        model = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization)
        # train mode, as in training: in eval mode bitsandbytes repacks CPU weights for a bf16
        # inference kernel whenever an input does not require grad (the chunked forward's case).
        return lora(prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)).train()

    stock, patched = load(), load()
    apply_bpt_patch(patched, **SMALL_BLOCKS, **({} if chunk_budget is None else {"chunk_budget": chunk_budget}))
    inputs = make_batch("plain")
    stock_loss, stock_grads = loss_and_grads(stock, inputs)
    patched_loss, patched_grads = loss_and_grads(patched, inputs)
    assert abs(patched_loss - stock_loss) <= 1e-5 * abs(stock_loss)
    assert_grads_close(stock_grads, patched_grads)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_lora_projections_in_chunks_match_stock(checkpointing, monkeypatch):
    """With a chunk budget too small for a whole projection, the attention's LoRA projections (q, v adapted here)
    run in sequence chunks, recomputed in backward: the loss and LoRA gradients of stock."""
    import bpt.mlp as mlp

    calls = []
    original = mlp.chunked_mlp
    monkeypatch.setattr("patches.apply.chunked_mlp", lambda *a, **k: (calls.append(k["chunk"]), original(*a, **k))[1])
    stock = lora(tiny_model("llama"))
    patched = copy.deepcopy(stock)
    apply_bpt_patch(patched, **SMALL_BLOCKS, chunk_budget=1)
    if checkpointing:
        for model in (stock, patched):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = make_batch("unpadded")
    stock_loss, stock_grads = loss_and_grads(stock, inputs)
    patched_loss, patched_grads = loss_and_grads(patched, inputs)
    assert calls and min(calls) < inputs["input_ids"].shape[1]
    assert abs(patched_loss - stock_loss) <= 1e-5 * abs(stock_loss)
    assert_grads_close(stock_grads, patched_grads)


def test_norm_outputs_feeding_chunked_layers_are_not_held_for_backward():
    """Where every consumer of a norm's output runs in chunks (the attention's LoRA projections, the MLP), nothing
    saves that [B, N, hidden] output for backward: the chunks keep the norm's input and rebuild their rows (bpt.mlp);
    the gradients stay stock's."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    stock = get_peft_model(tiny_model("llama"), config)
    patched = copy.deepcopy(stock)
    apply_bpt_patch(patched, **SMALL_BLOCKS, chunk_budget=1)
    norm_outputs, saved = [], set()
    for name, module in patched.named_modules():
        if name.endswith(("input_layernorm", "post_attention_layernorm")):
            module.register_forward_hook(lambda m, i, out: norm_outputs.append(out))  # alive: no address reused
    inputs = make_batch("unpadded")
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.add(t.untyped_storage().data_ptr()), t)[1],
                                                  lambda t: t):
        patched_loss, patched_grads = loss_and_grads(patched, inputs)
    assert len(norm_outputs) == 2 * patched.config.num_hidden_layers
    assert not saved & {out.untyped_storage().data_ptr() for out in norm_outputs}
    stock_loss, stock_grads = loss_and_grads(stock, inputs)
    assert abs(patched_loss - stock_loss) <= 1e-5 * abs(stock_loss)
    assert_grads_close(stock_grads, patched_grads)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16_autocast", "bf16_weights"])
def test_rebuilding_norm_outputs_keeps_the_gradients_bitwise(checkpointing, precision, monkeypatch):
    """Chunked layers fed by a lean norm keep its input and rebuild its rows (bpt.norm.norm_source): the loss and
    every gradient bitwise those of keeping the norm's output, in fp32 and bf16, checkpointed or not."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = tiny_model("llama")
    model = get_peft_model(model.to(torch.bfloat16) if precision == "bf16_weights" else model, config)
    apply_bpt_patch(model, **SMALL_BLOCKS, chunk_budget=1)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    inputs = make_batch("unpadded")

    def run():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16_autocast"):
            return loss_and_grads(model, inputs)

    import bpt.mlp as mlp

    found, original = [], mlp.norm_source
    monkeypatch.setattr("bpt.mlp.norm_source", lambda y: (lambda s: (found.append(s is not None), s)[1])(original(y)))
    rebuilt_loss, rebuilt = run()
    # per layer: q, k, v and the MLP fed by a norm (o_proj is not), again in a checkpoint's recompute
    assert sum(found) == 4 * model.config.num_hidden_layers * (2 if checkpointing else 1)
    monkeypatch.setattr("bpt.mlp.norm_source", lambda y: None)
    kept_loss, kept = run()
    assert torch.equal(rebuilt_loss, kept_loss)
    assert rebuilt.keys() == kept.keys() and all(torch.equal(rebuilt[n], kept[n]) for n in kept)
