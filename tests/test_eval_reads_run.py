"""`python -m train.eval --adapter DIR` evaluates the model the run trained: the run's base, RoPE scaling and
bits (from its run_info.json, or peft's adapter_config.json without one), the RoPE flags applied exactly as
training applies them, flags overriding the run with one warning line each, and one-line errors.

One short train.qlora run (2 steps) on a tiny llama that is not the shipped one (hidden 64, 128 positions),
extended to 256 tokens with YaRN, is shared by the tests."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from train.evaluation.eval import load_for_eval, main, parse_args
from train.recipe.args import TINY_LLAMA_DIR

TRAIN_LENGTH = 256  # twice the base's 128 positions: RoPE x2
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on a shared CPU: one thread (conftest)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(base dir, finished run dir) of a 2-step 4-bit YaRN run with its passkey evaluation."""
    from cli_helpers import save_tiny_llama
    from train.recipe.args import parse_args as train_args
    from train.run.qlora import run

    root = tmp_path_factory.mktemp("reads_run")
    save_tiny_llama(root / "base")
    run(train_args(["--model_name_or_path", str(root / "base"), "--dataset", "passkey", "--passkey_samples", "4",
                    "--max_seq_len", str(TRAIN_LENGTH), "--rope_scaling", "yarn", "--output_dir", str(root / "run"),
                    "--max_steps", "2", "--save_steps", "2", "--lora_r", "4", "--learning_rate", "1e-2",
                    "--train_embeddings_and_norms", "--eval_passkey", "--eval_depths", "0.2", "0.8",
                    "--eval_trials", "2"]))
    return root / "base", root / "run"


def run_info(run_dir) -> dict:
    return json.loads((run_dir / "run_info.json").read_text())


def is_4bit(model) -> bool:
    return any(type(p).__name__ == "Params4bit" for p in model.parameters())


def warnings_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("warning:")]


