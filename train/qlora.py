"""`python -m train.qlora`: long-context QLoRA fine-tuning on accelerate.

    python -m train.qlora                                  # the embedded default run (tiny llama, passkey)
    python -m train.qlora --config configs/llama-8b-64k.yaml
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml -m train.qlora --config ...

Order of work: every cheap check (flags, output dir, checkpoint, model config, family, positions,
data) runs before any weights are loaded, so mistakes fail fast as one-line UserErrors.
Then: base -> k-bit prep -> LoRA -> BPT patch (train.model), the loop, the final adapter.

Files in --output_dir (written by the main process only): metrics.jsonl, checkpoint-N/,
the final adapter (adapter_config.json, adapter_model.safetensors) and tokenizer, eval.json with
--eval_passkey, merged/ with --merge, and run_info.json last: the marker that the run finished.
--report_to tensorboard writes train.qlora/events.* there too; --report_to wandb its wandb/ run directory
(unless WANDB_DIR says otherwise).

SIGINT / SIGTERM (Ctrl-C, a cluster's preemption): the loop finishes the optimizer step it is in, writes
checkpoint-N, prints where it is and the command that resumes, and exits 130 / 143. A second signal
aborts at once (one that follows within train.lifecycle.REPEAT_WINDOW_S counts as the same request: a
launcher forwarding the terminal's Ctrl-C, or a scheduler signalling every process, delivers one stop twice).
The process around the run (signals, library log noise, the one-line exit) lives in train.lifecycle.

Under `accelerate launch` every rank runs the same checks; a user error is printed once, by the main
process, every rank exits 2 and the process group is torn down (no rank is left waiting at a collective).
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

from train import checkpoint
from train.args import TINY_LLAMA_DIR, Args, parse_args
from train.errors import UserError
from train.lifecycle import SIGNALS, Interrupted, interrupted_message, leave, silence_library_noise
from train.fsdp import full_norm
from train.parallel import Layout, make_layout

METRICS_FILE = "metrics.jsonl"
RUN_INFO_FILE = "run_info.json"  # written last: its presence means the run finished
EVAL_FILE = "eval.json"
EVAL_SEED = 12345  # passkey evaluation prompts, disjoint from the training data's seed stream
# Test-only hooks: stop cleanly after a step (simulated interruption) / poison a step's loss.
STOP_AFTER_ENV = "QLORA_TEST_STOP_AFTER_STEP"
NAN_AT_ENV = "QLORA_TEST_NAN_AT_STEP"
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}
TRACKER_PROJECT = "train.qlora"  # tensorboard: the subdirectory of output_dir; wandb: the project (or WANDB_PROJECT)


class TrainingDiverged(RuntimeError):
    """The loss became NaN/inf; the weights of that step were not updated and nothing was saved."""


@dataclass
class RunResult:
    model: object  # the trained peft model (unwrapped from DDP)
    tokenizer: object
    losses: list[float] = field(default_factory=list)  # loss of every step this process ran
    eval: dict | None = None


# ---------------------------------------------------------------- setup: checks before heavy work, accelerator

def check_tracker(report_to: str) -> None:
    if report_to == "none":
        return
    if not any(importlib.util.find_spec(name) for name in TRACKER_PACKAGES[report_to]):
        raise UserError(f"--report_to {report_to} needs the {report_to} package: pip install {report_to} "
                        f"(or pass --report_to none)")


def check_writable(out: str) -> None:
    """Create --output_dir and write (then remove) a probe file in it: a run must not find out after
    loading the model and training a step that it cannot save."""
    try:
        os.makedirs(out, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=out)
        os.close(fd)
        os.remove(probe)
    except OSError as error:
        reason = error.strerror or str(error)
        raise UserError(f"--output_dir {out} is not writable ({reason}); choose a directory you can write to "
                        "or fix its permissions") from None


def check_output_dir(args: Args) -> None:
    """Writable, and no finished run or unfinished run's checkpoints to clobber unless told to."""
    out = args.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--output_dir {out} is a file; choose a directory")
    check_writable(out)
    if args.resume_from_checkpoint or args.overwrite_output_dir:
        return
    if os.path.isfile(os.path.join(out, RUN_INFO_FILE)):
        raise UserError(f"--output_dir {out} already holds a finished run; pass --overwrite_output_dir to replace "
                        "it or choose another --output_dir")
    found = checkpoint.list_checkpoints(out)
    if found:
        raise UserError(f"--output_dir {out} holds checkpoints of an unfinished run ({os.path.basename(found[-1])}); "
                        "pass --resume_from_checkpoint latest to continue it or --overwrite_output_dir to start over")


