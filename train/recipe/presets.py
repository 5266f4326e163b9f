"""--config YAML presets of train.qlora: read one, and turn its keys (flag names) into command-line tokens, so a value
is converted and checked by the same parser wherever it comes from."""
from __future__ import annotations

import difflib
from pathlib import Path

import yaml

from train.errors import UserError


def yaml_to_argv(values: dict, source: str, fields: dict) -> list[str]:
    """Turn a YAML mapping of flag values into argv tokens (None = keep the default); `fields`: the flag schema's
    names (train.recipe.args.schema_fields)."""
    unknown = [key for key in values if key not in fields]
    if unknown:
        hints = [f"{key!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(key, fields, 1))
                 else repr(key) for key in unknown]
        raise UserError(f"{source}: unknown key(s) {', '.join(hints)}; keys must be flag names "
                        "(python -m train.qlora --help)")
    argv = []
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(f"--{key}" if value else f"--no_{key}")
        elif isinstance(value, (list, tuple)):
            argv += [f"--{key}", *map(str, value)]
        elif isinstance(value, dict):
            raise UserError(f"{source}: {key} must be a single value or a list, not a mapping")
        else:
            argv += [f"--{key}", str(value)]
    return argv


def load_yaml(path: str) -> dict:
    """The mapping in a --config YAML file, or UserError saying what is wrong with it."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise UserError(f"cannot read --config {path}: {error.strerror or error}") from None
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        line = f" at line {where.line + 1}" if where else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise UserError(f"--config {path} is not valid YAML{line}: {problem}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise UserError(f"--config {path} must be a mapping of flag names to values, got {type(values).__name__}")
    return values
