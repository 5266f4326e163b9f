"""The training loop of train.qlora: the data order (reproducible across resumes and ranks), the optimizer step,
metrics.jsonl, checkpoints every --save_steps and --save_minutes, a graceful stop on SIGINT / SIGTERM, and a clean
stop (one line) when a save fails or another process of the run dies.

Tests reach into the loop by patching its functions (`accumulate`, `MetricsLog.add`, `save_checkpoint`): there are
no test hooks in here.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import resource
import time
import warnings

import torch

from train.parallel import deepspeed
from train.parallel.fsdp import full_norm
from train.parallel.layout import Layout
from train.recipe import checkpoint
from train.recipe.args import Args
from train.recipe.lifecycle import SIGNALS, Interrupted
from train.recipe.run_dir import METRICS_FILE
from train.run.peers import peer_lost, roster


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; the weights of that step were not updated and nothing was saved."""


# ---------------------------------------------------------------- the data order

def epoch_order(n_rows: int, *, seed: int, epoch: int, rank: int, world_size: int) -> list[int]:
    """This rank's row indices for an epoch: a permutation seeded by (seed, epoch) only, so a resumed
    run reproduces it, padded to a multiple of world_size and strided across ranks (DistributedSampler)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n_rows, generator=generator).tolist()
    order += order[: (-n_rows) % world_size]  # every rank gets the same number of rows
    return order[rank::world_size]


def batches_per_epoch(n_rows: int, args: Args, world_size: int) -> int:
    return math.ceil(math.ceil(n_rows / world_size) / args.per_device_train_batch_size)


def step_groups(dataset, collator, args: Args, *, rank: int, world_size: int, epoch: int, batch: int):
    """Yield (micro-batches of one optimizer step, data position after them), forever, from (epoch, batch).

    An epoch's last step may have fewer than gradient_accumulation_steps micro-batches; the loss is
    normalised by the step's token count, so it still weighs every token equally.
    """
    from torch.utils.data import DataLoader

    bs, n_batches = args.per_device_train_batch_size, batches_per_epoch(len(dataset), args, world_size)
    while True:
        order = epoch_order(len(dataset), seed=args.seed, epoch=epoch, rank=rank, world_size=world_size)
        # A private generator: starting an iterator draws a seed from it, and drawing from the global
        # RNG instead would shift the dropout stream of a resumed run against the uninterrupted one.
        loader = DataLoader(dataset, batch_size=bs, sampler=order[batch * bs:], collate_fn=collator,
                            generator=torch.Generator().manual_seed(args.seed))
        group = []
        for micro in loader:
            group.append(micro)
            batch += 1
            if len(group) == args.gradient_accumulation_steps or batch == n_batches:
                yield group, ((epoch + 1, 0) if batch == n_batches else (epoch, batch))
                group = []
        epoch, batch = epoch + 1, 0


def total_steps(n_rows: int, args: Args, world_size: int) -> int:
    if args.max_steps > 0:
        return args.max_steps
    steps_per_epoch = math.ceil(batches_per_epoch(n_rows, args, world_size) / args.gradient_accumulation_steps)
    return max(1, math.ceil(args.num_train_epochs * steps_per_epoch))


# ---------------------------------------------------------------- the optimizer step

def make_optimizer(model, args: Args):
    params = [p for p in model.parameters() if p.requires_grad]
    if args.optim == "paged_adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW8bit(params, lr=args.learning_rate, weight_decay=args.weight_decay)
    return torch.optim.AdamW(params, lr=args.learning_rate, weight_decay=args.weight_decay)


def make_scheduler(optimizer, args: Args, steps: int):
    from transformers import get_scheduler  # imported late: it pulls in bitsandbytes, which is slow and chatty

    return get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.warmup_steps,
                         num_training_steps=steps)


def continue_schedule(scheduler, step: int) -> float:
    """Move a freshly built schedule to `step` (its learning rate there set on the optimizer), for a resumed run
    whose schedule differs from the checkpoint's. Returns that learning rate."""
    scheduler.last_epoch = step - 1
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": intended here
        warnings.simplefilter("ignore", UserWarning)
        scheduler.step()
    return scheduler.get_last_lr()[0]


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def _targets(batch: dict) -> torch.Tensor:
    """Tokens the loss is computed on; causal LM losses shift labels, so position 0 never is one."""
    return (batch["labels"][..., 1:] != -100).sum()


