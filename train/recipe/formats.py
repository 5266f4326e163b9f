"""Dataset formats: which one a dataset is in, and each of its rows as text with the character spans the loss covers.

    text               {"text": "..."}                                          every token
    chat               {"messages": [{"role": "user", "content": ...}, ...]}    the assistant turns
    prompt_completion  {"prompt": "...", "completion": "..."}                   the completion
                       (or both lists of turns: TRL's conversational form)      (its assistant turns)
    alpaca             {"instruction": ..., "input": ... (optional), "output": ...}   the output

The format is found from the columns (FORMATS, first match) unless a flag names it: --prompt_field/--response_field
(prompt_completion on those columns), --dataset_format, or --text_field set to another column (text). Turns are
rendered by the tokenizer's chat template (train.recipe.chat); plain prompt and completion are joined as written,
with nothing between them; Alpaca rows take the Stanford Alpaca prompt. --train_on_prompt puts every token in the loss.
Nothing here imports torch or datasets: the command line checks a local file's first record with it before they load.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from train.errors import UserError


@dataclass(frozen=True)
class Format:
    name: str
    columns: tuple[str, ...]  # the columns it needs (detection looks for these)
    loss: str  # what the loss covers, as the run prints it
    optional: tuple[str, ...] = ()


FORMATS = (
    Format("chat", ("messages",), "the assistant turns"),
    Format("prompt_completion", ("prompt", "completion"), "the completion"),
    Format("alpaca", ("instruction", "output"), "the output", optional=("input",)),
    Format("text", ("text",), "every token"),
)
BY_NAME = {f.name: f for f in FORMATS}
FORMAT_CHOICES = ("auto", *BY_NAME)

# The Stanford Alpaca prompts (with and without an input), the text the format's models were trained on.
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                 "Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n"
                 "### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes "
                          "the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


@dataclass(frozen=True)
class Chosen:
    """A dataset's format, the column each of its parts is read from, and why it was chosen (printed)."""

    format: Format
    columns: dict  # part ("text", "messages", "prompt", ...) -> the dataset's column
    why: str
    conversational: bool = False  # prompt_completion as lists of turns
    present: tuple[str, ...] = field(default=())  # optional columns the dataset has

    @property
    def name(self) -> str:
        return self.format.name + (" (conversational)" if self.conversational else "")


def choose(columns: list[str], *, dataset_format: str = "auto", text_field: str = "text",
           prompt_field: str | None = None, response_field: str | None = None, source: str = "") -> Chosen:
    """The format of a dataset with these columns, as the flags and the columns decide; UserError when a column it
    needs is missing."""
    if prompt_field is not None or response_field is not None:
        if prompt_field is None or response_field is None:
            raise UserError("--prompt_field and --response_field go together: give both, or neither")
        chosen = Chosen(BY_NAME["prompt_completion"], {"prompt": prompt_field, "completion": response_field},
                        "--prompt_field/--response_field")
    elif dataset_format != "auto":
        fmt = BY_NAME[dataset_format]
        chosen = Chosen(fmt, {"text": text_field} if fmt.name == "text" else {c: c for c in fmt.columns},
                        f"--dataset_format {dataset_format}")
    elif text_field != "text":
        chosen = Chosen(BY_NAME["text"], {"text": text_field}, f"--text_field {text_field}")
    else:
        found = next((f for f in FORMATS if set(f.columns) <= set(columns)), None)
        if found is None:
            raise UserError(f"dataset {source} has none of the columns a format needs (it has {', '.join(columns)}): "
                            f"{'; '.join(f'{f.name}: {_needs(f)}' for f in FORMATS)}; name the text column with "
                            "--text_field, or the prompt and answer columns with --prompt_field/--response_field")
        chosen = Chosen(found, {c: c for c in found.columns},
                        f"detected from column{'s' if len(found.columns) > 1 else ''} {_needs(found)}")
    missing = [column for column in chosen.columns.values() if column not in columns]
    if missing:
        flag = ("--text_field" if chosen.format.name == "text" else "--prompt_field/--response_field"
                if prompt_field else "--dataset_format")
        raise UserError(f"column '{missing[0]}' is not in dataset {source}; available columns: {', '.join(columns)} "
                        f"(set {flag}, or --dataset_format to the format of the data)")
    present = tuple(c for c in chosen.format.optional if c in columns)
    return Chosen(chosen.format, chosen.columns, chosen.why, present=present)


