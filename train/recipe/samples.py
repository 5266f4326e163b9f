"""Rows of a format with a prompt (chat, prompt_completion, alpaca) tokenized, with labels on what the loss covers.

Each row becomes text and the character spans its loss covers (train.recipe.formats, train.recipe.chat); one
tokenization with the tokenizer's character offsets turns the spans into labels: a token is a target when its
characters overlap a span (as transformers' assistant masks place a span's tokens), every other label is -100.
Rendered conversations are tokenized without the tokenizer's own special tokens (the template writes BOS and the
end-of-turn tokens); plain prompt + completion text gets them and an EOS, which is trained.

Rows longer than --max_seq_len are dropped, never cut (a cut would train an answer without its question or stop in
its middle), and so are rows with nothing to train on (a conversation without an assistant turn, an empty
completion); `kept_rows` counts both for the run's data line.
"""
from __future__ import annotations

from dataclasses import dataclass

import datasets
import numpy as np
import pyarrow.compute as pc

from train.errors import UserError
from train.recipe.chat import assistant_spans
from train.recipe.formats import Chosen, plain_sample, turns_of


def _rendered(chosen: Chosen, row: dict, tokenizer, train_on_prompt: bool) -> tuple[str, list]:
    if chosen.format.name == "chat" or chosen.conversational:
        turns, first = turns_of(chosen, row)
        return assistant_spans(tokenizer, turns, first, everything=train_on_prompt)
    text, start = plain_sample(chosen, row)
    return text, [(0 if train_on_prompt else start, len(text))]


def _targets(offsets: np.ndarray, spans: list) -> np.ndarray:
    """[n] bool: tokens whose characters [start, end) overlap a span."""
    hit = np.zeros(len(offsets), dtype=bool)
    for start, end in spans:
        hit |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
    return hit


def _tokenize(batch, indices, *, tokenizer, chosen: Chosen, train_on_prompt: bool):
    templated = chosen.format.name == "chat" or chosen.conversational
    rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    texts, spans = [], []
    for index, row in zip(indices, rows):
        try:
            text, row_spans = _rendered(chosen, row, tokenizer, train_on_prompt)
        except UserError as error:
            raise UserError(f"row {index + 1}: {error}") from None
        texts.append(text)
        spans.append(row_spans)
    encoded = tokenizer(texts, add_special_tokens=not templated, return_offsets_mapping=True, verbose=False)
    out = {"input_ids": [], "labels": [], "targets": []}
    for ids, offsets, row_spans in zip(encoded["input_ids"], encoded["offset_mapping"], spans):
        ids = np.asarray(ids, dtype=np.int64)
        hit = _targets(np.asarray(offsets, dtype=np.int64).reshape(-1, 2), row_spans)
        if not templated:  # plain text closes with EOS, trained with the completion
            ids, hit = np.append(ids, tokenizer.eos_token_id), np.append(hit, bool(row_spans))
        out["input_ids"].append(ids)
        out["labels"].append(np.where(hit, ids, -100))
        out["targets"].append(int(hit.sum()))
    return out


@dataclass
class Kept:
    """What became of a dataset's rows (the run prints it)."""

    rows: int
    kept: int
    too_long: int
    longest: int
    nothing_to_train: int

    def text(self, max_seq_len: int) -> str:
        dropped = [f"{self.too_long:,} longer than --max_seq_len {max_seq_len} dropped (longest {self.longest:,} "
                   "tokens; raise --max_seq_len to keep them)" if self.too_long else "",
                   f"{self.nothing_to_train:,} with nothing to train on dropped (no assistant turn, or an empty answer)"
                   if self.nothing_to_train else ""]
        return f"{self.kept:,} of {self.rows:,} rows kept" + "".join(f"; {d}" for d in dropped if d)


def tokenize_samples(tokenizer, ds: datasets.Dataset, chosen: Chosen, *, train_on_prompt: bool, num_proc=None
                     ) -> datasets.Dataset:
    """Rows -> input_ids, labels and targets (the number of trained tokens)."""
    if not getattr(tokenizer, "is_fast", False):
        raise UserError(f"the {chosen.format.name} format needs a fast tokenizer (it places the loss by character "
                        "offsets), and this one is not; load the model's tokenizer.json (a fast tokenizer)")
    if tokenizer.eos_token_id is None and not (chosen.format.name == "chat" or chosen.conversational):
        raise UserError("the tokenizer has no eos_token; set one (a completion ends with EOS)")
    return ds.map(_tokenize, batched=True, with_indices=True, num_proc=num_proc, remove_columns=ds.column_names,
                  fn_kwargs={"tokenizer": tokenizer, "chosen": chosen, "train_on_prompt": train_on_prompt},
                  desc="tokenizing")


def kept_rows(tokenized: datasets.Dataset, max_seq_len: int) -> tuple[datasets.Dataset, Kept]:
    """The rows that fit --max_seq_len and train on something, and the counts of those that did not."""
    table = tokenized.with_format("arrow")
    lengths = pc.list_value_length(table["input_ids"]).to_numpy(zero_copy_only=False)
    targets = table["targets"].to_numpy(zero_copy_only=False)
    fits, trains = lengths <= max_seq_len, targets > 0
    keep = np.flatnonzero(fits & trains)
    kept = Kept(rows=len(tokenized), kept=len(keep), too_long=int((~fits).sum()),
                longest=int(lengths.max()) if len(lengths) else 0, nothing_to_train=int((fits & ~trains).sum()))
    return tokenized.select(keep).remove_columns("targets"), kept
