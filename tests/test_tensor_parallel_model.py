"""patches.tensor_parallel on a tiny GQA llama (4 query / 2 KV heads) split over 2 real gloo processes vs one process:
loss, every LoRA gradient (gathered to full shape), the clipped norm, the gathered adapter and greedy decoding (KV
cache), at 16 and 4 bits (the
4-bit base loaded by transformers with double quantisation, as train.recipe.model loads it), with and without the
blockwise patch. Plus the refusals, which need no processes."""
from __future__ import annotations

import functools

import pytest
import torch

from gloo_processes import run_on_ranks

pytestmark = pytest.mark.usefixtures("one_thread")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PHI3_TARGETS = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # fused [q; k; v] and [gate; up]
CASES = {"bits16": (16, False), "bits16_bpt": (16, True), "bits4": (4, False), "bits4_bpt": (4, True),
         "bits16_bias": (16, False),  # a llama with biases on every linear: sliced (colwise), added once (rowwise)
         "bits16_qwen3": (16, False), "bits4_qwen3": (4, True),  # per-head q/k norms, whole, trained here
         # Phi-3: fused qkv_proj / gate_up_proj, each rank keeping its slice of every part
         "bits16_phi3": (16, False), "bits16_bpt_phi3": (16, True), "bits4_phi3": (4, False),
         "bits4_bpt_phi3": (4, True)}
# Of each gradient's largest magnitude. The 16-bit cases run in float64, where only the summation order differs; the
# 4-bit ones compute in float32 (bitsandbytes dequantises to at most float32; a float64 input gives garbage), where
# the same reordering of the row-parallel sums measures ~2.4e-6 (Phi-3: 2.7e-6). That is float32's floor for these
# models, not the slicing: the 16-bit cases run in float32 measured 1.6e-6 (Phi-3: 1.5e-6). The 4-bit slices' weights
# are checked bit for bit instead.
GRAD_TOL = {16: 1e-10, 4: 1e-5}
LOSS_TOL = {16: 1e-12, 4: 1e-6}


def _config_kwargs() -> dict:
    return dict(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False)


def _config(**overrides):
    from transformers import LlamaConfig

    return LlamaConfig(**{**_config_kwargs(), **overrides})


def _model(path: str, bits: int, bpt: bool, case: str = ""):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from train.recipe.model import keep_4bit_layout, quantization_config

    kwargs = {"dtype": torch.float64 if bits == 16 else torch.float32}
    if bits == 4:
        kwargs["quantization_config"] = quantization_config(4, torch.float32)
    variant = case.rsplit("_", 1)[-1] if case.endswith(("_bias", "_qwen3", "_phi3")) else ""
    model = AutoModelForCausalLM.from_pretrained(path + (f"_{variant}" if variant else ""), **kwargs)
    keep_4bit_layout(model)
    torch.manual_seed(1)  # init_lora_weights=False: B is random too, so every factor gets a gradient
    targets = PHI3_TARGETS if variant == "phi3" else TARGETS
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                                             init_lora_weights=False))
    for name, param in model.named_parameters():  # Qwen3's per-head norms: whole on every rank, partial gradients
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            param.requires_grad_(True)
    return model


def _patch(model):
    from patches import apply_bpt_patch

    apply_bpt_patch(model, q_block=8, kv_block=8, mlp_chunk=8, loss_chunk=8, compile=False)


def _batch():
    g = torch.Generator().manual_seed(3)  # 37 tokens: not a multiple of any block
    ids = torch.randint(0, 96, (2, 37), generator=g)
    return {"input_ids": ids, "labels": ids}


def _weights(model) -> dict:
    """The (dequantised) base weights of layer 0's q_proj or fused qkv_proj (column-parallel) and o_proj
    (row-parallel)."""
    from bitsandbytes.functional import dequantize_4bit

    attention = model.base_model.model.model.layers[0].self_attn
    out = {}
    for name in ("qkv_proj" if hasattr(attention, "qkv_proj") else "q_proj", "o_proj"):
        weight = getattr(attention, name).base_layer.weight
        out[name] = dequantize_4bit(weight.data, weight.quant_state) if hasattr(weight, "quant_state") else weight.data
    return out