def clear_previous_run(output_dir: str) -> None:
    """--overwrite_output_dir: remove what an earlier run wrote (only our own files)."""
    for path in checkpoint.list_checkpoints(output_dir) + [os.path.join(output_dir, "merged")]:
        shutil.rmtree(path, ignore_errors=True)
    for name in (RUN_INFO_FILE, METRICS_FILE, EVAL_FILE):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(output_dir, name))


@dataclass
class Preflight:
    """What the cheap checks established, before any weights are read."""

    config: object  # the model config, RoPE scaling applied
    tokenizer: object
    rope_factor: float | None
    resume_path: str | None


def preflight(args: Args) -> Preflight:
    """Every check that needs no weights, in the order a user would fix them. Raises UserError."""
    from train.data import check_source
    from train.fsdp import check_fsdp, use_launcher_fsdp
    from train.model import apply_rope_scaling, check_bpt_support, check_packing, load_config, load_tokenizer
    from train.parallel import check_layout

    check_tracker(args.report_to)
    check_output_dir(args)
    resume_path = (checkpoint.resolve(args.resume_from_checkpoint, args.output_dir)
                   if args.resume_from_checkpoint else None)
    if args.model_name_or_path == str(TINY_LLAMA_DIR) and not TINY_LLAMA_DIR.is_dir():
        raise UserError(f"the bundled tiny llama ({TINY_LLAMA_DIR}) has not been built: run python -m "
                        "train.pretrain_tiny, or name a model with --model_name_or_path")
    check_source(args.dataset)  # the file exists; its content is read with the data, after the model config
    config = load_config(args.model_name_or_path, args.trust_remote_code)
    if args.bpt:
        check_bpt_support(config)
    check_packing(config, args.packing)
    check_layout(args)
    use_launcher_fsdp(args)
    check_fsdp(args, config)
    rope_factor = apply_rope_scaling(config, args.max_seq_len, args.rope_scaling, args.rope_factor)
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    if args.eval_passkey:  # found now, not after training
        from train.eval import check_passkey_lengths

        check_passkey_lengths(tokenizer, args.eval_lengths or [args.max_seq_len])
    return Preflight(config, tokenizer, rope_factor, resume_path)


def make_accelerator(args: Args):
    from accelerate import Accelerator

    precision = args.mixed_precision
    if precision is None and "ACCELERATE_MIXED_PRECISION" not in os.environ:  # else: the launch config's
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    # cpu=True on machines without an accelerator: accelerate then sets up gloo DDP when launched with
    # several processes (otherwise each process would silently train alone on the whole data).
    no_accelerator = not (torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available())
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        # accelerate keeps its state per process and refuses another precision later: a second run in the
        # same process (a notebook cell run again with other flags) must start from a fresh state.
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(mixed_precision=precision, log_with=None if args.report_to == "none" else args.report_to,
                       project_dir=args.output_dir, cpu=no_accelerator)


def on_main(accelerator, fn):
    """fn() on the main process only; the others wait. A UserError there is raised on every rank, so no
    rank is left waiting at a collective for a process that has gone (gloo: "connection closed")."""
    result, error = None, None
    if accelerator.is_main_process:
        try:
            result = fn()
        except UserError as raised:
            error = str(raised)
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        error = broadcast_object_list([error])[0]
    if error is not None:
        raise UserError(error)
    return result


def start_position(accelerator, args: Args, resume_path: str | None, model, optimizer, scheduler):
    """(step, (epoch, batch)) to start from: the checkpoint's when resuming (its weights are in already), else a
    clean output_dir."""
    start_step, position = 0, (0, 0)
    if resume_path:
        state = checkpoint.load(resume_path, model=accelerator.unwrap_model(model), optimizer=optimizer,
                                scheduler=scheduler, rank=accelerator.process_index)
        start_step, position = state["step"], (state["epoch"], state["batch"])
        if accelerator.is_main_process:
            print(f"resumed from {resume_path} at step {start_step}", file=sys.stderr)
    elif accelerator.is_main_process and args.overwrite_output_dir:
        clear_previous_run(args.output_dir)
    if accelerator.is_main_process:
        checkpoint.remove_leftovers(args.output_dir)
    accelerator.wait_for_everyone()
    return start_step, position


