"""Sync tests between the CLI schema (train/recipe/args.py), the YAML presets in configs/ and --help."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from train.recipe.args import DEFAULT_RUN, TINY_LLAMA_DIR, Args, build_parser, parse_args, schema_fields

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PRESETS = sorted(CONFIGS.glob("*.yaml"))


def test_there_are_presets():
    assert {"default.yaml", "llama-8b-64k.yaml"} <= {p.name for p in PRESETS}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_every_preset_key_is_a_flag_and_parses(preset):
    values = yaml.safe_load(preset.read_text())
    assert set(values) <= set(schema_fields()), f"keys that are not flags: {set(values) - set(schema_fields())}"
    args = parse_args(["--config", str(preset)])
    for key, value in values.items():
        assert getattr(args, key) == value, key


@pytest.mark.parametrize("preset", [*PRESETS, *sorted((CONFIGS / "accelerate").glob("*.yaml"))],
                         ids=lambda p: p.name)
def test_every_preset_says_how_to_run_it(preset):
    header = "".join(line for line in preset.read_text().splitlines(keepends=True) if line.startswith("#"))
    assert re.search(r"(python -m train\.qlora|accelerate launch).*--config", header), preset


LAUNCH_CONFIGS = sorted((CONFIGS / "accelerate").glob("*.yaml"))


@pytest.mark.parametrize("config", LAUNCH_CONFIGS, ids=lambda p: p.name)
def test_every_launch_command_in_a_launch_config_parses(config, monkeypatch):
    """accelerate reads the config and the launcher flags of each command in its header; train.qlora parses the
    rest (presets resolved from the repository root, as the commands are run from there)."""
    import shlex

    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    load_config_from_file(str(config))
    commands = [line.lstrip("# ").strip() for line in config.read_text().splitlines()
                if line.startswith("#") and "accelerate launch" in line and "train.qlora" in line]
    assert commands, config
    monkeypatch.chdir(CONFIGS.parent)
    for command in commands:
        words = shlex.split(command[command.index("accelerate launch") + len("accelerate launch"):])
        script = words.index("train.qlora")
        launcher = launch_command_parser().parse_args([*words[:script], "train.qlora"])
        assert launcher.config_file == f"configs/accelerate/{config.name}", command
        parse_args(words[script + 1:])


def test_default_yaml_is_the_embedded_default():
    values = yaml.safe_load((CONFIGS / "default.yaml").read_text())
    assert values == {k: v for k, v in DEFAULT_RUN.items() if k != "model_name_or_path"}
    from_yaml = parse_args(["--config", str(CONFIGS / "default.yaml")])
    assert parse_args([]) == dataclasses.replace(from_yaml, config=None)


def test_embedded_default_is_a_context_extension_of_the_packaged_tiny_llama():
    args = parse_args([])
    assert Path(args.model_name_or_path) == TINY_LLAMA_DIR and TINY_LLAMA_DIR.is_absolute()
    assert args.dataset == "passkey" and args.rope_scaling == "yarn" and args.bits == 4 and args.bpt
    if (TINY_LLAMA_DIR / "config.json").is_file():
        import json

        pretrain_len = json.loads((TINY_LLAMA_DIR / "config.json").read_text())["max_position_embeddings"]
        assert args.max_seq_len >= 8 * pretrain_len


def test_flags_override_yaml_and_yaml_overrides_defaults(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("model_name_or_path: some/model\nlearning_rate: 3e-4\nlora_r: 4\npacking: false\n")
    args = parse_args(["--config", str(config), "--lora_r", "8"])
    assert (args.learning_rate, args.lora_r, args.packing) == (3e-4, 8, False)
    assert args.max_seq_len == Args().max_seq_len  # a named model: the embedded default run does not apply


def test_help_documents_every_flag():
    text = build_parser().format_help()
    for name, field in schema_fields().items():
        assert f"--{name}" in text, name
        assert field.metadata.get("help"), f"{name} has no help text"
