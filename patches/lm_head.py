"""The CausalLM forward with labels: loss from the chunked LM head, logits never materialised."""
from __future__ import annotations

import functools
import inspect

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from bpt.config import BPTConfig
from bpt.loss import chunked_lm_loss
from patches.chunk_bytes import loss_bytes_per_token
from patches.families import Family

# The KV cache's field in model outputs: `cache` since transformers renamed it (reading or passing the old
# `past_key_values` then logs a deprecation warning), `past_key_values` before.
_CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def causal_lm_forward(model, original, family: Family, options: BPTConfig):
    """Replacement for `model.forward`. Without labels it is the stock forward (logits as usual);
    with labels it runs the base model and the chunked LM head + cross entropy, returning
    `loss` with `logits=None`. Evaluation (eval mode and gradients off: HF Trainer's evaluate / predict) with
    `options.eval_logits` takes the stock forward with labels too (logits and stock's loss), so evaluation metrics
    see what they see unpatched; a loss that will be differentiated never does, whatever `model.training` says (a
    model fresh from `from_pretrained` is in eval mode). shift_labels without labels (a sequence-parallel shard's)
    always take the chunked loss."""
    signature = inspect.signature(original)
    var_keyword = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    softcap = getattr(model.config, family.logit_softcap, None) if family.logit_softcap else None

    @functools.wraps(original)
    def forward(*args, **kwargs):
        arguments = dict(signature.bind(*args, **kwargs).arguments)
        extra = arguments.pop(var_keyword, {}) if var_keyword else {}
        labels = arguments.pop("labels", None)
        _check_positions(model, family, arguments)
        if labels is None and extra.get("shift_labels") is None:
            return original(*args, **kwargs)
        if options.eval_logits and not model.training and not torch.is_grad_enabled() and labels is not None:
            return original(*args, **kwargs)  # (stock computes no loss from shift_labels alone: the split path's)
        if arguments.get("output_router_logits") or getattr(model.config, "output_router_logits", False):
            raise NotImplementedError("the MoE router auxiliary loss is not computed by the patched loss; "
                                      "set output_router_logits=False or train unpatched")
        arguments.pop("logits_to_keep", None)
        # transformers 5 passes return_dict in **kwargs (older-style forwards, e.g. Bloom's, name it): the base model
        # always returns its dict here, and this forward returns the form the caller asked for.
        return_dict = arguments.pop("return_dict", None)
        return_dict = extra.pop("return_dict", return_dict)
        if return_dict is None:
            return_dict = getattr(model.config, "return_dict", True)
        outputs = getattr(model, family.base)(**arguments, **extra, return_dict=True)
        hidden = outputs.last_hidden_state  # [B, N, H]
        loss = chunked_lm_loss(
            hidden, getattr(model, family.head), labels,
            chunk=options.chunk_tokens("loss_chunk", hidden.shape[0] * hidden.shape[1],
                                       lambda: loss_bytes_per_token(vocab_size(model, family), hidden), hidden.device),
            num_items_in_batch=extra.get("num_items_in_batch"),
            shift_labels=extra.get("shift_labels"),
            logit_scale=logit_factor(model.config, family),
            logit_softcap=softcap,
            compile=options.compile,
        )
        output = CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            **{_CACHE: getattr(outputs, _CACHE, None)},
            hidden_states=getattr(outputs, "hidden_states", None),
            attentions=getattr(outputs, "attentions", None),
        )
        return output if return_dict else output.to_tuple()

    return forward


def logit_factor(config, family: Family) -> float | None:
    """The factor the stock CausalLM applies to lm_head's logits (config read per call, as Granite's forward
    does): config.<logit_scale>, or 1 / config.<logit_divisor>; a None config value means 1. None: no scaling."""
    factor = 1.0
    if family.logit_scale:
        scale = getattr(config, family.logit_scale)
        factor *= 1.0 if scale is None else float(scale)
    if family.logit_divisor:
        divisor = getattr(config, family.logit_divisor)
        factor /= 1.0 if divisor is None else float(divisor)
    return None if factor == 1.0 else factor


def _check_positions(model, family: Family, arguments: dict):
    """Learned absolute positions cannot go past their table: say so instead of an IndexError."""
    if not family.learned_positions:
        return
    limit = getattr(model.config, family.learned_positions)
    tokens = arguments.get("input_ids")
    if tokens is None:
        tokens = arguments.get("inputs_embeds")
    if tokens is None:
        return
    cache = arguments.get("cache", arguments.get("past_key_values"))  # the argument's name since / before the rename
    length = tokens.shape[1] + (cache.get_seq_length() if cache is not None else 0)
    if length > limit:
        raise ValueError(f"{length} tokens exceed this model's {limit} learned positions "
                         f"(config.{family.learned_positions}); use at most {limit} tokens per sequence")


def vocab_size(model, family: Family) -> int | None:
    """The LM head's output features (a LoRA-wrapped head says them too), None when it does not say."""
    return getattr(getattr(model, family.head), "out_features", None)
