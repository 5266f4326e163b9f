"""The table of supported model families, keyed by `config.model_type`.

Adding a family whose modules have the same shapes as an existing one is one row. A row says
where the decoder layers, their MLP and the LM head live, and how attention is reached:
through transformers' AttentionInterface (most families), or by binding our forward onto the
attention module instance for families that compute attention (ALiBi) inside their own forward.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    base: str = "model"  # attribute of the CausalLM holding the base model
    layers: str = "layers"  # attribute of the base model holding the decoder layers
    mlp: str = "mlp"  # attribute of a decoder layer holding its MLP / MoE block
    head: str = "lm_head"  # attribute of the CausalLM holding the output projection
    attention: str = "self_attn"  # attribute of a decoder layer holding its attention module
    bound_attention: str | None = None  # key in patches.bound_attention.BINDERS; None = AttentionInterface
    logit_softcap: str | None = None  # config attribute with the final logit softcap, if any
    learned_positions: str | None = None  # config attribute bounding learned absolute positions


LLAMA_LIKE = Family()

FAMILIES: dict[str, Family] = {
    "llama": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
    "mixtral": LLAMA_LIKE,
    "qwen2": LLAMA_LIKE,
    "qwen3": LLAMA_LIKE,
    "gemma": LLAMA_LIKE,
    "gemma2": Family(logit_softcap="final_logit_softcapping"),
    "phi3": LLAMA_LIKE,
    "gpt_neox": Family(base="gpt_neox", attention="attention"),
    "gpt2": Family(base="transformer", layers="h", attention="attn", learned_positions="n_positions"),
    "bloom": Family(base="transformer", layers="h", attention="self_attention", bound_attention="bloom"),
    "falcon": Family(base="transformer", layers="h", attention="self_attention", bound_attention="falcon"),
}


class UnsupportedModelError(ValueError):
    """The model's family is not in the table (or uses a feature the patch cannot reproduce exactly)."""


def family_of(config) -> Family:
    """The table row for a transformers config, or an error naming the supported families."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model family {model_type!r} is not supported by apply_bpt_patch; supported families: "
            f"{', '.join(sorted(FAMILIES))}. Train it without the patch (e.g. --no_bpt), or add a row to "
            "patches/families.py if its modules match an existing family."
        )
    return FAMILIES[model_type]
