"""The models benchmarked: presets, config resolution, building the stock or patched model.

- `SIDES`: the sides compared: stock transformers, the BPT patch, and the patch with its checkpoints offloaded
- `PRESETS`: model shapes by name (random weights from config are fine for memory and speed)
- `HUB_MODELS`: well-known hub names -> their preset and position settings (train.qlora --plan, offline)
- `resolve_model_config`: preset name or config json -> config dict, checked against transformers
- `build_model`: the seeded model of a worker spec, with gradient checkpointing, LoRA and the patch as asked
- `quantise_with_bitsandbytes`, `apply_liger`: a real NF4 base (bitsandbytes) and the peer's patch (Liger-Kernel) on
  a model built on a real GPU (the GPU check, bpt.bench.gpu_check)

transformers (and peft, patches) are imported only inside these functions: `bpt` must stay importable
without transformers.
"""
from __future__ import annotations

import json
import os

import torch

SIDES = ("stock", "patched", "patched+offload")  # the last: checkpoints in host memory (offload_checkpoints)
PEER = "liger"  # Liger-Kernel's patch on a stock model (real GPU only: Triton kernels), the GPU check's peer side

# Model shapes (random weights from config are fine for memory and speed). max_position_embeddings is
# set per sweep to cover its longest length.
PRESETS: dict[str, dict] = {
    # For tests: builds and steps in well under a second.
    "tiny": dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=176, vocab_size=1024),
    # The CPU reference model of the design goals (bpt.bench.report.TARGETS).
    "llama-ref": dict(model_type="llama", hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=1408, vocab_size=32000),
    # Full-size shapes, for GPU runs.
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                         tie_word_embeddings=True),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    # Hub models' shapes (from their config.json), for the simulated GPU (--simulate) and --plan: no download.
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
                         max_position_embeddings=131072, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, rope_theta=1000000.0,
                       max_position_embeddings=131072, tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=32768, rope_theta=1000000.0,
                       max_position_embeddings=32768, sliding_window=None),
    "gemma-2-9b": dict(model_type="gemma2", hidden_size=3584, num_hidden_layers=42, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=256, intermediate_size=14336, vocab_size=256000,
                       sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       query_pre_attn_scalar=256, max_position_embeddings=8192, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936,
                         tie_word_embeddings=True),
}

