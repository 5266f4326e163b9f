"""Synthetic passkey retrieval data (Landmark Attention / LongLoRA style).

A prompt is filler text with one key line hidden at a chosen depth, then the question:

    <filler> The pass key is 12345. Remember it. 12345 is the pass key. <filler>
    What is the pass key? The pass key is

and the answer is " 12345" (a training row then closes with EOS). Everything is built in token space
so that a prompt has an exact length: pieces (filler sentences, the key line, the question) are
tokenized separately, each with a leading space, and concatenated. The filler is varied natural-ish
sentences drawn from a small seeded grammar; it never contains digits, so the key is the only number
in the context.
"""
from __future__ import annotations

import random
import weakref

import datasets

from train.errors import UserError

QUESTION = "What is the pass key? The pass key is"
DEFAULT_KEY_DIGITS = 5


def key_line(key: str) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


# A tiny grammar for filler: enough variety that a small model cannot memorise positions, no digits
# (the key must be the only number), nothing that mentions a pass key, and no " is " (so that "is "
# followed by a digit, the pattern a small model learns to copy from, stays unambiguous).
_NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Felix", "Grace", "Hugo", "Iris", "Jack"]
_NOUNS = ["cat", "river", "house", "tree", "garden", "train", "book", "ship", "road", "bird",
          "window", "mountain", "lamp", "field", "bridge", "market"]
_ADJS = ["green", "quiet", "old", "bright", "small", "warm", "blue", "tall", "slow", "happy"]
_PLACES = ["village", "forest", "harbor", "station", "library", "valley", "kitchen", "city"]
_VERBS = ["walked", "looked", "waited", "sang", "rested", "worked", "wandered", "listened"]
_TIMES = ["in the morning", "at night", "after lunch", "before dawn", "every day", "in spring"]
_TEMPLATES = [
    "The {noun} looks {adj}.",
    "{name} {verb} near the {place} {time}.",
    "A {adj} {noun} stood by the {place}.",
    "{name} and {name2} saw a {adj} {noun}.",
    "The sky turns {adj} {time}.",
    "Here we go, to the {place} and back again.",
    "{name} likes the {adj} {noun} in the {place}.",
    "A {noun} sits behind the {noun2}.",
]


def _as_rng(seed) -> random.Random:
    return seed if isinstance(seed, random.Random) else random.Random(seed)


def filler_sentence(rng: random.Random) -> str:
    return rng.choice(_TEMPLATES).format(
        name=rng.choice(_NAMES), name2=rng.choice(_NAMES), noun=rng.choice(_NOUNS),
        noun2=rng.choice(_NOUNS), adj=rng.choice(_ADJS), place=rng.choice(_PLACES),
        verb=rng.choice(_VERBS), time=rng.choice(_TIMES))


def random_key(rng: random.Random, digits: int = DEFAULT_KEY_DIGITS) -> str:
    # No leading zero, so the key's digit count is unambiguous.
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


