"""The support table of docs/families.md, generated from the registry (`FAMILIES`) and the tests' tiny configs.

It lives with the tests because it reads them (tests/tiny_models.py, tests/test_generation.py): the installed
package never does. `python tests/support_table.py` prints the table; `--write` replaces the block of
docs/families.md between `<!-- support-table -->` and `<!-- /support-table -->`, its family list, and the family
count there and in the README (tests/test_readme_sync.py asserts both pages agree).

Every mark is derived from data, none is typed by hand:

- padding: yes for every family (the exactness tests run each one with right padding).
- packing: the row's `packing` field: stock keeps packed documents apart (tests/test_packing.py checks it against
  stock; the exactness tests run every family packed either way, and train.qlora refuses to pack the others).
- window / softcap / ALiBi: read from the transformers config class defaults and from each of the family's tiny
  configs (what the exactness tests exercise): sliding windows (`layer_types` with a sliding layer, else a
  `sliding_window` value), attention or final logit softcap, ALiBi of the bound-attention families (Bloom and MPT
  always, Falcon when `alibi`).
- sinks: the tiny model, built on the meta device (no memory, no init), has a `sinks` parameter in its attention.
- MoE: the config class defaults have experts, or the tiny model has an `experts` module. Not the tiny configs'
  expert counts: they are passed to dense families too (ignored by the model but kept on the config).
- generation: yes where tests/test_generation.py generates with the family (its `name` parametrization), else
  "untested" (a blank always means no).
"""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from patches.families import FAMILIES
from tiny_models import TINY_CONFIGS, tiny_config

TESTS = Path(__file__).resolve().parent
README = TESTS.parent / "README.md"
FAMILIES_PAGE = TESTS.parent / "docs" / "families.md"  # the list and the table; the README states the count
BEGIN, END = "<!-- support-table -->", "<!-- /support-table -->"
FEATURES = ("padding", "packing", "window", "softcap", "sinks", "ALiBi", "MoE", "generation")


def _generation_tested() -> set[str]:
    """Tiny-config names in tests/test_generation.py's `parametrize("name", ...)`: list literals or module-level
    list constants, read with ast (importing the test module would import pytest and the test helpers)."""
    tree = ast.parse((TESTS / "test_generation.py").read_text())
    constants = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "parametrize"
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == "name"):
            values = node.args[1]
            values = constants.get(values.id, values) if isinstance(values, ast.Name) else values
            names.update(ast.literal_eval(values))
    return names


def _window(config) -> bool:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:  # per-layer types decide (qwen2 keeps a sliding_window value it does not use)
        return any("sliding" in t for t in layer_types)
    return bool(getattr(config, "sliding_window", None))


def _softcap(config, family) -> bool:
    final = getattr(config, family.logit_softcap, None) if family.logit_softcap else None
    return bool(getattr(config, "attn_logit_softcapping", None) or final)


def _alibi(config, family) -> bool:
    return family.bound_attention in ("bloom", "mpt") or (family.bound_attention == "falcon" and bool(config.alibi))


def _moe(config) -> bool:
    keys = ("num_experts", "num_local_experts", "n_routed_experts")
    return any((getattr(config, key, None) or 0) > 0 for key in keys)


def _built(config, family) -> tuple[bool, bool]:
    """(sinks, experts) of the tiny model, built on the meta device: a `sinks` parameter in a layer's attention,
    a module named `experts` in a layer (dots1's config class leaves its expert count unset by default)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    layers = getattr(getattr(model, family.base), family.layers)
    attentions = [family.attention_of(layer) for layer in layers]  # None: a hybrid row's recurrent layer
    sinks = any(name.split(".")[-1] == "sinks" for attention in attentions if attention is not None
                for name, _ in attention.named_parameters())
    experts = any(name.split(".")[-1] == "experts" for layer in layers for name, _ in layer.named_modules())
    return sinks, experts


def support_rows() -> dict[str, dict[str, str]]:
    """family -> feature -> "yes" / "" / "untested" (generation only)."""
    generated = _generation_tested()
    rows = {}
    for model_type in sorted(FAMILIES):
        family = FAMILIES[model_type]
        variants = [name for name, (mt, _) in TINY_CONFIGS.items() if mt == model_type]
        tiny_configs = [tiny_config(name) for name in variants]
        configs = [AutoConfig.for_model(model_type), *tiny_configs]
        built = [_built(c, family) for c in tiny_configs]
        marks = {
            "padding": True, "packing": family.packs(),
            "window": any(_window(c) for c in configs),
            "softcap": any(_softcap(c, family) for c in configs),
            "sinks": any(sinks for sinks, _ in built),
            "ALiBi": any(_alibi(c, family) for c in configs),
            "MoE": _moe(configs[0]) or any(experts for _, experts in built),
        }
        row = {feature: "yes" if on else "" for feature, on in marks.items()}
        row["generation"] = "yes" if generated & set(variants) else "untested"
        rows[model_type] = row
    return rows


def support_table() -> str:
    """The markdown table: one row per family, sorted; a column per feature."""
    lines = ["| family | " + " | ".join(FEATURES) + " |", "|---" * (len(FEATURES) + 1) + "|"]
    for model_type, row in support_rows().items():
        lines.append(f"| {model_type} | " + " | ".join(row[f] for f in FEATURES) + " |")
    return "\n".join(lines)


def readme_block(text: str) -> str:
    """What a page holds between the markers (stripped)."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def with_family_list(text: str) -> str:
    """A page's text with its `<!-- families -->` list (wrapped, indented under its bullet) and count from FAMILIES
    (either one where the page has it)."""
    lines, line = [], "  <!-- families -->"
    for name in sorted(FAMILIES):
        piece = f"{name}, "
        if len(line) + len(piece) > 117:
            lines.append(line.rstrip())
            line = "  "
        line += piece
    listed = "\n".join([*lines, line.rstrip(", ") + "<!-- /families -->"])
    text = re.sub(r"  <!-- families -->.*?<!-- /families -->", lambda _: listed, text, flags=re.S)
    return re.sub(r"\(`config\.model_type`, \d+;", f"(`config.model_type`, {len(FAMILIES)};", text)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    table = support_table()
    if argv == ["--write"]:
        README.write_text(with_family_list(README.read_text()))
        head, rest = with_family_list(FAMILIES_PAGE.read_text()).split(BEGIN, 1)
        FAMILIES_PAGE.write_text(f"{head}{BEGIN}\n\n{table}\n\n{END}{rest.split(END, 1)[1]}")
    elif argv:
        sys.exit("usage: python tests/support_table.py [--write]")
    else:
        print(table)


if __name__ == "__main__":
    main()
