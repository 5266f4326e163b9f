"""The long-context metrics: passkey retrieval accuracy and long-document perplexity, on a plain, a peft (LoRA) or a
bitsandbytes 4-bit model. Used by training (train.qlora's evaluation before / after) and by `python -m train.eval`."""
from __future__ import annotations

import contextlib
import math
import random

import torch

from train.errors import UserError
from train.recipe.passkey import DEFAULT_KEY_DIGITS, min_passkey_length, passkey_case, random_key

EVAL_SEED = 12345  # passkey prompts of a run's evaluation: disjoint from the training data's seed stream


@contextlib.contextmanager
def evaluation_mode(model):
    """model.eval() inside, the model's own train/eval mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def answer_is_correct(generated: str, key: str) -> bool:
    """Exact match of the answer: the greedy continuation starts with the key (after whitespace).

    What follows the key is not judged, as in LongLoRA / Landmark Attention, which generate exactly the
    answer's tokens; we generate a few more only so that tokenizers that split the key differently
    from the reference answer are not penalised."""
    return generated.lstrip().startswith(key)


def _sequence_split(split):
    """The split when it splits sequences (a sequence-parallel group), else None."""
    return split if split is not None and split.group is not None else None


def _greedy(model, batch: torch.Tensor, max_new_tokens: int, pad_token_id, split=None) -> torch.Tensor:
    """Greedy continuation of equal-length prompts [B, L] -> new tokens [B, max_new_tokens]; with a `split`
    (train.evaluation.split_eval.SplitEval) that has a sequence-parallel group, every rank of it decodes together, each
    holding a shard. Weights sharded over every rank (split.lockstep): generate's synced_gpus keeps the ranks' forwards
    in step."""
    if _sequence_split(split) is not None:
        from train.evaluation.split_eval import split_greedy

        return split_greedy(model, batch, max_new_tokens, split)
    out = model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=pad_token_id,
                         synced_gpus=None if split is None else split.lockstep)
    return out[:, batch.shape[1]:]


def batched(cases: list[dict], key, batch_size: int) -> list[list[dict]]:
    """The cases in batches of at most batch_size with equal key(case) (equal prompt lengths: no padding), in the
    order of the keys' first appearance."""
    groups: dict = {}
    for case in cases:
        groups.setdefault(key(case), []).append(case)
    return [group[i:i + batch_size] for group in groups.values() for i in range(0, len(group), batch_size)]


def decode_batches(model, tokenizer, batches: list[list[dict]], *, prompt, new_tokens, score, split=None,
                   progress=None) -> None:
    """Greedy-decode every batch (new_tokens(batch) tokens after each case's prompt(case)) and set each case's
    "correct" to score(case, generated text). With `split` the batches are shared out over its data-parallel groups
    (train.evaluation.split_eval.spread): the same batches, so the same answers, as one process. `progress` (a tqdm
    bar): its total set to the prompts this process decodes, advanced after each of its batches."""
    from train.evaluation.split_eval import spread

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if progress is not None:  # spread deals batch i to data-parallel group i % data_world
        mine = batches if split is None else batches[split.data_rank::split.data_world]
        progress.reset(total=sum(map(len, mine)))

    def run(batch: list[dict]) -> list:
        ids = torch.tensor([prompt(c) for c in batch], dtype=torch.long, device=_device(model))
        new = _greedy(model, ids, new_tokens(batch), pad_id, split)
        if progress is not None:
            progress.update(len(batch))
        return [score(c, tokenizer.decode(row, skip_special_tokens=True)) for c, row in zip(batch, new.tolist())]

    with evaluation_mode(model):
        results = spread(split, batches, run, "prompts", len)
    for batch, scores in zip(batches, results):
        for case, correct in zip(batch, scores):
            case["correct"] = correct


def _passkey_cases(tokenizer, lengths, depths, trials: int, seed: int, key_digits: int) -> list[dict]:
    """One prompt per (length, depth, trial), sized like a training row of `length` tokens (prompt +
    answer + EOS), so evaluating at the training length never positions a token beyond it."""
    rng = random.Random(seed)
    cases = []
    for length in lengths:
        for depth in depths:
            for _ in range(trials):
                key = random_key(rng, key_digits)
                prompt, answer = passkey_case(tokenizer, length, depth, key, rng)
                cases.append({"length": length, "depth": depth, "key": key, "prompt": prompt, "answer": answer})
    return cases


