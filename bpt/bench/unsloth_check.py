"""The GPU check's Unsloth row (worker task "unsloth"): Unsloth's own QLoRA step on the check's model, timed as the
other sides are, where Unsloth is installed (`python -m bpt.bench.gpu_wheels --unsloth` packs it for a lent card).

Unsloth loads a model through its own `FastLanguageModel.from_pretrained` (it patches the model's classes and
quantises while loading), so the worker saves the check's model (the config's shapes, random weights, bf16) and a
word-level tokenizer of its vocabulary to a temporary folder, loads that with Unsloth (4-bit as asked,
`max_seq_length` the longest length), adds LoRA through `FastLanguageModel.get_peft_model` as the check's sides have
it (r 16 on every linear, alpha 2r, dropout 0) with Unsloth's own checkpointing, and times one warm-up and K steps
per length (bf16 autocast: Unsloth trains in the loaded dtype, and autocast changes none of its bf16 work). Offline:
the hub is never asked (HF_HUB_OFFLINE, UNSLOTH_DISABLE_STATISTICS), and Unsloth's compiled cache goes to the
temporary folder. Unsloth is imported first in its process, as it asks, before transformers.
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time

NOT_INSTALLED = "not run: unsloth is not installed here (python -m bpt.bench.gpu_wheels --unsloth packs it)"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_unsloth(spec: dict) -> dict:
    """Worker task "unsloth": {"ok": True, "cells": [one timed row per length]} or {"ok": False, "error": ...}.
    spec: model_config, bits (4 or 16), lora_r, seq_lens, timed_steps, seed, device ("cuda" on a card)."""
    folder = tempfile.mkdtemp(prefix="bpt-unsloth-")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", os.path.join(folder, "compiled"))
    try:
        from unsloth import FastLanguageModel  # first: it patches transformers as it is imported
    except ImportError as error:  # not there, or there without what it imports (its one line says which)
        missing = isinstance(error, ModuleNotFoundError) and error.name == "unsloth"
        return {"ok": False, "error": NOT_INSTALLED if missing else f"not run: unsloth did not import: {error}"}
    import torch

    model_dir = save_model(spec, os.path.join(folder, "model"))
    model, _ = FastLanguageModel.from_pretrained(model_dir, max_seq_length=max(spec["seq_lens"]),
                                                 dtype=torch.bfloat16, load_in_4bit=spec["bits"] == 4,
                                                 local_files_only=True)
    r = spec["lora_r"]
    model = FastLanguageModel.get_peft_model(model, r=r, lora_alpha=2 * r, lora_dropout=0.0, bias="none",
                                             target_modules=TARGETS, use_gradient_checkpointing="unsloth",
                                             random_state=spec["seed"])
    model.train()
    cells = []
    for seq_len in spec["seq_lens"]:
        try:
            cells.append({"seq_len": seq_len, "ok": True, **_timed(model, spec, seq_len)})
        except Exception as error:  # an out-of-memory (or any) failure is this length's row
            text = (str(error).strip().splitlines() or [""])[0][:300]
            cells.append({"seq_len": seq_len, "ok": False, "error": f"{type(error).__name__}: {text}"})
    return {"ok": True, "cells": cells, "unsloth": _version()}


def save_model(spec: dict, folder: str) -> str:
    """The spec's model (random weights, bf16) and a word-level tokenizer of its vocabulary, saved in `folder`."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, PreTrainedTokenizerFast

    from bpt.bench.models import model_from_config

    config = AutoConfig.for_model(**spec["model_config"])
    torch.manual_seed(spec["seed"])
    model_from_config(config, torch.bfloat16).save_pretrained(folder)
    words = {f"w{i}": i for i in range(config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="w0")),
                                        unk_token="w0", pad_token="w1", eos_token="w2", bos_token="w3")
    tokenizer.save_pretrained(folder)
    return folder


def _timed(model, spec: dict, seq_len: int) -> dict:
    """One warm-up and `timed_steps` synchronised steps at `seq_len`: the median, tokens/s, peak and the loss."""
    import torch

    device = next(p.device for p in model.parameters())
    cuda = device.type == "cuda"
    generator = torch.Generator().manual_seed(spec["seed"])
    ids = torch.randint(0, spec["model_config"]["vocab_size"], (1, seq_len), generator=generator).to(device)
    seconds, peaks, loss = [], [], None
    for _ in range(1 + spec["timed_steps"]):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated())
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds[1:])
    trained = sum(1 for p in model.parameters() if p.requires_grad and p.grad is not None)
    return {"timed_steps": spec["timed_steps"], "seconds_per_step": median, "step_seconds_each": seconds[1:],
            "warmup_seconds": seconds[0], "tokens_per_second": seq_len / median,
            "timed_peak_bytes": max(peaks[1:]) if cuda else None, "timed_loss": float(loss.detach()),
            "adapters_with_gradients": trained}


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("unsloth")
    except PackageNotFoundError:
        return None
