"""Causal-LM model types of transformers that apply_bpt_patch does not support, each with its reason.

Together with FAMILIES this classifies every type of transformers' MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
(tests/test_registry.py): a transformers release that adds a type fails that test until the type is a
row or has a reason here. Reasons start with a category: encoder, encoder-decoder, state-space or recurrent,
multimodal-only, feature not yet reproduced (named), pending low-precision check, not yet classified.
"""

UNSUPPORTED: dict[str, str] = {
    "apertus1p5_text": "not yet classified: new in transformers 5.24 (Apertus1p5TextForCausalLM)",
    "dory": "not yet classified: new in transformers 5.24 (DoryForCausalLM)",
    "inkling2_loop_text": "not yet classified: new in transformers 5.24 (Inkling2LoopForCausalLM)",
    "lara_mini": "not yet classified: new in transformers 5.24 (LaraMiniForCausalLM)",
    "apertus": (
        "pending low-precision check: exact in fp32 as a Llama-like row; low-precision test over its limit "
        "(feedforward_layernorm.weight gradient 1.70x stock's error (packed, bf16 weights); its xIELU activation's "
        "alpha_p / alpha_n gradients 1.43-1.46x): decide whether that is noise or a gap"
    ),
    "axk2": (
        "feature not yet reproduced: sparse attention (DSA lightning indexer): every layer is indexed_attention; "
        "the attention module indexes the 4-D mask (attention_mask[:, 0]) for its indexer and masks all but the "
        "top-k keys per query (MLA head dims themselves are fine: deepseek_v3 / axk1 rows)"
    ),
    "bailing_hybrid": (
        "pending low-precision check: exact in fp32 as a Llama-like row (delta attention + MLA at layer.self_attn, "
        "tiny config as kimi_linear's with head_dim 8, num_mtp_layers=0); low-precision test over its "
        "limit (layer 0 forget_gate.A_log 2.04x (packed, bf16 weights, seeds 0-7)); seeds 8-15: 1.13x, 16-23: "
        "1.08x, 0-23: 1.13x (stock's own error 3.7e-3 on seeds 0-7 vs 1.6e-2 on 8-15): looks like noise in the "
        "4-entry decay gradient of the recurrent layer; confirm before adding the row"
    ),
    "bart": "encoder-decoder: decoder half of an encoder-decoder (cross-attention)",
    "bert": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "bert-generation": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "big_bird": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "bigbird_pegasus": "encoder-decoder: decoder half of an encoder-decoder (cross-attention)",
    "biogpt": (
        "feature not yet reproduced: module layout the row cannot name + learned positions with offset: "
        "fc1/fc2 sit on the decoder layer (no MLP submodule to chunk)"
    ),
    "blenderbot": "encoder-decoder: decoder half of an encoder-decoder (cross-attention)",
    "blenderbot-small": "encoder-decoder: decoder half of an encoder-decoder (cross-attention)",
    "blt": "multimodal-only: byte latent transformer: local encoder/decoder + patcher (tiny build > 90 s)",
    "camembert": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "codegen": (
        "feature not yet reproduced: custom attention outside AttentionInterface: own _attn adds a 4-D mask "
        "tensor"
    ),
    "cpmant": (
        "feature not yet reproduced: custom attention outside AttentionInterface: own attention with segment "
        "/ relative position bias"
    ),
    "ctrl": (
        "feature not yet reproduced: custom attention outside AttentionInterface: own MultiHeadAttention with "
        "a 4-D mask; ffn is an nn.Sequential"
    ),
    "data2vec-text": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "dbrx": (
        "feature not yet reproduced: module layout the row cannot name: attention sits at "
        "transformer.blocks[i].norm_attn_norm.attn (nested; Family.attention is one attribute, so block options "
        "would land on the wrapper and the kernel would run with defaults), MoE at .ffn; Dbrx MoE is per-token, "
        "candidate once rows can name a dotted path"
    ),
    "deepseek_v32": (
        "feature not yet reproduced: MLA head dims + sparse attention (DSA lightning indexer): top-k token "
        "selection per query"
    ),
    "deepseek_v4": (
        "feature not yet reproduced: MLA + hyper-connections (MLP called with extra kwargs): layer calls "
        "mlp(hidden, input_ids=...)"
    ),
    "diffllama": (
        "not yet classified: differential attention calls AttentionInterface twice per layer; exact in loss "
        "and all but the lambda_* gradients, which are ill-conditioned: patched 3.3e-4 of max vs 1e-4 "
        "threshold on right_padded, while stock eager vs stock sdpa differ by 6.9e-4 on the same parameters; "
        "needs a tiny config whose lambda grads are well conditioned or a per-test tolerance"
    ),
    "doge": (
        "feature not yet reproduced: dynamic mask attention (custom mask values): uses the mask tensor's "
        "dtype / values"
    ),
    "dots3_note": "multimodal-only: vision-language wrapper",
    "dots3_note_text": (
        "feature not yet reproduced: custom mask handling outside the mask interface: indexes the mask "
        "(attention_mask[:, 0])"
    ),
    "electra": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "emu3": "multimodal-only: image-token VQ model (tiny build > 90 s)",
    "ernie": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "falcon_mamba": "state-space or recurrent: Mamba layers, no softmax attention to compute blockwise",
    "fuyu": "multimodal-only: image-patch decoder (FuyuConfig wraps a text config)",
    "gemma3": "multimodal-only: Gemma3ForConditionalGeneration (vision tower); text-only is gemma3_text (added)",
    "gemma3n": "multimodal-only: audio + vision towers (needs timm)",
    "gemma4": "multimodal-only: vision/audio wrapper; text is gemma4_text (added)",
    "gemma4_assistant": (
        "feature not yet reproduced: speculative-decoding drafter, not a standalone LM: forward requires "
        "inputs_embeds + shared_kv_states from the target Gemma 4 model (every layer reuses its KV), builds "
        "bidirectional masks itself and returns no loss (no labels)"
    ),
    "gemma4_unified": "multimodal-only: vision/audio wrapper; text is gemma4_unified_text (added)",
    "gemma4_unified_assistant": (
        "feature not yet reproduced: speculative-decoding drafter, not a standalone LM: forward requires "
        "inputs_embeds + shared_kv_states from the target Gemma 4 model (every layer reuses its KV), builds "
        "bidirectional masks itself and returns no loss (no labels)"
    ),
    "git": "multimodal-only: image-to-text (vision encoder + BERT-style decoder)",
    "glm_moe_dsa": (
        "feature not yet reproduced: MLA head dims + sparse attention (DSA lightning indexer): top-k token "
        "selection per query"
    ),
    "got_ocr2": "multimodal-only: OCR vision-language model",
    "gpt_neo": (
        "feature not yet reproduced: custom attention outside AttentionInterface: own _attn adds a 4-D mask "
        "tensor"
    ),
    "gpt_neox_japanese": (
        "feature not yet reproduced: custom attention outside AttentionInterface: own _attn adds a 4-D mask "
        "tensor"
    ),
    "gptj": (
        "feature not yet reproduced: custom attention outside AttentionInterface: own _attn adds a 4-D mask "
        "tensor"
    ),
    "hrm_text": (
        "feature not yet reproduced: recurrent stacks (L_module / H_module iterated): hierarchical reasoning "
        "model: layers re-run several cycles"
    ),
    "hy_v4": (
        "feature not yet reproduced: custom mask handling outside the mask interface: attention code indexes "
        "the 4-D mask directly"
    ),
    "inkling2_text": (
        "feature not yet reproduced: relative-position logits inside attention: r_proj / rel_logits_proj add "
        "a learned bias the kernel does not get"
    ),
    "inkling_text": (
        "feature not yet reproduced: relative-position logits inside attention: r_proj / rel_logits_proj add "
        "a learned bias the kernel does not get"
    ),
    "llama4": "multimodal-only: Llama4ForConditionalGeneration (vision tower); text-only is llama4_text (added)",
    "longcat_flash": (
        "feature not yet reproduced: module layout the row cannot name: two attention + MLP sub-blocks per layer "
        "(layer.self_attn and layer.mlps are ModuleLists of 2, layer.mlp is the shortcut MoE): the row would set "
        "block options on the ModuleList, not the attention modules, leave mlps unchunked, and the guard test "
        "counts 2 attention calls per layer; MLA head dims themselves are fine (deepseek_v3 row)"
    ),
    "mamba": "state-space or recurrent: Mamba layers, no softmax attention to compute blockwise",
    "mamba2": "state-space or recurrent: Mamba-2 layers, no softmax attention to compute blockwise",
    "marian": "encoder-decoder: decoder half of an encoder-decoder (cross-attention)",
    "mbart": "encoder-decoder: decoder half of an encoder-decoder (cross-attention)",
    "megatron-bert": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "minimax_m3_vl_text": (
        "feature not yet reproduced: sparse block attention (lightning indexer, block_indices): sparse layers "
        "mask by indexer-chosen key blocks; bpt ignores block_indices (tiny config with only full layers "
        "passed, real checkpoints would be wrong)"
    ),
    "mllama": "multimodal-only: cross-attention vision layers (Llama 3.2 Vision)",
    "modernbert-decoder": (
        "feature not yet reproduced: two-module LM head: logits = decoder(lm_head(hidden)); lm_head is a "
        "dense+norm transform"
    ),
    "moshi": "multimodal-only: speech-text model with depth decoder",
    "moss_transcribe_diarize": "multimodal-only: speech model (audio encoder)",
    "musicgen": "encoder-decoder: audio decoder of MusicGen (text encoder + audio codebooks)",
    "musicgen_melody": "encoder-decoder: audio decoder of MusicGen Melody",
    "mvp": "encoder-decoder: decoder half of an encoder-decoder (cross-attention)",
    "nemotron_h": (
        "feature not yet reproduced: hybrid attention + SSM / linear attention: each block has one `mixer` holding "
        "Mamba-2, attention, MLP or MoE by config.layers_block_type; a row names attributes, not block types, so "
        "the MLP blocks (to chunk) cannot be told from the Mamba blocks (chunking those would cut the recurrence)"
    ),
    "openai-gpt": (
        "feature not yet reproduced: custom attention outside AttentionInterface: own _attn (eager): MLP and "
        "loss would be chunked but attention stays N x N"
    ),
    "opt": (
        "feature not yet reproduced: module layout the row cannot name + learned positions with offset: base "
        "is model.decoder (nested); fc1/fc2 on the layer"
    ),
    "pegasus": "encoder-decoder: decoder half of an encoder-decoder (cross-attention)",
    "phi4_multimodal": (
        "multimodal-only: vision + audio towers built at default size (44 s on CPU); its text decoder is "
        "Phi-3-shaped and passed as LLAMA_LIKE in all three kinds: candidate once tiny vision/audio "
        "sub-configs are written"
    ),
    "phimoe": (
        "feature not yet reproduced: MoE routing that samples in training (sparsemixer jitter): chunking "
        "changes the random draws; router gradients differ"
    ),
    "plbart": "encoder-decoder: decoder half of an encoder-decoder (cross-attention)",
    "prophetnet": "encoder-decoder: decoder half of an encoder-decoder (cross-attention)",
    "qwen3_5": (
        "multimodal-only: Qwen3_5ForConditionalGeneration (vision tower); AutoModelForCausalLM on it builds the "
        "text model, qwen3_5_text (added)"
    ),
    "qwen3_5_moe": (
        "multimodal-only: Qwen3_5MoeForConditionalGeneration (vision tower); AutoModelForCausalLM on it builds the "
        "text model, qwen3_5_moe_text (added)"
    ),
    "qwen4_exp": (
        "feature not yet reproduced: hybrid attention + SSM / linear attention: Gated DeltaNet + indexed attention "
        "whose QSA indexer picks the top-k key blocks per query and ANDs that [B, 1, Nq, Nk] selection into the "
        "dense causal mask (reads its shape and dtype): a data-dependent mask the O(N) mask inputs cannot carry"
    ),
    "qwen4_exp_text": (
        "feature not yet reproduced: hybrid attention + SSM / linear attention: Gated DeltaNet + indexed attention "
        "whose QSA indexer picks the top-k key blocks per query and ANDs that [B, 1, Nq, Nk] selection into the "
        "dense causal mask (reads its shape and dtype): a data-dependent mask the O(N) mask inputs cannot carry"
    ),
    "recurrent_gemma": "state-space or recurrent: Griffin recurrent blocks + local attention",
    "reformer": "encoder: Reformer: LSH / local attention, own attention code",
    "rembert": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "roberta": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "roberta-prelayernorm": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "roc_bert": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "roformer": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "rwkv": "state-space or recurrent: RWKV layers, no softmax attention to compute blockwise",
    "trocr": "encoder-decoder: decoder half of an encoder-decoder (cross-attention)",
    "whisper": "encoder-decoder: decoder half of an encoder-decoder (cross-attention)",
    "xglm": (
        "feature not yet reproduced: module layout the row cannot name: fc1/fc2 sit on the decoder layer (no "
        "MLP submodule to chunk)"
    ),
    "xlm": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "xlm-roberta": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "xlm-roberta-xl": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "xlnet": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "xlstm": "state-space or recurrent: xLSTM layers, no softmax attention to compute blockwise",
    "xmod": "encoder: bidirectional encoder with an LM head (is_decoder flag)",
    "zamba": (
        "feature not yet reproduced: hybrid attention + SSM / linear attention: Mamba layers, some wrapping one "
        "shared (tied) attention + MLP block one level down (layer.shared_transf.self_attn / .feed_forward, fed "
        "hidden states concatenated with the embeddings): a row names attributes of the decoder layer itself"
    ),
    "zamba2": (
        "feature not yet reproduced: hybrid attention + SSM / linear attention: Mamba-2 layers, some wrapping "
        "shared (tied) attention + MLP blocks one level down (layer.shared_transformer.self_attn / .feed_forward, "
        "with per-invocation LoRA adapters): a row names attributes of the decoder layer itself"
    ),
    "zaya": (
        "feature not yet reproduced: hybrid attention + SSM / linear attention: CCA attention (AttentionInterface, "
        "fine) but the MoE block returns per-token router hidden states that the next layer's router adds in "
        "(use_eda); the chunked MLP keeps only the first output of each chunk, so that chain would be cut silently"
    ),
}