# Well-known hub models -> (preset, what their config.json has beyond the preset's shape: positions and RoPE),
# for `python -m train.qlora --plan` when the model's config.json is neither local nor in the hub cache.
# Values from the models' config.json on the hub; a name is matched case-insensitively.
_LLAMA3_8K = {"max_position_embeddings": 8192, "rope_theta": 500000.0}
_LLAMA32 = {"max_position_embeddings": 131072, "rope_theta": 500000.0, "rope_scaling": {
    "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}}
_QWEN_32K = {"max_position_embeddings": 32768, "rope_theta": 1000000.0}
HUB_MODELS: dict[str, tuple[str, dict]] = {
    **{name: ("llama-3.1-8b", {}) for name in (
        "meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B-Instruct",
        "meta-llama/Meta-Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B-Instruct")},
    "meta-llama/Meta-Llama-3-8B": ("llama-3-8b", _LLAMA3_8K),
    "meta-llama/Meta-Llama-3-8B-Instruct": ("llama-3-8b", _LLAMA3_8K),
    "meta-llama/Llama-3.2-1B": ("llama-3.2-1b", _LLAMA32),
    "meta-llama/Llama-3.2-1B-Instruct": ("llama-3.2-1b", _LLAMA32),
    "Qwen/Qwen2.5-7B": ("qwen2.5-7b", {}),
    "Qwen/Qwen2.5-7B-Instruct": ("qwen2.5-7b", {"max_position_embeddings": 32768}),
    "Qwen/Qwen2.5-0.5B": ("qwen2.5-0.5b", _QWEN_32K),
    "Qwen/Qwen2.5-0.5B-Instruct": ("qwen2.5-0.5b", _QWEN_32K),
    "mistralai/Mistral-7B-v0.3": ("mistral-7b", {}),
    "mistralai/Mistral-7B-Instruct-v0.3": ("mistral-7b", {}),
    "google/gemma-2-9b": ("gemma-2-9b", {}),
    "google/gemma-2-9b-it": ("gemma-2-9b", {}),
}


def resolve_model_config(spec: str, longest: int) -> dict:
    """Preset name or config-json path -> config dict (with model_type) able to position `longest` tokens.

    Raises ValueError with what to do on an unknown preset, a missing/invalid file or an unknown family.
    """
    if spec in PRESETS:
        config = dict(PRESETS[spec])
    elif os.path.isfile(spec):
        try:
            with open(spec) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"--model {spec}: cannot read it as a transformers config json ({error})") from None
        if not isinstance(config, dict) or "model_type" not in config:
            raise ValueError(f"--model {spec}: a transformers config json needs a 'model_type' key")
        config.pop("quantization_config", None)  # random weights: quantization is --lora's business, not the config's
    else:
        raise ValueError(f"--model {spec!r} is neither a preset ({', '.join(PRESETS)}) nor an existing config json file")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if config["model_type"] not in CONFIG_MAPPING:
        raise ValueError(f"--model {spec}: model_type {config['model_type']!r} is unknown to this transformers version")
    # Random weights with computed (rotary) or freshly initialized positions: extending the range
    # only lets the model accept the lengths we ask for; it does not change the per-token cost.
    config["max_position_embeddings"] = max(int(config.get("max_position_embeddings") or 0), longest)
    config["use_cache"] = False
    return config


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # a spec's "dtype" (--dtype)


def model_from_config(config, dtype: torch.dtype):
    """The causal LM of `config` with stock attention through SDPA, or eager for families that refuse SDPA (gemma2:
    its attention softcap), as from_pretrained would pick."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    except ValueError as error:
        if "scaled_dot_product_attention" not in str(error):
            raise
        return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)


def build_model(spec: dict, tp_group=None):
    """Stock model from the spec's config (seeded, so both sides get the same weights), ready to train; with
    `tp_group` its layers are sliced over that tensor-parallel group once LoRA is on (patches.tensor_parallel)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(**spec["model_config"])
    dtype = DTYPES[spec["dtype"]]
    torch.manual_seed(spec["seed"])
    with torch.device(spec["device"]):  # build in place: an 8B model is never materialized on the host
        model = model_from_config(config, dtype)
    model.train()
    if spec["gradient_checkpointing"]:
        # transformers renamed it (the old name warns); accept both for transformers >= 5.0
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec["lora"]:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], lora_dropout=0.0,
                          target_modules="all-linear", task_type="CAUSAL_LM")
        model = get_peft_model(model, lora)  # freezes the base: only adapters train, as in QLoRA
    if tp_group is not None:
        from patches.tensor_parallel import tensor_parallel

        tensor_parallel(model, tp_group)
    handle = None
    if spec["side"] != "stock":  # the recipe's order (train/parallel/placement.py): LoRA, slices, then the patch
        from patches import apply_bpt_patch

        handle = apply_bpt_patch(model, **patch_options(spec))
    return model, handle


def patch_options(spec: dict) -> dict:
    """apply_bpt_patch's options for the spec's patched side (patched+offload: the checkpoints on the host)."""
    offload = spec["side"] == "patched+offload"
    return {**spec["bpt"], "offload_checkpoints": offload, "checkpoint_stride": checkpoint_stride(spec),
            "offload_keep_last": spec["bpt"].get("offload_keep_last", 0) if offload else 0}


def checkpoint_stride(spec: dict) -> int:
    """One layer checkpoint on the device in how many: the spec's stride on the `patched` side; 1 elsewhere (stock
    keeps every one; patched+offload moves them all to the host, leaving nothing to thin)."""
    return spec.get("bpt", {}).get("checkpoint_stride", 1) if spec["side"] == "patched" else 1


def quantise_with_bitsandbytes(model, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Every nn.Linear of `model` but the output layer replaced, in place, by bitsandbytes' Linear4bit quantised from
    its current weights on their device (NF4, double quantisation, bf16 compute): what from_pretrained with the
    recipe's BitsAndBytesConfig stores. Returns how many were replaced."""
    import bitsandbytes as bnb
    from torch import nn

    output = model.get_output_embeddings()
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not nn.Linear or child is output or name in skip:
                continue
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=torch.bfloat16, compress_statistics=True, quant_type="nf4",
                                      device="meta")
            layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, compress_statistics=True,
                                             quant_type="nf4", module=layer).to(child.weight.device)  # quantises
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.data, requires_grad=False)
            setattr(module, name, layer)
            swapped += 1
    return swapped


def apply_liger(model) -> None:
    """Liger-Kernel's patch for the model's family on this instance (its RMSNorm, SwiGLU, RoPE and fused linear +
    cross entropy kernels, Triton: CUDA only). Raises ValueError when liger-kernel is missing or has no patch for it."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as error:
        raise ValueError(f"the liger side needs liger-kernel (pip install liger-kernel): {error}") from None
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model.config.model_type)
    if apply is None:
        raise ValueError(f"liger-kernel has no patch for model_type {model.config.model_type!r}")
    apply(model=model)