def init_trackers(accelerator, args: Args) -> None:
    """--report_to: tensorboard under output_dir/train.qlora; wandb's run directory in output_dir (unless
    WANDB_DIR is set), in project WANDB_PROJECT or train.qlora, named after output_dir."""
    config = {k: v for k, v in args.to_dict().items() if isinstance(v, (int, float, str, bool))}
    init_kwargs = {}
    project = TRACKER_PROJECT
    if args.report_to == "wandb":
        project = os.environ.get("WANDB_PROJECT", TRACKER_PROJECT)
        init_kwargs["wandb"] = {"name": os.path.basename(os.path.abspath(args.output_dir))}
        if not os.environ.get("WANDB_DIR"):
            init_kwargs["wandb"]["dir"] = args.output_dir
    accelerator.init_trackers(project, config=config, init_kwargs=init_kwargs)


# ---------------------------------------------------------------- data: the training rows and their order

def load_data(args: Args, tokenizer, *, main_process: bool = True):
    """The training rows; notes about the data (truncation) are printed once, by the main process."""
    from train.data import build_train_dataset, load_text_dataset

    def note(message: str) -> None:
        if main_process:
            print(f"note: {message}", file=sys.stderr, flush=True)

    source = args.dataset
    if source != "passkey" and args.dataset_split != "train":  # build_train_dataset loads the train split
        source = load_text_dataset(args.dataset, split=args.dataset_split)
    dataset = build_train_dataset(
        tokenizer, source, max_seq_len=args.max_seq_len, text_field=args.text_field,
        prompt_field=args.prompt_field, response_field=args.response_field, packing=args.packing,
        num_proc=args.num_proc, seed=args.seed, passkey_samples=args.passkey_samples, warn=note)
    if len(dataset) == 0:
        raise UserError(f"dataset {args.dataset} gives no training rows at --max_seq_len {args.max_seq_len}")
    return dataset


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


# ---------------------------------------------------------------- train: the loop

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


def train_step(model, group: list[dict], optimizer, scheduler, accelerator, args: Args, step: int, layout: Layout):
    """One optimizer step over the micro-batches in `group`. Returns (loss, tokens, grad_norm).

    Each micro-batch loss is its summed token loss / the step's target count over all ranks
    (num_items_in_batch), so the accumulated gradient is that of the step's mean token loss, whatever
    the padding or micro-batch sizes. Under sequence parallelism every rank of a group holds the same rows
    (counted once) and computes the token losses of its shard of them. Raises TrainingDiverged before
    touching the weights.
    """
    from patches import sequence_parallel, shard_batch

    device = accelerator.device
    copies = layout.sequence_parallel  # ranks holding each row
    n_items = (accelerator.reduce(sum(_targets(b) for b in group).to(device), "sum") // copies).clamp(min=1)
    tokens = accelerator.reduce(sum(_tokens(b) for b in group).to(device), "sum") // copies
    total = torch.zeros((), device=device)
    for i, micro in enumerate(group):
        micro = {k: v.to(device) for k, v in micro.items()}
        split = contextlib.nullcontext()
        if copies > 1:  # this rank's shard of every sequence; the attention runs over the group
            micro, context = shard_batch(micro, layout.group, layout.mode)
            split = sequence_parallel(accelerator.unwrap_model(model), context)
        micro["num_items_in_batch"] = n_items
        # Gradients are all-reduced only on the step's last micro-batch.
        sync = contextlib.nullcontext() if i == len(group) - 1 else accelerator.no_sync(model)
        with sync, split:  # backward inside: gradient checkpointing recomputes the attention there
            with accelerator.autocast():  # (a model sharded by FSDP is not wrapped by accelerate.prepare)
                loss = model(**micro).loss
            # DDP averages gradients over ranks; the normalisation above already is global (the ranks' losses
            # sum to the step's mean token loss).
            accelerator.backward(loss * accelerator.num_processes)
        total += loss.detach().float()
    loss = accelerator.reduce(total, "sum").item()
    if os.environ.get(NAN_AT_ENV) == str(step):
        loss = float("nan")
    if not math.isfinite(loss):
        optimizer.zero_grad(set_to_none=True)
        raise TrainingDiverged(f"loss is {loss} at step {step}")
    grad_norm = None
    if args.max_grad_norm > 0:
        grad_norm = full_norm(accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm))
    optimizer.step()
    if not accelerator.optimizer_step_was_skipped:  # fp16 overflow: keep the schedule in step with updates
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, int(tokens.item()), grad_norm


