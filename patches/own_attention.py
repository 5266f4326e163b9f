"""A patched model's own attention implementation, and stock's eager attention when a call asks for the weights.

Config view: transformers reads the attention implementation from `config._attn_implementation` (the attention
modules, the mask builders, generate), and a config object is shared by every model built from it
(`from_config(cfg)`, `Model(cfg)`). So the patch never writes it: each module of the patched model that held the
config gets a view of it instead, which shares the config's settings (one `__dict__`: a change made through
`model.config` reaches the caller's object, as unpatched) but holds its own attention implementation. A copy of the
view (deepcopy, pickle, `from_config(patched.config)`) is a plain config with the stock implementation.

Rule for switching (docs/patch.md): a patched model refuses another attention implementation
(`set_attn_implementation`, `config._attn_implementation = ...`) with what to do: remove the patch first.

Attention weights: the blockwise kernel never forms them. A call that asks for them (`output_attentions=True`,
generate's included) runs stock's eager attention and masks for that call, with one warning per model naming the
N x N cost; loss chunking and the chunked MLP stay on.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import warnings

from patches.attention import ATTN_IMPLEMENTATION, CONFIG_ATTR
from patches.masks import BlockMaskInputs

_VIEW_CLASSES: dict[type, type] = {}


def _implementation(view) -> str:
    try:
        return view._bpt_attention
    except AttributeError:  # built by its class's constructor (`type(config)(**settings)`): a plain config
        return vars(view).get("_attn_implementation_internal")


def _refuse(view, value):
    try:
        own = view._bpt_attention
    except AttributeError:  # a plain config (above): set as stock sets it
        vars(view)["_attn_implementation_internal"] = value
        return
    if value != own:
        raise ValueError(f"this model is patched by apply_bpt_patch (blockwise attention); to use "
                         f"attn_implementation={value!r}, call remove() on its patch handle first (that restores "
                         "stock), then set it")


def _plain(cls, state: dict):
    config = cls.__new__(cls)
    object.__setattr__(config, "__dict__", state)
    return config


def config_view(config, attn_implementation: str = ATTN_IMPLEMENTATION):
    """A view of `config` (same settings, same class name) whose attention implementation is its own."""
    cls = type(config)
    view_class = _VIEW_CLASSES.get(cls)
    if view_class is None:
        view_class = _VIEW_CLASSES[cls] = type(cls.__name__, (cls,), {
            "__slots__": ("_bpt_attention",), "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "_attn_implementation_internal": property(_implementation, _refuse),
            "__reduce_ex__": lambda self, protocol: (_plain, (cls, dict(vars(self)))),
        })
    view = object.__new__(view_class)
    object.__setattr__(view, "__dict__", vars(config))
    object.__setattr__(view, "_bpt_attention", attn_implementation)
    return view


@contextlib.contextmanager
def _stock_eager(model, view):
    """Within the block `model` runs stock's eager attention: the view says "eager" (masks and AttentionInterface
    families follow it), and bound attention modules (Bloom, Falcon, MPT) run their class's forward."""
    bound = [m for m in model.modules() if getattr(m, CONFIG_ATTR, None) is not None and "forward" in vars(m)]
    forwards = [vars(m).pop("forward") for m in bound]
    object.__setattr__(view, "_bpt_attention", "eager")
    try:
        yield
    finally:
        object.__setattr__(view, "_bpt_attention", ATTN_IMPLEMENTATION)
        for module, forward in zip(bound, forwards):
            module.forward = forward


def attention_weights_forward(base, original, view):
    """Replacement for the base model's forward: as before unless the call asks for attention weights."""
    signature = inspect.signature(original)
    warned = []

    @functools.wraps(original)
    def forward(*args, **kwargs):
        arguments = signature.bind(*args, **kwargs).arguments
        for parameter in signature.parameters.values():
            if parameter.kind is parameter.VAR_KEYWORD:
                arguments = {**arguments, **arguments.pop(parameter.name, {})}
        wanted = arguments.get("output_attentions")
        if not (view.output_attentions if wanted is None else wanted):
            return original(*args, **kwargs)
        masks = arguments.get("attention_mask")
        if any(isinstance(m, BlockMaskInputs) for m in (masks.values() if isinstance(masks, dict) else [masks])):
            raise ValueError("output_attentions=True cannot run with masks built for the blockwise kernel (generate "
                             "with a static cache builds them ahead): use the default dynamic cache, or remove the "
                             "patch")
        if not warned:
            warned.append(True)
            warnings.warn("output_attentions=True: this call runs stock eager attention, which materialises the "
                          "N x N attention weights of every layer and head (memory grows with the square of the "
                          "sequence length); calls without it stay blockwise", stacklevel=2)
        with _stock_eager(base, view):
            return original(*args, **kwargs)

    return forward