def _tokens(batch: dict) -> torch.Tensor:
    """Tokens processed, padding excluded."""
    mask = batch.get("attention_mask")
    return mask.sum() if mask is not None else torch.tensor(batch["input_ids"].numel())


def accumulate(model, group: list[dict], accelerator, layout: Layout) -> tuple[float, int]:
    """Forward and backward over the micro-batches of one optimizer step. Returns (loss, tokens) over all ranks.

    Each micro-batch loss is its summed token loss / the step's target count over all ranks
    (num_items_in_batch), so the accumulated gradient is that of the step's mean token loss, whatever
    the padding or micro-batch sizes. Under sequence parallelism every rank of a group holds the same rows
    (counted once) and computes the token losses of its shard of them; under tensor parallelism every rank of a
    group computes the same loss (of the same rows, or of the same shard of them under both) with its slice of every
    layer.
    """
    from patches import sequence_parallel_attention, shard_batch

    device, tensor_parallel = accelerator.device, layout.tensor_parallel
    copies = layout.copies  # ranks holding each row
    n_items = (accelerator.reduce(sum(_targets(b) for b in group).to(device), "sum") // copies).clamp(min=1)
    tokens = accelerator.reduce(sum(_tokens(b) for b in group).to(device), "sum") // copies
    total = torch.zeros((), device=device)
    engine = model if deepspeed.is_engine(model) else None  # ZeRO-3: the engine reduces at the step's boundary
    # The ranks DDP / FSDP average each gradient over: all of them; under TP (no DDP) none, or with FSDP the ranks
    # holding the same slices.
    averaged_over = accelerator.num_processes if tensor_parallel == 1 else \
        (layout.world // tensor_parallel if layout.fsdp else 1)
    for i, micro in enumerate(group):
        micro = {k: v.to(device) for k, v in micro.items()}
        split = contextlib.nullcontext()
        if layout.sequence_parallel > 1:  # this rank's shard of every sequence; the attention runs over the group
            micro, context = shard_batch(micro, layout.group, layout.mode)
            split = sequence_parallel_attention(accelerator.unwrap_model(model), context)
        micro["num_items_in_batch"] = n_items
        # Gradients are all-reduced only on the step's last micro-batch.
        last = i == len(group) - 1
        sync = contextlib.nullcontext() if last or engine else accelerator.no_sync(model)
        with sync, split:  # backward inside: gradient checkpointing recomputes the attention there
            with accelerator.autocast():  # (a model sharded by FSDP is not wrapped by accelerate.prepare)
                loss = model(**micro).loss
            # The normalisation above already is global (the ranks' losses sum to the step's mean token loss):
            # undo the averaging. Under TP without FSDP the gradients are summed below.
            if engine:
                deepspeed.backward(engine, loss * accelerator.num_processes, boundary=last)
            else:
                accelerator.backward(loss * averaged_over)
        total += loss.detach().float()
    if tensor_parallel > 1:
        from bpt.tensor_parallel import reduce_tensor_parallel_gradients

        reduce_tensor_parallel_gradients(model, layout.tp_group, None if layout.fsdp else layout.tp_data_group)
    # Every rank of a TP group computed the same loss (share): count it once; the SP ranks' shares sum.
    return accelerator.reduce(total, "sum").item() / tensor_parallel, int(tokens.item())


def train_step(model, group: list[dict], optimizer, scheduler, accelerator, args: Args, step: int, layout: Layout):
    """One optimizer step over the micro-batches in `group`. Returns (loss, tokens, grad_norm).
    Raises TrainingDiverged before touching the weights."""
    loss, tokens = accumulate(model, group, accelerator, layout)
    if not math.isfinite(loss):
        if not deepspeed.is_engine(model):
            optimizer.zero_grad(set_to_none=True)
        raise TrainingDiverged(f"loss is {loss} at step {step}")
    grad_norm = None
    if deepspeed.is_engine(model):  # clips at --max_grad_norm (its config) and steps `optimizer`'s partitions
        grad_norm = deepspeed.step(model, args)
    else:
        if args.max_grad_norm > 0 and layout.tensor_parallel > 1:  # the sliced parameters' squares summed over TP
            from bpt.tensor_parallel import clip_grad_norm_

            grad_norm = float(clip_grad_norm_(model.parameters(), args.max_grad_norm, layout.tp_group))
        elif args.max_grad_norm > 0:
            grad_norm = full_norm(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))
        optimizer.step()
    if not accelerator.optimizer_step_was_skipped:  # fp16 overflow: keep the schedule in step with updates
        scheduler.step()
    if not deepspeed.is_engine(model):  # the engine clears its own (offloaded gradients live in fixed buffers)
        optimizer.zero_grad(set_to_none=True)
    return loss, tokens, grad_norm


# ---------------------------------------------------------------- metrics, checkpoints, the loop

class MetricsLog:
    """metrics.jsonl (+ trackers) on the main process; window averages between logged steps.

    The window (the losses, tokens and seconds since the last row) goes into every checkpoint (`state`) and comes
    back on resume, so a resumed run logs the uninterrupted run's rows: the same steps and values (tokens_per_s and
    peak_mem_mb measure this process's wall time and memory, so they differ)."""

    def __init__(self, args: Args, accelerator, start_step: int, window: dict | None = None):
        self.path = os.path.join(args.output_dir, METRICS_FILE)
        self.accelerator, self.every = accelerator, args.logging_steps
        window = window or {"losses": [], "tokens": 0, "seconds": 0.0}
        self.losses, self.tokens, self.seconds = list(window["losses"]), window["tokens"], window["seconds"]
        self.failed: str | None = None  # why the main process could not write its last row
        if accelerator.is_main_process:
            _truncate_metrics(self.path, start_step)

    def state(self) -> dict:
        return {"losses": self.losses, "tokens": self.tokens, "seconds": self.seconds}

    def add(self, step: int, loss: float, tokens: int, seconds: float, lr: float, grad_norm, last: bool) -> dict:
        self.losses.append(loss)
        self.tokens += tokens
        self.seconds += seconds
        window = {"loss": sum(self.losses) / len(self.losses), "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
                  "peak_mem_mb": peak_memory_mb(self.accelerator.device)}
        if step % self.every == 0 or last:
            record = {"step": step, **window, "lr": lr, "grad_norm": grad_norm, "tokens": self.tokens}
            if self.accelerator.is_main_process:
                size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
                try:
                    with open(self.path, "a") as f:
                        f.write(json.dumps(record) + "\n")
                except OSError as error:  # a full disk: no torn row left, and the loop stops every rank
                    self.failed = checkpoint.write_failure(error)
                    with contextlib.suppress(OSError):
                        os.truncate(self.path, size)
            # Trackers get HF Trainer's names: train/loss, train/lr, ... (grouped under "train").
            self.accelerator.log({f"train/{k}": v for k, v in record.items() if k != "step" and v is not None},
                                 step=step)
            self.losses, self.tokens, self.seconds = [], 0, 0.0
        return window


class CompileWatch:
    """Says when a step compiled (bpt.compile: the patch's compiled code, on CUDA by default): the first step's graphs
    and their seconds, and any later step that compiled again (its shapes changed: packed rows of other lengths do
    not, the dynamic shapes take them)."""

    def __init__(self, accelerator):
        from bpt.compile import compile_stats

        self.accelerator, self.stats, self.seen = accelerator, compile_stats, compile_stats()

    def after(self, step: int, first: bool) -> None:
        now = self.stats()
        if now["compiling_calls"] == self.seen["compiling_calls"]:
            return
        graphs, seconds = now["graphs"] - self.seen["graphs"], now["compile_seconds"] - self.seen["compile_seconds"]
        self.seen = now
        why = "" if first else " again (a shape or setting it had not seen)"
        self.accelerator.print(f"compile: step {step} compiled {graphs} graph(s){why}, {seconds:.1f} s")


def _truncate_metrics(path: str, keep_through_step: int) -> None:
    """Drop lines of steps after the resume point (an interrupted run may have logged past its checkpoint) and a
    row torn by a crash; the file is replaced whole, so a failure here leaves it as it was."""
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            with contextlib.suppress(ValueError):
                if json.loads(line)["step"] <= keep_through_step:
                    kept.append(line if line.endswith("\n") else line + "\n")
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)  # after a failed write (after os.replace there is none)


