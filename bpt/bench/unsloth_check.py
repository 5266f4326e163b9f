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
import shutil
import tempfile

NOT_INSTALLED = "not run: unsloth is not installed here (python -m bpt.bench.gpu_wheels --unsloth packs it)"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def run_unsloth(spec: dict) -> dict:
    """Worker task "unsloth": {"ok": True, "cells": [one timed row per length]} or {"ok": False, "error": ...}.
    spec: model_config, bits (4 or 16), lora_r, seq_lens, timed_steps, seed (Unsloth places the model: the GPU)."""
    folder = tempfile.mkdtemp(prefix="bpt-unsloth-")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("UNSLOTH_DISABLE_STATISTICS", "1")
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", os.path.join(folder, "compiled"))
    try:
        try:
            from unsloth import FastLanguageModel  # first: it patches transformers as it is imported
        except ImportError as error:  # not there, or there without what it imports (its one line says which)
            missing = isinstance(error, ModuleNotFoundError) and error.name == "unsloth"
            return {"ok": False, "error": NOT_INSTALLED if missing else f"not run: unsloth did not import: {error}"}
        return _run(FastLanguageModel, spec, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the saved model: the check's 1B is 2.5 GB


def _run(FastLanguageModel, spec: dict, folder: str) -> dict:
    import torch

    from bpt.bench.cells import first_line  # after unsloth: the cells import transformers

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
            cells.append({"seq_len": seq_len, "ok": False, "error": f"{type(error).__name__}: {first_line(error)}"})
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
    """One warm-up and `timed_steps` steps at `seq_len` (bpt.bench.cells.timed_steps), and how many adapter weights
    the last one gave a gradient (every LoRA A and B: the step trained them)."""
    import torch

    from bpt.bench.cells import timed_steps

    device = next(p.device for p in model.parameters())
    generator = torch.Generator().manual_seed(spec["seed"])
    ids = torch.randint(0, spec["model_config"]["vocab_size"], (1, seq_len), generator=generator).to(device)

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    row = timed_steps(model, step, spec["timed_steps"], seq_len, cuda=device.type == "cuda")
    row["adapters_with_gradients"] = sum(1 for p in model.parameters() if p.requires_grad and p.grad is not None)
    return row


def _version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("unsloth")
    except PackageNotFoundError:
        return None