def check_passkey_lengths(tokenizer, lengths, key_digits: int = DEFAULT_KEY_DIGITS) -> None:
    shortest = min_passkey_length(tokenizer, key_digits)
    if min(lengths) < shortest:
        raise UserError(f"passkey length {min(lengths)} is too short for this tokenizer; use lengths of at least "
                        f"{shortest + 32} (the key line, question and answer alone take {shortest} tokens)")


@torch.no_grad()
def passkey_accuracy(model, tokenizer, *, lengths, depths, trials: int = 5, seed: int = 0,
                     batch_size: int = 8, key_digits: int = DEFAULT_KEY_DIGITS, split=None, progress=None) -> dict:
    """Greedy-decode the pass key for every (length, depth, trial); exact match.

    Returns {"by_length_depth": {length: {depth: acc}}, "by_length": {length: acc}, "accuracy": acc}.
    Prompts of equal token length are batched (no padding needed); batch_size bounds memory. `split`: decode over a
    sequence-parallel group and share the batches over the data-parallel groups (train.evaluation.split_eval), every
    rank calling with the same arguments. `progress`: a tqdm bar counting the prompts decoded (decode_batches).
    """
    check_passkey_lengths(tokenizer, lengths, key_digits)
    cases = _passkey_cases(tokenizer, lengths, depths, trials, seed, key_digits)
    # A few tokens beyond the answer so that a longer (wrong) number is caught.
    decode_batches(model, tokenizer, batched(cases, lambda c: len(c["prompt"]), batch_size),
                   prompt=lambda c: c["prompt"], new_tokens=lambda batch: max(len(c["answer"]) for c in batch) + 2,
                   score=lambda c, text: answer_is_correct(text, c["key"]), split=split, progress=progress)
    return _summarise(cases, lengths, depths)


def _summarise(cases: list[dict], lengths, depths) -> dict:
    def mean(xs):
        return sum(xs) / len(xs) if xs else 0.0

    by_length_depth = {
        length: {depth: mean([c["correct"] for c in cases if c["length"] == length and c["depth"] == depth])
                 for depth in depths}
        for length in lengths}
    by_length = {length: mean([c["correct"] for c in cases if c["length"] == length]) for length in lengths}
    return {"by_length_depth": by_length_depth, "by_length": by_length,
            "accuracy": mean([c["correct"] for c in cases])}


def _loss(model, x: torch.Tensor, labels: torch.Tensor, split=None) -> torch.Tensor:
    """The model's mean loss over the labelled targets; with `split` computed over a sequence-parallel group."""
    if _sequence_split(split) is not None:
        from train.evaluation.split_eval import split_loss

        return split_loss(model, x, split, labels)
    return model(input_ids=x, labels=labels).loss


@torch.no_grad()
def perplexity(model, tokenizer, texts, *, max_seq_len: int, split=None) -> float:
    """Token-weighted perplexity of held-out documents, each cut into non-overlapping chunks of at most
    max_seq_len tokens (every chunk is scored on its own, so this measures the model at that context).

    Uses the model's own loss (labels=input_ids) rather than logits, so it also works when a patch
    computes the loss chunk by chunk without materialising logits.
    """
    from train.evaluation.split_eval import spread

    chunks = [chunk for text in texts for chunk in _chunks(tokenizer(text)["input_ids"], max_seq_len)
              if len(chunk) >= 2]  # a single token: nothing to predict

    def nll(chunk: list[int]) -> float:
        x = torch.tensor([chunk], dtype=torch.long, device=_device(model))
        return _loss(model, x, x, split).float().item() * (len(chunk) - 1)  # the mean over len(chunk) - 1 targets

    with evaluation_mode(model):
        total_nll = sum(spread(split, chunks, nll))
    total_tokens = sum(len(chunk) - 1 for chunk in chunks)
    if total_tokens == 0:
        raise UserError("perplexity: the texts have no tokens to score; pass non-empty documents")
    return math.exp(total_nll / total_tokens)