def save_on_main(accelerator, what: str, write, last_checkpoint: str | None):
    """write() on the main process, the others waiting; its result. When it fails (a full disk) every rank raises
    checkpoint.SaveFailed, so none is left waiting at a collective for the others."""
    result, failure = None, None
    if accelerator.is_main_process:
        try:
            result = write()
        except checkpoint.WRITE_ERRORS as error:
            failure = checkpoint.write_failure(error)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        failure = broadcast_object_list([failure])[0]
    if failure is not None:
        raise checkpoint.SaveFailed(what, failure, last_checkpoint)
    return result


def save_checkpoint(accelerator, model, optimizer, scheduler, args: Args, step: int, position, steps: int,
                    metrics_window: dict | None = None, last_checkpoint: str | None = None) -> str | None:
    """Write checkpoint-<step> (every rank calls it); a failed write removes it and raises SaveFailed naming
    last_checkpoint, the one before."""
    from accelerate.utils import gather_object

    rng_states = gather_object([checkpoint.rng_state()])  # every rank's, so each resumes its own dropout stream
    model = accelerator.unwrap_model(model)
    weights, optimizer_state = checkpoint.gathered_states(model, optimizer, accelerator.is_main_process)
    return save_on_main(accelerator, f"{checkpoint.PREFIX}{step}", lambda: checkpoint.save(
        args.output_dir, step, model=model, weights=weights, optimizer_state=optimizer_state, scheduler=scheduler,
        rng_states=rng_states, position=position, args_dict=args.to_dict(), world_size=accelerator.num_processes,
        total_steps=steps, metrics_window=metrics_window), last_checkpoint)