def _on_rank(path, rank, world):
    import torch.distributed as dist

    from bpt.tensor_parallel import (clip_grad_norm_, gather_param, gathered_state_dict,
                                     reduce_tensor_parallel_gradients, slice_like)
    from patches.tensor_parallel import tensor_parallel

    out = {}
    for case, (bits, bpt) in CASES.items():
        model = _model(path, bits, bpt, case)
        handle = tensor_parallel(model, dist.group.WORLD)
        if bpt:
            _patch(model)
        state = gathered_state_dict(model)  # before training: the one-process factors, whole
        # a whole tensor sliced again as a checkpoint's optimizer state is on resume: this rank's slice
        resliced = all(torch.equal(slice_like(state[n], p, rank, world), p.detach())
                       for n, p in model.named_parameters() if hasattr(p, "tp_dim"))
        loss = model(**_batch()).loss
        loss.backward()
        reduce_tensor_parallel_gradients(model)
        def gathered():
            return {n: gather_param(p.grad, p.tp_dim, None, getattr(p, "tp_parts", None)) if hasattr(p, "tp_dim")
                    else p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

        grads = gathered()
        norm = clip_grad_norm_(model.parameters(), 1e-3)
        clipped = gathered()
        model.eval()
        with torch.no_grad():  # greedy decoding with the KV cache: each rank caches its own heads
            decoded = model.generate(input_ids=_batch()["input_ids"][:, :9], max_new_tokens=6, do_sample=False)
        out[case] = {"decoded": decoded, "loss": loss.item(), "grads": grads, "norm": float(norm), "clipped": clipped, "state": state,
                     "weights": _weights(model), "sliced": len(handle.modules),
                     "resliced": resliced}
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from transformers import LlamaForCausalLM

    path = tmp_path_factory.mktemp("tp_llama")
    torch.manual_seed(0)
    LlamaForCausalLM(_config()).save_pretrained(path)
    torch.manual_seed(0)
    with_bias = LlamaForCausalLM(_config(attention_bias=True, mlp_bias=True))
    with torch.no_grad():  # transformers initialises biases to 0: make them count
        for name, param in with_bias.named_parameters():
            if name.endswith(".bias"):
                param.normal_(std=0.1)
    with_bias.save_pretrained(str(path) + "_bias")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    qwen3 = Qwen3ForCausalLM(Qwen3Config(**_config_kwargs(), head_dim=32))
    with torch.no_grad():  # norms start at 1: make them differ per channel
        for name, param in qwen3.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                param.normal_(1.0, 0.1)
    qwen3.save_pretrained(str(path) + "_qwen3")
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    Phi3ForCausalLM(Phi3Config(**_config_kwargs(), pad_token_id=0)).save_pretrained(str(path) + "_phi3")
    per_rank = run_on_ranks(functools.partial(_on_rank, str(path)), 2, str(tmp_path_factory.mktemp("tp_ranks")))
    return str(path), per_rank


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_match_one_process(results, case):
    path, per_rank = results
    bits, bpt = CASES[case]
    model = _model(path, bits, bpt, case)
    if bpt:
        _patch(model)
    ref_state = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    loss = model(**_batch()).loss
    loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    ref_norm = float(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 1e-3))
    ref_clipped = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    targets = 4 if "phi3" in case else 7
    assert len(ref) == 2 * targets * 2 + (4 if "qwen3" in case else 0)  # 2 layers x targets x (A, B) (+ q/k norms)
    weights = _weights(model)
    model.eval()
    with torch.no_grad():
        decoded = model.generate(input_ids=_batch()["input_ids"][:, :9], max_new_tokens=6, do_sample=False)
    for rank, got in enumerate(per_rank):
        got = got[case]
        assert got["sliced"] == 2 * targets
        assert got["resliced"]
        assert torch.equal(got["decoded"], decoded)
        # this rank's heads (rows 64r..64r+63 of q: 2 of the 4 heads) and the matching columns of o, bit for bit
        if "phi3" in case:  # fused [q (128 rows); k (64); v (64)]: 2 of the 4 query heads, 1 of the 2 KV heads
            rows = [*range(64 * rank, 64 * (rank + 1)), *range(128 + 32 * rank, 128 + 32 * (rank + 1)),
                    *range(192 + 32 * rank, 192 + 32 * (rank + 1))]
            assert torch.equal(got["weights"]["qkv_proj"], weights["qkv_proj"][rows])
        else:
            assert torch.equal(got["weights"]["q_proj"], weights["q_proj"][64 * rank:64 * (rank + 1)])
        assert torch.equal(got["weights"]["o_proj"], weights["o_proj"][:, 64 * rank:64 * (rank + 1)])
        assert got["loss"] == pytest.approx(loss.item(), rel=LOSS_TOL[bits])
        assert got["norm"] == pytest.approx(ref_norm, rel=1e-6)
        assert sorted(got["grads"]) == sorted(ref) == sorted(got["state"])
        for name, g in ref.items():
            assert g.abs().max() > 0, name
            assert got["grads"][name].shape == g.shape, name
            tol = GRAD_TOL[bits] * g.abs().max()
            assert (got["grads"][name] - g).abs().max() <= tol, (rank, name)
            assert (got["clipped"][name] - ref_clipped[name]).abs().max() <= tol, (rank, name)
            assert torch.equal(got["state"][name], ref_state[name]), name


