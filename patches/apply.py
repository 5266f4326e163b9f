"""`apply_bpt_patch`: swap a transformers model's attention, MLP and LM-head/loss for blockwise ones.

Every change is recorded on a handle as an undo step, so `handle.remove()` restores exactly the
stock model (the same bound methods, the same attention implementation).

Lifecycle rules (what a notebook that re-runs cells needs):
- One live handle per target. A model has at most one patch handle, and the loaders
  (`apply_bpt_patch()` with no model) at most one. Applying again returns that same handle: unchanged
  if the options are the same, re-patched with the new options if they differ. So re-running a cell
  is harmless, and one `remove()` on any handle variable that cell produced restores stock.
- Atomic: if patching raises midway (any exception, KeyboardInterrupt included), everything it had
  changed is undone before the exception propagates; the model is exactly as it was before the call
  (stock, or still patched with its previous options when re-patching).
- `remove()` undoes exactly what its handle recorded, in reverse order, and is idempotent. Removing
  the loaders' handle restores `PreTrainedModel.from_pretrained` / `_from_config` to the original
  objects and unpatches the models they patched; models loaded afterwards are stock.
- `copy.deepcopy` of a patched model (TRL's reference model, an EMA copy), or of a peft wrapper around one, is
  a model patched with the same options under a handle of its own, running its own modules. The patch's forwards
  are closures over the modules they were made for, so the copy is made of the stock model and both are patched
  again. The hook is a copyreg reducer of the model's class (not `__deepcopy__`, which peft's attribute
  forwarding would hand to the wrapper's copy).
"""
from __future__ import annotations

import copy
import copyreg
import weakref

import torch
from transformers import PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from bpt.compile import compiled_forward
from bpt.config import BPTConfig
from bpt.mlp import chunked_mlp
from bpt.norm import norm_source
from patches.attention_once import keeping_forward
from patches.attention import (ATTN_IMPLEMENTATION, CONFIG_ATTR, EMPTY_ROWS_ATTR, bpt_attention_forward,
                               stock_empty_rows)
from patches.bound_attention import BINDERS
from patches.chunk_bytes import mlp_bytes_per_token, norm_bytes_per_token
from patches.dequant_once import dequantising_once_forward, is_4bit_linear
from patches.families import FAMILIES, Family, UnsupportedModelError, family_of
from patches.lm_head import causal_lm_forward
from patches.lora_forward import lora_epilogue_forward
from patches.lora_inputs import input_cast_skipping_round_trips, is_lora_layer
from patches.checkpoint_stride import strided_forward
from patches.offload import offloading_forward
from patches.spent_input import AttentionInput, LayerInput
from patches.masks import bpt_mask
from patches.norms import lean_norm_forward, per_token_norm_dims
from patches.own_attention import attention_weights_forward, config_view
from patches import rotary

_HANDLE_ATTR = "_bpt_patch_handle"


# Registering a name is global and harmless; a model uses it only once its config names it.
AttentionInterface.register(ATTN_IMPLEMENTATION, bpt_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, bpt_mask)
assert ATTN_IMPLEMENTATION in ALL_ATTENTION_FUNCTIONS and ATTN_IMPLEMENTATION in ALL_MASK_ATTENTION_FUNCTIONS


class BPTPatchHandle:
    """Undo log of one patch (a model's, or the loaders'). Use `remove()` (or `with apply_bpt_patch(...):`).

    `options` are the BPTConfig the patch runs with; `active` is False once removed.
    """

    def __init__(self, options: BPTConfig):
        self.options = options
        self._undo: list = []

    @property
    def active(self) -> bool:
        return bool(self._undo)

    def set(self, obj, name: str, value):
        """setattr that remembers whether `obj` had its own attribute and what it was."""
        if name in vars(obj):  # the raw entry: a classmethod stays a classmethod
            had_own, old = True, vars(obj)[name]
        elif isinstance(getattr(type(obj), name, None), property):  # e.g. a config's _attn_implementation
            had_own, old = True, getattr(obj, name)
        else:
            had_own, old = False, None
        setattr(obj, name, value)

        def undo():
            if had_own:
                setattr(obj, name, old)
            else:
                delattr(obj, name)

        self._undo.append(undo)

    def remove(self):
        """Undo every recorded change, newest first. Idempotent. If an undo step raises, the others
        still run and the first error is raised at the end."""
        error = None
        while self._undo:
            try:
                self._undo.pop()()
            except BaseException as exc:  # noqa: BLE001 - keep undoing, re-raise below
                error = error or exc
        if error is not None:
            raise error

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def __repr__(self):
        return f"BPTPatchHandle({'active' if self.active else 'removed'}, {self.options})"


