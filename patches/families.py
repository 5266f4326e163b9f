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
    logit_scale: str | None = None  # config attribute the CausalLM multiplies lm_head's logits by (None value: 1)
    logit_divisor: str | None = None  # config attribute the CausalLM divides lm_head's logits by (None value: 1)
    logit_softcap: str | None = None  # config attribute with the final logit softcap, if any
    learned_positions: str | None = None  # config attribute bounding learned absolute positions
    # Hybrid attention + state-space / linear-attention stacks: some decoder layers mix tokens with a recurrent
    # module (Mamba, short conv, Gated DeltaNet, ...) instead of softmax attention, so they have no `attention`
    # attribute (or hold None there). Those mixers are left stock: their state is a recurrence, with nothing to
    # compute blockwise. Only rows that set this skip such layers: elsewhere a missing attribute is a wrong row
    # and must fail loudly. The MLP is still required in every layer.
    hybrid: bool = False
    # Packed documents (position ids that restart, as our CLI and TRL's padding-free batches pack them) are kept
    # apart by stock: its masks read the position ids and no recurrent state crosses a document start. False where
    # stock lets them mix (masks built without position ids: Bloom, Falcon, MPT, gpt-oss, AFMoE; recurrent layers
    # that carry state across: the hybrids). The patch equals stock either way; train.qlora refuses to pack these
    # (--no_packing). tests/test_packing.py checks every row against stock's behaviour.
    packing: bool = True
    # The transformers release from which stock keeps them apart, where an older one let them mix (`packing` then
    # says what the older releases did): `packs()` answers for the installed one.
    packing_since: str | None = None
    # Per-token norms (RMSNorm, LayerNorm, q-k norms) run through bpt.norm.lean_norm: input saved, the fp32
    # temporaries recomputed one chunk at a time in backward (patches/norms.py says which modules count).
    # False leaves a family's norms stock.
    lean_norms: bool = True
    # The attention's submodules that read its input, where they are that input's only readers in the decoder layer
    # (a sequential pre-norm layer: the input norm's output goes to the attention alone, and there to these
    # projections alone). Once the last of them has read it, patches/spent_input.py drops it from the device (under
    # checkpoint offload, where the projections keep the norm's input as its host copy). Empty: kept, as stock keeps it.
    # A parallel layer (Cohere, GPT-J, Phi: the MLP reads the same normed input) must leave it empty.
    attention_input_readers: tuple[str, ...] = ()
    # The decoder layer's module that reads its input first (the input norm), and the one called once the layer has
    # read its input for the last time (a sequential pre-norm layer: the post-attention norm, called on the residual
    # sum). In a checkpoint's recompute under offload the layer input is dropped from the device then
    # (patches/spent_input.py). Empty: kept. Gemma 2 normalises the attention's output before the residual add: its
    # post-attention norm comes before that last read.
    layer_input_span: tuple[str, ...] = ()

    def packs(self) -> bool:
        """Whether stock transformers, as installed, keeps packed documents apart for this family."""
        if self.packing_since is None:
            return self.packing
        import transformers
        from packaging.version import Version

        return Version(transformers.__version__) >= Version(self.packing_since)

    def attention_of(self, layer):
        """The decoder layer's attention module; None for a hybrid row's recurrent layer (no attention attribute,
        or None there). Any other row reads the attribute strictly: a wrong name raises AttributeError."""
        return getattr(layer, self.attention, None) if self.hybrid else getattr(layer, self.attention)


LLAMA_LIKE = Family()
# Llama-shaped layers checked to read the normed input by q / k / v alone and the layer input before the post-attention
# norm alone (their modeling code, tests/test_spent_input.py)
PRE_NORM_QKV = Family(attention_input_readers=("q_proj", "k_proj", "v_proj"),
                      layer_input_span=("input_layernorm", "post_attention_layernorm"))

