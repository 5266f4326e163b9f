"""RULER-style synthetic long-context tasks, generated here (offline) in token space, and their scoring.

    passkey            train.recipe.passkey's pass key (exact match of the key as the first thing generated)
    niah_single        one needle "One of the special magic numbers for <key> is: <value>." in filler; its value
    niah_single_word   the same, the value an adjective-noun word (RULER niah_single with word values)
    niah_single_uuid   the same, the value a UUID
    niah_multikey      four needles with distinct keys (three are distractors); one key's value
    niah_multivalue    one key with four values (four needles); all four values
    niah_multiquery    four keys; the values of all four
    variable_tracking  a chain "VAR ABCDE = 12345. VAR FGHIJ = VAR ABCDE. ..." (4 hops); every variable bound to 12345

Prompts and scoring follow RULER as lm-evaluation-harness's `ruler` group implements them (lm_eval/tasks/ruler):
the same instruction, needle, question and answer prefix ("The special magic number for <key> mentioned in the
provided text is"), singular wording when one value is asked for, 7-digit numbers, adjective-noun keys, UUIDs,
5-letter variable names with a 5-digit value, and `string_match_all`: the prediction is stripped (control
characters become newlines) and scores the fraction of reference strings it contains, case-insensitively (a
multi-value answer with 2 of 4 values scores 0.5). Differences: the filler is train.recipe.passkey's seeded sentences
(no digits, so needle values are the only numbers), not Paul Graham essays or "The grass is green..." repeats;
variable_tracking has no few-shot example (and spells "assigned" right); the pieces are joined by spaces.

Lengths are exact: a prompt plus the tokens generated for it (its answer's length + ANSWER_SLACK per expected
string; RULER generates a fixed 128 / 30 tokens) is exactly the requested length, like a passkey row (prompt +
answer + EOS), so evaluating at the trained length never positions a token beyond it. Depth places the needle the question asks about (for multivalue / multiquery the first answer
needle; for variable_tracking the chain's first assignment) at the sentence boundary nearest to that fraction of
the filler; the other needles (distractors, other values, other queried keys, the chain's later hops, which always
follow its start) go to seeded random depths.
"""
from __future__ import annotations

import random
import re
import string
import sys
import uuid
from dataclasses import dataclass
from typing import Callable

import torch

from train.errors import UserError
from train.recipe.passkey import encoder_for, filler_pieces

ANSWER_SLACK = 4  # tokens generated per expected string beyond the answer's own length: room for separators
# ("and", "VAR ") and for a longer (wrong) answer to be seen
NIAH_NEEDLES = 4  # RULER's num_needle_k / num_needle_v / num_needle_q for multikey / multivalue / multiquery
VT_HOPS = 4  # RULER's variable_tracking: one chain, 4 hops (5 variables)

# Keys and word values: adjective-noun, as RULER's wonderwords pairs; none of these words is in the filler grammar.
_KEY_ADJS = ["amber", "brisk", "calm", "dusty", "eager", "faint", "gentle", "hollow", "icy", "jolly", "keen",
             "lucky", "misty", "noble", "odd", "proud", "rapid", "silent", "tidy", "vivid"]
_KEY_NOUNS = ["anchor", "badge", "candle", "dragon", "engine", "falcon", "glove", "hammer", "island", "jacket",
              "kettle", "lantern", "magnet", "needle", "orchid", "pepper", "quartz", "rocket", "saddle", "tunnel"]

NIAH_TEMPLATE = ("Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {kind} afterwards.")
NIAH_QUESTION = "What are all the special magic {kind} for {query} mentioned in the provided text?"
NIAH_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_ANSWER_PREFIX = "The special magic {kind} for {query} mentioned in the provided text are"
VT_TEMPLATE = "Memorize and track the chain(s) of variable assignment hidden in the following text."
VT_QUESTION = ("Question: Find all variables that are assigned the value {value} in the text above. Answer: "
               "According to the chain(s) of variable assignment in the text above, {n} variables are assigned "
               "the value {value}, they are:")


# ---------------------------------------------------------------- scoring (RULER's string_match_all)

