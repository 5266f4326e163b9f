"""lm-evaluation-harness's RULER tasks (the optional `lm-eval` package: pip install -e ".[ruler]") on the model
train.eval loads, through lm-eval's own HF wrapper (HFLM) and `simple_evaluate`, with the blockwise patch applied:
figures comparable with published RULER results, beside train.evaluation.tasks' own RULER-style tasks.

Only the tasks that generate their data offline run here: niah_single_1 ("The grass is green..." repeats),
niah_multikey_2 / niah_multikey_3 (needle haystacks), ruler_vt, ruler_cwe and ruler_fwe. The others download data
(DOWNLOADS) and are refused before any work. `ruler` names the offline ones.

Prompts are lm-eval's, built (before the weights load) with the evaluated model's tokenizer, seeded as
simple_evaluate seeds them, 500 per length (RULER's count); `limit` evaluates the first N of each length. A
length too short for a task's template, needles and generated tokens (128 for the needle tasks) is one error line.
"""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import random
import sys
from dataclasses import dataclass

from train.errors import UserError
from train.recipe.lifecycle import quieted

EXTRA = 'pip install -e ".[ruler]"'
GROUP = "ruler"
OFFLINE = ("niah_single_1", "niah_multikey_2", "niah_multikey_3", "ruler_vt", "ruler_cwe", "ruler_fwe")
# lm-eval's generators' fixed sizes (lm_eval/tasks/ruler/vt_utils.py, cwe_utils.py), for _check_buildable
VT_EXAMPLE_TOKENS, VT_GENERATED = 500, 30
CWE_SMALLEST, CWE_GENERATED = 10, 120
_ESSAYS = "Paul Graham essays (HF hub dataset baber/paul_graham_essays) as the haystack"
DOWNLOADS = {"niah_single_2": _ESSAYS, "niah_single_3": _ESSAYS, "niah_multikey_1": _ESSAYS,
             "niah_multivalue": _ESSAYS, "niah_multiquery": _ESSAYS,
             "ruler_qa_squad": "SQuAD v2's dev set from rajpurkar.github.io",
             "ruler_qa_hotpot": "HotpotQA's distractor dev set from the HF hub (namlh2004/hotpotqa)"}


def check_installed() -> None:
    missing = [name for name in ("lm_eval", "wonderwords", "nltk") if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"--lm_eval_tasks needs lm-evaluation-harness with its RULER extras ({', '.join(missing)} "
                        f"missing): {EXTRA}")


def check_tasks(names: list[str]) -> list[str]:
    """The offline task names `names` asks for (`ruler`: all of them), or one UserError; cheap (no lm-eval import
    beyond finding it)."""
    if not names:
        raise UserError(f"--lm_eval_tasks needs at least one task: {GROUP} or some of {', '.join(OFFLINE)}")
    downloading = [name for name in names if name in DOWNLOADS]
    if downloading:
        sources = "; ".join(f"{name}: {DOWNLOADS[name]}" for name in downloading)
        raise UserError(f"--lm_eval_tasks {' '.join(downloading)}: downloads its data ({sources}); only the RULER "
                        f"tasks that generate their data offline run here: {', '.join(OFFLINE)}")
    unknown = [name for name in names if name not in OFFLINE and name != GROUP]
    if unknown:
        raise UserError(f"--lm_eval_tasks: unknown task {', '.join(map(repr, unknown))}; valid: {GROUP} (all of "
                        f"them), {', '.join(OFFLINE)}")
    check_installed()
    expanded = [task for name in names for task in (OFFLINE if name == GROUP else [name])]
    return list(dict.fromkeys(expanded))


@dataclass
class Prompts:
    """lm-eval's RULER tasks with their generated prompts, before any weights load."""

    manager: object  # the lm_eval TaskManager that built them
    tasks: dict  # {name: lm-eval Task}
    lengths: list[int]


@contextlib.contextmanager
def _random_state_kept():
    import numpy as np

    state = random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])


def _check_buildable(tokenizer, names: list[str], lengths: list[int]) -> None:
    """UserError for a length (or tokenizer) at which lm-eval's ruler_vt or ruler_cwe cannot make a prompt: there
    its generator loops forever (vt; cwe when not even its template fits) or makes prompts with nothing to find
    (cwe). Measured with lm-eval's own generators at their smallest size; the random state is left as it was."""
    def tokens(text: str) -> int:
        return len(tokenizer(text).input_ids)

    with _random_state_kept(), contextlib.redirect_stdout(sys.stderr):
        if "ruler_vt" in names:
            from lm_eval.tasks.ruler import vt_utils

            # Its few-shot example is sized to 500 tokens (RULER's), from 5 noise lines up; then the prompt from 10.
            example, answer = vt_utils.generate_input_output(5, 1, 4, is_icl=True)
            smallest = tokens(example + " " + " ".join(answer)) + VT_GENERATED
            if smallest >= VT_EXAMPLE_TOKENS:
                raise UserError(f"lm-eval's ruler_vt cannot be built with this tokenizer: its few-shot example must fit "
                                f"{VT_EXAMPLE_TOKENS} tokens and takes at least {smallest} here (lm-eval would loop "
                                "forever); leave ruler_vt out")
            prompt, _ = vt_utils.generate_input_output(10, 1, 4)
            need = VT_EXAMPLE_TOKENS + tokens(prompt) + VT_GENERATED
            if min(lengths) < need:
                raise UserError(f"lm-eval's ruler_vt needs lengths of at least {need} tokens with this tokenizer (its "
                                f"few-shot example, the smallest prompt and {VT_GENERATED} generated tokens); "
                                f"--lengths has {min(lengths)}")
        if "ruler_cwe" in names:
            from lm_eval.tasks.ruler import cwe_utils

            for length in lengths:  # under 4096 its words repeat less: another size per length
                example, prompt, answer = cwe_utils.generate_input_output(CWE_SMALLEST, length)
                listed = " ".join(f"{i + 1}. {word}" for i, word in enumerate(answer))
                need = tokens(f"{example}\n{prompt} {listed}") + CWE_GENERATED
                if length < need:
                    raise UserError(f"lm-eval's ruler_cwe at length {length} needs {need} tokens with this tokenizer "
                                    f"(its example, {CWE_SMALLEST} words and {CWE_GENERATED} generated tokens; "
                                    "shorter, it makes prompts with no words to find); give longer --lengths")