class PieceEncoder:
    """Tokenizes text pieces (with a leading space, no special tokens), caching repeats.

    The filler grammar repeats sentences often, so the cache makes building thousands of prompts cheap.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[str, list[int]] = {}
        # Start prompts the way the tokenizer starts any text, i.e. with BOS only if it adds one.
        probe = tokenizer("a", add_special_tokens=True)["input_ids"]
        bos = tokenizer.bos_token_id
        self.prefix = [bos] if bos is not None and probe and probe[0] == bos else []

    def __call__(self, text: str) -> list[int]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self.tokenizer(" " + text, add_special_tokens=False)["input_ids"]
            self._cache[text] = ids
        return ids


_ENCODERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def encoder_for(tokenizer) -> PieceEncoder:
    """One caching encoder per tokenizer object, shared by every function here."""
    try:
        encoder = _ENCODERS.get(tokenizer)
        if encoder is None:
            encoder = _ENCODERS[tokenizer] = PieceEncoder(tokenizer)
        return encoder
    except TypeError:  # not weak-referenceable: no sharing, still correct
        return PieceEncoder(tokenizer)


def filler_pieces(encode: PieceEncoder, n_tokens: int, rng: random.Random) -> list[list[int]]:
    """Whole filler sentences totalling exactly n_tokens (the last one cut to fit)."""
    pieces, total = [], 0
    while total < n_tokens:
        ids = encode(filler_sentence(rng))
        pieces.append(ids[: n_tokens - total])
        total += len(pieces[-1])
    return pieces


def _build_prompt(encode: PieceEncoder, length: int, depth: float, key: str, rng) -> list[int]:
    if not 0.0 <= depth <= 1.0:
        raise UserError(f"passkey depth {depth} is outside [0, 1]; use 0 (start) to 1 (end of the context)")
    key_ids, question_ids = encode(key_line(key)), encode(QUESTION)
    budget = length - len(encode.prefix) - len(key_ids) - len(question_ids)
    if budget < 0:
        raise UserError(f"passkey length {length} is too short: the key line and question alone take "
                        f"{length - budget} tokens; use a length of at least {length - budget + 16}")
    pieces = filler_pieces(encode, budget, rng)
    # Insert the key line at the sentence boundary nearest to the requested depth.
    boundaries, acc = [0], 0
    for p in pieces:
        acc += len(p)
        boundaries.append(acc)
    cut = min(range(len(boundaries)), key=lambda i: abs(boundaries[i] - depth * budget))
    before = [t for p in pieces[:cut] for t in p]
    after = [t for p in pieces[cut:] for t in p]
    return encode.prefix + before + key_ids + after + question_ids


def _eos(tokenizer) -> list[int]:
    # Every sample ends with EOS, like every document in train.recipe.data, so a model learns to stop after
    # the key instead of running on into more digits.
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def passkey_prompt(tokenizer, length: int, depth: float, key: str, seed) -> tuple[list[int], list[int]]:
    """(prompt ids of exactly `length` tokens ending in the question, answer ids " <key>").

    depth 0 puts the key line right after BOS, 1 right before the question. `seed` (int or
    random.Random) drives the filler.
    """
    encode = encoder_for(tokenizer)
    prompt = _build_prompt(encode, length, depth, str(key), _as_rng(seed))
    return prompt, encode(str(key))


def passkey_case(tokenizer, length: int, depth: float, key: str, seed) -> tuple[list[int], list[int]]:
    """(prompt, answer) sized like a training row: prompt + answer + EOS is exactly `length` tokens."""
    n_prompt = length - len(passkey_answer(tokenizer, key)) - len(_eos(tokenizer))
    return passkey_prompt(tokenizer, n_prompt, depth, key, seed)


def min_passkey_length(tokenizer, key_digits: int = DEFAULT_KEY_DIGITS) -> int:
    """Shortest sample (prompt + answer + EOS, no filler) for keys of key_digits digits."""
    encode, key = encoder_for(tokenizer), "9" * key_digits
    return (len(encode.prefix) + len(encode(key_line(key))) + len(encode(QUESTION)) + len(encode(key))
            + len(_eos(tokenizer)))


def passkey_answer(tokenizer, key: str) -> list[int]:
    """The answer ids that follow a prompt: " <key>"."""
    return encoder_for(tokenizer)(str(key))


def passkey_sample(tokenizer, length: int, seed, *, key_digits: int = DEFAULT_KEY_DIGITS) -> tuple[list[int], int]:
    """(ids, n_answer): prompt (random key at a random depth) + answer + EOS, exactly `length` tokens;
    the n_answer tokens before the EOS are the answer."""
    rng = _as_rng(seed)
    key = random_key(rng, key_digits)
    prompt, answer = passkey_case(tokenizer, length, rng.random(), key, rng)
    return prompt + answer + _eos(tokenizer), len(answer)


def passkey_dataset(tokenizer, n: int, length: int, seed: int, *, key_digits: int = DEFAULT_KEY_DIGITS,
                    answer_only_loss: bool = True) -> datasets.Dataset:
    """n training rows of exactly `length` tokens: a passkey prompt, its answer, EOS.

    Random keys and depths (uniform in [0, 1]). labels are the unshifted input_ids (the model shifts)
    with the prompt masked (-100), as for any prompt/response pair: only the answer and EOS are trained.
    answer_only_loss=False trains on every token instead; the answer is then ~0.5% of the loss at 1K
    tokens, and extending the tiny model this way needs several times more steps.
    """
    rng = random.Random(seed)
    n_eos = len(_eos(tokenizer))
    rows = {"input_ids": [], "labels": [], "position_ids": []}
    for _ in range(n):
        ids, n_answer = passkey_sample(tokenizer, length, rng, key_digits=key_digits)
        n_target = n_answer + n_eos
        labels = [-100] * (length - n_target) + ids[-n_target:] if answer_only_loss else list(ids)
        rows["input_ids"].append(ids)
        rows["labels"].append(labels)
        rows["position_ids"].append(list(range(length)))
    return datasets.Dataset.from_dict(rows)


def filler_document(tokenizer, length: int, seed) -> list[int]:
    """Exactly `length` tokens of filler (BOS if the tokenizer adds one, sentences, EOS); no key."""
    encode, eos = encoder_for(tokenizer), _eos(tokenizer)
    pieces = filler_pieces(encode, max(0, length - len(encode.prefix) - len(eos)), _as_rng(seed))
    return (encode.prefix + [t for p in pieces for t in p] + eos)[:length]
