"""train.recipe.data and train.recipe.passkey: loading, tokenizing, packing, collating, passkey prompts."""
import json

import datasets
import pandas as pd
import pytest
import torch

from train.errors import UserError
from train.pretrain_tiny import build_tokenizer
from train.recipe.data import Collator, DataWarning, build_train_dataset, load_text_dataset
from train.recipe.passkey import QUESTION, key_line, passkey_dataset, passkey_prompt

DOCS = ["The cat sat.", "A much longer second document, with commas.", "Third!"]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _enc(tok, text):
    return tok(text)["input_ids"]


# --- loading ------------------------------------------------------------------------------------

def _write(path, fmt, docs):
    if fmt in ("jsonl", "json"):
        with open(path, "w") as f:
            if fmt == "json":
                json.dump([{"text": d} for d in docs], f)
            else:
                f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    elif fmt == "parquet":
        pd.DataFrame({"text": docs}).to_parquet(path)
    elif fmt == "csv":
        pd.DataFrame({"text": docs}).to_csv(path, index=False)


@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet", "csv"])
def test_load_tabular_formats(tmp_path, fmt):
    path = tmp_path / f"data.{fmt}"
    _write(path, fmt, DOCS)
    ds = load_text_dataset(str(path))
    assert list(ds["text"]) == DOCS


def test_load_txt_is_one_document_per_file(tmp_path):
    (tmp_path / "book.txt").write_text("line one\nline two\n\nafter a blank line")
    ds = load_text_dataset(str(tmp_path / "book.txt"))
    assert len(ds) == 1 and "line two\n\nafter" in ds["text"][0]


def test_load_directory(tmp_path):
    for i, doc in enumerate(DOCS):
        _write(tmp_path / f"part{i}.jsonl", "jsonl", [doc])
    (tmp_path / "notes.md").write_text("ignored: not a data format")
    assert sorted(load_text_dataset(str(tmp_path))["text"]) == sorted(DOCS)


def test_load_errors(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_text_dataset(str(tmp_path / "missing.jsonl"))
    (tmp_path / "data.xml").write_text("<a/>")
    with pytest.raises(UserError, match="unsupported data file format"):
        load_text_dataset(str(tmp_path / "data.xml"))
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="empty|could not read"):
        load_text_dataset(str(tmp_path / "empty.jsonl"))
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(UserError, match="could not read"):
        load_text_dataset(str(tmp_path / "bad.jsonl"))
    (tmp_path / "emptydir").mkdir()
    with pytest.raises(UserError, match="has no"):
        load_text_dataset(str(tmp_path / "emptydir"))


@pytest.mark.parametrize("name,text,line,what", [
    ("bad.jsonl", '{"text": "a"}\n\n{"text": "b"}\n{"text": oops}\n{"text": "c"}\n', 4, "not valid JSON"),
    ("list.jsonl", '{"text": "a"}\n[1, 2]\n', 2, "not a JSON object"),
    ("bad.json", '[{"text": "a"},\n {"text": b}]\n', 2, "not valid JSON"),
    ("lines.json", '{"text": "a"}\n{"text": "b"\n', 2, "not valid JSON"),  # JSON lines named .json
])
def test_broken_json_names_the_file_and_line(tmp_path, name, text, line, what):
    (tmp_path / name).write_text(text)
    with pytest.raises(UserError) as raised:
        load_text_dataset(str(tmp_path / name))
    message = str(raised.value)
    assert f"{tmp_path / name}: line {line} is {what}" in message and "fix or remove that line" in message
    assert "DatasetGenerationError" not in message and "\n" not in message


@pytest.mark.parametrize("record,problem", [
    ('{"text": "tab\there"}', "Invalid control character at column 14"),  # a raw tab inside a string
    ('{"text": "cut off', "Unterminated string starting at column 10"),
    ('{"text": oops}', "Expecting value at column 10"),
])
def test_broken_json_line_says_what_and_where_in_words(tmp_path, record, problem):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n' + record + "\n")
    with pytest.raises(UserError) as raised:
        load_text_dataset(str(tmp_path / "bad.jsonl"))
    assert f"line 2 is not valid JSON ({problem}); fix or remove that line" in str(raised.value)


