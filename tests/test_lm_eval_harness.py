"""`python -m train.eval --lm_eval_tasks`: lm-evaluation-harness's RULER tasks through its HFLM wrapper around the
patched model (train.evaluation.harness). The patched model generates what stock transformers generates through the same
lm-eval loop, and our own decoding and scoring (train.evaluation.metrics._greedy,
train.evaluation.tasks.string_match_all) of lm-eval's prompts give lm-eval's texts and scores. The lm-eval tests skip
where it is not installed (pip install -e ".[ruler]").
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml

from cli_helpers import error_line
from train.errors import UserError
from train.evaluation import harness
from train.evaluation.eval import main
from train.recipe.args import TINY_LLAMA_DIR

pytestmark = pytest.mark.usefixtures("one_thread")
HAS_LM_EVAL = all(importlib.util.find_spec(name) for name in ("lm_eval", "wonderwords", "nltk"))
needs_lm_eval = pytest.mark.skipif(not HAS_LM_EVAL, reason='lm-eval is not installed: pip install -e ".[ruler]"')
TASKS, LENGTH, LIMIT = ["niah_single_1", "niah_multikey_2"], 512, 2
SMALL_BLOCKS = {"q_block": 64, "kv_block": 64, "mlp_chunk": 96, "loss_chunk": 80}  # several blocks per prompt


def test_without_lm_eval_one_line_names_the_extra(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(harness.importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else
                        real(name, *a))
    assert main(["--lm_eval_tasks", "niah_single_1"]) == 2
    assert 'pip install -e ".[ruler]"' in error_line(capsys)


def test_downloading_unknown_and_split_tasks_are_one_error_line(capsys):
    assert main(["--lm_eval_tasks", "niah_single_1", "niah_single_2"]) == 2
    line = error_line(capsys)
    assert "niah_single_2: downloads its data" in line and "Paul Graham" in line and "niah_single_1" not in \
        line.split("downloads")[0]
    assert main(["--lm_eval_tasks", "ruler_qa_squad"]) == 2
    assert "SQuAD" in error_line(capsys)
    assert main(["--lm_eval_tasks", "niah_single"]) == 2
    assert "unknown task 'niah_single'" in error_line(capsys)
    for layout in (["--sequence_parallel", "2"], ["--tensor_parallel", "2"], ["--fsdp"]):
        assert main(["--lm_eval_tasks", "ruler", *layout]) == 2
        assert "--lm_eval_tasks runs in one process" in error_line(capsys)


@needs_lm_eval
def test_offline_and_downloading_tasks_are_the_installed_ruler_group():
    import lm_eval

    group = yaml.safe_load((Path(lm_eval.__file__).parent / "tasks" / "ruler" / "ruler.yaml").read_text())
    assert sorted(group["task"]) == sorted([*harness.OFFLINE, *harness.DOWNLOADS])
    assert harness.check_tasks(["ruler", "ruler_vt"]) == list(harness.OFFLINE)


@needs_lm_eval
def test_lengths_lm_eval_cannot_build_are_one_error_line(tmp_path, capsys):
    """ruler_vt's few-shot example is sized for 500 tokens, which the char-level tiny tokenizer cannot fit (lm-eval
    would loop forever); ruler_cwe below its size makes prompts with nothing to find; niah says so itself."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA_DIR)
    with pytest.raises(UserError, match="ruler_vt cannot be built with this tokenizer"):
        harness.build_tasks(tokenizer, str(TINY_LLAMA_DIR), ["ruler_vt"], [8192])
    with pytest.raises(UserError, match="ruler_cwe at length 1024 needs"):
        harness.build_tasks(tokenizer, str(TINY_LLAMA_DIR), ["ruler_cwe"], [1024])
    assert main(["--lm_eval_tasks", "niah_single_1", "--lengths", "200", "--output_json", str(tmp_path / "r.json")]) \
        == 2
    assert "niah_single_1 cannot be built with --lengths 200" in error_line(capsys)


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA_DIR)
    return tokenizer, harness.build_tasks(tokenizer, str(TINY_LLAMA_DIR), TASKS, [LENGTH])


def _model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY_LLAMA_DIR, dtype=torch.float32)


def _samples(raw: dict) -> dict:
    return {name: sorted(raw["samples"][name], key=lambda s: s["doc_id"]) for name in TASKS}


@pytest.fixture(scope="module")
def stock_run(prompts):
    tokenizer, built = prompts
    return harness.simple_evaluate(_model(), tokenizer, built, limit=LIMIT, batch_size=2, patched=False,
                                   log_samples=True)


