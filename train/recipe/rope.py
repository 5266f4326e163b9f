"""RoPE scaling on a model config: the one place that writes it, for training (train.qlora) and evaluation
(train.eval) alike, so an evaluated model positions tokens exactly as the trained one did. Config-only: no weights."""
from __future__ import annotations

import math
import warnings

from train.errors import UserError

ROPE_EXTRA = {  # keys each scaling type needs besides rope_type, factor and rope_theta
    "linear": {},
    "dynamic": {},
    "yarn": {"original_max_position_embeddings": None},
    "llama3": {"original_max_position_embeddings": None, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
}


ROPE_TYPES = tuple(ROPE_EXTRA)


def check_rope_flags(kind: str | None, factor: float | None) -> None:
    """The checks on --rope_scaling / --rope_factor that need no model (both CLIs)."""
    if factor is not None and factor < 1:
        raise UserError(f"--rope_factor must be >= 1 (it stretches the positions), got {factor}")
    if factor is not None and kind is None:
        raise UserError(f"--rope_factor needs --rope_scaling ({', '.join(ROPE_TYPES[:-1])} or {ROPE_TYPES[-1]})")


def apply_rope_scaling(config, max_seq_len: int, kind: str | None, factor: float | None) -> float | None:
    """Check that max_seq_len fits the model's positions and set RoPE scaling on `config` in place.

    The factor defaults to max_seq_len / max_position_embeddings. Returns the factor used (None when
    no scaling is set). transformers 5 keeps RoPE settings in config.rope_parameters.
    """
    original = getattr(config, "max_position_embeddings", None)
    if kind is None:
        if original is not None and max_seq_len > original:
            raise UserError(
                f"--max_seq_len {max_seq_len} is beyond the model's max_position_embeddings {original} and no RoPE "
                f"scaling is set: add --rope_scaling linear (factor {max_seq_len / original:g} is derived) or lower "
                f"--max_seq_len to {original}")
        return None
    _check_rotary(config)
    if factor is None:
        if max_seq_len <= original:
            warnings.warn(f"--max_seq_len {max_seq_len} fits the model's {original} positions: --rope_scaling "
                          f"{kind} is not applied")
            return None
        factor = max_seq_len / original
    if max_seq_len > original * factor:
        raise UserError(f"--rope_factor {factor:g} stretches {original} positions to {original * factor:g}, fewer "
                        f"than --max_seq_len {max_seq_len}: raise it to {max_seq_len / original:g} or omit it")
    set_rope_scaling(config, kind, factor)
    return float(factor)


def _check_rotary(config) -> None:
    rope = getattr(config, "rope_parameters", None)
    if getattr(config, "max_position_embeddings", None) is None or not isinstance(rope, dict):
        raise UserError(f"--rope_scaling needs a model with rotary position embeddings; {config.model_type} has "
                        "none. Drop --rope_scaling and keep --max_seq_len within the model's positions")
    if _per_layer_type(config, rope):
        raise UserError(f"--rope_scaling is not supported for {config.model_type}, whose RoPE differs per layer "
                        "type; drop --rope_scaling")


def _per_layer_type(config, rope: dict) -> bool:
    """Whether `rope` holds one RoPE per layer type (Gemma3-style), as transformers >= 5.2x says it
    (`nested_rope_parameter_keys`); before that method existed, the keys that name the config's layer types."""
    if hasattr(config, "nested_rope_parameter_keys"):
        return bool(config.nested_rope_parameter_keys(rope))
    labels = getattr(config, "_rope_type_labels", None) or getattr(config, "layer_types", None) or ()
    return any(key in labels for key in rope)


def set_rope_scaling(config, kind: str, factor: float) -> None:
    """Write RoPE scaling `kind` x `factor` onto the base model's `config` in place.

    The one place that builds the scaled RoPE: training (apply_rope_scaling) and `train.eval` flags both
    call it, so an evaluated model positions tokens exactly as the trained one did."""
    _check_rotary(config)
    rope, original = config.rope_parameters, config.max_position_embeddings
    if rope.get("rope_type", "default") != "default":
        warnings.warn(f"replacing the model's own {rope['rope_type']} RoPE scaling with {kind} x{factor:g}")
    params = {"rope_type": kind, "factor": float(factor), "rope_theta": rope.get("rope_theta", config.default_theta)}
    params.update({key: (original if value is None else value) for key, value in ROPE_EXTRA[kind].items()})
    if "partial_rotary_factor" in rope:
        params["partial_rotary_factor"] = rope["partial_rotary_factor"]
    config.rope_parameters = params
    if kind != "dynamic":
        # Dynamic NTK computes its stretch relative to max_position_embeddings, so that must stay the
        # original length; the others now position original * factor tokens.
        config.max_position_embeddings = math.ceil(original * factor)