def test_broken_jsonl_in_a_directory_names_the_file(tmp_path):
    _write(tmp_path / "a.jsonl", "jsonl", DOCS)
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"text": "cut off\n')
    with pytest.raises(UserError, match=r"b\.jsonl: line 2 is not valid JSON"):
        load_text_dataset(str(tmp_path))


# A line saved as Latin-1 (é is the byte 0xe9) with two junk bytes: not UTF-8. pyarrow's json reader loads it and
# tokenizing failed later with a traceback; the text and csv readers failed without naming the line.
NOT_UTF8 = b"caf\xe9 \xff\xfe"


@pytest.mark.parametrize("name,content,line,column", [
    ("data.jsonl", b'{"text": "fine"}\n{"text": "' + NOT_UTF8 + b'"}\n{"text": "after"}\n', 2, 14),
    ("data.json", b'[{"text": "fine"},\n {"text": "' + NOT_UTF8 + b'"}]\n', 2, 15),
    ("book.txt", b"a first line\n\n" + NOT_UTF8 + b"\n", 3, 4),
    ("data.csv", b"text\nfine\n" + NOT_UTF8 + b"\n", 3, 4),
])
def test_text_that_is_not_utf8_names_the_file_and_line(tmp_path, name, content, line, column):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(UserError) as raised:
        load_text_dataset(str(tmp_path / name))
    assert str(raised.value) == (f"could not read {tmp_path / name}: line {line} is not UTF-8 text (byte 0xe9 at "
                                 f"column {column}; save the file as UTF-8); fix or remove that line")


def test_text_that_is_not_utf8_in_a_directory_names_the_file(tmp_path):
    _write(tmp_path / "a.jsonl", "jsonl", DOCS)
    (tmp_path / "b.jsonl").write_bytes('{"text": "naïve"}\n'.encode() + b'{"id": 1, "text": "' + NOT_UTF8 + b'"}\n')
    with pytest.raises(UserError, match=r"b\.jsonl: line 2 is not UTF-8 text \(byte 0xe9 at column 23;"):
        load_text_dataset(str(tmp_path))


def test_hub_names_go_to_load_dataset(monkeypatch):
    calls = []

    def fake_load_dataset(name, split):
        calls.append((name, split))
        if name == "org/missing":
            raise FileNotFoundError("Dataset 'org/missing' doesn't exist on the Hub\nmore details")
        return datasets.Dataset.from_dict({"text": DOCS})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    assert len(load_text_dataset("org/corpus", split="validation")) == 3
    with pytest.raises(UserError, match=r"could not load dataset 'org/missing'.*doesn't exist on the Hub\); check"):
        load_text_dataset("org/missing")
    assert calls == [("org/corpus", "validation"), ("org/missing", "train")]


def test_empty_dataset_error(tok):
    empty = datasets.Dataset.from_dict({"text": []})
    with pytest.raises(UserError, match="empty"):
        build_train_dataset(tok, empty, max_seq_len=16)


@pytest.mark.parametrize("packing", [True, False])
def test_all_empty_documents_are_refused(tok, packing):
    # Each empty document would still become BOS + EOS: a run that trains on nothing, without complaint.
    empty = datasets.Dataset.from_dict({"text": ["", "  \n", None] * 20})
    with pytest.raises(UserError, match=r"every document in dataset \(in memory\) has an empty 'text'.*--text_field"):
        build_train_dataset(tok, empty, max_seq_len=4, packing=packing)
    pairs = datasets.Dataset.from_dict({"q": ["Q: hi", "Q: yo"], "a": ["", " "]})
    with pytest.raises(UserError, match="empty 'a'.*--response_field"):
        build_train_dataset(tok, pairs, max_seq_len=16, prompt_field="q", response_field="a", packing=packing)
    some_empty = datasets.Dataset.from_dict({"text": ["", "words"]})  # only all-empty is an error
    assert len(build_train_dataset(tok, some_empty, max_seq_len=8, packing=packing)) > 0


