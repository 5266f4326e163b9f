"""Training data: load it, tokenize in parallel by its format (train.recipe.formats: text, chat, prompt_completion,
alpaca), pack into fixed-length rows, collate batches.

Row format (every row, packed or not): input_ids, labels, position_ids, all of one length.
labels are UNSHIFTED copies of input_ids (the HF convention: the model shifts) with -100 where a token
is not a prediction target. In packed rows position_ids restart at 0 at each document start; both
transformers and our patch read a restart as "no attention across this boundary".
"""
from __future__ import annotations

import json
import logging
import os
import warnings
from collections.abc import Callable

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from train.errors import UserError, one_line
from train.recipe.chat import check_has_template
from train.recipe.data_files import BUILDER_KWARGS, local_files
from train.recipe.formats import Chosen, check_kinds, choose, kind_of_feature
from train.recipe.lifecycle import quieted
from train.recipe.packing import pack_whole
from train.recipe.samples import kept_rows, tokenize_samples

# Below this many documents, worker processes cost more than they save.
_MIN_DOCS_PER_PROC = 1000
_EMPTY_CHECK_ROWS = 10_000  # documents checked for text at a time (whitespace is trimmed on a copy)


class DataWarning(UserWarning):
    """Something about the data the user should know (e.g. documents truncated by --no_packing)."""


def load_text_dataset(source: str, *, split: str = "train") -> datasets.Dataset:
    """A local .json/.jsonl/.txt/.parquet/.csv file, a directory of such files, or a hub dataset name."""
    local = local_files(source)
    if local is None:
        return _load_from_hub(source, split)
    builder, files = local
    try:
        # Local files always land in the builder's "train" split, whatever `split` asks for.
        # the json and csv builders' own "Failed to load JSON from file ..." line: the UserError names the file and line
        with quieted(f"datasets.packaged_modules.{builder}.{builder}", logging.CRITICAL):
            ds = datasets.load_dataset(builder, data_files=files, split="train", **BUILDER_KWARGS.get(builder, {}))
    except Exception as e:  # datasets raises many types for unreadable files
        where = (_locate_json_error(files) if builder == "json" else
                 _locate_non_utf8(files) if builder in ("text", "csv") else None)  # (parquet is binary)
        if where:
            raise UserError(f"{where}; fix or remove that line") from None
        raise UserError(f"could not read {source} as {builder} ({type(e).__name__}: {one_line(e)}); "
                        "check that the file is valid") from None
    if builder == "json":
        _check_utf8(ds, files, source)
    return _non_empty(ds, source)


def _check_utf8(ds: datasets.Dataset, files: list[str], source: str) -> None:
    """UserError naming the file and line when the loaded text is not UTF-8. pyarrow's json reader keeps such bytes
    (the text and csv builders fail on them while loading), and they would only fail later, in the middle of
    tokenizing, as a traceback. One pass over the table in Arrow (~1 GB/s)."""
    try:
        ds.data.table.validate(full=True)
    except pa.ArrowInvalid:
        where = _locate_non_utf8(files)
        raise UserError(f"{where}; fix or remove that line" if where else
                        f"dataset {source} holds text that is not UTF-8; save its files as UTF-8") from None


def _locate_json_error(files: list[str]) -> str | None:
    """'could not read FILE: line N ...' for the first malformed record of a json/jsonl file, or None when the
    files parse (then the failure lies elsewhere, e.g. columns whose types differ between records).
    Only runs after `datasets` failed, so valid data is never parsed twice."""
    if where := _locate_non_utf8(files):
        return where  # (read below with errors="replace", such bytes would pass as valid JSON)
    for path in files:
        if path.lower().endswith(".json"):
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
            try:
                json.loads(text)
                continue  # one valid JSON document
            except json.JSONDecodeError as e:
                if not e.msg.startswith("Extra data"):  # else: JSON lines in a .json file, scan them below
                    return f"could not read {path}: line {e.lineno} is not valid JSON ({_json_problem(e)})"
        where = _first_bad_json_line(path)
        if where:
            return where
    return None


def _first_bad_json_line(path: str) -> str | None:
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue  # blank lines are skipped by the reader too
            try:
                record = json.loads(line.rstrip("\r\n"))  # a line cut short: "Unterminated string"
            except json.JSONDecodeError as e:
                return f"could not read {path}: line {number} is not valid JSON ({_json_problem(e)})"
            if not isinstance(record, dict):
                return (f"could not read {path}: line {number} is not a JSON object (got {type(record).__name__}; "
                        'each line must be one {"column": value, ...} record)')
    return None