def unwrap(model):
    """The transformers model inside peft wrappers (PeftModel -> LoraModel -> model)."""
    for _ in range(4):
        if isinstance(model, PreTrainedModel):
            return model
        if hasattr(model, "get_base_model"):  # peft.PeftModel
            model = model.get_base_model()
        elif isinstance(getattr(model, "model", None), torch.nn.Module):  # peft tuner (LoraModel)
            model = model.model
        else:
            break
    raise TypeError(f"apply_bpt_patch expects a transformers PreTrainedModel (or a peft wrapper of one), "
                    f"got {type(model).__name__}")


def is_patched(model) -> bool:
    return _HANDLE_ATTR in vars(unwrap(model))


def check_supported(config) -> Family:
    """Raise UnsupportedModelError before any compute if the patch cannot reproduce this model."""
    family = family_of(config)
    if getattr(config, "output_router_logits", False):
        raise UnsupportedModelError("output_router_logits=True (MoE auxiliary loss) is not supported patched; "
                                    "set it to False or train unpatched")
    return family


def apply_bpt_patch(model=None, **options) -> BPTPatchHandle:
    """Patch `model` (a transformers causal LM, plain, peft-wrapped or quantised) in place, or, with no
    model, every supported causal LM loaded afterwards through `from_pretrained` / `from_config`.

    Options: q_block, kv_block, mlp_chunk, loss_chunk, norm_chunk (tokens), compile (None = auto),
    offload_checkpoints (layer checkpoints in host memory; needs gradient checkpointing; offload_keep_last: how many
    of the last saved stay on the device), checkpoint_stride (one
    layer checkpoint kept in that many, the others remade in backward). With labels
    the patched model returns the loss and `logits=None`: full logits are never materialised.

    Calling it again on the same target returns the same handle (re-patched if the options differ);
    a failure midway leaves the target exactly as it was. See the module docstring.
    """
    config = BPTConfig.from_options(**options)
    if model is None:
        return _patch_models_loaded_later(config)
    hf_model = unwrap(model)
    family = check_supported(hf_model.config)
    handle = vars(hf_model).get(_HANDLE_ATTR)
    if handle is None:
        handle = BPTPatchHandle(config)
        _patch_atomically(hf_model, family, handle)
        return handle
    if handle.options == config:
        return handle
    previous = handle.options
    handle.remove()  # re-patch with the new options, under the same handle
    try:
        handle.options = config
        _patch_atomically(hf_model, family, handle)
    except BaseException:
        handle.options = previous  # back to the state before this call
        _patch_atomically(hf_model, family, handle)
        raise
    return handle


def _patch_atomically(hf_model, family: Family, handle: BPTPatchHandle):
    """Record every change of one model's patch on `handle`; on any exception undo them all."""
    try:
        _patch_model(hf_model, family, handle)
    except BaseException:
        handle.remove()
        raise


