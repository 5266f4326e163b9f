"""Long-context evaluation: passkey retrieval accuracy and long-document perplexity.

    python -m train.eval --adapter DIR                       # the model a train.qlora run trained, as it trained it
    python -m train.eval --model_name_or_path M [--rope_scaling yarn --rope_factor 4] [--bits 4]
        [--lengths 256 1024] [--depths 0 0.5 1] [--trials N] [--dataset FILE --text_field text]
        [--max_seq_len N] [--output_json F]

--adapter DIR reads the run's own files: its base model, RoPE scaling and bits from run_info.json (for
a directory without one, such as checkpoint-N, the base from peft's adapter_config.json), and, unless
given, the passkey settings of the run's own evaluation, so it reproduces eval.json's "after". Flags
override the run; one that contradicts it prints a warning line. RoPE flags are applied by
train.model's functions, exactly as training applies them. With neither --adapter nor a model named
it evaluates the tiny model shipped in train/assets/tiny-llama.
Both metrics work on a plain, a peft (LoRA) or a bitsandbytes 4-bit model.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from train.errors import UserError
from train.lifecycle import silence_library_noise
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


# ---------------------------------------------------------------- what to evaluate

@dataclass
class EvalModel:
    """The model to evaluate, settled before any weights are read."""

    model_name_or_path: str  # the base
    config: object  # RoPE scaling applied
    bits: int
    trust_remote_code: bool
    tokenizer_source: str
    run: object | None  # train.model.TrainedRun when --adapter is given


def plan_model(args: argparse.Namespace) -> EvalModel:
    """Base, RoPE scaling and bits: a run's own (--adapter), each replaced by its flag when given, with one
    warning line per flag that contradicts what the run was trained with. Cheap: configs only."""
    from train.model import load_config, read_run

    run = read_run(args.adapter, model_name_or_path=args.model_name_or_path) if args.adapter else None
    fill_passkey_defaults(args, run.info if run else None)
    if run is None:
        base, trust_remote_code = args.model_name_or_path or str(TINY_MODEL_DIR), False
        config = load_config(base, trust_remote_code)
    else:
        base, trust_remote_code, config = run.model_name_or_path, run.trust_remote_code, run.config
        if run.info is None:
            print(f"note: {args.adapter} has no run_info.json (not a finished train.qlora run), so the RoPE scaling "
                  f"and bits it was trained with are unknown: evaluating it on {base} with the base's own RoPE and "
                  "16-bit weights; pass --rope_scaling, --rope_factor and --bits as trained", file=sys.stderr)
    if args.rope_scaling or args.rope_factor:
        # From the base's own config, exactly as training scales it.
        config = load_config(base, trust_remote_code)
        _scale_rope(config, args, run)
    bits = args.bits or (run.bits if run else 16)
    if run is not None and run.info is not None:
        _warn_contradictions(run, base, config, bits)
    if run is not None:  # what load_run_model will load
        run.config, run.bits = config, bits
    args.model_name_or_path, args.bits = base, bits  # recorded in the output as evaluated
    adapter_tokenizer = args.adapter and (Path(args.adapter) / "tokenizer_config.json").is_file()
    return EvalModel(base, config, bits, trust_remote_code, args.adapter if adapter_tokenizer else base, run)


def fill_passkey_defaults(args: argparse.Namespace, info: dict | None) -> None:
    """Passkey settings not given as flags: those of the run's own evaluation when `info` (run_info.json)
    has them, so `--adapter DIR` alone reproduces the run's eval.json "after"; else the defaults."""
    from train.qlora import EVAL_SEED

    trained = (info or {}).get("args") or {}
    if "max_seq_len" in trained:
        defaults = {"lengths": trained.get("eval_lengths") or [trained["max_seq_len"]],
                    "depths": trained.get("eval_depths") or DEFAULT_DEPTHS,
                    "trials": trained.get("eval_trials") or 5, "seed": EVAL_SEED}
    else:
        defaults = {"lengths": [256, 1024], "depths": DEFAULT_DEPTHS, "trials": 5, "seed": 0}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _scale_rope(config, args: argparse.Namespace, run) -> None:
    """--rope_scaling / --rope_factor on the base config, through training's own set_rope_scaling."""
    from train.model import set_rope_scaling

    trained = (run.info or {}).get("rope_parameters") if run else None  # None: the run set no scaling
    kind = args.rope_scaling or (trained or {}).get("rope_type")
    if kind is None:
        raise UserError("--rope_factor needs --rope_scaling (linear, dynamic, yarn or llama3)")
    factor, original = args.rope_factor, getattr(config, "max_position_embeddings", None)
    if factor is None and original:
        # As training derives it from --max_seq_len: the longest evaluated length over the model's positions.
        if max(args.lengths) <= original:
            raise UserError(f"--rope_scaling {kind} without --rope_factor: the longest --lengths, {max(args.lengths)}, "
                            f"fits the model's {original} positions, so no factor can be derived; give --rope_factor")
        factor = max(args.lengths) / original
    if factor is not None and factor < 1:
        raise UserError(f"--rope_factor must be >= 1 (it stretches the positions), got {factor}")
    # No check that --lengths fit the stretched positions: evaluating past them is a legitimate extrapolation test.
    set_rope_scaling(config, kind, factor)


