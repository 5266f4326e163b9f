"""Long-context evaluation: passkey retrieval accuracy and long-document perplexity.

    python -m train.eval --model_name_or_path M [--adapter DIR] [--rope_factor 4 --rope_type yarn] [--lengths 256 1024]
        [--depths 0 0.5 1] [--trials N] [--dataset FILE --text_field text] [--max_seq_len N]
        [--output_json F]

With no model named it evaluates the tiny model shipped in train/assets/tiny-llama.
Both metrics work on a plain, a peft (LoRA) or a bitsandbytes 4-bit model.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch

from train.errors import UserError
from train.passkey import DEFAULT_KEY_DIGITS, min_passkey_length, passkey_case, random_key

TINY_MODEL_DIR = Path(__file__).parent / "assets" / "tiny-llama"
DEFAULT_DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]


def _device(model) -> torch.device:
    return next(model.parameters()).device


def answer_is_correct(generated: str, key: str) -> bool:
    """Exact match of the answer: the greedy continuation starts with the key (after whitespace).

    What follows the key is not judged, as in LongLoRA / Landmark Attention, which generate exactly the
    answer's tokens; we generate a few more only so that tokenizers that split the key differently
    from the reference answer are not penalised."""
    return generated.lstrip().startswith(key)


def _greedy(model, batch: torch.Tensor, max_new_tokens: int, pad_token_id) -> torch.Tensor:
    """Greedy continuation of equal-length prompts [B, L] -> new tokens [B, max_new_tokens]."""
    out = model.generate(input_ids=batch, attention_mask=torch.ones_like(batch), do_sample=False,
                         max_new_tokens=max_new_tokens, pad_token_id=pad_token_id)
    return out[:, batch.shape[1]:]


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
                     batch_size: int = 8, key_digits: int = DEFAULT_KEY_DIGITS) -> dict:
    """Greedy-decode the pass key for every (length, depth, trial); exact match.

    Returns {"by_length_depth": {length: {depth: acc}}, "by_length": {length: acc}, "accuracy": acc}.
    Prompts of equal token length are batched (no padding needed); batch_size bounds memory.
    """
    check_passkey_lengths(tokenizer, lengths, key_digits)
    cases = _passkey_cases(tokenizer, lengths, depths, trials, seed, key_digits)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    was_training = model.training
    model.eval()
    try:
        by_len: dict[int, list[dict]] = {}
        for case in cases:
            by_len.setdefault(len(case["prompt"]), []).append(case)
        for group in by_len.values():
            for i in range(0, len(group), batch_size):
                chunk = group[i:i + batch_size]
                batch = torch.tensor([c["prompt"] for c in chunk], dtype=torch.long, device=_device(model))
                # A few tokens beyond the answer so that a longer (wrong) number is caught.
                new = _greedy(model, batch, max(len(c["answer"]) for c in chunk) + 2, pad_id)
                for c, ids in zip(chunk, new.tolist()):
                    c["correct"] = answer_is_correct(tokenizer.decode(ids, skip_special_tokens=True), c["key"])
    finally:
        model.train(was_training)
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


@torch.no_grad()
def perplexity(model, tokenizer, texts, *, max_seq_len: int) -> float:
    """Token-weighted perplexity of held-out documents, each cut into non-overlapping chunks of at most
    max_seq_len tokens (every chunk is scored on its own, so this measures the model at that context).

    Uses the model's own loss (labels=input_ids) rather than logits, so it also works when a patch
    computes the loss chunk by chunk without materialising logits.
    """
    total_nll, total_tokens = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        for text in texts:
            ids = tokenizer(text)["input_ids"]
            for start in range(0, len(ids), max_seq_len):
                chunk = ids[start:start + max_seq_len]
                if len(chunk) < 2:  # nothing to predict
                    continue
                x = torch.tensor([chunk], dtype=torch.long, device=_device(model))
                loss = model(input_ids=x, labels=x).loss  # mean over len(chunk) - 1 predictions
                total_nll += loss.float().item() * (len(chunk) - 1)
                total_tokens += len(chunk) - 1
    finally:
        model.train(was_training)
    if total_tokens == 0:
        raise UserError("perplexity: the texts have no tokens to score; pass non-empty documents")
    return math.exp(total_nll / total_tokens)


def with_rope_scaling(config, factor: float, rope_type: str = "linear"):
    """Scale a RoPE model's context by `factor` (the same change the trainer makes when extending it)."""
    original = config.max_position_embeddings
    params = {**(config.rope_parameters or {}), "rope_type": rope_type, "factor": float(factor)}
    if rope_type != "linear":  # yarn / dynamic need the length the model was trained at
        params["original_max_position_embeddings"] = original
    config.rope_parameters = params
    config.max_position_embeddings = int(original * factor)
    return config