def test_no_packing_says_once_how_many_documents_it_truncated(tok):
    docs = ["x" * 40, "short", "y" * 100]  # 42 and 102 tokens with BOS and EOS
    notes = []
    rows = build_train_dataset(tok, datasets.Dataset.from_dict({"text": docs}), max_seq_len=16, packing=False,
                               warn=notes.append)
    assert [len(ids) for ids in rows["input_ids"]] == [16, 7, 16]
    assert notes == ["--no_packing truncated 2 of 3 documents to --max_seq_len 16 tokens (longest 102; 112 tokens "
                     "dropped, never trained on); to keep them, pack (drop --no_packing) or raise --max_seq_len"]
    with pytest.warns(DataWarning, match="truncated 2 of 3 documents"):  # the default: a warning
        build_train_dataset(tok, datasets.Dataset.from_dict({"text": docs}), max_seq_len=16, packing=False)
    build_train_dataset(tok, datasets.Dataset.from_dict({"text": docs}), max_seq_len=102, packing=False,
                        warn=notes.append)
    assert len(notes) == 1  # nothing cut, nothing said


def test_wrong_text_field_names_the_columns(tok):
    ds = datasets.Dataset.from_dict({"content": DOCS, "id": [1, 2, 3]})
    with pytest.raises(UserError, match="it has content, id.*text: 'text'.*--text_field"):
        build_train_dataset(tok, ds, max_seq_len=16)
    with pytest.raises(UserError, match="column 'body' is not in .*available columns: content, id"):
        build_train_dataset(tok, ds, max_seq_len=16, text_field="body")


# --- packing ------------------------------------------------------------------------------------

def test_packing_exact_rows_positions_and_every_token(tok):
    docs = DOCS * 4 + ["x" * 70]  # the last document is longer than a row
    L = 32
    rows = build_train_dataset(tok, datasets.Dataset.from_dict({"text": docs}), max_seq_len=L)
    stream = [t for d in docs for t in _enc(tok, d) + [tok.eos_token_id]]
    assert len(rows) == len(stream) // L  # only the final partial row is dropped
    flat_ids = [t for r in rows["input_ids"] for t in r]
    assert flat_ids == stream[: len(flat_ids)]  # every token kept, in order
    assert all(len(r["input_ids"]) == len(r["labels"]) == len(r["position_ids"]) == L for r in rows)

    doc_starts, i = set(), 0  # stream indices where a document starts
    for d in docs:
        doc_starts.add(i)
        i += len(_enc(tok, d)) + 1
    for r, row in enumerate(rows):
        pos, labels = row["position_ids"], row["labels"]
        for j in range(L):
            g = r * L + j
            if g in doc_starts:
                assert pos[j] == 0 and labels[j] == -100  # restart; no target across the boundary
            else:
                assert labels[j] == row["input_ids"][j]
                # Positions count up within a document; a document continued from the previous row
                # restarts at 0 there too, so positions stay below max_seq_len.
                assert pos[j] == (pos[j - 1] + 1 if j > 0 else 0)
    eos_positions = [j for j, t in enumerate(flat_ids) if t == tok.eos_token_id]
    assert all(flat_ids[j + 1] == tok.bos_token_id for j in eos_positions if j + 1 < len(flat_ids))


def test_parallel_tokenization_matches_serial(tok):
    ds = datasets.Dataset.from_dict({"text": [f"Document {i}: " + "word " * (i % 7) for i in range(40)]})
    serial = build_train_dataset(tok, ds, max_seq_len=32)
    parallel = build_train_dataset(tok, ds, max_seq_len=32, num_proc=2)
    assert serial.to_dict() == parallel.to_dict()


def test_packing_too_little_data(tok):
    with pytest.raises(UserError, match="smaller --max_seq_len"):
        build_train_dataset(tok, datasets.Dataset.from_dict({"text": ["hi"]}), max_seq_len=64)


def test_packed_rows_collate_without_attention_mask(tok):
    rows = build_train_dataset(tok, datasets.Dataset.from_dict({"text": DOCS * 5}), max_seq_len=24)
    batch = Collator(tok.pad_token_id)([rows[0], rows[1]])
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert all(t.dtype == torch.long and t.shape == (2, 24) for t in batch.values())