FAMILIES: dict[str, Family] = {
    "llama": PRE_NORM_QKV,
    "mistral": PRE_NORM_QKV,
    "mixtral": PRE_NORM_QKV,
    "qwen2": PRE_NORM_QKV,
    "qwen3": PRE_NORM_QKV,
    "gemma": PRE_NORM_QKV,
    "gemma2": Family(logit_softcap="final_logit_softcapping"),
    "phi3": LLAMA_LIKE,
    "gpt_neox": Family(base="gpt_neox", attention="attention"),
    "gpt2": Family(base="transformer", layers="h", attention="attn", learned_positions="n_positions"),
    "bloom": Family(base="transformer", layers="h", attention="self_attention", bound_attention="bloom",
                    packing=False),
    "falcon": Family(base="transformer", layers="h", attention="self_attention", bound_attention="falcon",
                     packing=False, packing_since="5.24.0"),
    # MPT: ALiBi inside its own forward (bound like Bloom / Falcon); its MLP takes (hidden, residual).
    "mpt": Family(base="transformer", layers="blocks", attention="attn", mlp="ffn", bound_attention="mpt",
                  packing=False),
    # Llama-shaped rows: attention through AttentionInterface, masks through create_causal_mask /
    # create_sliding_window_causal_mask (sliding layers of `layer_types` get their window from the mask),
    # decoder layers at model.layers[i].self_attn / .mlp (an MoE block in the *_moe rows: routing is per
    # token, so running it per sequence chunk is exact; its aux loss is refused by check_supported), lm_head.
    "afmoe": Family(packing=False),  # its masks are built without the position ids
    "arcee": LLAMA_LIKE,
    "bitnet": LLAMA_LIKE,
    "dots1": LLAMA_LIKE,
    "ernie4_5": LLAMA_LIKE,
    "exaone": LLAMA_LIKE,
    "exaone4": LLAMA_LIKE,
    "exaone_moe": LLAMA_LIKE,
    "glm": LLAMA_LIKE,  # partial rotary: applied before attention, nothing for the kernel to do
    "glm4": LLAMA_LIKE,
    "glm4_moe": LLAMA_LIKE,
    "sarvam_moe": LLAMA_LIKE,
    "helium": LLAMA_LIKE,
    "hunyuan_v1_dense": LLAMA_LIKE,  # QK-norm inside the attention module, before AttentionInterface
    "hunyuan_v1_moe": LLAMA_LIKE,
    "hy_v3": LLAMA_LIKE,
    "internlm3": LLAMA_LIKE,
    "iquestcoder": LLAMA_LIKE,
    "jais2": LLAMA_LIKE,
    "laguna": LLAMA_LIKE,
    "ministral": LLAMA_LIKE,
    "nemotron": LLAMA_LIKE,
    "olmo": LLAMA_LIKE,
    "olmo2": LLAMA_LIKE,
    "olmo3": LLAMA_LIKE,
    "olmoe": LLAMA_LIKE,
    "persimmon": LLAMA_LIKE,  # partial rotary + QK layernorm, both before AttentionInterface
    "phi": LLAMA_LIKE,  # partial rotary; parallel attention + MLP block
    "seed_oss": LLAMA_LIKE,
    "smollm3": LLAMA_LIKE,  # NoPE layers: rotary skipped before attention
    "stablelm": LLAMA_LIKE,  # partial rotary
    # Final logit softcap (tanh) applied by the CausalLM after lm_head: the chunked loss must apply it too.
    "beam": Family(logit_softcap="final_logit_softcapping"),
    "gemma3_text": Family(logit_softcap="final_logit_softcapping"),
    # Gemma 4 text: dense MLP at layer.mlp. With enable_moe_block=True the experts are attributes of the decoder
    # layer itself (router / experts), not of layer.mlp: exact, but those run unchunked.
    "gemma4_text": Family(logit_softcap="final_logit_softcapping"),
    "gemma4_unified_text": Family(logit_softcap="final_logit_softcapping"),
    "nanochat": Family(logit_softcap="final_logit_softcapping"),
    "vaultgemma": Family(logit_softcap="final_logit_softcapping"),
    # GPT-2 shaped: transformer.h[i].attn / .mlp, learned absolute positions.
    "gpt-sw3": Family(base="transformer", layers="h", attention="attn", learned_positions="n_positions"),
    "gpt_bigcode": Family(base="transformer", layers="h", attention="attn", learned_positions="n_positions"),  # MQA
    # JetMoE: mixture-of-attention-heads module at layer.self_attention (experts project q / o around one
    # AttentionInterface call), MoE MLP at layer.mlp.
    "jetmoe": Family(attention="self_attention"),
    # Logit scaling: the CausalLM multiplies (Cohere, HyperCLOVA X MuP) or divides (Granite) lm_head's output by a
    # config value before the loss; the chunked loss applies the same factor to each chunk's logits.
    "cohere": Family(logit_scale="logit_scale"),
    "cohere2": Family(logit_scale="logit_scale"),
    "cohere_compass_text": Family(logit_scale="logit_scale"),  # Compass text decoder; M-RoPE, one position per axis
    "granite": Family(logit_divisor="logits_scaling"),
    # Granite MoE: the MoE block is layer.block_sparse_moe; granitemoeshared's shared_mlp (added beside it by the
    # decoder layer) is exact but runs unchunked.
    "granitemoe": Family(mlp="block_sparse_moe", logit_divisor="logits_scaling"),
    "granitemoeshared": Family(mlp="block_sparse_moe", logit_divisor="logits_scaling"),
    "hyperclovax": Family(logit_scale="logits_scaling"),  # multiplies, unlike Granite's same-named attribute
    # Multi-head latent attention (DeepSeek-style MLA): low-rank q / kv projections expanded inside the attention module,
    # which calls AttentionInterface with q/k head dim != v head dim (the kernel takes v [B, H, Nk, Dv]; SDPA's fast
    # path needs equal dims, so these run blockwise). MoE blocks (routed + shared experts, group-limited top-k) route
    # per token: chunking them is exact.
    "deepseek_v2": LLAMA_LIKE,
    "deepseek_v3": LLAMA_LIKE,
    "sarvam_mla": LLAMA_LIKE,
    "glm4_moe_lite": LLAMA_LIKE,
    "axk1": LLAMA_LIKE,
    "youtu": LLAMA_LIKE,
    "minicpm3": Family(logit_divisor="logits_scaling"),  # divides hidden by logits_scaling before a bias-free lm_head
    # Gemma 3n text: AltUp / LAuReL / per-layer inputs live on the decoder layer around self_attn and mlp; the MLP's
    # activation sparsity (Gaussian top-k) is per token, KV-shared layers get the stored keys through AttentionInterface.
    "gemma3n_text": Family(logit_softcap="final_logit_softcapping"),
    # Attention sinks: a learned per-head logit (`s_aux`) in every row's softmax normaliser, passed to the kernel.
    # gpt-oss's MoE block returns (hidden, router_scores): chunked on its first output (see _chunked_mlp_forward).
    "gpt_oss": Family(packing=False),  # its masks are built without the position ids
    "flint": LLAMA_LIKE,
    "mimo_v2_flash": LLAMA_LIKE,  # sinks on sliding layers only; v head dim != q/k head dim
    "granite_swa": Family(logit_divisor="logits_scaling"),  # sink applied as sigmoid(lse - sink): the same softmax
    "granitemoe_swa": Family(mlp="block_sparse_moe", logit_divisor="logits_scaling"),
    # Llama 4 text: chunked attention on RoPE layers (`attention_chunk_size`: a query sees the keys of its own chunk,
    # which bpt_mask turns into per-(document, chunk) segment ids, never a window); NoPE full-attention layers scale
    # their queries (attn_temperature_tuning) before AttentionInterface. MLP / MoE at layer.feed_forward; the MoE
    # returns (token-flattened hidden [B * N, H], router_logits): chunked on the first, viewed back to [B, n, H].
    "llama4_text": Family(mlp="feed_forward"),
    # Llama-shaped rows added once the low-precision test routed MoE configs to every expert.
    **dict.fromkeys(("aria_text", "cwm", "ernie4_5_moe", "flex_olmo", "kolibri1", "minimax_m2", "qwen2_moe",
                     "qwen3_moe", "solar_open"), LLAMA_LIKE),
    "cohere2_moe": Family(logit_scale="logit_scale"),
    # Llama-shaped rows added once the low-precision test compared the loss token by token (their batch-mean loss
    # ratio was noise: 1.5-2.0x at ~1e-5 relative error).
    **dict.fromkeys(("mellum", "ministral3", "starcoder2"), LLAMA_LIKE),
    # Hybrid attention + state-space / linear-attention stacks: the attention layers go through AttentionInterface
    # with masks from create_causal_mask / create_sliding_window_causal_mask; the recurrent layers (Mamba, Mamba-2,
    # short conv, Gated DeltaNet) have no `attention` attribute and are left stock. Their own padding mask
    # (create_recurrent_attention_mask) is the 2-D attention_mask, whatever the attention implementation. Packed
    # documents (restarting position ids) are kept apart by the attention layers only: stock's recurrent layers carry
    # their state from one document into the next (they would need seq_idx / cu_seq_lens), and so does the patch:
    # packing=False.
    "bamba": Family(mlp="feed_forward", hybrid=True, packing=False),
    # Granite MoE hybrid: MoE at layer.block_sparse_moe; the shared_mlp beside it is exact but runs unchunked.
    "granitemoehybrid": Family(mlp="block_sparse_moe", logit_divisor="logits_scaling", hybrid=True, packing=False),
    "jamba": Family(mlp="feed_forward", hybrid=True, packing=False),
    "lfm2": Family(mlp="feed_forward", hybrid=True, packing=False),
    "lfm2_moe": Family(mlp="feed_forward", hybrid=True, packing=False),
    "lfm3": Family(mlp="feed_forward", hybrid=True, packing=False),
    **dict.fromkeys(("olmo_hybrid", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"),
                    Family(hybrid=True, packing=False)),
    # Falcon-H1: Mamba-2 beside attention in every layer (so not `hybrid`); logits times lm_head_multiplier.
    "falcon_h1": Family(mlp="feed_forward", logit_scale="lm_head_multiplier", packing=False),
    # Linear attention at layer.self_attn too (the attribute is in every layer, so not `hybrid`): those modules
    # never call AttentionInterface, the bpt_config set on them is unused and they run stock.
    **dict.fromkeys(("kimi_linear", "minimax"), Family(packing=False)),
}


class UnsupportedModelError(ValueError):
    """The model's family is not in the table (or uses a feature the patch cannot reproduce exactly)."""


def family_of(config) -> Family:
    """The table row for a transformers config, or an error saying why this family is not supported (one line,
    pointing at the support table of docs/families.md)."""
    from patches.unsupported import user_reason

    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"apply_bpt_patch does not support {model_type!r} models: {user_reason(model_type)}. The supported "
            "families are in the support table of docs/families.md; train this model without the patch (e.g. --no_bpt)"
        )
    return FAMILIES[model_type]
