"""Build the tiny Llama shipped in train/assets/tiny-llama (offline, deterministic, CPU).

    python -m train.pretrain_tiny --output_dir train/assets/tiny-llama

It makes a character-level tokenizer, a small LlamaConfig whose max_position_embeddings is the short
pretraining context, and pretrains from scratch on generated text at that context: rows packed with
passkey samples (train.recipe.passkey: filler sentences, a key line, the question, the answer) and some plain
filler. The loss is on every token, with the key digits that can be copied from earlier weighted up:
they are the only tokens that need retrieval (an induction-style copy). About 8 minutes on one core.
The trainer's default run then extends this model to a several-times-longer context with RoPE scaling.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import string
import sys
import time

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from train.evaluation.metrics import evaluation_mode, passkey_accuracy
from train.recipe.passkey import filler_document, min_passkey_length, passkey_dataset, passkey_sample

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
CHARACTERS = string.digits + string.ascii_letters + string.punctuation + " \n"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character; BOS is prepended on encode (as Llama does), EOS is not."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS.values())}
    for ch in CHARACTERS:
        vocab[ch] = len(vocab)
    # A BPE model without merges and without a pre-tokenizer splits text into single characters;
    # Fuse joins them back on decode without inserting spaces.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.decoder = decoders.Fuse()
    bos = SPECIAL_TOKENS["bos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])])
    tok.add_special_tokens(list(SPECIAL_TOKENS.values()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


def build_config(tokenizer, args) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)


def packed_row(tokenizer, length: int, rng: random.Random, filler_fraction: float) -> tuple[list, list, list, list]:
    """One row of exactly `length` tokens: passkey samples (each document replaced by plain filler with
    probability filler_fraction), either one document filling the row or, half the time when there
    is room, a short one followed by the rest.

    Packing short passkey documents gives more answers per token and short key-to-question distances,
    which is what lets the retrieval (induction) circuit form within a CPU budget. position_ids
    restart per document (transformers reads that as separate sequences), and the first token of each
    document is not a target (nothing before it in the row may predict it). The fourth list flags the
    tokens that need retrieval (for the loss weight).
    """
    min_len = min_passkey_length(tokenizer) + 8
    digit_ids = set(tokenizer.convert_tokens_to_ids(list(string.digits)))
    ids, labels, pos, is_retrieval = [], [], [], []
    while len(ids) < length:
        remaining = length - len(ids)
        split = remaining >= 2 * min_len and rng.random() < 0.5
        n = rng.randint(min_len, remaining - min_len) if split else remaining
        flags = [0] * n
        if n < min_len or rng.random() < filler_fraction:
            doc = filler_document(tokenizer, n, rng)
        else:
            doc, _ = passkey_sample(tokenizer, n, rng)
            flags = _retrieval_flags(doc, digit_ids)
        ids += doc
        labels += [-100] + doc[1:]
        pos += list(range(n))
        is_retrieval += flags
    return ids, labels, pos, is_retrieval


def _retrieval_flags(doc: list[int], digit_ids: set[int]) -> list[int]:
    """1 on key digits that can be copied from earlier in the document: the key's second mention in
    the key line (a short-range copy) and the answer (the long-range one). The first mention is random,
    so it is not flagged. Filler has no digits, so digits are exactly the key's three mentions."""
    digits = [i for i, t in enumerate(doc) if t in digit_ids]
    flags = [0] * len(doc)
    for i in digits[len(digits) // 3:]:
        flags[i] = 1
    return flags


def training_batch(tokenizer, args, step: int) -> dict[str, torch.Tensor]:
    """A fresh batch for this step (seeded by step, so the run is reproducible and never repeats data)."""
    rng = random.Random(args.seed * 1_000_003 + step)
    rows = [packed_row(tokenizer, args.seq_len, rng, args.filler_fraction) for _ in range(args.batch_size)]
    ids, labels, pos, is_retrieval = (torch.tensor([r[i] for r in rows], dtype=torch.long) for i in range(4))
    return {"input_ids": ids, "labels": labels, "position_ids": pos, "is_retrieval": is_retrieval}


def weighted_loss(model, batch: dict, answer_weight: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted loss to optimise, plain mean token loss to report). Every token is trained on; the key
    digits that can be copied from earlier weigh answer_weight times more, because they are ~4% of
    tokens yet the only ones that need retrieval: without the weight the copy (induction) circuit
    forms far too slowly for a CPU budget."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[:, :-1]  # [B, L-1, V]
    labels = batch["labels"][:, 1:]
    nll = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")  # [B, L-1]
    scored = (labels != -100).float()
    weight = scored * (1 + (answer_weight - 1) * batch["is_retrieval"][:, 1:].float())
    return (nll * weight).sum() / weight.sum(), (nll * scored).sum() / scored.sum()


@torch.no_grad()
def quick_passkey_accuracy(model, tokenizer, length: int, n: int, seed: int) -> tuple[float, float]:
    """(exact match, answer-token accuracy), teacher-forced. Exact match this way equals greedy-decoding
    exact match (the greedy answer is right iff every answer token is the argmax given the right
    prefix) and costs one batched forward pass. For progress reports; the final number uses train.eval."""
    ds = passkey_dataset(tokenizer, n, length, seed, answer_only_loss=True)
    ids, labels = torch.tensor(list(ds["input_ids"])), torch.tensor(list(ds["labels"]))
    with evaluation_mode(model):
        pred = model(input_ids=ids).logits[:, :-1].argmax(-1)
    target, scored = labels[:, 1:], labels[:, 1:] != -100
    scored[:, -1] = False  # the closing EOS: greedy exact match judges the key only
    hit = pred == target
    return (hit | ~scored).all(-1).float().mean().item(), hit[scored].float().mean().item()


def lr_at(step: int, args) -> float:
    """Linear warmup then cosine decay to 10% of the peak."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def pretrain(model, tokenizer, args) -> list[dict]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    history, start = [], time.time()
    model.train()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        loss, plain_loss = weighted_loss(model, training_batch(tokenizer, args, step), args.answer_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            # Evaluation seeds are disjoint from training seeds (negative).
            accuracy, token_acc = quick_passkey_accuracy(model, tokenizer, args.seq_len, 64, -1 - step)
            history.append({"step": step + 1, "loss": round(plain_loss.item(), 4), "passkey_acc": accuracy,
                            "answer_token_acc": round(token_acc, 3),
                            "elapsed_s": round(time.time() - start, 1)})
            print(json.dumps(history[-1]), flush=True)
    return history


def write_readme(output_dir: str, metadata: dict) -> None:
    with open(os.path.join(output_dir, "pretrain_metadata.json"), "w") as f:
        json.dump(metadata, f, indent=2)
    cfg = metadata["config"]
    text = f"""# tiny-llama (generated, not downloaded)

A {cfg['num_hidden_layers']}-layer, hidden {cfg['hidden_size']} Llama ({metadata['parameters']:,} parameters, fp32)
with a character-level tokenizer, pretrained from scratch at a {metadata['pretrain_seq_len']}-token context on
synthetic filler text and passkey-retrieval samples (`train/recipe/passkey.py`). It exists so that
`python -m train.qlora` has an offline default: extend this model to a longer context with RoPE scaling.

- command: `{metadata['command']}`
- seed: {metadata['seed']}, steps: {metadata['steps_run']}, wall time: {metadata['wall_time_s']:.0f} s on {metadata['threads']} CPU threads
- passkey accuracy at {metadata['pretrain_seq_len']} tokens (greedy, exact match): {metadata['passkey_accuracy']:.3f}

Details and the training curve are in `pretrain_metadata.json`.
"""
    with open(os.path.join(output_dir, "README.md"), "w") as f:
        f.write(text)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output_dir", default="train/assets/tiny-llama")
    p.add_argument("--seq_len", type=int, default=256, help="pretraining context = max_position_embeddings")
    p.add_argument("--hidden_size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2, help="2 is the fewest that can form an induction (copy) circuit")
    p.add_argument("--heads", type=int, default=8, help="8 heads learn the copy far faster than 4")
    p.add_argument("--kv_heads", type=int, default=8, help="fewer than --heads = grouped-query attention")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--filler_fraction", type=float, default=0.1, help="share of documents with no passkey")
    p.add_argument("--lr", type=float, default=1e-3, help="3e-3 plateaus far below 1.0 accuracy")
    p.add_argument("--answer_weight", type=float, default=20.0, help="loss weight of the copyable key digits")
    p.add_argument("--warmup_steps", type=int, default=100)
    p.add_argument("--eval_every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="1 is fastest on a shared CPU (threads spin-wait)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    tokenizer = build_tokenizer()
    model = LlamaForCausalLM(build_config(tokenizer, args))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tiny llama: {n_params:,} parameters, vocab {len(tokenizer)}, context {args.seq_len}", flush=True)

    start = time.time()
    history = pretrain(model, tokenizer, args)
    wall = time.time() - start

    # Save before the final evaluation so a failure there never loses the trained weights.
    os.makedirs(args.output_dir, exist_ok=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(args.output_dir, safe_serialization=True)
    tokenizer.save_pretrained(args.output_dir)
    # The weights file is written owner-only; shipped assets must be readable by everyone.
    os.chmod(os.path.join(args.output_dir, "model.safetensors"), 0o644)

    final = passkey_accuracy(model, tokenizer, lengths=[args.seq_len], depths=[0.0, 0.25, 0.5, 0.75, 1.0],
                             trials=20, seed=12345)
    print(f"final passkey accuracy at {args.seq_len}: {final['accuracy']:.3f} (wall {wall:.0f}s)", flush=True)
    write_readme(args.output_dir, {
        "command": "python -m train.pretrain_tiny " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": vars(args), "seed": args.seed, "parameters": n_params,
        "config": model.config.to_diff_dict(), "pretrain_seq_len": args.seq_len,
        "steps_run": history[-1]["step"], "wall_time_s": wall, "threads": args.threads,
        "passkey_accuracy": final["accuracy"], "passkey_by_depth": final["by_length_depth"],
        "history": history, "torch": torch.__version__,
    })


if __name__ == "__main__":
    main()