@needs_lm_eval
def test_patched_generates_what_stock_does_through_hflm(prompts, stock_run):
    tokenizer, built = prompts
    model = _model()
    patched = harness.simple_evaluate(model, tokenizer, built, limit=LIMIT, batch_size=2, patched=True,
                                      bpt_options=SMALL_BLOCKS, log_samples=True)
    from patches import is_patched

    assert not is_patched(model)  # the patch is removed after
    for name, samples in _samples(stock_run).items():
        got = _samples(patched)[name]
        assert len(samples) == len(got) == LIMIT
        assert [s["resps"] for s in got] == [s["resps"] for s in samples]
        assert all(len(s["resps"][0][0]) > 0 for s in got)  # the model did generate
    assert harness.summarise(patched, built, LIMIT, True)["tasks"] == harness.summarise(stock_run, built, LIMIT,
                                                                                          False)["tasks"]


@needs_lm_eval
def test_our_decoding_and_scoring_of_lm_eval_prompts_agree(prompts, stock_run):
    """lm-eval's prompts (prompt + references), decoded by train.evaluation.metrics._greedy and scored by
    train.evaluation.tasks: the same texts and per-prompt scores as lm-eval's, hence its per-length score."""
    from lm_eval.tasks.ruler.common_utils import process_results

    from train.evaluation.metrics import _greedy
    from train.evaluation.tasks import string_match_all

    tokenizer, built = prompts
    model = _model().eval()
    summary = harness.summarise(stock_run, built, LIMIT, False)
    for name, samples in _samples(stock_run).items():
        ours = []
        for sample in samples:
            context, gen_kwargs = sample["arguments"][0]
            ids = torch.tensor([tokenizer(context).input_ids])
            new = _greedy(model, ids, gen_kwargs["max_gen_toks"], tokenizer.pad_token_id)
            text = tokenizer.decode(new[0], skip_special_tokens=True)
            assert text == sample["resps"][0][0]
            score = string_match_all(text, sample["doc"]["outputs"])
            assert score == sample[str(LENGTH)]
            ours.append(score)
            outputs = sample["doc"]["outputs"]  # right, partly right and wrong answers to lm-eval's own prompts
            for guess in (" " + ", ".join(outputs).upper() + ".\n", " " + outputs[0] + " and 1234567", " no"):
                assert string_match_all(guess, outputs) == process_results(sample["doc"], [guess])[str(LENGTH)]
        assert sum(ours) / len(ours) == summary["tasks"][name]["by_length"][LENGTH]


@needs_lm_eval
def test_cli_runs_offline_tasks_on_the_patched_model(prompts, stock_run, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["--lm_eval_tasks", *TASKS, "--lengths", str(LENGTH), "--lm_eval_limit", str(LIMIT),
                 "--batch_size", "2", "--output_json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["tasks"] == {} and result["lm_eval"]["patched"] is True and result["lm_eval"]["limit"] == LIMIT
    expected = harness.summarise(stock_run, prompts[1], LIMIT, False)["tasks"]
    assert result["lm_eval"]["tasks"] == json.loads(json.dumps(expected))  # patched CLI = stock
    assert "RULER on the patched model" in printed and all(name in printed for name in TASKS)


@needs_lm_eval
def test_adapter_run_4bit_yarn_patched_equals_stock(tmp_path, capsys):
    """A train.qlora run's model as train.eval loads it (4-bit base, YaRN, LoRA adapter: a PeftModel) through HFLM:
    the CLI runs, and the patched model generates what the stock one does."""
    from cli_helpers import save_tiny_llama
    from train.evaluation.eval import load_for_eval, parse_args
    from train.recipe.args import parse_args as train_args
    from train.run.qlora import run

    save_tiny_llama(tmp_path / "base")
    run(train_args(["--model_name_or_path", str(tmp_path / "base"), "--dataset", "passkey", "--passkey_samples", "2",
                    "--max_seq_len", "256", "--rope_scaling", "yarn", "--output_dir", str(tmp_path / "run"),
                    "--max_steps", "1", "--save_steps", "1", "--lora_r", "4", "--bits", "4"]))
    argv = ["--adapter", str(tmp_path / "run"), "--lm_eval_tasks", "niah_single_1", "--lengths", str(LENGTH),
            "--lm_eval_limit", "1", "--output_json", str(tmp_path / "eval.json")]
    assert main(argv) == 0
    assert "niah_single_1" in json.loads((tmp_path / "eval.json").read_text())["lm_eval"]["tasks"]
    capsys.readouterr()
    args = parse_args(argv)
    model, tokenizer = load_for_eval(args)
    assert type(model).__name__.startswith("Peft") and model.get_base_model().config.rope_parameters["rope_type"] == \
        "yarn"
    built = harness.build_tasks(tokenizer, str(tmp_path / "run"), ["niah_single_1"], [LENGTH])
    texts = {}
    for patched in (False, True):
        raw = harness.simple_evaluate(model, tokenizer, built, limit=1, patched=patched, bpt_options=SMALL_BLOCKS,
                                      log_samples=True)
        texts[patched] = [s["resps"] for s in raw["samples"]["niah_single_1"]]
    assert texts[True] == texts[False] and texts[True][0][0][0]