def _rope_text(params: dict | None) -> str:
    if not params or params.get("rope_type", "default") == "default":
        return "no RoPE scaling"
    factor = params.get("factor")
    return f"RoPE {params['rope_type']}" + (f" x{factor:g}" if factor else "")


def _same_model(a: str, b: str | None) -> bool:
    local = [Path(x).expanduser() for x in (a, b or "")]
    if all(path.exists() for path in local):
        return local[0].resolve() == local[1].resolve()
    return a == b


def _warn_contradictions(run, base: str, config, bits: int) -> None:
    """One warning line per flag that changes the model the run trained (run.config: the run's RoPE)."""
    from train.model import RUN_INFO_FILE

    source = Path(run.adapter_dir) / RUN_INFO_FILE
    lines = []
    if not _same_model(base, run.trained_base):
        lines.append(f"--model_name_or_path {base} replaces the base the run was trained on ({run.trained_base})")
    if (config.rope_parameters, getattr(config, "max_position_embeddings", None)) != \
            (run.config.rope_parameters, getattr(run.config, "max_position_embeddings", None)):
        lines.append(f"the RoPE flags give {_rope_text(config.rope_parameters)}, the run was trained with "
                     f"{_rope_text(run.config.rope_parameters)}")
    if bits != run.bits:
        lines.append(f"--bits {bits} loads the base unlike the run, which trained on {run.bits}-bit weights")
    for text in lines:
        print(f"warning: {text} (from {source}): this evaluates another model than the one trained", file=sys.stderr)


def load_for_eval(args: argparse.Namespace):
    """(model, tokenizer) that `args` name: for --adapter, the run's own model, loaded by train.model's code."""
    from train.model import load_tokenizer

    plan = plan_model(args)
    tokenizer = load_tokenizer(plan.tokenizer_source, plan.trust_remote_code)
    check_passkey_lengths(tokenizer, args.lengths)  # before paying for the weights
    return _load_weights(plan), tokenizer


def _load_weights(plan: EvalModel):
    from train.model import load_base, load_run_model

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if plan.run is not None:
        return load_run_model(plan.run, device)
    return load_base(plan.model_name_or_path, plan.config, bits=plan.bits, device=device,
                     trust_remote_code=plan.trust_remote_code)


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
    from train.model import ROPE_EXTRA

    p = argparse.ArgumentParser(prog="python -m train.eval", description="Passkey retrieval and long-document perplexity.")
    p.add_argument("--adapter", default=None,
                   help="output_dir of a train.qlora run (or a checkpoint-N): evaluates the model it trained, with the "
                   "base, RoPE scaling and bits it records; the flags below override them")
    p.add_argument("--model_name_or_path", default=None,
                   help="base model (default: the run's with --adapter, else the shipped tiny model)")
    p.add_argument("--rope_scaling", "--rope_type", dest="rope_scaling", default=None, choices=list(ROPE_EXTRA),
                   help="RoPE scaling, applied as train.qlora applies it (default: the run's, else none)")
    p.add_argument("--rope_factor", type=float, default=None,
                   help="RoPE scaling factor (default with --rope_scaling: the longest --lengths over the model's "
                   "positions, as training derives it from --max_seq_len)")
    p.add_argument("--bits", type=int, default=None, choices=[4, 8, 16],
                   help="base weights: 4 = NF4, 8 = int8, 16 = unquantised (default: the run's, else 16)")
    p.add_argument("--load_in_4bit", dest="bits", action="store_const", const=4, help="same as --bits 4")
    p.add_argument("--lengths", type=int, nargs="+", default=None,
                   help="passkey context lengths (default: the run's evaluation, else 256 1024)")
    p.add_argument("--depths", type=float, nargs="+", default=None,
                   help=f"passkey depths (default: the run's evaluation, else {' '.join(map(str, DEFAULT_DEPTHS))})")
    p.add_argument("--trials", type=int, default=None, help="trials per (length, depth) (default: the run's, else 5)")
    p.add_argument("--seed", type=int, default=None, help="prompt seed (default: the run's evaluation seed, else 0)")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--dataset", default=None, help="held-out documents for perplexity (local file/dir or hub name)")
    p.add_argument("--text_field", default="text")
    p.add_argument("--max_seq_len", type=int, default=None, help="perplexity context (default: the largest --lengths)")
    p.add_argument("--max_docs", type=int, default=100)
    p.add_argument("--output_json", default=None)
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict:
    if (args.trials is not None and args.trials < 1) or any(length < 1 for length in args.lengths or []):
        raise UserError("--trials and every --lengths value must be positive integers")
    model, tokenizer = load_for_eval(args)
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
    config = model.get_base_model().config if args.adapter else model.config
    result["rope_parameters"] = config.rope_parameters
    result["max_position_embeddings"] = getattr(config, "max_position_embeddings", None)
    result["args"] = vars(args)  # as resolved: the run's base, bits and passkey settings filled in
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result


def main(argv=None) -> int:
    silence_library_noise()  # before bitsandbytes is imported: it logs its noise at import
    try:
        run(parse_args(argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