class MetricsLog:
    """metrics.jsonl (+ trackers) on the main process; window averages between logged steps."""

    def __init__(self, args: Args, accelerator, start_step: int):
        self.path = os.path.join(args.output_dir, METRICS_FILE)
        self.accelerator, self.every = accelerator, args.logging_steps
        self.losses, self.tokens, self.seconds = [], 0, 0.0
        if accelerator.is_main_process:
            _truncate_metrics(self.path, start_step)

    def add(self, step: int, loss: float, tokens: int, seconds: float, lr: float, grad_norm, last: bool) -> dict:
        self.losses.append(loss)
        self.tokens += tokens
        self.seconds += seconds
        window = {"loss": sum(self.losses) / len(self.losses), "tokens_per_s": self.tokens / max(self.seconds, 1e-9),
                  "peak_mem_mb": peak_memory_mb(self.accelerator.device)}
        if step % self.every == 0 or last:
            record = {"step": step, **window, "lr": lr, "grad_norm": grad_norm, "tokens": self.tokens}
            if self.accelerator.is_main_process:
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            # Trackers get HF Trainer's names: train/loss, train/lr, ... (grouped under "train").
            self.accelerator.log({f"train/{k}": v for k, v in record.items() if k != "step" and v is not None},
                                 step=step)
            self.losses, self.tokens, self.seconds = [], 0, 0.0
        return window


