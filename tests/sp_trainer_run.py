"""One HF Trainer run for tests/test_trainer_sequence_parallel.py: `python sp_trainer_run.py OUT SP MODE [hf|trl]
[eval_first]` alone, or under torchrun with several processes. Writes OUT/result.pt on the main process: the logged
losses and the trained LoRA weights, and after training `trainer.evaluate()`'s eval_loss on the same 8 rows (2 a
batch); with eval_first an evaluate() runs before training too. A tiny llama with LoRA, patched; 8 right-padded rows
of 45 tokens; 3 steps of 2 rows."""
from __future__ import annotations

import gc
import os
import sys

import torch


def rows() -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        length = 45 - 7 * (i % 3)
        ids = torch.randint(3, 100, (length,), generator=generator).tolist()
        out.append({"input_ids": ids})
    return out


def collate(batch: list[dict]) -> dict:
    n = 45
    ids = torch.zeros(len(batch), n, dtype=torch.long)
    mask = torch.zeros(len(batch), n, dtype=torch.long)
    for i, row in enumerate(batch):
        ids[i, :len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, :len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


ARG_NAMES = ("output_dir", "per_device_train_batch_size", "per_device_eval_batch_size", "prediction_loss_only",
             "max_steps", "learning_rate", "logging_steps", "save_strategy", "report_to", "use_cpu",
             "train_sampling_strategy", "gradient_checkpointing", "gradient_checkpointing_kwargs", "disable_tqdm",
             "remove_unused_columns", "seed")


def main(out: str, sequence_parallel: int, mode: str, trainer_kind: str = "hf", eval_first: str = "") -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from patches import apply_bpt_patch
    from patches.trainer import SequenceParallelTrainer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    apply_bpt_patch(model, q_block=8, kv_block=8, mlp_chunk=8, loss_chunk=8)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2 // (int(os.environ.get("WORLD_SIZE", 1))
                                                                               // sequence_parallel),
                             per_device_eval_batch_size=2, prediction_loss_only=True, max_steps=3, learning_rate=1e-2,
                             logging_steps=1, save_strategy="no", report_to=[],
                             use_cpu=True, train_sampling_strategy="sequential", gradient_checkpointing=True,
                             gradient_checkpointing_kwargs={"use_reentrant": False}, disable_tqdm=True,
                             remove_unused_columns=False, seed=0)
    if trainer_kind == "trl":  # TRL's SFTTrainer with its own collator, on pre-tokenized rows
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        from patches.trainer import SequenceParallelMixin

        class SequenceParallelSFTTrainer(SequenceParallelMixin, SFTTrainer):
            pass

        from train.pretrain_tiny import build_tokenizer

        args = SFTConfig(**{k: v for k, v in args.to_dict().items() if k in ARG_NAMES}, bf16=False, max_length=None)
        trainer = SequenceParallelSFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows()),
                                             eval_dataset=Dataset.from_list(rows()), processing_class=build_tokenizer(),
                                             sequence_parallel=sequence_parallel, sp_mode=mode)
    else:
        trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=rows(), eval_dataset=rows(),
                                          data_collator=collate, sequence_parallel=sequence_parallel, sp_mode=mode)
    from bpt.sequence_parallel import traffic

    if eval_first:  # an evaluate() before training must leave the training as without it
        trainer.evaluate()
    trainer.train()
    sent = traffic.total()
    evals = [trainer.evaluate()["eval_loss"]]
    eval_bytes = traffic.total() - sent  # > 0 when evaluation ran split over the group
    gathered = None
    if sequence_parallel > 1:  # the eval loop's gather: one copy per group (values: group, rank in group + 5)
        rank = torch.distributed.get_rank()
        mine = torch.tensor([rank // sequence_parallel, rank % sequence_parallel + 5])
        gathered = trainer._gather_one_per_group(mine).tolist()
    refusal = None
    if sequence_parallel > 1:  # logits / predictions (compute_metrics) are refused
        trainer.compute_metrics, trainer.args.prediction_loss_only = (lambda prediction: {}), False
        try:
            trainer.evaluate()
        except ValueError as error:
            refusal = str(error)
    if trainer.is_world_process_zero():
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        torch.save({"losses": losses, "lora": lora, "bytes_sent": traffic.total(), "eval_losses": evals,
                    "eval_bytes": eval_bytes, "refusal": refusal,
                    "gathered": gathered}, os.path.join(out, "result.pt"))
    # Tear down while every rank is alive: DDP's reducer holds a gloo group, and a group destroyed at interpreter
    # exit, after its peers left, was seen to abort the process (CI) or hang it in the group's destructor.
    trainer.accelerator.free_memory()  # accelerate's references to the DDP-wrapped model
    del trainer
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *sys.argv[4:])  # [hf|trl] [eval_first]