def load_for_eval(model_name_or_path: str, *, adapter: str | None = None, rope_factor: float | None = None,
                  rope_type: str = "linear", load_in_4bit: bool = False):
    """(model, tokenizer) for evaluation: optional RoPE scaling, 4-bit base, LoRA adapter.

    An adapter does not record the RoPE scaling it was trained with: pass the same factor and type."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = load_tokenizer(model_name_or_path, adapter)
    try:
        config = AutoConfig.from_pretrained(model_name_or_path)
    except (OSError, ValueError) as e:
        raise UserError(f"could not load model '{model_name_or_path}' ({_first_line(e)}); pass a local model "
                        "directory or a hub model name") from None
    if rope_factor:
        with_rope_scaling(config, rope_factor, rope_type)
    use_cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if use_cuda else torch.float32
    kwargs = {"config": config, "dtype": dtype}
    if load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                           bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(model_name_or_path, **kwargs)
    if use_cuda and not load_in_4bit:
        model = model.cuda()
    if adapter:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, adapter)
        except (OSError, ValueError) as e:
            raise UserError(f"could not load the LoRA adapter from '{adapter}' ({_first_line(e)}); pass the output "
                            "directory of a train.qlora run") from None
    return model, tokenizer


def load_tokenizer(model_name_or_path: str, adapter: str | None = None):
    """The adapter directory's tokenizer if it saved one, else the base model's."""
    from transformers import AutoTokenizer

    if _looks_local(model_name_or_path) and not Path(model_name_or_path).exists():
        raise UserError(f"model directory {model_name_or_path} does not exist; check the path or pass a hub model name")
    source = adapter if adapter and _has_tokenizer(adapter) else model_name_or_path
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise UserError(f"could not load a tokenizer from '{source}' ({_first_line(e)}); pass a local model "
                        "directory or a hub model name") from None


def _looks_local(name: str) -> bool:
    return name.startswith((".", "/", "~")) or Path(name).exists()


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _has_tokenizer(path: str) -> bool:
    return (Path(path) / "tokenizer_config.json").is_file()


def format_table(result: dict) -> str:
    depths = list(next(iter(result["by_length_depth"].values())))
    names = [f"d={d:g}".rjust(4) for d in depths]
    header = "length | " + " | ".join(names) + " |  all"
    lines = [header, "-" * len(header)]
    for length, row in result["by_length_depth"].items():
        cells = " | ".join(f"{row[d]:.2f}".rjust(len(n)) for d, n in zip(depths, names))
        lines.append(f"{length:>6} | {cells} | {result['by_length'][length]:.2f}")
    lines.append(f"passkey accuracy: {result['accuracy']:.3f}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m train.eval", description="Passkey retrieval and long-document perplexity.")
    p.add_argument("--model_name_or_path", default=str(TINY_MODEL_DIR))
    p.add_argument("--adapter", default=None, help="LoRA adapter directory (a train.qlora output_dir)")
    p.add_argument("--rope_factor", type=float, default=None, help="RoPE scaling factor the adapter was trained with")
    p.add_argument("--rope_type", default="linear", choices=["linear", "yarn", "dynamic"])
    p.add_argument("--load_in_4bit", action="store_true")
    p.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--depths", type=float, nargs="+", default=DEFAULT_DEPTHS)
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--dataset", default=None, help="held-out documents for perplexity (local file/dir or hub name)")
    p.add_argument("--text_field", default="text")
    p.add_argument("--max_seq_len", type=int, default=None, help="perplexity context (default: the largest --lengths)")
    p.add_argument("--max_docs", type=int, default=100)
    p.add_argument("--output_json", default=None)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    if args.trials < 1 or any(length < 1 for length in args.lengths):
        raise UserError("--trials and every --lengths value must be positive integers")
    # Check the lengths against the tokenizer before paying for loading the model.
    check_passkey_lengths(load_tokenizer(args.model_name_or_path, args.adapter), args.lengths)
    model, tokenizer = load_for_eval(args.model_name_or_path, adapter=args.adapter,
                                     rope_factor=args.rope_factor, rope_type=args.rope_type,
                                     load_in_4bit=args.load_in_4bit)
    result = passkey_accuracy(model, tokenizer, lengths=args.lengths, depths=args.depths,
                              trials=args.trials, seed=args.seed, batch_size=args.batch_size)
    print(format_table(result))
    if args.dataset:
        from train.data import load_text_dataset

        ds = load_text_dataset(args.dataset)
        if args.text_field not in ds.column_names:
            raise UserError(f"--text_field '{args.text_field}' is not a column of {args.dataset}; "
                            f"available: {', '.join(ds.column_names)}")
        texts = list(ds.select(range(min(len(ds), args.max_docs)))[args.text_field])
        max_seq_len = args.max_seq_len or max(args.lengths)
        result["perplexity"] = perplexity(model, tokenizer, texts, max_seq_len=max_seq_len)
        result["perplexity_max_seq_len"] = max_seq_len
        print(f"perplexity at {max_seq_len} tokens: {result['perplexity']:.3f}")
    result["args"] = vars(args)
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def main(argv=None) -> int:
    try:
        run(parse_args(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