def agree(accelerator, *votes: int) -> list[int]:
    """Each vote's largest value over every rank, in one gather per step: the decisions every rank must take at the
    same step, so their collectives stay in step (a stop signal any rank got, a checkpoint any rank's clock says is
    due, a row the main process could not write)."""
    if accelerator.num_processes == 1:
        return list(votes)
    gathered = accelerator.gather(torch.tensor(votes, device=accelerator.device))
    return gathered.view(-1, len(votes)).amax(0).tolist()


# ---------------------------------------------------------------- the loop

def train_loop(model, optimizer, scheduler, dataset, tokenizer, accelerator, args: Args, *, layout: Layout,
               start_step: int, position: tuple[int, int], steps: int, last_checkpoint: str | None) -> list[float]:
    """Optimizer steps start_step+1 .. steps. On SIGINT/SIGTERM: finish the step, save, raise Interrupted.
    A failed save raises checkpoint.SaveFailed, a dead process PeerLost (on every rank still running)."""
    with SIGNALS.mode(graceful=True):
        return _train_loop(model, optimizer, scheduler, dataset, tokenizer, accelerator, args, layout=layout,
                           start_step=start_step, position=position, steps=steps, last_checkpoint=last_checkpoint)


def _train_loop(model, optimizer, scheduler, dataset, tokenizer, accelerator, args: Args, *, layout: Layout,
                start_step: int, position: tuple[int, int], steps: int, last_checkpoint: str | None) -> list[float]:
    from tqdm.auto import tqdm

    from train.recipe.data import Collator

    groups = step_groups(dataset, Collator(tokenizer.pad_token_id), args, rank=layout.data_rank,
                         world_size=layout.data_world, epoch=position[0], batch=position[1])
    resumed = checkpoint.read_state(last_checkpoint) if start_step and last_checkpoint else {}
    metrics = MetricsLog(args, accelerator, start_step, resumed.get("metrics_window"))
    peers = roster(accelerator)
    bar = tqdm(total=steps, initial=start_step, desc="train", dynamic_ncols=True,
               disable=not accelerator.is_local_main_process)
    losses = []
    model.train()
    step, saved_at = start_step, time.monotonic()
    compiled = CompileWatch(accelerator)
    try:
        for step in range(start_step + 1, steps + 1):
            group, position = next(groups)
            lr = scheduler.get_last_lr()[0]
            started = time.perf_counter()
            try:
                loss, tokens, grad_norm = train_step(model, group, optimizer, scheduler, accelerator, args, step,
                                                     layout)
            except TrainingDiverged as error:
                keep = (f"the last good checkpoint is {last_checkpoint}" if last_checkpoint
                        else "no checkpoint was written")
                raise TrainingDiverged(f"{error}: training stopped without updating the weights or saving; {keep}. "
                                       "Lower --learning_rate or check the data, then resume with "
                                       "--resume_from_checkpoint latest") from None
            losses.append(loss)
            compiled.after(step, first=step == start_step + 1)
            # A row only where the uninterrupted run writes one: a stop keeps the window in its checkpoint.
            window = metrics.add(step, loss, tokens, time.perf_counter() - started, lr, grad_norm,
                                 last=step == steps)
            bar.update(1)
            bar.set_postfix(loss=f"{window['loss']:.4f}", tok_s=f"{window['tokens_per_s']:.0f}",
                            mem=f"{window['peak_mem_mb']:.0f}MB")
            due = args.save_minutes > 0 and time.monotonic() - saved_at >= 60 * args.save_minutes
            stopping, due, unwritten = agree(accelerator, SIGNALS.requested or 0, int(due), int(bool(metrics.failed)))
            if unwritten:
                raise checkpoint.SaveFailed(metrics.path, metrics.failed or "failed on the main process",
                                            last_checkpoint)
            # The last step too: a finished run's final state is a checkpoint, so the run can be extended.
            if (args.save_steps and step % args.save_steps == 0) or due or stopping or step == steps:
                last_checkpoint = save_checkpoint(accelerator, model, optimizer, scheduler, args, step, position,
                                                  steps, metrics.state(), last_checkpoint)
                saved_at = time.monotonic()
            if stopping:
                for tracker in accelerator.trackers:  # end the tracker runs cleanly (wandb: run finished)
                    tracker.finish()
                raise Interrupted(stopping, step=step, steps=steps, saved=last_checkpoint)
    except Interrupted as stop:
        if stop.step is None:  # a repeated signal aborted mid-step (an atomic checkpoint write leaves nothing)
            stop.step, stop.steps, stop.last_checkpoint = step, steps, last_checkpoint
        raise
    except RuntimeError as error:  # a collective failed: did a process of the run die?
        lost = None if isinstance(error, TrainingDiverged) else \
            peer_lost(error, peers, accelerator, step, steps, last_checkpoint)
        if lost is None:
            raise
        raise lost from None
    finally:
        bar.close()
    return losses