# --- no packing + collator ----------------------------------------------------------------------

def test_no_packing_truncates_and_collator_pads(tok):
    with pytest.warns(DataWarning, match="truncated 1 of 3 documents"):
        rows = build_train_dataset(tok, datasets.Dataset.from_dict({"text": DOCS}), max_seq_len=20, packing=False)
    lengths = [len(r) for r in rows["input_ids"]]
    assert lengths == [min(20, len(_enc(tok, d)) + 1) for d in DOCS]
    assert rows[0]["input_ids"][-1] == tok.eos_token_id and rows[0]["labels"] == rows[0]["input_ids"]

    batch = Collator(tok.pad_token_id)(list(rows))
    assert batch["input_ids"].shape == (3, max(lengths))
    for i, n in enumerate(lengths):
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (max(lengths) - n)
        assert batch["labels"][i, n:].eq(-100).all() and batch["input_ids"][i, n:].eq(tok.pad_token_id).all()
        assert batch["position_ids"][i].tolist() == list(range(max(lengths)))


# --- prompt / response --------------------------------------------------------------------------

def test_prompt_response_masks_the_prompt(tok):
    ds = datasets.Dataset.from_dict({"q": ["Q: two plus two?", "Q: hi"], "a": [" A: four.", " A: hello"]})
    rows = build_train_dataset(tok, ds, max_seq_len=64, prompt_field="q", response_field="a", packing=False)
    for row, q, a in zip(rows, ds["q"], ds["a"]):
        p, r = _enc(tok, q), tok(a, add_special_tokens=False)["input_ids"]
        assert row["input_ids"] == p + r + [tok.eos_token_id]
        assert row["labels"] == [-100] * len(p) + r + [tok.eos_token_id]
    with pytest.raises(UserError, match="both"):
        build_train_dataset(tok, ds, max_seq_len=64, prompt_field="q")


# --- passkey ------------------------------------------------------------------------------------

@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_passkey_prompt_structure(tok, depth):
    length = 300
    prompt, answer = passkey_prompt(tok, length, depth, "48213", seed=7)
    assert len(prompt) == length and prompt[0] == tok.bos_token_id
    text = tok.decode(prompt, skip_special_tokens=True)
    assert text.endswith(QUESTION) and text.count(key_line("48213")) == 1
    assert tok.decode(answer) == " 48213"
    # The key line starts at the requested depth of the filler, to within one sentence.
    line = tok(" " + key_line("48213"), add_special_tokens=False)["input_ids"]
    start = next(i for i in range(len(prompt)) if prompt[i:i + len(line)] == line)
    question_len = len(tok(" " + QUESTION, add_special_tokens=False)["input_ids"])
    filler = length - 1 - len(line) - question_len
    assert abs((start - 1) - depth * filler) <= 50


def test_passkey_dataset_rows(tok):
    ds = passkey_dataset(tok, 4, 200, seed=1)
    assert len(ds) == 4 and len(set(map(tuple, ds["input_ids"]))) == 4
    for row in ds:
        assert len(row["input_ids"]) == len(row["labels"]) == 200 and row["position_ids"] == list(range(200))
        assert row["input_ids"][-1] == tok.eos_token_id  # a sample is a document: it ends with EOS
        text = tok.decode(row["input_ids"], skip_special_tokens=True)
        key = text.split("The pass key is ")[1][:5]
        assert text.endswith(QUESTION + " " + key)
        assert [t for t in row["labels"] if t != -100] == row["input_ids"][-7:]  # only " 12345" + EOS trained
    full = passkey_dataset(tok, 1, 200, seed=1, answer_only_loss=False)[0]
    assert full["labels"] == full["input_ids"] == ds[0]["input_ids"]
    built = build_train_dataset(tok, "passkey", max_seq_len=128, passkey_samples=3)
    assert len(built) == 3 and all(len(ids) == 128 for ids in built["input_ids"])


def test_passkey_too_short(tok):
    with pytest.raises(UserError, match="too short"):
        passkey_prompt(tok, 40, 0.5, "12345", 0)
