"""HF `Trainer` (and trainers built on it, e.g. TRL's) with sequence parallelism: groups of N processes split each
training sequence (patches.sequence_parallel), data parallel over the groups.

    from patches import apply_bpt_patch
    from patches.trainer import SequenceParallelTrainer

    apply_bpt_patch(model)
    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=rows, data_collator=collator,
                                      sequence_parallel=2, sp_mode="ring")
    trainer.train()          # under accelerate launch / torchrun with a multiple of 2 processes

    class MySFTTrainer(SequenceParallelMixin, SFTTrainer): ...   # the same for another Trainer subclass

How it plugs in (transformers' own hooks for its context parallelism, which this replaces):
- `_prepare_context_parallel_inputs`: each training batch is split by `shard_batch` and the step's forward and
  backward run inside `sequence_parallel_attention(model, ...)` (gradient checkpointing recomputes inside it too).
- `get_cp_size`: N, so the Trainer divides its token count (gathered over all processes) by the N copies of each row
  and counts the data-parallel world as world / N. Its usual loss x world (undoing DDP's mean) then gives every
  process's gradient the sum over the group, as the split requires.
- the training dataloader: the ranks of a group read the same rows (accelerate's batch sharding over the
  data-parallel groups instead of over every process).
Evaluation is not split: each process evaluates whole sequences of its own rows.
"""
from __future__ import annotations

from transformers import Trainer

from patches.sequence_parallel import MODES, sequence_parallel_attention, sequence_parallel_group, shard_batch

__all__ = ["SequenceParallelMixin", "SequenceParallelTrainer"]


class SequenceParallelMixin:
    """Put before a Trainer class: `class T(SequenceParallelMixin, Trainer)`."""

    def __init__(self, *args, sequence_parallel: int = 1, sp_mode: str = "ring", **kwargs):
        for hook in ("_prepare_context_parallel_inputs", "get_cp_size"):
            if not hasattr(Trainer, hook):
                raise RuntimeError(f"this transformers' Trainer has no {hook}: SequenceParallelTrainer was built on "
                                   "transformers 5.23; install a version that has it")
        if sp_mode not in MODES:
            raise ValueError(f"sp_mode must be one of {MODES}, got {sp_mode!r}")
        super().__init__(*args, **kwargs)
        self.sequence_parallel, self.sp_mode, self.sp_group = sequence_parallel, sp_mode, None
        if sequence_parallel > 1:
            self.sp_group = sequence_parallel_group(sequence_parallel)  # raises unless N divides the processes

    def get_cp_size(self) -> int:
        return self.sequence_parallel

    def get_train_dataloader(self):
        loader = super().get_train_dataloader()
        if self.sequence_parallel > 1:
            batches = getattr(loader, "batch_sampler", None)
            if not hasattr(batches, "process_index"):
                raise ValueError("sequence parallelism needs a map-style train_dataset (with a length), so the ranks "
                                 "of a group can read the same rows")
            rank = self.accelerator.process_index
            batches.num_processes = self.accelerator.num_processes // self.sequence_parallel
            batches.process_index = rank // self.sequence_parallel
        return loader

    def _prepare_context_parallel_inputs(self, model, inputs):
        if self.sequence_parallel == 1 or not model.training:
            return super()._prepare_context_parallel_inputs(model, inputs)
        inputs = self._prepare_inputs(inputs)  # on the device first: the context's masks are built from them
        local, context = shard_batch(inputs, self.sp_group, self.sp_mode)
        local.pop("num_items_in_batch")  # the Trainer passes its own count (the same, over every group)
        patched = self.accelerator.unwrap_model(model)
        return (lambda: sequence_parallel_attention(patched, context)), local


class SequenceParallelTrainer(SequenceParallelMixin, Trainer):
    """transformers.Trainer with `sequence_parallel=N, sp_mode="ring"|"ulysses"` (see the module docstring)."""