def _locate_non_utf8(files: list[str]) -> str | None:
    """'could not read FILE: line N is not UTF-8 text (...)' for the first line of the files that is not UTF-8 (a file
    saved as Latin-1 or cp1252, binary junk), or None. Lines as an editor numbers them (a csv record may span several);
    the column counts characters."""
    for path in files:
        with open(path, "rb") as f:
            for number, line in enumerate(f, 1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as e:
                    column = len(line[:e.start].decode("utf-8")) + 1
                    return (f"could not read {path}: line {number} is not UTF-8 text (byte 0x{line[e.start]:02x} at "
                            f"column {column}; save the file as UTF-8)")
    return None


def _json_problem(error: json.JSONDecodeError) -> str:
    """"Invalid control character at column 22": json's message ends in "at" when it names a place, which its own
    str() then completes ("at: line 1 column 22 (char 21)")."""
    where = f"column {error.colno}"
    return f"{error.msg} {where}" if error.msg.endswith(" at") else f"{error.msg} at {where}"


def _load_from_hub(name: str, split: str) -> datasets.Dataset:
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # network, unknown name, unknown split...
        raise UserError(f"could not load dataset '{name}' split '{split}' from the hub "
                        f"({type(e).__name__}: {one_line(e)}); check the name, or pass a local file") from None
    return _non_empty(ds, name)


def _non_empty(ds: datasets.Dataset, source: str) -> datasets.Dataset:
    if len(ds) == 0:
        raise UserError(f"dataset {source} is empty; give it at least one document")
    return ds


def _encode(tokenizer, texts: list, add_special_tokens: bool) -> list[list[int]]:
    texts = ["" if t is None else str(t) for t in texts]  # empty CSV cells arrive as None
    # verbose=False: documents longer than the tokenizer's model_max_length are expected here.
    return tokenizer(texts, add_special_tokens=add_special_tokens, verbose=False)["input_ids"]


def _tokenize_text(batch, *, tokenizer, text_field):
    ids = [doc + [tokenizer.eos_token_id] for doc in _encode(tokenizer, batch[text_field], True)]
    return {"input_ids": ids, "labels": [list(x) for x in ids]}


def _default_num_proc(n_docs: int) -> int | None:
    if n_docs < 2 * _MIN_DOCS_PER_PROC:
        return None
    return max(1, min(os.cpu_count() or 1, 8, n_docs // _MIN_DOCS_PER_PROC))


def _check_not_all_empty(ds: datasets.Dataset, field: str, source, flag: str) -> None:
    """UserError when every value of a text column is empty or whitespace (a wrong column or an export
    gone wrong): such a dataset would train on nothing but BOS -> EOS. Computed in Arrow, no Python loop."""
    column = ds.with_format("arrow")[field]
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        return  # numbers etc. are stringified by _encode, never empty
    for start in range(0, len(column), _EMPTY_CHECK_ROWS):  # real data stops at the first slice
        if pc.max(pc.utf8_length(pc.utf8_trim_whitespace(column.slice(start, _EMPTY_CHECK_ROWS)))).as_py():
            return  # (a max of None means every value was null)
    raise UserError(f"every document in dataset {source} has an empty '{field}' ({len(ds)} rows): nothing to "
                    f"train on; point {flag} at the column that holds the text")


def choose_format(ds: datasets.Dataset, *, dataset_format: str = "auto", text_field: str = "text",
                  prompt_field: str | None = None, response_field: str | None = None, source: str = "") -> Chosen:
    """The dataset's format (train.recipe.formats), its columns checked for what the format reads."""
    chosen = choose(ds.column_names, dataset_format=dataset_format, text_field=text_field,
                    prompt_field=prompt_field, response_field=response_field, source=source)
    kinds = {name: kind_of_feature(feature) for name, feature in ds.features.items()}
    return check_kinds(chosen, kinds, source)


def tokenize_dataset(tokenizer, ds: datasets.Dataset, *, text_field="text", num_proc=None, source=""
                     ) -> datasets.Dataset:
    """Text documents -> rows of input_ids and labels (each document ends with EOS, every token trained)."""
    if tokenizer.eos_token_id is None:
        raise UserError("the tokenizer has no eos_token; set one (documents are separated by EOS)")
    _check_not_all_empty(ds, text_field, source, "--text_field")
    return ds.map(_tokenize_text, batched=True, num_proc=num_proc, remove_columns=ds.column_names,
                  fn_kwargs={"tokenizer": tokenizer, "text_field": text_field}, desc="tokenizing")


def _packed_rows(tokenized: datasets.Dataset, max_seq_len: int, batch_docs: int = 1000):
    """Yield packed rows; a buffer carries the remainder across batches so no token is lost between them."""
    buf_ids, buf_labels, buf_pos = (np.zeros(0, dtype=np.int64) for _ in range(3))
    for batch in tokenized.iter(batch_size=batch_docs):
        docs = [np.asarray(d, dtype=np.int64) for d in batch["input_ids"]]
        labels = [np.asarray(lab, dtype=np.int64).copy() for lab in batch["labels"]]
        for lab in labels:
            # The first token of a document is never a target: predicting it would mean predicting
            # across a document boundary (from the previous document's EOS).
            lab[:1] = -100
        pos = [np.arange(len(d), dtype=np.int64) for d in docs]
        buf_ids = np.concatenate([buf_ids, *docs])
        buf_labels = np.concatenate([buf_labels, *labels])
        buf_pos = np.concatenate([buf_pos, *pos])
        n_rows = len(buf_ids) // max_seq_len
        for r in range(n_rows):
            sl = slice(r * max_seq_len, (r + 1) * max_seq_len)
            yield {"input_ids": buf_ids[sl], "labels": buf_labels[sl], "position_ids": _restart_at_row(buf_pos[sl])}
        cut = n_rows * max_seq_len
        buf_ids, buf_labels, buf_pos = buf_ids[cut:], buf_labels[cut:], buf_pos[cut:]
    # The final partial row (< max_seq_len tokens) is dropped: padding it would waste a whole row of
    # compute on a sliver of data, and every other row is exactly max_seq_len.


def _restart_at_row(pos: np.ndarray) -> np.ndarray:
    """Positions of a document continued from the previous row restart at 0 too: positions then never
    exceed max_seq_len - 1 (the range the model is configured for), whatever the document's length."""
    starts = np.flatnonzero(pos == 0)
    n_continued = starts[0] if len(starts) else len(pos)  # tokens before this row's first document start
    out = pos.copy()
    out[:n_continued] -= pos[0]
    return out


def pack(tokenized: datasets.Dataset, max_seq_len: int) -> datasets.Dataset:
    rows = {"input_ids": [], "labels": [], "position_ids": []}
    for row in _packed_rows(tokenized, max_seq_len):
        for k in rows:
            rows[k].append(row[k])
    if not rows["input_ids"]:
        n_tokens = sum(len(x) for x in tokenized["input_ids"])
        raise UserError(f"the dataset has {n_tokens} tokens, fewer than one packed row of max_seq_len="
                        f"{max_seq_len}; use a smaller --max_seq_len, more data, or --no_packing")
    return datasets.Dataset.from_dict(rows)


def _truncate(batch, *, max_seq_len):
    ids = [x[:max_seq_len] for x in batch["input_ids"]]
    return {"input_ids": ids, "labels": [x[:max_seq_len] for x in batch["labels"]],
            "position_ids": [list(range(len(x))) for x in ids]}


def _warn(message: str) -> None:
    warnings.warn(message, DataWarning, stacklevel=3)


def truncation_note(tokenized: datasets.Dataset, max_seq_len: int) -> str | None:
    """What --no_packing's truncation drops, in one line (None when every document fits)."""
    lengths = pc.list_value_length(tokenized.with_format("arrow")["input_ids"])
    too_long = pc.greater(lengths, max_seq_len)
    n_long = pc.sum(too_long).as_py() or 0
    if not n_long:
        return None
    lost = pc.sum(pc.subtract(lengths, max_seq_len).filter(too_long)).as_py()
    return (f"--no_packing truncated {n_long} of {len(tokenized)} documents to --max_seq_len {max_seq_len} tokens "
            f"(longest {pc.max(lengths).as_py()}; {lost} tokens dropped, never trained on); to keep them, pack "
            "(drop --no_packing) or raise --max_seq_len")


def build_train_dataset(tokenizer, source: str | datasets.Dataset, *, max_seq_len: int, text_field: str = "text",
                        prompt_field: str | None = None, response_field: str | None = None,
                        dataset_format: str = "auto", train_on_prompt: bool = False, packing: bool = True,
                        num_proc: int | None = None, seed: int = 0, passkey_samples: int = 256,
                        passkey_answer_only: bool = True, warn: Callable[[str], None] | None = None,
                        report: Callable[[str], None] | None = None) -> datasets.Dataset:
    """Rows of input_ids, labels, position_ids ready for Collator.

    source "passkey" is the built-in synthetic passkey data (passkey_samples rows of max_seq_len tokens,
    loss on the answer only unless passkey_answer_only=False; see train.recipe.passkey.passkey_dataset);
    otherwise a Dataset or anything load_text_dataset accepts, in a format of train.recipe.formats (found from
    its columns unless the flags name it). Text: packing=True fills rows of exactly max_seq_len tokens with
    consecutive documents (a long one continues in the next row); packing=False keeps one document per row,
    truncated to max_seq_len (the collator pads); how many documents that cut short goes to `warn` (default: a
    DataWarning), once. The other formats keep each sample whole: one longer than max_seq_len is dropped (counted),
    and packing fills rows with whole samples (train.recipe.packing). `report` gets one line: the format, why,
    and what became of the rows.
    """
    if max_seq_len < 2:
        raise UserError(f"max_seq_len must be at least 2 (got {max_seq_len})")
    if isinstance(source, str) and source == "passkey":
        from train.recipe.passkey import passkey_dataset

        return passkey_dataset(tokenizer, passkey_samples, max_seq_len, seed, answer_only_loss=passkey_answer_only)
    name = source if isinstance(source, str) else "(in memory)"
    ds = load_text_dataset(source) if isinstance(source, str) else _non_empty(source, name)
    chosen = choose_format(ds, dataset_format=dataset_format, text_field=text_field, prompt_field=prompt_field,
                           response_field=response_field, source=name)
    num_proc = num_proc if num_proc is not None else _default_num_proc(len(ds))
    say = report or (lambda line: None)
    if chosen.format.name == "text":
        tokenized = tokenize_dataset(tokenizer, ds, text_field=chosen.columns["text"], num_proc=num_proc, source=name)
        say(f"data: text format ({chosen.why}), column '{chosen.columns['text']}'; {len(tokenized):,} documents; "
            f"the loss covers every token; " + ("packed into rows of --max_seq_len, a long document continuing in the "
                                                 "next row" if packing else "one document per row"))
        if packing:
            return pack(tokenized, max_seq_len)
        note = truncation_note(tokenized, max_seq_len)
        if note:
            (warn or _warn)(note)
        return tokenized.map(_truncate, batched=True, fn_kwargs={"max_seq_len": max_seq_len}, desc="truncating")
    return _samples(tokenizer, ds, chosen, name, max_seq_len=max_seq_len, packing=packing,
                    train_on_prompt=train_on_prompt, num_proc=num_proc, say=say)


def _samples(tokenizer, ds, chosen: Chosen, source: str, *, max_seq_len, packing, train_on_prompt, num_proc, say):
    """Rows of a format with a prompt: whole samples, dropped when longer than max_seq_len, packed whole or one per
    row."""
    if chosen.format.name == "chat" or chosen.conversational:
        check_has_template(tokenizer, getattr(tokenizer, "name_or_path", "") or "this model")
    elif chosen.format.name == "prompt_completion":
        _check_not_all_empty(ds, chosen.columns["completion"], source,
                             "--response_field" if chosen.why.startswith("--prompt") else "--dataset_format")
    tokenized, kept = kept_rows(tokenize_samples(tokenizer, ds, chosen, train_on_prompt=train_on_prompt,
                                                 num_proc=num_proc), max_seq_len)
    covers = "every token (--train_on_prompt)" if train_on_prompt else chosen.format.loss
    say(f"data: {chosen.name} format ({chosen.why}); {kept.text(max_seq_len)}; the loss covers {covers}; "
        + ("packed whole into rows of --max_seq_len" if packing else "one sample per row"))
    if not len(tokenized):
        raise UserError(f"no row of dataset {source} is left to train on ({kept.text(max_seq_len)})")
    if packing:
        return pack_whole(tokenized, max_seq_len, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
    return tokenized.map(_positions, batched=True, desc="positions")


def _positions(batch):
    return {"position_ids": [list(range(len(x))) for x in batch["input_ids"]]}


class Collator:
    """rows -> dict of torch.long tensors [B, L]: input_ids, labels, position_ids, and attention_mask
    only when rows differ in length (right padding; padded labels are -100).

    Equal-length rows (e.g. packed) get no attention_mask: document boundaries travel in position_ids.
    """

    def __init__(self, pad_token_id: int | None):
        # Padded positions are masked out of attention and loss, so the id itself does not matter;
        # 0 stands in for tokenizers without a pad token.
        self.pad_token_id = 0 if pad_token_id is None else pad_token_id

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        ids = [list(r["input_ids"]) for r in rows]
        labels = [list(r["labels"]) if r.get("labels") is not None else list(x) for r, x in zip(rows, ids)]
        pos = [list(r["position_ids"]) if r.get("position_ids") is not None else list(range(len(x)))
               for r, x in zip(rows, ids)]
        lengths = [len(x) for x in ids]
        width = max(lengths)
        batch = {
            "input_ids": _pad(ids, width, self.pad_token_id),
            "labels": _pad(labels, width, -100),
            "position_ids": torch.tensor([_pad_positions(p, width) for p in pos], dtype=torch.long),
        }
        if len(set(lengths)) > 1:
            batch["attention_mask"] = torch.tensor([[1] * n + [0] * (width - n) for n in lengths], dtype=torch.long)
        return batch


def _pad(rows: list[list[int]], width: int, value: int) -> torch.Tensor:
    return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=torch.long)


def _pad_positions(pos: list[int], width: int) -> list[int]:
    # Padding continues the row's positions instead of restarting at 0, which would read as the
    # start of another document.
    nxt = pos[-1] + 1 if pos else 0
    return pos + list(range(nxt, nxt + width - len(pos)))