# What the error message tells a user: what the patch needs that the model lacks, in plain terms (the reasons above are
# for maintainers). Looked up by category, or for "feature not yet reproduced" by the kind after it (prefix match).
USER_REASONS: dict[str, str] = {
    "encoder": "it is a bidirectional encoder, and the patch computes left-to-right (causal) attention only",
    "encoder-decoder": "it is the decoder half of an encoder-decoder model, and the patch has no cross-attention",
    "state-space or recurrent": "its layers are recurrent (no softmax attention), so there is nothing to compute "
                                "blockwise",
    "multimodal-only": "it is a multimodal model, and the patch takes text-only causal LMs (load its text model "
                       "if it has one)",
    "pending low-precision check": "it is not in the support table yet (its low-precision accuracy check is pending)",
    "not yet classified": "it is not in the support table yet",
    "custom attention outside AttentionInterface": "it computes attention in its own code, and the patch can only "
                                                   "replace attention that goes through transformers' attention "
                                                   "interface",
    "custom mask handling outside the mask interface": "its attention reads a full sequence x sequence mask, which "
                                                       "the patch never builds",
    "module layout the row cannot name": "the patch needs each decoder layer to hold its attention and its MLP as "
                                         "submodules, and this model's layers are laid out differently",
    "hybrid attention + SSM / linear attention": "its attention and MLP blocks are nested inside recurrent blocks, "
                                                 "where the patch cannot reach them yet",
}


def user_reason(model_type: str) -> str:
    """Why `model_type` is refused, for the error message."""
    reason = UNSUPPORTED.get(model_type)
    if reason is None:
        return "it is not in the support table"
    category, detail = reason.split(":", 1)
    kind = detail.split(":", 1)[0].strip() if category == "feature not yet reproduced" else category
    return next((text for key, text in USER_REASONS.items() if kind.startswith(key)),
                f"it uses a feature the patch does not reproduce yet ({kind})")