def _needs(fmt: Format) -> str:
    return " + ".join(f"'{c}'" for c in fmt.columns)


# ---------------------------------------------------------------- what a column holds

def kind_of_value(value) -> str:
    """'text', 'turns' (a list), 'mapping' or 'scalar' (numbers, booleans, None) of one record's value."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, (list, tuple)):
        return "turns"
    return "mapping" if isinstance(value, dict) else "scalar"


def kind_of_feature(feature) -> str:
    """The same for a `datasets` feature (Value, List / Sequence / LargeList, a dict of features)."""
    if isinstance(feature, dict):
        return "mapping"
    if isinstance(feature, list) or type(feature).__name__ in ("List", "Sequence", "LargeList"):
        return "turns"
    dtype = getattr(feature, "dtype", "")
    return "text" if dtype in ("string", "large_string") else "scalar"


def check_kinds(chosen: Chosen, kinds: dict, source: str = "") -> Chosen:
    """`chosen` with conversational set, after checking that each column holds what its format reads (kinds: column
    -> kind_of_*); UserError in one line naming --dataset_format otherwise."""
    fmt = chosen.format.name

    def refuse(column: str, holds: str, wants: str) -> None:
        hint = ("pass --dataset_format chat (or leave --text_field out: the format is found from the columns)"
                if holds == "turns" and fmt == "text" else
                f"pass --dataset_format for the format the data is in ({', '.join(BY_NAME)})")
        raise UserError(f"column '{column}' of dataset {source} holds {_KIND_WORDS[holds]}, not {wants}: {hint}")

    if fmt == "chat":
        column = chosen.columns["messages"]
        if kinds[column] != "turns":
            refuse(column, kinds[column], "a list of {role, content} turns")
        return chosen
    if fmt == "prompt_completion":
        prompt, completion = chosen.columns["prompt"], chosen.columns["completion"]
        if kinds[prompt] == kinds[completion] == "turns":
            return Chosen(chosen.format, chosen.columns, chosen.why, conversational=True, present=chosen.present)
        for column in (prompt, completion):
            if kinds[column] not in ("text", "scalar"):
                refuse(column, kinds[column], "text (or, with the other column, lists of turns)")
        return chosen
    for column in [*chosen.columns.values(), *chosen.present]:
        if kinds[column] not in ("text", "scalar"):
            refuse(column, kinds[column], "text")
    return chosen


_KIND_WORDS = {"turns": "lists (chat turns?)", "mapping": "records (JSON objects)", "scalar": "numbers",
               "text": "text"}


# ---------------------------------------------------------------- rows as text + the spans the loss covers

def _text(value) -> str:
    return "" if value is None else str(value)  # empty CSV cells arrive as None


def plain_sample(chosen: Chosen, row: dict) -> tuple[str, int]:
    """(text, where the trained part starts) of a prompt_completion or alpaca row that is not made of turns."""
    if chosen.format.name == "alpaca":
        values = {part: _text(row.get(part)) for part in ("instruction", "input")}
        template = ALPACA_PROMPT if values["input"].strip() else ALPACA_PROMPT_NO_INPUT
        prompt, completion = template.format(**values), _text(row[chosen.columns["output"]])
    else:
        prompt, completion = _text(row[chosen.columns["prompt"]]), _text(row[chosen.columns["completion"]])
    return prompt + completion, len(prompt)


def turns_of(chosen: Chosen, row: dict) -> tuple[list, int]:
    """(the conversation, index of its first turn the loss may cover) of a chat or conversational row."""
    if chosen.format.name == "chat":
        return list(row[chosen.columns["messages"]]), 0
    prompt = list(row[chosen.columns["prompt"]])
    return prompt + list(row[chosen.columns["completion"]]), len(prompt)