def _patch_model(hf_model, family: Family, handle: BPTPatchHandle):
    config = handle.options
    base = getattr(hf_model, family.base)
    empty_rows = stock_empty_rows(hf_model.config._attn_implementation)
    patched_attention = 0
    layer_inputs = []  # per decoder layer: its input's first reader and the module called after its last read
    for module in filter(is_lora_layer, hf_model.modules()):  # first: the attention's chunked projections wrap it
        if "forward" not in vars(module):  # peft's own (not another library's wrapper, e.g. accelerate's hooks)
            handle.set(module, "forward", lora_epilogue_forward(module))
    for layer in getattr(base, family.layers):
        # A hybrid row's recurrent layers have no attention module: left stock (Family.attention_of).
        attention = family.attention_of(layer)
        if attention is not None or not family.hybrid:
            handle.set(attention, CONFIG_ATTR, config)
            handle.set(attention, EMPTY_ROWS_ATTR, empty_rows)
            if family.bound_attention:
                handle.set(attention, "forward", BINDERS[family.bound_attention](attention))
            readers = [getattr(attention, name, None) for name in family.attention_input_readers]
            shared_input = AttentionInput(len(readers)) \
                if config.offload_checkpoints and readers and all(map(is_lora_layer, readers)) else None
            for module in attention.modules():  # LoRA projections (q / k / v / o, fused or not): token chunks
                if is_lora_layer(module):
                    reads = shared_input if any(module is r for r in readers) else None
                    handle.set(module, "forward", _chunked_projection_forward(module, module.forward, config, reads))
            patched_attention += 1
        mlp = getattr(layer, family.mlp)
        handle.set(mlp, "forward", _chunked_mlp_forward(mlp, mlp.forward, config))
        if isinstance(layer, GradientCheckpointingLayer):
            for module in filter(is_4bit_linear, layer.modules()):
                handle.set(module, "forward", dequantising_once_forward(module, module.forward, layer))
        span = [getattr(layer, name, None) for name in family.layer_input_span]
        if config.offload_checkpoints and span and all(m is not None for m in span):
            layer_inputs.append(span)
    if patched_attention == 0:  # a hybrid row whose attention attribute is wrong would otherwise patch nothing
        raise UnsupportedModelError(f"no decoder layer of this {hf_model.config.model_type!r} model has attention at "
                                    f"layer.{family.attention}: nothing to patch (is its row in FAMILIES right?)")
    _patch_rotary(hf_model, family, base, config, handle)
    if family.lean_norms:
        _patch_norms(hf_model, config, handle)
    for first, last in layer_inputs:  # after the norms: both are norms, their forwards the lean ones
        layer_input = LayerInput()
        handle.set(first, "forward", layer_input.first_reader_forward(first.forward))
        handle.set(last, "forward", layer_input.last_reader_forward(last.forward))
    for module in hf_model.modules():  # present when the patch is applied after get_peft_model, as the recipe does
        if is_lora_layer(module):
            handle.set(module, "_cast_input_dtype", input_cast_skipping_round_trips(module, module._cast_input_dtype))
    # The attention implementation is the model's own: the config object may be shared with other models.
    shared, view = hf_model.config, config_view(hf_model.config, ATTN_IMPLEMENTATION)
    for module in hf_model.modules():
        if vars(module).get("config") is shared:
            handle.set(module, "config", view)
    handle.set(base, "forward", attention_weights_forward(base, base.forward, view))
    handle.set(hf_model, "forward", causal_lm_forward(hf_model, hf_model.forward, family, config))
    handle.set(hf_model, "forward", keeping_forward(hf_model, hf_model.forward, config))
    if config.offload_checkpoints:
        text_config = hf_model.config.get_text_config() if hasattr(hf_model.config, "get_text_config") else hf_model.config
        handle.set(hf_model, "forward", offloading_forward(hf_model, hf_model.forward, text_config.hidden_size,
                                                           config.offload_keep_last))
    if config.checkpoint_stride > 1:
        handle.set(hf_model, "forward", strided_forward(hf_model, hf_model.forward, config.checkpoint_stride))
    if type(hf_model) not in copyreg.dispatch_table:  # once per class; another library's reducer is left alone
        copyreg.pickle(type(hf_model), _reduce_patched)
    handle.set(hf_model, _HANDLE_ATTR, handle)  # last: is_patched is True only for a complete patch


