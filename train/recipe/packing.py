"""Whole samples packed into rows of exactly --max_seq_len tokens (chat, prompt_completion, alpaca).

A sample is never split over two rows: the second half of a conversation would train its answers without the
question. Rows are filled best fit decreasing (each sample, longest first, goes to the fullest row it still fits),
and what is left of a row is one padding document: pad tokens whose positions restart at 0, so they attend only to
each other, with no loss. As in text packing, each sample's positions restart at 0 and its first token is not a
target; no attention mask is needed, so rows of a batch keep their documents apart in stock transformers as in the
patch.
"""
from __future__ import annotations

import bisect

import datasets
import numpy as np


def best_fit(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sample indices per row: best fit decreasing over `lengths` (each <= capacity)."""
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[index]
        at = bisect.bisect_left(free, (n, -1))
        if at == len(free):
            rows.append([index])
            room, row = capacity - n, len(rows) - 1
        else:
            room, row = free.pop(at)
            rows[row].append(index)
            room -= n
        if room > 0:
            bisect.insort(free, (room, row))
    return rows


def pack_whole(samples: datasets.Dataset, max_seq_len: int, pad_id: int) -> datasets.Dataset:
    """Rows of input_ids, labels, position_ids of exactly max_seq_len tokens from samples no longer than that."""
    ids = [np.asarray(x, dtype=np.int64) for x in samples["input_ids"]]
    labels = [np.asarray(x, dtype=np.int64) for x in samples["labels"]]
    out = {"input_ids": [], "labels": [], "position_ids": []}
    for members in best_fit([len(x) for x in ids], max_seq_len):
        pieces = [(ids[i], labels[i]) for i in members]
        room = max_seq_len - sum(len(x) for x, _ in pieces)
        if room:
            pieces.append((np.full(room, pad_id, dtype=np.int64), np.full(room, -100, dtype=np.int64)))
        row_labels = [lab.copy() for _, lab in pieces]
        for lab in row_labels:
            lab[:1] = -100  # predicting a document's first token would read across the boundary
        out["input_ids"].append(np.concatenate([x for x, _ in pieces]))
        out["labels"].append(np.concatenate(row_labels))
        out["position_ids"].append(np.concatenate([np.arange(len(x)) for x, _ in pieces]))
    return datasets.Dataset.from_dict(out)
