"""train.evaluation.tasks: RULER-style prompts (exact length, needle at the requested depth), RULER's string_match_all
scoring on hand-made predictions, and generation end to end (an oracle that reads the prompt, a random tiny llama)."""
import random
import re

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from train.errors import UserError
from train.pretrain_tiny import build_tokenizer
from train.evaluation.tasks import (NIAH_NEEDLES, TASKS, VT_HOPS, build_case, check_task_lengths, check_task_names,
                         string_match_all, task_accuracy)

pytestmark = pytest.mark.usefixtures("one_thread")
RULER_TASKS = [name for name in TASKS if name != "passkey"]
NEEDLE = re.compile(r"One of the special magic \w+ for ([\w-]+) is: ([\w-]+)\.")
VAR_LINE = re.compile(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.")


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()  # one token per character: offsets in tokens are offsets in characters


def text(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------- scoring

def test_string_match_all_on_hand_made_predictions():
    assert string_match_all(" 1234567.", ["1234567"]) == 1.0
    assert string_match_all("The number is 7654321", ["1234567"]) == 0.0
    assert string_match_all("  Brisk-Island\n", ["brisk-island"]) == 1.0  # case-insensitive, stripped
    assert string_match_all(" 1111111, 2222222 and 9999999", ["1111111", "2222222", "3333333", "4444444"]) == 0.5
    assert string_match_all(" ABCDE, FGHIJ\x00KLMNO", ["ABCDE", "FGHIJ", "KLMNO"]) == 1.0  # control char -> newline
    assert string_match_all("123456", ["1234567"]) == 0.0  # a prefix of the value is not the value


def test_passkey_scoring_is_train_metrics_exact_match():
    score = TASKS["passkey"].score
    assert score(" 12345. Remember", ["12345"]) == 1.0 and score(" the key 12345", ["12345"]) == 0.0


def test_task_names_are_checked_with_the_valid_ones_listed():
    assert check_task_names(["niah_single", "passkey", "niah_single"]) == ["niah_single", "passkey"]
    with pytest.raises(UserError) as error:
        check_task_names(["passkey", "niah_singel"])
    assert "niah_singel" in str(error.value) and all(name in str(error.value) for name in TASKS)


# ---------------------------------------------------------------- prompts

@pytest.mark.parametrize("task", RULER_TASKS)
@pytest.mark.parametrize("length", [800, 1001])
def test_prompt_and_generation_fill_exactly_the_requested_length(tok, task, length):
    for depth in (0.0, 0.5, 1.0):
        case = build_case(tok, task, length, depth, random.Random(3))
        assert len(case.prompt) + case.max_new_tokens == length
        assert case.prompt[0] == tok.bos_token_id
        context = text(tok, case.prompt[case.context[0]:case.context[1]])
        assert all(ref in context for ref in case.references)  # every answer is in the context
        assert not any(ref in text(tok, case.prompt[case.context[1]:]) for ref in case.references)  # not asked


def filler_before_target(tok, case) -> tuple[int, int]:
    """(filler tokens before the target needle, filler tokens in all): needles and chain lines not counted."""
    def filler_tokens(ids) -> int:
        decoded = text(tok, ids)
        inserted = [*NEEDLE.finditer(decoded), *VAR_LINE.finditer(decoded)]
        return len(ids) - sum(len(" " + match.group(0)) for match in inserted)

    return (filler_tokens(case.prompt[case.context[0]:case.target[0]]),
            filler_tokens(case.prompt[case.context[0]:case.context[1]]))


@pytest.mark.parametrize("task", ["niah_single", "niah_single_uuid", "niah_multikey", "niah_multivalue",
                                  "variable_tracking"])
def test_the_target_needle_sits_at_the_requested_depth(tok, task):
    for depth in (0.0, 0.25, 0.5, 0.75, 1.0):
        case = build_case(tok, task, 1500, depth, random.Random(7))
        target = text(tok, case.prompt[case.target[0]:case.target[1]]).strip()
        assert NEEDLE.fullmatch(target) or VAR_LINE.fullmatch(target), target
        before, total = filler_before_target(tok, case)
        # The nearest sentence boundary: within one filler sentence (< 60 characters) of depth x filler.
        assert abs(before - depth * total) < 60, (depth, before, total)
        if depth == 0.0:
            assert case.target[0] == case.context[0]


def test_niah_needles_keys_and_queries(tok):
    rng = random.Random(1)
    single = build_case(tok, "niah_single", 800, 0.5, rng)
    assert len(NEEDLE.findall(text(tok, single.prompt))) == 1 and re.fullmatch(r"\d{7}", single.references[0])
    assert "What is the special magic number for" in text(tok, single.prompt)

    multikey = build_case(tok, "niah_multikey", 1000, 0.5, rng)
    needles = NEEDLE.findall(text(tok, multikey.prompt))
    keys = [key for key, _ in needles]
    assert len(needles) == NIAH_NEEDLES and len(set(keys)) == NIAH_NEEDLES  # distinct keys: three distractors
    asked = re.search(r"number for ([\w-]+) mentioned", text(tok, multikey.prompt)).group(1)
    assert multikey.references == [value for key, value in needles if key == asked]

    multivalue = build_case(tok, "niah_multivalue", 1000, 0.5, rng)
    needles = NEEDLE.findall(text(tok, multivalue.prompt))
    assert len({key for key, _ in needles}) == 1 and sorted(multivalue.references) == sorted(v for _, v in needles)
    assert "What are all the special magic numbers for" in text(tok, multivalue.prompt)

    multiquery = build_case(tok, "niah_multiquery", 1200, 0.5, rng)
    needles = dict(NEEDLE.findall(text(tok, multiquery.prompt)))
    assert len(needles) == NIAH_NEEDLES and sorted(multiquery.references) == sorted(needles.values())
    assert all(key in text(tok, multiquery.prompt[multiquery.context[1]:]) for key in needles)

    uuid_case = build_case(tok, "niah_single_uuid", 800, 0.5, rng)
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", uuid_case.references[0])
    word_case = build_case(tok, "niah_single_word", 800, 0.5, rng)
    assert re.fullmatch(r"[a-z]+-[a-z]+", word_case.references[0])


def test_variable_tracking_chain_in_order(tok):
    for depth in (0.0, 0.6, 1.0):
        case = build_case(tok, "variable_tracking", 900, depth, random.Random(2))
        lines = VAR_LINE.findall(text(tok, case.prompt))
        assert len(lines) == VT_HOPS + 1 and [name for name, _ in lines] == case.references
        assert lines[0][1].isdigit() and all(lines[i + 1][1] == f"VAR {lines[i][0]}" for i in range(VT_HOPS))
        assert f"assigned the value {lines[0][1]}" in text(tok, case.prompt[case.context[1]:])


def test_same_seed_same_prompts_and_too_short_is_a_user_error(tok):
    for task in RULER_TASKS:
        assert build_case(tok, task, 800, 0.3, 5).prompt == build_case(tok, task, 800, 0.3, 5).prompt
    with pytest.raises(UserError) as error:
        check_task_lengths(tok, ["niah_single", "niah_multiquery"], [300, 2000])
    suggested = int(re.search(r"at least (\d+)", str(error.value)).group(1))
    assert "niah_multiquery length 300" in str(error.value)
    check_task_lengths(tok, ["niah_multiquery"], [suggested])  # the length it suggests works


# ---------------------------------------------------------------- generation end to end

class Oracle(torch.nn.Module):
    """Answers every task's prompt by reading it, as a perfect model would; `keep` values of each answer only."""

    def __init__(self, tok, keep=None):
        super().__init__()
        self.tok, self.keep = tok, keep
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def answer(self, prompt: str) -> list[str]:
        if "Find all variables" in prompt:
            value = re.search(r"assigned the value (\d+) in the text", prompt).group(1)
            names, bound = [], {value}
            for name, source in VAR_LINE.findall(prompt):
                if source in bound or source.removeprefix("VAR ") in names:
                    names.append(name)
            return names
        question = prompt[prompt.rindex(" What "):]
        query = re.search(r"special magic \w+ for (.*) mentioned in the provided text\?", question).group(1)
        keys = re.split(r", and |, ", query)
        return [value for key in keys for k, value in NEEDLE.findall(prompt) if k == key]

    def generate(self, input_ids, max_new_tokens, **_):
        rows = []
        for row in input_ids.tolist():
            values = self.answer(self.tok.decode(row, skip_special_tokens=True))[:self.keep]
            new = self.tok(" " + ", ".join(values), add_special_tokens=False)["input_ids"][:max_new_tokens]
            rows.append(row + new + [self.tok.pad_token_id] * (max_new_tokens - len(new)))
        return torch.tensor(rows)


def test_an_oracle_scores_one_and_a_partial_answer_partial_credit(tok):
    lengths, depths = [900, 1100], [0.0, 0.5, 1.0]
    for task in RULER_TASKS:
        result = task_accuracy(Oracle(tok), tok, task, lengths=lengths, depths=depths, trials=2)
        assert result["accuracy"] == 1.0, task
        assert list(result["by_length_depth"]) == lengths and list(result["by_length_depth"][900]) == depths
    half = task_accuracy(Oracle(tok, keep=2), tok, "niah_multivalue", lengths=[900], depths=[0.5], trials=3)
    assert half["accuracy"] == pytest.approx(0.5)
    none = task_accuracy(Oracle(tok, keep=0), tok, "niah_single", lengths=[900], depths=[0.5], trials=3)
    assert none["accuracy"] == 0.0


def test_generation_on_a_random_tiny_llama(tok):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(config)
    for task in ("niah_multikey", "variable_tracking"):
        result = task_accuracy(model, tok, task, lengths=[700, 800], depths=[0.0, 1.0], trials=1, batch_size=2)
        assert set(result) == {"by_length_depth", "by_length", "accuracy"}
        assert list(result["by_length"]) == [700, 800] and 0.0 <= result["accuracy"] < 0.5  # random weights
    assert model.training  # its mode restored