def _reduce_patched(model):
    """copy.deepcopy's (and pickle's) reducer of a patched model's class: a patched model is rebuilt as the patched
    stock copy (_StockCopy); any other instance reduces as without this reducer."""
    handle = vars(model).get(_HANDLE_ATTR)
    if handle is None:
        return model.__reduce_ex__(4)
    return _patched_again, (_StockCopy(model), handle.options)


class _StockCopy:
    """Deep-copied, the stock copy of a patched model: the patch is removed for the copy and applied again after."""

    def __init__(self, hf_model):
        self.hf_model = hf_model

    def __deepcopy__(self, memo):
        handle = vars(self.hf_model)[_HANDLE_ATTR]
        handle.remove()
        try:
            return copy.deepcopy(self.hf_model, memo)
        finally:
            _patch_atomically(self.hf_model, family_of(self.hf_model.config), handle)

    def __reduce__(self):
        raise TypeError("a model patched by apply_bpt_patch cannot be pickled: save it with save_pretrained, or "
                        "remove the patch (handle.remove()) before pickling and apply it again after loading")


def _patched_again(stock_copy, options: BPTConfig):
    _patch_atomically(stock_copy, family_of(stock_copy.config), BPTPatchHandle(options))
    return stock_copy


def _chunked_projection_forward(module, original, config: BPTConfig, attention_input: AttentionInput | None = None):
    """A LoRA projection of the attention run in sequence chunks where a chunk budget exists and the whole would not
    fit it: peft's LoRA forward holds the base output, its defensive clone, the adapter's output and its scaled copy
    over every token at once (4 x [N, out] at the output projection; 24 GiB at 1M tokens of Llama-3.1-8B).
    attention_input: where this projection is one of the row's named readers of the attention's input
    (patches/spent_input.py)."""

    body = compiled_forward(original, config.compile)

    def forward(x, *args, **kwargs):
        if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 3:
            return original(x, *args, **kwargs)
        if not config.largest_budget(x.device):
            return body(x)
        chunk = _mlp_chunk(module, x, config)
        if chunk is None:
            return body(x)
        # q, k and v share the norm before them: its backward runs once, over their summed gradient, as stock's does
        out = chunked_mlp(body, list(module.parameters()), x, chunk=chunk, fold_norms=False)
        if attention_input is not None:
            attention_input.read(module, x)
        return out

    return forward


def _mlp_chunk(module, hidden: torch.Tensor, config: BPTConfig, folds_norm: bool = False) -> int | None:
    """Tokens per chunk of `module` over hidden [B, N, H] (the `mlp_chunk` rule); None where the whole sequence fits
    (then the module runs as stock's). folds_norm: a chunk's backward runs a lean norm's too (bpt.mlp.chunked_mlp's
    fold_norms), with its float32 temporaries."""
    per_token = lambda: mlp_bytes_per_token(module, hidden)  # noqa: E731 (asked only where there is a budget)
    if config.whole_fits("mlp_chunk", hidden.shape[1], per_token, hidden.device):
        return None

    def with_norm():
        mlp = per_token()
        return mlp + norm_bytes_per_token(hidden.shape[-1]) if mlp is not None and folds_norm else mlp
    return config.chunk_tokens("mlp_chunk", hidden.shape[1], with_norm, hidden.device)


def _chunked_mlp_forward(module, original, config: BPTConfig):
    body = compiled_forward(original, config.compile)

    def forward(*inputs):
        hidden = inputs[0]  # [B, N, H]
        if hidden.dim() < 3:
            return original(*inputs)
        fold = config.folds_norms(hidden.numel() * hidden.element_size(), hidden.device)
        chunk = _mlp_chunk(module, hidden, config, folds_norm=fold and any(norm_source(x) is not None for x in inputs))
        if chunk is None:
            return body(*inputs)
        # An MLP that returns a tuple (gpt-oss: (hidden, router_scores)) is chunked on its first output. The
        # rest are per-chunk routing details the decoder layer discards; they come back as None, so a caller
        # that did read them fails loudly instead of getting one chunk's values.
        extra = []

        def first_output(*pieces):
            y = body(*pieces)
            if isinstance(y, tuple):
                extra[:] = [None] * (len(y) - 1)
                y = y[0]
            piece = pieces[0]  # [B, n, H]
            if isinstance(y, torch.Tensor) and y.dim() == 2 and y.shape[0] == piece.shape[0] * piece.shape[1]:
                # Token-flattened output [B * n, H] (Llama 4's MoE; its decoder layer views it back).
                y = y.view(piece.shape[0], piece.shape[1], -1)
            return y

        # Parameters are read at call time: LoRA layers added after patching are included.
        out = chunked_mlp(first_output, list(module.parameters()), *inputs, chunk=chunk, fold_norms=fold)
        return (out, *extra) if extra else out

    return forward