def postprocess(prediction: str) -> str:
    """As RULER: strip, control characters to newlines, strip again."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: list[str]) -> float:
    """Fraction of `references` found in the prediction, case-insensitively."""
    text = postprocess(prediction).lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def passkey_score(prediction: str, references: list[str]) -> float:
    from train.evaluation.metrics import answer_is_correct

    return float(answer_is_correct(prediction, references[0]))


# ---------------------------------------------------------------- values

def random_number(rng: random.Random) -> str:
    return str(rng.randint(10 ** 6, 10 ** 7 - 1))  # 7 digits, as RULER


def random_word(rng: random.Random) -> str:
    return f"{rng.choice(_KEY_ADJS)}-{rng.choice(_KEY_NOUNS)}"


def random_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


VALUE_KINDS = {"numbers": random_number, "words": random_word, "uuids": random_uuid}


def _distinct(draw: Callable[[random.Random], str], rng: random.Random, n: int, exclude=()) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        value = draw(rng)
        if value not in out and value not in exclude:
            out.append(value)
    return out


# ---------------------------------------------------------------- prompts in token space

class TooShort(UserError):
    def __init__(self, message: str, minimum: int):
        super().__init__(message)
        self.minimum = minimum


@dataclass
class Case:
    """One prompt: ids, the strings a correct answer contains, and how many tokens to generate."""

    prompt: list[int]
    references: list[str]
    max_new_tokens: int
    context: tuple[int, int]  # [start, end) of the filler-and-needles span in `prompt`
    target: tuple[int, int] = (0, 0)  # [start, end) of the needle placed at the requested depth


def _depth_cut(boundaries: list[int], depth: float, budget: int) -> int:
    return min(range(len(boundaries)), key=lambda i: abs(boundaries[i] - depth * budget))


def _assemble(encode, length: int, head: str, needles: list[tuple[float, str]], tail: str, references: list[str],
              answer: str, rng: random.Random, task: str) -> Case:
    """prefix + head + filler with `needles` (depth, text; the first is the target) + tail, exactly
    length - (tokens of `answer` + ANSWER_SLACK per reference) tokens."""
    max_new = len(encode(answer)) + ANSWER_SLACK * len(references)
    head_ids, tail_ids = encode(head), encode(tail)
    needle_ids = [encode(text) for _, text in needles]
    fixed = len(encode.prefix) + len(head_ids) + len(tail_ids) + sum(map(len, needle_ids)) + max_new
    budget = length - fixed
    if budget < 0:
        raise TooShort(f"{task} length {length} is too short for this tokenizer: its instruction, needles, "
                       f"question and answer alone take {fixed} tokens; use lengths of at least {fixed + 32}",
                       fixed + 32)
    pieces = filler_pieces(encode, budget, rng)
    boundaries = [0]
    for piece in pieces:
        boundaries.append(boundaries[-1] + len(piece))
    slots: dict[int, list[int]] = {}
    for index, (depth, _) in enumerate(needles):
        if not 0.0 <= depth <= 1.0:
            raise UserError(f"{task} depth {depth} is outside [0, 1]; use 0 (start) to 1 (end of the context)")
        slots.setdefault(_depth_cut(boundaries, depth, budget), []).append(index)
    context: list[int] = []
    target = (0, 0)
    start = len(encode.prefix) + len(head_ids)
    for cut in range(len(pieces) + 1):
        for index in slots.get(cut, []):
            if index == 0:
                target = (start + len(context), start + len(context) + len(needle_ids[0]))
            context += needle_ids[index]
        if cut < len(pieces):
            context += pieces[cut]
    prompt = encode.prefix + head_ids + context + tail_ids
    return Case(prompt, references, max_new, (start, start + len(context)), target)


def _niah(encode, length: int, depth: float, rng: random.Random, *, task: str, kind: str = "numbers",
          n_keys: int = 1, n_values: int = 1, n_queries: int = 1) -> Case:
    keys = _distinct(random_word, rng, n_keys)
    values = [_distinct(VALUE_KINDS[kind], rng, n_values, exclude=keys) for _ in keys]
    needles = [(depth, NIAH_NEEDLE.format(kind=kind, key=keys[0], value=values[0][0]))]
    for k, key in enumerate(keys):
        for v, value in enumerate(values[k]):
            if (k, v) != (0, 0):
                needles.append((rng.random(), NIAH_NEEDLE.format(kind=kind, key=key, value=value)))
    query = keys[0] if n_queries == 1 else ", ".join(keys[:n_queries - 1]) + ", and " + keys[n_queries - 1]
    references = [value for k in range(n_queries) for value in values[k]]
    asked = kind if len(references) > 1 else kind[:-1]  # "number" when one value is asked for, as RULER
    head = NIAH_TEMPLATE.format(kind=asked)
    question = NIAH_QUESTION.format(kind=asked, query=query)
    prefix = NIAH_ANSWER_PREFIX.format(kind=asked, query=query)
    if len(references) == 1:
        head = head.replace("Some", "A").replace("are", "is")
        question, prefix = question.replace("are all", "is"), prefix.replace(" are", " is")
    return _assemble(encode, length, head, needles, f"{question} {prefix}", references, ", ".join(references),
                     rng, task)


def _variable_name(rng: random.Random) -> str:
    return "".join(rng.choices(string.ascii_uppercase, k=5))


def _variable_tracking(encode, length: int, depth: float, rng: random.Random, *, task: str,
                       hops: int = VT_HOPS) -> Case:
    names = _distinct(_variable_name, rng, hops + 1)
    value = str(rng.randint(10000, 99999))
    later = sorted(depth + (1.0 - depth) * rng.random() for _ in range(hops))  # the chain keeps its order
    lines = [(depth, f"VAR {names[0]} = {value}.")]
    lines += [(d, f"VAR {names[i + 1]} = VAR {names[i]}.") for i, d in enumerate(later)]
    return _assemble(encode, length, VT_TEMPLATE, lines, VT_QUESTION.format(value=value, n=hops + 1), names,
                     " ".join(names), rng, task)


# ---------------------------------------------------------------- the registry

@dataclass(frozen=True)
class Task:
    name: str
    build: Callable  # (encode, length, depth, rng, task=name) -> Case
    score: Callable[[str, list[str]], float]  # (generated text, references) -> score in [0, 1]


def _passkey_build(encode, length: int, depth: float, rng: random.Random, *, task: str) -> Case:
    from train.recipe.passkey import passkey_case, random_key

    key = random_key(rng)
    prompt, answer = passkey_case(encode.tokenizer, length, depth, key, rng)
    return Case(prompt, [key], len(answer) + 2, (0, len(prompt)))


TASKS: dict[str, Task] = {task.name: task for task in [
    Task("passkey", _passkey_build, passkey_score),
    Task("niah_single", lambda *a, **k: _niah(*a, **k), string_match_all),
    Task("niah_single_word", lambda *a, **k: _niah(*a, kind="words", **k), string_match_all),
    Task("niah_single_uuid", lambda *a, **k: _niah(*a, kind="uuids", **k), string_match_all),
    Task("niah_multikey", lambda *a, **k: _niah(*a, n_keys=NIAH_NEEDLES, **k), string_match_all),
    Task("niah_multivalue", lambda *a, **k: _niah(*a, n_values=NIAH_NEEDLES, **k), string_match_all),
    Task("niah_multiquery", lambda *a, **k: _niah(*a, n_keys=NIAH_NEEDLES, n_queries=NIAH_NEEDLES, **k),
         string_match_all),
    Task("variable_tracking", _variable_tracking, string_match_all),
]}
DEFAULT_TASKS = ["passkey"]


def check_task_names(names, flag: str = "--tasks") -> list[str]:
    unknown = [name for name in names if name not in TASKS]
    if unknown:
        raise UserError(f"{flag}: unknown task {', '.join(map(repr, unknown))}; valid tasks: {', '.join(TASKS)}")
    if not names:
        raise UserError(f"{flag} needs at least one task; valid tasks: {', '.join(TASKS)}")
    return list(dict.fromkeys(names))  # repeats dropped, order kept


def build_case(tokenizer, task: str, length: int, depth: float, rng) -> Case:
    """One prompt of `task`; prompt + max_new_tokens is exactly `length` tokens."""
    rng = rng if isinstance(rng, random.Random) else random.Random(rng)
    return TASKS[task].build(encoder_for(tokenizer), length, depth, rng, task=task)


def check_task_lengths(tokenizer, tasks, lengths) -> None:
    """UserError (before any weights load) when the shortest length cannot hold a task's fixed parts, naming the
    task that needs the most. The random keys and values vary a little in token count, so a few seeded draws are
    tried (and the suggested minimum has 32 tokens of room)."""
    from train.evaluation.metrics import check_passkey_lengths

    if "passkey" in tasks:
        check_passkey_lengths(tokenizer, lengths)
    worst = None
    for task in tasks:
        for seed in range(4 if task != "passkey" else 0):
            try:
                build_case(tokenizer, task, min(lengths), 0.5, seed)
            except TooShort as error:
                worst = error if worst is None or error.minimum > worst.minimum else worst
    if worst is not None:
        raise worst


def _cases(tokenizer, task: str, lengths, depths, trials: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"length": length, "depth": depth, "case": build_case(tokenizer, task, length, depth, rng)}
            for length in lengths for depth in depths for _ in range(trials)]


@torch.no_grad()
def task_accuracy(model, tokenizer, task: str, *, lengths, depths, trials: int = 5, seed: int = 0,
                  batch_size: int = 8, split=None, progress=None) -> dict:
    """Greedy-decode every (length, depth, trial) prompt of `task` and score it with the task's scorer.

    Returns passkey_accuracy's shape: {"by_length_depth": {length: {depth: acc}}, "by_length": {length: acc},
    "accuracy": acc}, acc the mean score (partial credit for multi-value answers). `split`: decode over a
    sequence-parallel group and share the batches over the data-parallel groups (train.evaluation.split_eval), every
    rank calling with the same arguments. `progress`: a tqdm bar counting the prompts decoded."""
    from train.evaluation.metrics import _summarise, batched, decode_batches

    if task == "passkey":  # train.evaluation.metrics' own (its checks and messages)
        from train.evaluation.metrics import passkey_accuracy

        return passkey_accuracy(model, tokenizer, lengths=lengths, depths=depths, trials=trials, seed=seed,
                                batch_size=batch_size, split=split, progress=progress)
    cases = _cases(tokenizer, task, lengths, depths, trials, seed)
    batches = batched(cases, lambda c: (len(c["case"].prompt), c["case"].max_new_tokens), batch_size)
    decode_batches(model, tokenizer, batches, prompt=lambda c: c["case"].prompt,
                   new_tokens=lambda batch: batch[0]["case"].max_new_tokens,
                   score=lambda c, text: TASKS[task].score(text, c["case"].references), split=split,
                   progress=progress)
    return _summarise(cases, lengths, depths)


def planned_work(tasks, lengths, depths, trials: int) -> str:
    """The prompts an evaluation decodes, said before it starts: "3 tasks x 2 lengths x 5 depths x 5 trials = 150
    prompts"."""
    def count(n: int, what: str) -> str:
        return f"{n} {what}{'s' if n != 1 else ''}"

    total = len(tasks) * len(lengths) * len(depths) * trials
    return (f"{count(len(tasks), 'task')} x {count(len(lengths), 'length')} x {count(len(depths), 'depth')} x "
            f"{count(trials, 'trial')} = {count(total, 'prompt')}")


def evaluate_tasks(model, tokenizer, tasks, *, lengths, depths, trials: int = 5, progress: bool = False,
                   **kwargs) -> dict:
    """{task: task_accuracy(...)} in the order given. `progress`: a bar per task on stderr (prompts done / total
    and the time left, tqdm's), for the main process only."""
    from tqdm.auto import tqdm

    results = {}
    for index, task in enumerate(tasks, 1):
        label = f"{task} ({index}/{len(tasks)})" if len(tasks) > 1 else task
        with tqdm(desc=label, total=len(lengths) * len(depths) * trials, unit="prompt", file=sys.stderr,
                  dynamic_ncols=True, disable=not progress) as bar:
            results[task] = task_accuracy(model, tokenizer, task, lengths=lengths, depths=depths, trials=trials,
                                          progress=bar, **kwargs)
    return results
