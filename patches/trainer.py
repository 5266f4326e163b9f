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
- `train` after an `evaluate()`: the model is wrapped in DDP as without it (accelerate would skip it) and the first
  step is split like the others.
- evaluation (`evaluate`, with `prediction_loss_only`): the eval / test dataloaders give the ranks of a group the same
  rows, as for training; `prediction_step` splits each batch by `shard_batch` and its loss is the group's
  token-weighted mean (`group_loss`), the same on every rank of the group; the loop gathers one copy per group, so
  `eval_loss` is the one-process loss of the same batches (tested: SP 2 x DP 2 ring and SP 2 Ulysses with Trainer,
  SP 2 Ulysses with TRL's SFTTrainer; eval rows a multiple of the global eval batch, so accelerate's cut of a short
  last batch's padding rows, kept as is, is not exercised).
  Logits / predictions (`prediction_loss_only=False`, e.g. for `compute_metrics`) are refused with a ValueError.
"""
from __future__ import annotations

from transformers import Trainer

import torch

from patches.sequence_parallel import (MODES, group_loss, sequence_parallel_attention, sequence_parallel_group,
                                       shard_batch)

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

    def train(self, *args, **kwargs):
        # An evaluate() before train() leaves the model marked prepared by accelerate (for evaluation: not wrapped in
        # DDP), and accelerate then skips wrapping it for training: no gradient all-reduce, each rank training alone
        # (seen with stock Trainer too). Unmarked, it is wrapped as without that evaluate().
        model = self.model
        if self.accelerator.num_processes > 1 and self.model_wrapped is model and \
                getattr(model, "_is_accelerate_prepared", False):
            model._is_accelerate_prepared = False
            self.accelerator._models = [m for m in self.accelerator._models if m is not model]
        return super().train(*args, **kwargs)

    def get_cp_size(self) -> int:
        return self.sequence_parallel

    def _same_rows_in_group(self, loader, dataset: str):
        """Shard the loader's batches over the data-parallel groups, not over every process (in place)."""
        if self.sequence_parallel > 1:
            batches = getattr(loader, "batch_sampler", None)
            if not hasattr(batches, "process_index"):
                raise ValueError(f"sequence parallelism needs a map-style {dataset} (with a length), so the ranks "
                                 "of a group can read the same rows")
            rank = self.accelerator.process_index
            batches.num_processes = self.accelerator.num_processes // self.sequence_parallel
            batches.process_index = rank // self.sequence_parallel
        return loader

    def get_train_dataloader(self):
        return self._same_rows_in_group(super().get_train_dataloader(), "train_dataset")

    def get_eval_dataloader(self, eval_dataset=None):
        return self._same_rows_in_group(super().get_eval_dataloader(eval_dataset), "eval_dataset")

    def get_test_dataloader(self, test_dataset):
        return self._same_rows_in_group(super().get_test_dataloader(test_dataset), "test_dataset")

    def evaluation_loop(self, *args, **kwargs):
        if self.sequence_parallel > 1:  # the Trainer resets it to gather_for_metrics after its loop
            self.gather_function = self._gather_one_per_group
        return super().evaluation_loop(*args, **kwargs)

    def _gather_one_per_group(self, tensor):
        """gather_for_metrics over the data-parallel groups: every process's tensor, then the first rank's of each
        group (the group's ranks hold the same rows), then accelerate's cut of the last batch's padding rows."""
        gathered = self.accelerator.gather(tensor)
        groups = self.accelerator.num_processes // self.sequence_parallel
        gathered = gathered.reshape(groups, self.sequence_parallel, -1, *tensor.shape[1:])[:, 0].flatten(0, 1)
        state = self.accelerator.gradient_state
        if state.end_of_dataloader and state.remainder > 0:
            gathered = gathered[:state.remainder]
        return gathered

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        if self.sequence_parallel == 1:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        if not prediction_loss_only:
            raise ValueError("evaluation with sequence parallelism computes the loss only: set "
                             "prediction_loss_only=True (no compute_metrics, no logits or predictions)")
        inputs = self._prepare_inputs(inputs)
        local, context = shard_batch(inputs, self.sp_group, self.sp_mode)
        with torch.no_grad(), self.compute_loss_context_manager(), \
                sequence_parallel_attention(self.accelerator.unwrap_model(model), context):
            share = model(**local).loss  # this rank's token losses / the group's count
        return group_loss(share, self.sp_group), None, None

    def _prepare_context_parallel_inputs(self, model, inputs):
        # Under SP only training_step reaches this (prediction_step above splits its own batches). Not keyed on
        # model.training: training_step calls this before model.train(), so the first step after an evaluate()
        # would run unsplit (every rank the whole rows: loss and gradients x N).
        if self.sequence_parallel == 1:
            return super()._prepare_context_parallel_inputs(model, inputs)
        inputs = self._prepare_inputs(inputs)  # on the device first: the context's masks are built from them
        local, context = shard_batch(inputs, self.sp_group, self.sp_mode)
        local.pop("num_items_in_batch")  # the Trainer passes its own count (the same, over every group)
        patched = self.accelerator.unwrap_model(model)
        return (lambda: sequence_parallel_attention(patched, context)), local


class SequenceParallelTrainer(SequenceParallelMixin, Trainer):
    """transformers.Trainer with `sequence_parallel=N, sp_mode="ring"|"ulysses"` (see the module docstring)."""