def test_families_without_a_plain_plan_are_refused():
    from transformers import Phi3Config

    from patches.tensor_parallel import check_tensor_parallel

    config = _config()  # a fused style in a family without a FUSED row
    config.base_model_tp_plan = {**config.base_model_tp_plan, "layers.*.self_attn.q_proj": "colwise_gather_output"}
    with pytest.raises(ValueError, match="colwise_gather_output.*only plain colwise / rowwise layers"):
        check_tensor_parallel(config, 2)
    phi3 = Phi3Config(**_config_kwargs(), pad_token_id=0)
    check_tensor_parallel(phi3, 2, bits=4)  # fused qkv_proj / gate_up_proj: sliced per part
    with pytest.raises(ValueError, match=r"must divide the phi3 model's num_key_value_heads \(2\)"):
        check_tensor_parallel(phi3, 4)  # 4 query heads but 2 KV heads
    # k's slice (1 of 2 KV heads of 16: 16 rows x 66) cuts a block, though a plain half (96 rows x 66) would not
    phi3 = Phi3Config(**{**_config_kwargs(), "hidden_size": 66, "num_attention_heads": 8}, head_dim=16,
                      pad_token_id=0)
    with pytest.raises(ValueError, match=r"would cut the 4-bit quantisation blocks \(64 weights\) of .*qkv_proj"):
        check_tensor_parallel(phi3, 2, bits=4)
    config = _config()
    config.base_model_tp_plan = None
    with pytest.raises(ValueError, match="no tensor-parallel plan"):
        check_tensor_parallel(config, 2)


@pytest.mark.parametrize("overrides,size,bits,message", [
    ({}, 3, 16, r"--tensor_parallel 3 must divide the llama model's num_attention_heads \(4\)"),
    ({"num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 256}, 4, 16,
     r"must divide the llama model's num_key_value_heads \(2\)"),
    ({"intermediate_size": 255}, 2, 16, r"must divide the llama model's intermediate_size \(255\)"),
    ({"hidden_size": 64}, 2, 4, r"would cut the 4-bit quantisation blocks \(64 weights\) of .*o_proj"),
])
def test_impossible_splits_are_refused(overrides, size, bits, message):
    from patches.tensor_parallel import check_tensor_parallel

    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(_config(**overrides), size, bits=bits)
    check_tensor_parallel(_config(), 2, bits=bits)  # the same family at a size that fits


@pytest.mark.parametrize("storage", [torch.uint8, torch.float32, torch.bfloat16])
def test_4bit_slices_are_the_same_bytes_in_any_storage(storage):
    """The packed 4-bit data in uint8 (as loaded for one process) or in the compute dtype (as loaded for FSDP: the same
    bytes, 8 or 4 weights an element): each rank's dequantised slice (column-, row-parallel, fused parts) equals the
    same slice of the one-process weight, bit for bit, and stays in the storage dtype. No processes: the slicing only
    reads the rank."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import dequantize_4bit, quantize_4bit

    from bpt.tensor_parallel import row_ranges
    from patches.tensor_parallel import _slice_4bit

    weight = torch.randn(192, 128, generator=torch.Generator().manual_seed(0))
    packed, state = quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4",
                                  quant_storage=storage)
    whole = dequantize_4bit(packed, state)
    for style, parts in (("colwise", None), ("colwise", [128, 64]), ("rowwise", None)):
        for rank in range(2):
            layer = bnb.nn.Linear4bit(128, 192, bias=False, compute_dtype=torch.float32, quant_storage=storage)
            layer.weight = bnb.nn.Params4bit(packed.clone(), requires_grad=False, quant_state=state, blocksize=64,
                                             compress_statistics=True, quant_type="nf4", quant_storage=storage,
                                             module=layer, bnb_quantized=True)
            _slice_4bit(layer, style, rank, 2, parts)
            expected = torch.cat([whole[a:b] for a, b in row_ranges(192, parts, rank, 2)]) if style == "colwise" \
                else whole[:, rank * 64:(rank + 1) * 64]
            assert layer.weight.dtype == storage
            assert torch.equal(dequantize_4bit(layer.weight.data, layer.weight.quant_state), expected), (style, parts)