def _chunks(ids: list[int], max_seq_len: int) -> list[list[int]]:
    return [ids[start:start + max_seq_len] for start in range(0, len(ids), max_seq_len)]


def position_buckets(max_seq_len: int, n_buckets: int) -> list[tuple[int, int]]:
    """n_buckets equal, fixed ranges [start, end) of positions in a chunk of max_seq_len tokens: with 8,
    [0, L/8), [L/8, L/4), ..., [7L/8, L) (edges rounded; empty ranges dropped)."""
    edges = [round(i * max_seq_len / n_buckets) for i in range(n_buckets + 1)]
    return [(start, end) for start, end in zip(edges, edges[1:]) if end > start]


@torch.no_grad()
def perplexity_by_position(model, tokenizer, texts, *, max_seq_len: int, n_buckets: int = 8, split=None) -> dict:
    """perplexity() broken down by where the predicted token sits in its chunk, so that a reader sees whether the
    model uses the far context (a model that does predicts late positions better than early ones).

    Returns {"perplexity", "nll", "tokens", "buckets": [{"start", "end", "tokens", "nll", "perplexity"}]}: nll the
    mean negative log-likelihood (nats) of the tokens at positions [start, end) of every chunk (position 0, the
    chunk's first token, is never predicted), perplexity its exp; the overall figures are perplexity()'s. Each
    bucket is one forward with the labels outside it masked (-100), so a model that only returns its loss (a
    chunked-loss patch) works too; that costs n_buckets forwards per chunk.
    """
    from train.evaluation.split_eval import spread

    buckets = position_buckets(max_seq_len, n_buckets)
    forwards = []  # (chunk, bucket, first, last): one forward scoring positions [first, last) of the chunk
    for text in texts:
        for chunk in _chunks(tokenizer(text)["input_ids"], max_seq_len):
            for b, (start, end) in enumerate(buckets):
                first, last = max(start, 1), min(end, len(chunk))
                if last > first:
                    forwards.append((chunk, b, first, last))

    def scored(forward) -> float:
        chunk, _, first, last = forward
        x = torch.tensor([chunk], dtype=torch.long, device=_device(model))
        labels = torch.full_like(x, -100)
        labels[:, first:last] = x[:, first:last]
        return _loss(model, x, labels, split).float().item() * (last - first)  # the mean over last - first targets

    sums, counts = [0.0] * len(buckets), [0] * len(buckets)
    with evaluation_mode(model):
        for (_, b, first, last), value in zip(forwards, spread(split, forwards, scored)):
            sums[b] += value
            counts[b] += last - first
    if sum(counts) == 0:
        raise UserError("perplexity: the texts have no tokens to score; pass non-empty documents")
    nll = sum(sums) / sum(counts)
    rows = [{"start": start, "end": end, "tokens": count, "nll": total / count if count else None,
             "perplexity": math.exp(total / count) if count else None}
            for (start, end), total, count in zip(buckets, sums, counts)]
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": sum(counts), "buckets": rows}


def format_perplexity(result: dict, max_seq_len: int) -> str:
    lines = [f"perplexity at {max_seq_len} tokens: {result['perplexity']:.3f}", "positions      |    nll | perplexity"]
    for row in result["buckets"]:
        if row["tokens"]:
            lines.append(f"[{row['start']:>5}, {row['end']:>5}) | {row['nll']:6.3f} | {row['perplexity']:10.3f}")
    return "\n".join(lines)


def format_table(result: dict, task: str = "passkey", total: bool = True) -> str:
    """A length x depth table of a task's accuracy (passkey_accuracy's / train.evaluation.tasks.task_accuracy's result),
    closed by a "<task> accuracy: X" line when `total`."""
    depths = list(next(iter(result["by_length_depth"].values())))
    names = [f"d={d:g}".rjust(4) for d in depths]
    header = "length | " + " | ".join(names) + " |  all"
    lines = [header, "-" * len(header)]
    for length, row in result["by_length_depth"].items():
        cells = " | ".join(f"{row[d]:.2f}".rjust(len(n)) for d, n in zip(depths, names))
        lines.append(f"{length:>6} | {cells} | {result['by_length'][length]:.2f}")
    if total:
        lines.append(f"{task} accuracy: {result['accuracy']:.3f}")
    return "\n".join(lines)