def build_tasks(tokenizer, tokenizer_source: str, names: list[str], lengths: list[int]) -> Prompts:
    """lm-eval's tasks `names` with their prompts for `lengths`, sized by `tokenizer` (lm-eval loads its own copy
    from `tokenizer_source`). Seeded as simple_evaluate seeds, so the prompts are those `lm_eval --tasks` makes.
    Needs no weights: run it before loading them."""
    import numpy as np
    from lm_eval.defaults import DEFAULT_OTHER_SEED, DEFAULT_RANDOM_SEED
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import set_torch_seed

    lengths = sorted(set(lengths))
    _check_buildable(tokenizer, names, lengths)
    random.seed(DEFAULT_RANDOM_SEED)
    np.random.seed(DEFAULT_OTHER_SEED)
    set_torch_seed(DEFAULT_OTHER_SEED)
    manager = TaskManager(metadata={"tokenizer": tokenizer_source, "max_seq_lengths": lengths})
    tasks = {}
    # Its generators print progress ("Downloaded punkt_tab on rank 0", "Num noises: ..."): stderr, the results stdout.
    with quieted("lm_eval", logging.ERROR), contextlib.redirect_stdout(sys.stderr):
        for name in names:  # one at a time (the same random stream as all at once) to name the one that fails
            try:
                tasks.update(manager.load([name])["tasks"])
            except ValueError as error:  # lm-eval: "Could not generate any sample ... at max_seq_length=N ..."
                raise UserError(f"lm-eval's {name} cannot be built with --lengths {' '.join(map(str, lengths))} and "
                                f"this tokenizer: {str(error).splitlines()[0]} Give longer --lengths.") from None
    return Prompts(manager, tasks, lengths)


def _selection(tasks: dict, limit: int | None) -> dict | None:
    """simple_evaluate's `samples`: the first `limit` prompts of every length of every task (None: all)."""
    if limit is None:
        return None
    chosen = {}
    for name, task in tasks.items():
        counts: dict[int, int] = {}
        chosen[name] = []
        for index, doc in enumerate(task.eval_docs):
            if counts.get(doc["max_length"], 0) < limit:
                counts[doc["max_length"]] = counts.get(doc["max_length"], 0) + 1
                chosen[name].append(index)
    return chosen


def simple_evaluate(model, tokenizer, prompts: Prompts, *, limit: int | None = None, batch_size: int = 1,
                    patched: bool = True, bpt_options: dict | None = None, log_samples: bool = False) -> dict:
    """lm-eval's simple_evaluate of `prompts` on `model` wrapped in lm-eval's HFLM, greedy (the tasks' own
    generation settings), inside the blockwise patch unless `patched` is False (stock transformers, to compare).
    Returns lm-eval's results dict."""
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    from patches import apply_bpt_patch, is_patched
    from train.evaluation.metrics import evaluation_mode

    with quieted("lm_eval", logging.ERROR), evaluation_mode(model):
        # max_length only bounds HFLM's left truncation: RULER sizes a prompt without the answer prefix lm-eval
        # appends, so with max_length = the length a prompt's start would be cut off. Twice it never cuts.
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=2 * max(prompts.lengths))
        patch = apply_bpt_patch(model, **(bpt_options or {})) if patched and not is_patched(model) \
            else contextlib.nullcontext()
        with patch:
            return lm_eval.simple_evaluate(model=lm, tasks=list(prompts.tasks.values()), task_manager=prompts.manager,
                                           samples=_selection(prompts.tasks, limit), bootstrap_iters=0,
                                           log_samples=log_samples)


def summarise(results: dict, prompts: Prompts, limit: int | None, patched: bool) -> dict:
    """{name: {"by_length": {length: score}, "accuracy": mean over lengths}} from lm-eval's results (its metric
    per length: the mean string_match_all of that length's prompts)."""
    tasks = {}
    for name in prompts.tasks:
        metrics = results["results"][name]
        by_length = {length: metrics[f"{length},none"] for length in prompts.lengths}
        tasks[name] = {"by_length": by_length, "accuracy": sum(by_length.values()) / len(by_length)}
    return {"version": _version(), "patched": patched, "limit": limit, "lengths": prompts.lengths, "tasks": tasks}


def _version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def format_results(summary: dict) -> str:
    lengths = summary["lengths"]
    width = max(len(name) for name in summary["tasks"])
    header = f"{'task'.ljust(width)} | " + " | ".join(f"{length:>6}" for length in lengths) + " |   all"
    lines = [f"lm-eval {summary['version']} RULER on the {'patched' if summary['patched'] else 'stock'} model, score by length "
             f"({'all' if summary['limit'] is None else summary['limit']} prompts per length)", header,
             "-" * len(header)]
    for name, result in summary["tasks"].items():
        cells = " | ".join(f"{result['by_length'][length]:6.3f}" for length in lengths)
        lines.append(f"{name.ljust(width)} | {cells} | {result['accuracy']:.3f}")
    return "\n".join(lines)
