"""Our scoring agrees with lm-evaluation-harness's RULER scoring (lm_eval/tasks/ruler/common_utils.py:
postprocess_pred + string_match_all, as its process_results applies them) on the same predictions. Skipped where
lm_eval is not installed (pip install lm-eval)."""
import random

import pytest

from train.evaluation.tasks import TASKS, build_case
from train.pretrain_tiny import build_tokenizer

ruler = pytest.importorskip("lm_eval.tasks.ruler.common_utils")


def predictions(references: list[str], rng: random.Random) -> list[str]:
    """Right, wrong, partial, re-cased, padded with control characters, buried in other text."""
    joined = ", ".join(references)
    return [" " + joined, " 0000000", " " + references[0], joined.upper() + "\x00\x01 and more", joined.lower(),
            "\n\t" + joined + ".\n", f"I think it is {references[-1]} or maybe {rng.randint(10**6, 10**7 - 1)}",
            " " + ", ".join(references[: len(references) // 2]), ""]


@pytest.mark.parametrize("task", ["niah_single", "niah_single_uuid", "niah_multikey", "niah_multivalue",
                                  "niah_multiquery", "variable_tracking"])
def test_scores_agree_with_lm_eval(task):
    tok, rng = build_tokenizer(), random.Random(0)
    scored = 0
    for trial in range(3):
        case = build_case(tok, task, 900, rng.random(), rng)
        doc = {"max_length": 900, "outputs": case.references}
        for prediction in predictions(case.references, rng):
            ours = TASKS[task].score(prediction, case.references)
            theirs = ruler.process_results(doc, [prediction])["900"]
            assert ours == pytest.approx(theirs), (prediction, case.references)
            scored += ours not in (0.0, 1.0)  # partial credit is compared too
    assert scored > 0 or task.startswith("niah_single") or task == "niah_multikey"