def test_adapter_alone_loads_the_runs_base_rope_and_bits(trained):
    from train.recipe.model import load_trained

    _, run_dir = trained
    info = run_info(run_dir)
    args = parse_args(["--adapter", str(run_dir)])
    model, tokenizer = load_for_eval(args)
    config = model.get_base_model().config
    assert config.hidden_size == 64  # the run's base, not the shipped tiny model
    assert config.rope_parameters == info["rope_parameters"] and config.rope_parameters["rope_type"] == "yarn"
    assert config.max_position_embeddings == info["max_position_embeddings"] == TRAIN_LENGTH
    assert args.bits == info["bits"] == 4 and is_4bit(model)
    # The same model train.recipe.model.load_trained rebuilds, to the bit.
    reference, _ = load_trained(str(run_dir))
    probe = torch.randint(3, 60, (2, TRAIN_LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(input_ids=probe).logits, reference.eval()(input_ids=probe).logits,
                                   rtol=0, atol=0)


def test_cli_adapter_alone_repeats_the_runs_passkey_evaluation(trained, tmp_path, capsys):
    from train.evaluation.metrics import EVAL_SEED

    _, run_dir = trained
    out = tmp_path / "eval.json"
    assert main(["--adapter", str(run_dir), "--output_json", str(out)]) == 0
    result = json.loads(out.read_text())
    after = json.loads((run_dir / "eval.json").read_text())["after"]
    # The run's own settings: its length, depths, trials and seed, so the table is the run's "after".
    assert result["args"]["lengths"] == [TRAIN_LENGTH] and result["args"]["depths"] == [0.2, 0.8]
    assert result["args"]["trials"] == 2 and result["args"]["seed"] == EVAL_SEED
    assert result["by_length_depth"] == after["by_length_depth"] and result["accuracy"] == after["accuracy"]
    assert result["rope_parameters"] == run_info(run_dir)["rope_parameters"]
    assert not warnings_in(capsys.readouterr().err)


def test_cli_adapter_without_output_json_writes_into_the_run(trained):
    _, run_dir = trained
    assert main(["--adapter", str(run_dir), "--lengths", "120", "--depths", "0.5", "--trials", "1"]) == 0
    result = json.loads((run_dir / "eval_results.json").read_text())
    assert result["args"]["adapter"] == str(run_dir) and result["args"]["lengths"] == [120]
    assert "before" in json.loads((run_dir / "eval.json").read_text())  # the run's own evaluation is left alone


def test_checkpoint_without_run_info_takes_the_base_from_adapter_config(trained, capsys):
    base, run_dir = trained
    checkpoint = run_dir / "checkpoint-2"  # what an interrupted run leaves: an adapter, no run_info.json
    assert not (checkpoint / "run_info.json").exists()
    args = parse_args(["--adapter", str(checkpoint), "--lengths", "120"])
    model, _ = load_for_eval(args)
    config = model.get_base_model().config
    assert args.model_name_or_path == str(base) and config.hidden_size == 64
    assert config.rope_parameters["rope_type"] == "default" and args.bits == 16  # unknown: the base's own
    err = capsys.readouterr().err
    assert "note:" in err and "no run_info.json" in err and "--rope_scaling" in err


def training_config(base, tmp_path, *flags):
    """The config train.qlora's preflight builds (RoPE scaling applied), no weights loaded."""
    from train.recipe.args import parse_args as train_args
    from train.run.qlora import preflight

    return preflight(train_args(["--model_name_or_path", str(base), "--output_dir", str(tmp_path / "unused"),
                                 "--max_seq_len", str(TRAIN_LENGTH), *flags])).config


# Factor derived from the longest length (as training derives it from --max_seq_len) for every type; explicit
# for the two types whose parameters differ most from linear's.
@pytest.mark.parametrize("kind,factor", [("linear", None), ("dynamic", None), ("yarn", None), ("llama3", None),
                                         ("dynamic", "3"), ("llama3", "3")])
def test_rope_flags_are_applied_as_training_applies_them(trained, tmp_path, kind, factor):
    base, _ = trained
    factor_flags = ["--rope_factor", factor] if factor else []
    expected = training_config(base, tmp_path, "--rope_scaling", kind, *factor_flags)
    model, _ = load_for_eval(parse_args(["--model_name_or_path", str(base), "--rope_type", kind,
                                         "--lengths", str(TRAIN_LENGTH), *factor_flags]))
    assert model.config.rope_parameters == expected.rope_parameters
    # dynamic NTK keeps the original 128 positions; the others stretch them
    assert model.config.max_position_embeddings == expected.max_position_embeddings


def test_flags_override_the_run_with_one_warning_line_each(trained, tmp_path, capsys):
    base, run_dir = trained
    # Flags that agree with the run: no warning.
    load_for_eval(parse_args(["--adapter", str(run_dir), "--rope_scaling", "yarn", "--rope_factor", "2",
                              "--bits", "4", "--model_name_or_path", str(base), "--lengths", "120"]))
    assert not warnings_in(capsys.readouterr().err)

    copy = tmp_path / "base_copy"
    shutil.copytree(base, copy)
    args = parse_args(["--adapter", str(run_dir), "--rope_type", "llama3", "--rope_factor", "2", "--bits", "16",
                       "--model_name_or_path", str(copy), "--lengths", "120"])
    model, _ = load_for_eval(args)
    config = model.get_base_model().config
    assert config.rope_parameters == training_config(base, tmp_path, "--rope_scaling", "llama3").rope_parameters
    assert config.name_or_path == str(copy) and not is_4bit(model)
    lines = warnings_in(capsys.readouterr().err)
    assert len(lines) == 3, lines
    assert "llama3" in lines[1] and "yarn" in lines[1] and "--bits 16" in lines[2] and str(copy) in lines[0]


def test_rope_factor_alone_keeps_the_runs_rope_type(trained, capsys):
    from train.evaluation.eval import plan_model

    _, run_dir = trained
    plan = plan_model(parse_args(["--adapter", str(run_dir), "--rope_factor", "3"]))  # configs only, no weights
    assert plan.config.rope_parameters["rope_type"] == "yarn" and plan.config.rope_parameters["factor"] == 3.0
    lines = warnings_in(capsys.readouterr().err)
    assert len(lines) == 1 and "yarn x3" in lines[0] and "yarn x2" in lines[0]


def test_bad_input_is_one_error_line_before_loading_weights(trained, tmp_path, capsys, monkeypatch):
    import train.recipe.model

    base, run_dir = trained
    empty = tmp_path / "empty"
    empty.mkdir()
    moved = tmp_path / "moved_base_run"
    shutil.copytree(run_dir, moved, ignore=shutil.ignore_patterns("checkpoint-*"))
    info = run_info(moved)
    (moved / "run_info.json").write_text(json.dumps({**info, "model_name_or_path": str(tmp_path / "gone")}))

    def no_weights(*_, **__):
        raise AssertionError("weights loaded before the input was checked")

    monkeypatch.setattr(train.recipe.model, "load_base", no_weights)
    cases = {str(tmp_path / "nope"): "does not exist", str(empty): "no LoRA adapter",
             str(moved): "--model_name_or_path"}
    for adapter, expected in cases.items():
        assert main(["--adapter", adapter]) == 2
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1 and expected in lines[0] and "Traceback" not in err, err
    assert "run_info.json" in lines[0]
    monkeypatch.undo()

    # A base the adapter was not trained on: shapes differ (hidden 128 vs 64), one line, not a traceback.
    # (--output_json elsewhere: the run's eval_results.json, of its own base, would be refused first.)
    assert main(["--adapter", str(run_dir), "--model_name_or_path", str(TINY_LLAMA_DIR), "--lengths", "120",
                 "--output_json", str(tmp_path / "other_base.json")]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "does not fit" in errors[0] and "Traceback" not in err


def test_a_run_that_evaluated_nothing_gets_the_defaults_help_names():
    """--adapter on a run trained without --eval_passkey: tasks, depths, trials and seed as --help says (not the
    training flags' unused evaluation defaults), at the length the run trained for."""
    import re

    from train.evaluation.eval import EvalArgs, fill_passkey_defaults
    from train.recipe.args import build_parser
    from train.recipe.args import parse_args as train_args

    helps = {a.dest: a.help for a in build_parser((EvalArgs,), default_run=None, config_flag=False)._actions}
    trained_args = train_args(["--model_name_or_path", "m", "--max_seq_len", "512"]).to_dict()
    assert not trained_args["eval_passkey"] and trained_args["eval_depths"] == [0.1, 0.5, 0.9]
    args = EvalArgs()
    fill_passkey_defaults(args, {"args": trained_args})
    said = re.search(r"else ([\d. ]+)\)", helps["depths"]).group(1).split()
    assert args.depths == [float(d) for d in said]
    assert args.trials == int(re.search(r"else (\d+)\)", helps["trials"]).group(1))
    assert args.seed == int(re.search(r"else (\d+)\)", helps["seed"]).group(1))
    assert args.lengths == [512] and "else the run's --max_seq_len" in helps["lengths"]

    evaluated = {**trained_args, "eval_passkey": True}
    args = EvalArgs()
    fill_passkey_defaults(args, {"args": evaluated})
    assert args.depths == [0.1, 0.5, 0.9] and args.trials == 4  # the run's own evaluation, reproduced
