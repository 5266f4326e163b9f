"""Conversations rendered by the tokenizer's chat template, and where each assistant turn lies in the rendering.

Any template works; no `{% generation %}` markers are needed. The conversation is rendered whole, and for each
assistant turn i two more renderings find its span by their lengths: turns [0, i) with the generation prompt (where
the answer starts) and turns [0, i] (where it ends, less trailing whitespace: the loss covers the content and the
template's end-of-turn text, such as <|im_end|> or <|eot_id|>, not the newline between turns). Both must be
prefixes of the whole rendering; a template that renders earlier turns differently once later ones follow (one that
drops past reasoning, say) is refused, since the spans could not be placed.
"""
from __future__ import annotations

from pathlib import Path

from train.errors import UserError, one_line


class TemplateMismatch(UserError):
    """The template's rendering of a conversation's start is not the start of its whole rendering."""


def read_chat_template(path: str) -> str:
    """The Jinja text of --chat_template FILE; UserError when it cannot be read."""
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise UserError(f"cannot read --chat_template {path}: {getattr(error, 'strerror', None) or error}") from None
    if "{%" not in text and "{{" not in text:
        raise UserError(f"--chat_template {path} is not a Jinja chat template (no {{% ... %}} or {{{{ ... }}}}); give "
                        "the template's file, e.g. one saved from a tokenizer's chat_template")
    return text


def check_has_template(tokenizer, model: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UserError(f"the tokenizer of {model} has no chat template to render conversations with; give one with "
                        "--chat_template FILE (a Jinja template, e.g. the instruct model's)")


def render(tokenizer, turns: list, *, generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as error:  # jinja2's TemplateError, and whatever the template raises itself
        raise UserError(f"the chat template cannot render this conversation ({type(error).__name__}: "
                        f"{one_line(error)})") from None


def assistant_spans(tokenizer, turns: list, first: int = 0, everything: bool = False) -> tuple[str, list]:
    """(rendering, [(start, end) character spans of the assistant turns from turn `first` on]); with `everything`
    the whole rendering is one span (--train_on_prompt)."""
    _check_turns(turns)
    whole = render(tokenizer, turns)
    if everything:
        return whole, [(0, len(whole))]
    spans = []
    for i in range(first, len(turns)):
        if turns[i]["role"] != "assistant":
            continue
        start = len(_prefix(tokenizer, whole, turns[:i], True, i))
        end = len(_prefix(tokenizer, whole, turns[:i + 1], False, i).rstrip())
        if end > start:
            spans.append((start, end))
    return whole, spans


def _prefix(tokenizer, whole: str, turns: list, generation_prompt: bool, i: int) -> str:
    text = render(tokenizer, turns, generation_prompt=generation_prompt) if turns else ""
    if not whole.startswith(text):
        what = "with the generation prompt" if generation_prompt else "alone"
        raise TemplateMismatch(
            f"the chat template renders turns 1-{len(turns)} {what} differently from how it renders them at the start "
            f"of the whole conversation (assistant turn {i + 1}), so the answer's tokens cannot be located; use a "
            "template that renders each conversation's start the same whatever follows (--chat_template FILE), or "
            "--train_on_prompt")
    return text


def _check_turns(turns: list) -> None:
    if not turns:
        raise UserError("a conversation has no turns")
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
            raise UserError(f"a turn is not a {{\"role\": ..., \"content\": ...}} record (got {str(turn)[:80]})")