def _patch_rotary(hf_model, family: Family, base, config: BPTConfig, handle: BPTPatchHandle):
    """Long sequences' rotary embeddings a chunk at a time (patches/rotary.py): the modeling module's function is
    wrapped once per process (a pass-through for every call it does not take), and this model's rotary embedding
    modules tag their cos so that its calls are taken, until the patch is removed."""
    classes = {type(family.attention_of(layer)) for layer in getattr(base, family.layers)} - {type(None)}
    if not any([rotary.install(cls) for cls in classes]):
        return
    for module in hf_model.modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            hook = module.register_forward_hook(rotary.tag_rotary_outputs(config))
            handle._undo.append(hook.remove)


def _patch_norms(hf_model, config: BPTConfig, handle: BPTPatchHandle):
    """Bind a lean forward (input saved, backward recomputed per chunk) on every per-token norm instance,
    peft's modules_to_save copies included (their wrapper calls the inner norm, which is wrapped)."""
    text_config = hf_model.config.get_text_config() if hasattr(hf_model.config, "get_text_config") else hf_model.config
    hidden = getattr(text_config, "hidden_size", None)
    for module in hf_model.modules():
        norm_dims = per_token_norm_dims(module)
        if norm_dims is not None:
            handle.set(module, "forward", lean_norm_forward(module, module.forward, norm_dims, config,
                                                            hidden if isinstance(hidden, int) else None))


class _Loaders:
    """Holds the loaders' live handle (`handle` attribute, set and removed through that handle's log)."""


_LOADERS = ("from_pretrained", "_from_config")


def _patch_models_loaded_later(config: BPTConfig) -> BPTPatchHandle:
    """Wrap PreTrainedModel.from_pretrained / _from_config so each causal LM they return is patched with
    the live handle's options (the newest ones: applying again with other options updates them)."""
    handle = vars(_Loaders).get("handle")
    if handle is not None:
        handle.options = config  # later loads use the new options; models already loaded keep theirs
        return handle
    handle = BPTPatchHandle(config)
    model_handles: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def patch_loaded(loaded):
        # from_pretrained(..., output_loading_info=True) returns (model, loading_info): returned unchanged.
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        family = FAMILIES.get(getattr(model.config, "model_type", None))
        if family is not None and hasattr(model, family.head) and hasattr(model, family.base):
            model_handles[model] = apply_bpt_patch(model, **vars(handle.options))
        elif family is None and any(word in type(model).__name__ for word in ("CausalLM", "LMHead")):
            family_of(model.config)  # raises UnsupportedModelError saying why
        return loaded  # anything else (encoders, base models) is left alone

    def remove_model_patches():
        for model_handle in list(model_handles.values()):
            model_handle.remove()

    handle._undo.append(remove_model_patches)  # first in the log: runs last, after the loaders are restored
    try:
        for name in _LOADERS:
            loader = vars(PreTrainedModel)[name].__func__

            def patched_loader(cls, *args, __loader=loader, **kwargs):
                return patch_loaded(__loader(cls, *args, **kwargs))

            handle.set(PreTrainedModel, name, classmethod(patched_loader))
        handle.set(_Loaders, "handle", handle)
    except BaseException:
        handle.remove()
        raise
    return handle
