"""A patched model inside HF Trainer and TRL's SFTTrainer, set up the way users set them up
(bf16 on, LoRA, gradient checkpointing, compute_metrics, TRL's defaults, packing, padding-free)."""
from __future__ import annotations

import os

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments

from patches import apply_bpt_patch
from test_patches import SMALL_BLOCKS, make_batch
from tiny_models import tiny_model

SHIPPED = os.path.join(os.path.dirname(__file__), "..", "train", "assets", "tiny-llama")
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)


def _token_rows(count: int = 8) -> Dataset:
    rows = []
    for seed in range(count):
        batch = make_batch("right_padded", batch=1, seed=seed)
        rows.append({key: value[0].tolist() for key, value in batch.items() if isinstance(value, torch.Tensor)})
    return Dataset.from_list(rows)


def _token_accuracy(eval_pred):
    logits, labels = eval_pred.predictions, eval_pred.label_ids  # numpy [B, N, V], [B, N]
    predicted = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    counted = target != -100
    return {"token_accuracy": float((predicted == target)[counted].mean())}


def _trainer(model, tmp_path, *, bf16: bool, gradient_checkpointing: bool):
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, bf16=bf16, gradient_checkpointing=gradient_checkpointing,
        per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=3, learning_rate=1e-2,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, data_seed=0,
    )
    return Trainer(model=model, args=args, train_dataset=_token_rows(), eval_dataset=_token_rows(4),
                   compute_metrics=_token_accuracy)


def _lora_model(patched: bool, chunk_budget: int | None = None):
    model = get_peft_model(tiny_model("llama"), LoraConfig(task_type="CAUSAL_LM", **LORA))
    if patched:  # chunk_budget 1: the LoRA projections in chunks too, rebuilding the norms' outputs (as on a GPU)
        apply_bpt_patch(model, **SMALL_BLOCKS, **({} if chunk_budget is None else {"chunk_budget": chunk_budget}))
    return model


def _train_losses(trainer) -> list[float]:
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


@pytest.mark.parametrize("chunk_budget", [None, 1])
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_hf_trainer_fp32_patched_equals_stock(tmp_path, gradient_checkpointing, chunk_budget):
    """Train, evaluate (compute_metrics on logits) and predict: patched equals stock."""
    results = {}
    for patched in (False, True):
        trainer = _trainer(_lora_model(patched, chunk_budget), tmp_path / str(patched), bf16=False,
                           gradient_checkpointing=gradient_checkpointing)
        losses = _train_losses(trainer)
        metrics = trainer.evaluate()
        predictions = trainer.predict(_token_rows(2)).predictions
        results[patched] = losses, metrics, predictions
    (stock_losses, stock_metrics, stock_pred), (losses, metrics, pred) = results[False], results[True]
    assert len(losses) == 3
    assert losses == pytest.approx(stock_losses, rel=1e-5)
    assert metrics["eval_loss"] == pytest.approx(stock_metrics["eval_loss"], rel=1e-5)
    assert metrics["eval_token_accuracy"] == stock_metrics["eval_token_accuracy"]
    assert pred.shape == stock_pred.shape
    assert abs(pred - stock_pred).max() <= 1e-4 * abs(stock_pred).max()


def test_hf_trainer_bf16_lora_checkpointing_metrics(tmp_path):
    """What a user writes: Trainer(bf16=True), LoRA, gradient checkpointing, compute_metrics."""
    trainer = _trainer(_lora_model(True), tmp_path, bf16=True, gradient_checkpointing=True)
    losses = _train_losses(trainer)
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    metrics = trainer.evaluate()
    assert 0.0 <= metrics["eval_token_accuracy"] <= 1.0 and torch.isfinite(torch.tensor(metrics["eval_loss"]))
    predictions = trainer.predict(_token_rows(2)).predictions
    assert predictions.shape[0] == 2 and predictions.shape[-1] == trainer.model.config.vocab_size


def _text_rows() -> Dataset:
    words = "the pass key is hidden in this long filler text remember it".split()
    texts = [" ".join(words[(i + j) % len(words)] for j in range(6 + 2 * i)) for i in range(12)]
    return Dataset.from_dict({"text": texts})


@pytest.mark.parametrize("mode", ["defaults", "packing", "padding_free"])
def test_trl_sft_trainer(tmp_path, mode):
    """TRL SFTTrainer with its defaults (bf16 and gradient checkpointing on), with packing (position
    ids restart per document, no attention mask) and padding-free batches: patched per-step losses
    follow stock's in the same precision, and both train."""
    from trl import SFTConfig, SFTTrainer

    options = {"defaults": {"max_length": 96}, "packing": {"packing": True, "max_length": 96}, "padding_free": {"padding_free": True, "max_length": None}}[mode]
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    losses = {}
    for patched in (False, True):
        model = AutoModelForCausalLM.from_pretrained(SHIPPED)
        if patched:
            apply_bpt_patch(model, q_block=32, kv_block=32, mlp_chunk=32, loss_chunk=32)
        args = SFTConfig(output_dir=str(tmp_path / str(patched)), use_cpu=True, max_steps=3,
                         per_device_train_batch_size=2, logging_steps=1, save_strategy="no", report_to=[],
                         seed=0, data_seed=0, **options)
        trainer = SFTTrainer(model=model, args=args, train_dataset=_text_rows(), processing_class=tokenizer,
                             peft_config=LoraConfig(task_type="CAUSAL_LM", **LORA))
        assert args.bf16 and args.gradient_checkpointing
        trainer.train()
        losses[patched] = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses[True]) == 3 and all(torch.isfinite(torch.tensor(losses[True])))
    # bf16 rounding differs between the two attention kernels: equal to bf16 resolution.
    assert losses[True] == pytest.approx(losses[False], rel=2 ** -7)