def _truncate_metrics(path: str, keep_through_step: int) -> None:
    """Drop lines of steps after the resume point (an interrupted run may have logged past its checkpoint)."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = [line for line in f if line.strip() and json.loads(line)["step"] <= keep_through_step]
    with open(path, "w") as f:
        f.writelines(lines)


def save_checkpoint(accelerator, model, optimizer, scheduler, args: Args, step: int, position) -> str | None:
    from accelerate.utils import gather_object

    rng_states = gather_object([checkpoint.rng_state()])  # every rank's, so each resumes its own dropout stream
    model = accelerator.unwrap_model(model)
    weights, optimizer_state = checkpoint.gathered_states(model, optimizer, accelerator.is_main_process)
    path = None
    if accelerator.is_main_process:
        path = checkpoint.save(args.output_dir, step, model=model, weights=weights, optimizer_state=optimizer_state,
                               scheduler=scheduler, rng_states=rng_states, position=position,
                               args_dict=args.to_dict(), world_size=accelerator.num_processes)
    accelerator.wait_for_everyone()
    return path


def stop_requested(accelerator) -> int | None:
    """The signal that asked this run to stop, agreed by every rank (any rank's request stops all of them,
    at the same step, so their collectives stay in step)."""
    requested = SIGNALS.requested or 0
    if accelerator.num_processes > 1:
        requested = int(accelerator.gather(torch.tensor([requested], device=accelerator.device)).max())
    return requested or None


def train_loop(model, optimizer, scheduler, dataset, tokenizer, accelerator, args: Args, *, layout: Layout,
               start_step: int, position: tuple[int, int], steps: int, last_checkpoint: str | None) -> list[float]:
    """Optimizer steps start_step+1 .. steps. On SIGINT/SIGTERM: finish the step, save, raise Interrupted."""
    with SIGNALS.mode(graceful=True):
        return _train_loop(model, optimizer, scheduler, dataset, tokenizer, accelerator, args, layout=layout,
                           start_step=start_step, position=position, steps=steps, last_checkpoint=last_checkpoint)


def _train_loop(model, optimizer, scheduler, dataset, tokenizer, accelerator, args: Args, *, layout: Layout,
                start_step: int, position: tuple[int, int], steps: int, last_checkpoint: str | None) -> list[float]:
    from tqdm.auto import tqdm

    from train.data import Collator

    groups = step_groups(dataset, Collator(tokenizer.pad_token_id), args, rank=layout.data_rank,
                         world_size=layout.data_world, epoch=position[0], batch=position[1])
    metrics = MetricsLog(args, accelerator, start_step)
    bar = tqdm(total=steps, initial=start_step, desc="train", dynamic_ncols=True,
               disable=not accelerator.is_local_main_process)
    stop_after = int(os.environ.get(STOP_AFTER_ENV, "0"))
    losses = []
    model.train()
    step = start_step
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
            stopping = stop_requested(accelerator)  # a signal arrived: this step was the last
            window = metrics.add(step, loss, tokens, time.perf_counter() - started, lr, grad_norm,
                                 last=step == steps or stopping is not None)
            bar.update(1)
            bar.set_postfix(loss=f"{window['loss']:.4f}", tok_s=f"{window['tokens_per_s']:.0f}",
                            mem=f"{window['peak_mem_mb']:.0f}MB")
            if (args.save_steps and step % args.save_steps == 0) or stopping:
                last_checkpoint = save_checkpoint(accelerator, model, optimizer, scheduler, args, step, position)
            if stopping:
                for tracker in accelerator.trackers:  # end the tracker runs cleanly (wandb: run finished)
                    tracker.finish()
                raise Interrupted(stopping, step=step, steps=steps, saved=last_checkpoint)
            if step == stop_after:
                bar.close()
                print(f"stopping after step {step} ({STOP_AFTER_ENV})", file=sys.stderr)
                sys.exit(3)
    except Interrupted as stop:
        if stop.step is None:  # a repeated signal aborted mid-step (an atomic checkpoint write leaves nothing)
            stop.step, stop.steps, stop.last_checkpoint = step, steps, last_checkpoint
        raise
    finally:
        bar.close()
    return losses


# ---------------------------------------------------------------- save: evaluation and the final files

def passkey_eval(model, tokenizer, args: Args) -> dict:
    from train.eval import passkey_accuracy

    lengths = args.eval_lengths or [args.max_seq_len]
    return passkey_accuracy(model, tokenizer, lengths=lengths, depths=args.eval_depths, trials=args.eval_trials,
                            seed=EVAL_SEED)


def _evaluate(accelerator, model, tokenizer, args: Args, when: str, eval_path: str, evals: dict,
              step: int) -> dict | None:
    """Passkey accuracy on the main process (the others wait: greedy decoding needs no data parallelism; under
    FSDP every rank decodes, as every forward gathers the shards), printed, logged to the tracker at `step` and
    written to eval.json under `when` ("before"/"after") beside the earlier results in `evals`."""

    def report(result: dict) -> dict:
        lengths = ", ".join(f"{length}: {acc:.3f}" for length, acc in result["by_length"].items())
        print(f"passkey accuracy {when} training: {result['accuracy']:.3f} (by length {lengths})", flush=True)
        _write_json(eval_path, {**evals, when: result})
        if args.report_to != "none":
            accelerator.log({"eval/passkey_accuracy": result["accuracy"],
                             **{f"eval/passkey_accuracy_{length}": acc for length, acc in result["by_length"].items()}},
                            step=step)
        return result

    evaluate = lambda: passkey_eval(accelerator.unwrap_model(model), tokenizer, args)  # noqa: E731
    if args.fsdp:  # every rank takes part in the forwards; the main one reports
        result = evaluate()
        on_main(accelerator, lambda: report(result))
        return result
    return on_main(accelerator, lambda: report(evaluate()))


def _write_json(path: str, data: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, default=str)
    os.replace(tmp, path)


def _read_json(path: str) -> dict:
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        return json.load(f)
    return {}


# ---------------------------------------------------------------- the run and the command line

def run(args: Args) -> RunResult:
    """The whole run; returns the trained model (for in-process use and tests)."""
    from accelerate.utils import set_seed

    from train.fsdp import gathered_trainable_state, local_share, shard_model
    from train.model import build_model

    started = time.time()
    silence_library_noise()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    plan = preflight(args)
    tokenizer = plan.tokenizer
    accelerator = make_accelerator(args)
    main_process = accelerator.is_main_process
    if plan.resume_path:
        checkpoint.check_compatible(checkpoint.read_state(plan.resume_path), args, accelerator.num_processes,
                                    plan.resume_path)
    # The main process first (it fills the datasets cache, the others reuse it); a data error there
    # stops every rank with the same message.
    dataset = on_main(accelerator, lambda: load_data(args, tokenizer))
    if not main_process:
        dataset = load_data(args, tokenizer, main_process=False)
    layout = make_layout(accelerator, args)
    steps = total_steps(len(dataset), args, layout.data_world)

    set_seed(args.seed)
    model, _handle = build_model(args, plan.config, accelerator.device)
    if plan.resume_path:  # before sharding / wrapping: every rank loads the whole adapter
        checkpoint.load_weights(plan.resume_path, model)
    if args.fsdp:
        shard_model(model)  # the optimizer must see the shards
    optimizer = make_optimizer(model, args)
    scheduler = make_scheduler(optimizer, args, steps)
    if args.fsdp:
        optimizer = accelerator.prepare(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    if main_process:
        print(f"trainable parameters: {sum(p.numel() for p in model.parameters() if p.requires_grad):,}; "
              f"{len(dataset)} rows of {args.max_seq_len} tokens; {steps} steps on {accelerator.num_processes} "
              f"process(es)" + (f"; sequences split {layout.sequence_parallel} ways ({layout.mode})"
                                 if layout.sequence_parallel > 1 else "")
              + (f"; RoPE {args.rope_scaling} x{plan.rope_factor:g}" if plan.rope_factor else "")
              + (f"; FSDP2 over {accelerator.num_processes} process(es), the main one holding "
                 f"{100 * local_share(model):.1f}% of the weights" if args.fsdp else ""),
              file=sys.stderr)
    os.makedirs(args.output_dir, exist_ok=True)
    start_step, position = start_position(accelerator, args, plan.resume_path, model, optimizer, scheduler)
    if args.report_to != "none":
        init_trackers(accelerator, args)

    eval_path = os.path.join(args.output_dir, EVAL_FILE)
    evals = _read_json(eval_path) if plan.resume_path else {}  # a resumed run keeps its "before"
    if args.eval_passkey and "before" not in evals:
        evals["before"] = _evaluate(accelerator, model, tokenizer, args, "before", eval_path, evals, start_step)

    losses = train_loop(model, optimizer, scheduler, dataset, tokenizer, accelerator, args, layout=layout,
                        start_step=start_step, position=position, steps=steps, last_checkpoint=plan.resume_path)
    trained = accelerator.unwrap_model(model)
    weights = gathered_trainable_state(trained, keep=main_process)  # whole, under FSDP too
    if main_process:
        trained.save_pretrained(args.output_dir, state_dict=weights)
        tokenizer.save_pretrained(args.output_dir)
    if args.eval_passkey:
        evals["after"] = _evaluate(accelerator, model, tokenizer, args, "after", eval_path, evals, steps)
    if args.merge:
        from train.model import merge_adapter

        on_main(accelerator, lambda: merge_adapter(args, plan.config, args.output_dir,
                                                  os.path.join(args.output_dir, "merged"), tokenizer))
    if main_process:  # last: the marker that the run finished
        _write_json(os.path.join(args.output_dir, RUN_INFO_FILE), {
            "finished": True, "steps": steps, "final_loss": losses[-1] if losses else None,
            "wall_time_s": round(time.time() - started, 1), "model_name_or_path": args.model_name_or_path,
            "trust_remote_code": args.trust_remote_code, "bits": args.bits,
            "rope_parameters": plan.config.rope_parameters if plan.rope_factor else None,
            "max_position_embeddings": getattr(plan.config, "max_position_embeddings", None),
            "eval": evals or None, "args": args.to_dict()})
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return RunResult(model=trained, tokenizer=tokenizer, losses=losses, eval=evals or None)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = None
    silence_library_noise()
    with SIGNALS.mode(graceful=False):
        try:
            args = parse_args(argv)
            run(args)
        except UserError as error:
            return leave(f"error: {error}", 2)
        except TrainingDiverged as error:
            return leave(f"error: {error}", 1)
        except Interrupted as stop:
            return leave(interrupted_message(stop, args, argv), stop.exit_code)
    return 0


if __name__ == "__main__":
    sys.exit(main())
