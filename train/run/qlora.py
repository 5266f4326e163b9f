"""`python -m train.qlora`: long-context QLoRA fine-tuning on accelerate.

    python -m train.qlora                                  # the embedded default run (tiny llama, passkey)
    python -m train.qlora --config configs/llama-8b-64k.yaml
    accelerate launch --config_file configs/accelerate/multi_gpu.yaml -m train.qlora --config ...

With --plan GPU it only simulates this run's step on that GPU and prints what it needs (train.run.plan), then exits.

Order of work: every cheap check (flags, output dir, checkpoint, model config, family, positions,
data) runs before any weights are loaded, so mistakes fail fast as one-line UserErrors.
Then: base -> k-bit prep -> LoRA -> BPT patch (train.recipe.model), the loop, the final adapter.

Files in --output_dir (written by the main process only): see train.recipe.run_dir. --report_to tensorboard writes
train.qlora/events.* there too; --report_to wandb its wandb/ run directory (unless WANDB_DIR says otherwise).
The loop itself (data order, optimizer step, metrics, checkpoints) is train.run.loop; the metrics
train.evaluation.metrics.

SIGINT / SIGTERM (Ctrl-C, a cluster's preemption): the loop finishes the optimizer step it is in, writes
checkpoint-N, prints where it is and the command that resumes, and exits 130 / 143. A second signal
aborts at once (one that follows within train.recipe.lifecycle.REPEAT_WINDOW_S counts as the same request: a
launcher forwarding the terminal's Ctrl-C, or a scheduler signalling every process, delivers one stop twice).
The process around the run (signals, library log noise, the one-line exit) lives in train.recipe.lifecycle.

Under `accelerate launch` every rank runs the same checks; a user error is printed once, by the main
process, the process group is torn down (no rank is left waiting at a collective) and each machine's first process
exits 2, the others 0 (train.recipe.lifecycle.leave: torchrun's report then names one process).
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

import torch

from train.errors import SharedUserError, UserError
from train.evaluation.metrics import EVAL_SEED
from train.parallel.layout import launched_world_size, make_layout
from train.recipe import checkpoint, run_dir
from train.recipe.args import Args
from train.recipe.lifecycle import silence_library_noise
from train.run import loop
from train.run.quick_checks import check_data_format, quick_checks
from train.run.trackers import check_tracker, init_trackers, log_heatmaps


@dataclass
class RunResult:
    model: object  # the trained peft model (unwrapped from DDP)
    tokenizer: object
    losses: list[float] = field(default_factory=list)  # loss of every step this process ran
    eval: dict | None = None


# ---------------------------------------------------------------- setup: checks before heavy work, accelerator

@dataclass
class Preflight:
    """What the cheap checks established, before any weights are read."""

    config: object  # the model config, RoPE scaling applied
    tokenizer: object
    rope_factor: float | None
    resume_path: str | None
    evals: dict  # eval.json of the run being resumed ("before" is not measured again)
    zero3: object = None  # train.parallel.deepspeed.Zero3 of a DeepSpeed launch with several processes, else None


def preflight(args: Args) -> Preflight:
    """Every check that needs no weights, in the order a user would fix them. Raises UserError."""
    from train.parallel.deepspeed import check_zero3, launcher_zero3
    from train.parallel.fsdp import check_fsdp, use_launcher_fsdp
    from train.parallel.layout import check_layout, check_tensor_parallel_model
    from train.recipe.chat import read_chat_template
    from train.recipe.model import check_bpt_support, check_packing, check_weight_files, load_config, load_tokenizer
    from train.recipe.rope import apply_rope_scaling
    from train.run.memory_check import check_memory

    check_tracker(args.report_to)
    zero3 = launcher_zero3()  # first: accelerate must not build its own DeepSpeed engine, whatever fails later
    if args.eval_tasks is not None:
        from train.evaluation.tasks import check_task_names

        args.eval_tasks = check_task_names(args.eval_tasks, "--eval_tasks")
    quick_checks(args)  # output dir, data file and its columns (the command line ran them before torch loaded)
    resume_path = (checkpoint.resolve(args.resume_from_checkpoint, args.output_dir)
                   if args.resume_from_checkpoint else None)
    config = load_config(args.model_name_or_path, args.trust_remote_code)
    check_weight_files(args.model_name_or_path)
    if args.bpt:
        check_bpt_support(config)
    check_packing(config, args.packing)
    use_launcher_fsdp(args)  # first: a launcher's FSDP config turns --fsdp on, which check_layout reads
    check_layout(args)
    zero3 = check_zero3(args, config, zero3)
    if zero3 is not None and args.tensor_parallel > 1:
        raise UserError("--tensor_parallel does not compose with DeepSpeed ZeRO-3 yet; launch without the DeepSpeed "
                        "config or drop --tensor_parallel")
    check_fsdp(args, config)
    check_tensor_parallel_model(args, config)
    rope_factor = apply_rope_scaling(config, args.max_seq_len, args.rope_scaling, args.rope_factor)
    tokenizer = load_tokenizer(args.model_name_or_path, args.trust_remote_code)
    if args.chat_template:
        tokenizer.chat_template = read_chat_template(args.chat_template)
    check_data_format(args, tokenizer)  # from a local file's first record; a hub dataset's when it loads
    # Last of the checks that allocate nothing (a second or two of simulated steps), and first of those that do: the
    # evaluation's length check below builds prompts of --eval_lengths tokens.
    check_memory(args, zero3)
    if args.eval_passkey:  # found now, not after training
        from train.evaluation.tasks import check_task_lengths

        check_task_lengths(tokenizer, eval_tasks(args), args.eval_lengths or [args.max_seq_len])
    evals = (run_dir.read_json(os.path.join(args.output_dir, run_dir.EVAL_FILE)) if resume_path else None) or {}
    return Preflight(config, tokenizer, rope_factor, resume_path, evals, zero3)


def cpu_threads(args: Args) -> int:
    """--torch_threads, else all but one of this process's cores shared by the launch's processes on this machine (at
    least 1): torch's default, every core, lost 2.5x (tokens/s) to one thread on a busy 2-core machine, its threads
    spinning against other work for the cores (docs/training.md)."""
    if args.torch_threads:
        return args.torch_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, (cores - 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def make_accelerator(args: Args):
    from accelerate import Accelerator

    precision = args.mixed_precision
    if precision is None and "ACCELERATE_MIXED_PRECISION" not in os.environ:  # else: the launch config's
        precision = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    # cpu=True on machines without an accelerator: accelerate then sets up gloo DDP when launched with
    # several processes (otherwise each process would silently train alone on the whole data).
    no_accelerator = not (torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available())
    if launched_world_size() == 1:
        # accelerate keeps its state per process and refuses another precision later: a second run in the
        # same process (a notebook cell run again with other flags) must start from a fresh state.
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    return Accelerator(mixed_precision=precision, log_with=None if args.report_to == "none" else args.report_to,
                       project_dir=args.output_dir, cpu=no_accelerator)


def on_main(accelerator, fn):
    """fn() on the main process only; the others wait. A UserError there is raised on every rank (as a
    SharedUserError), so no rank is left waiting at a collective for a process that has gone (gloo: "connection
    closed")."""
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
        raise SharedUserError(error)
    return result


def check_resume(resume_path: str, args: Args, world_size: int, steps: int) -> None:
    """UserError (before the model loads) when the checkpoint cannot continue this run."""
    state = checkpoint.read_state(resume_path)
    checkpoint.check_compatible(state, args, world_size, resume_path)
    if state["step"] > steps or (state["step"] == steps and run_dir.is_finished(args.output_dir)):  # else: finish it
        raise UserError(f"checkpoint {resume_path} is at step {state['step']}, and this run has {steps} steps: "
                        f"raise --max_steps above {state['step']} to train on")


def start_position(accelerator, args: Args, resume_path: str | None, model, optimizer, scheduler, steps: int):
    """(step, (epoch, batch)) to start from: the checkpoint's when resuming (its weights are in already), else a
    clean output_dir. A resumed run whose schedule differs from the checkpoint's (another --max_steps, say) gets
    its own schedule, continued at the checkpoint's step, and says so."""
    start_step, position = 0, (0, 0)
    if resume_path:
        changes = checkpoint.schedule_changes(checkpoint.read_state(resume_path), args, steps)
        state = checkpoint.load(resume_path, model=accelerator.unwrap_model(model), optimizer=optimizer,
                                scheduler=None if changes else scheduler, rank=accelerator.process_index)
        start_step, position = state["step"], (state["epoch"], state["batch"])
        how = ""
        if changes:
            lr = loop.continue_schedule(scheduler, start_step)
            how = (f"; the learning-rate schedule differs from the checkpoint's ({'; '.join(changes)}): rebuilt as "
                   f"{args.lr_scheduler_type} over {steps} steps and continued at step {start_step}, lr {lr:.3g}")
        if accelerator.is_main_process:
            print(f"resumed from {resume_path} at step {start_step}{how}", file=sys.stderr)
    elif accelerator.is_main_process and args.overwrite_output_dir:
        run_dir.clear_previous_run(args.output_dir)
    if accelerator.is_main_process:
        checkpoint.remove_leftovers(args.output_dir)
    accelerator.wait_for_everyone()
    return start_step, position


# ---------------------------------------------------------------- data

def load_data(args: Args, tokenizer, *, main_process: bool = True):
    """The training rows; the data's format and what became of its rows, and notes (truncation), are printed once,
    by the main process."""
    from train.recipe.data import build_train_dataset, load_text_dataset

    def note(message: str) -> None:
        if main_process:
            print(f"note: {message}", file=sys.stderr, flush=True)

    def say(line: str) -> None:
        if main_process:
            print(line, file=sys.stderr, flush=True)

    source = args.dataset
    if source != "passkey" and args.dataset_split != "train":  # build_train_dataset loads the train split
        source = load_text_dataset(args.dataset, split=args.dataset_split)
    dataset = build_train_dataset(
        tokenizer, source, max_seq_len=args.max_seq_len, text_field=args.text_field,
        prompt_field=args.prompt_field, response_field=args.response_field, dataset_format=args.dataset_format,
        train_on_prompt=args.train_on_prompt, packing=args.packing, num_proc=args.num_proc, seed=args.seed,
        passkey_samples=args.passkey_samples, warn=note, report=say)
    if len(dataset) == 0:
        raise UserError(f"dataset {args.dataset} gives no training rows at --max_seq_len {args.max_seq_len}")
    return dataset


# ---------------------------------------------------------------- evaluation

def eval_tasks(args: Args) -> list[str]:
    from train.evaluation.tasks import DEFAULT_TASKS

    return args.eval_tasks or DEFAULT_TASKS


def _evaluate(accelerator, model, tokenizer, args: Args, when: str, eval_path: str, evals: dict,
              step: int, layout) -> dict | None:
    """Accuracy of each --eval_tasks task, evaluated in the training layout (train.evaluation.split_eval): the prompts
    shared out over the data-parallel groups, each split over its sequence-parallel group as training splits its rows,
    every forward of sharded (FSDP, ZeRO-3) or sliced (TP) weights a collective of the ranks holding them; the answers
    are one process's. The main process prints them, logs them to the tracker at `step` (eval/<task>_accuracy, and
    _<length>) and writes them to eval.json under `when` ("before"/"after") beside the earlier results in `evals`:
    {"tasks": {task: result}}, passkey's result also at the top level."""
    from train.evaluation.metrics import format_table
    from train.evaluation.split_eval import SplitEval
    from train.evaluation.tasks import evaluate_tasks
    from train.parallel.deepspeed import partitioned

    def report(tasks: dict) -> dict:
        logged = {}
        for name, result in tasks.items():
            lengths = ", ".join(f"{length}: {acc:.3f}" for length, acc in result["by_length"].items())
            print(f"{name} accuracy {when} training: {result['accuracy']:.3f} (by length {lengths}){where}", flush=True)
            print(format_table(result, name, total=False), flush=True)  # train.eval's table, by length x depth
            logged[f"eval/{name}_accuracy"] = result["accuracy"]
            logged.update({f"eval/{name}_accuracy_{length}": acc for length, acc in result["by_length"].items()})
        result = {**tasks.get("passkey", {}), "tasks": tasks}
        run_dir.write_json(eval_path, {**evals, when: result})
        if args.report_to != "none":
            accelerator.log(logged, step=step)
        return result

    # Weights sharded over every rank (FSDP, ZeRO-3): every rank takes part in every forward.
    lockstep = args.fsdp or partitioned(accelerator.unwrap_model(model))
    split = SplitEval.of(layout, lockstep)
    where = (f"; prompts shared over {layout.data_world} data-parallel groups" if layout.data_world > 1 else "") + \
        (f"; each prompt split over {layout.sequence_parallel} processes ({layout.mode})"
         if layout.sequence_parallel > 1 else "")
    tasks = evaluate_tasks(accelerator.unwrap_model(model), tokenizer, eval_tasks(args),
                           lengths=args.eval_lengths or [args.max_seq_len], depths=args.eval_depths,
                           trials=args.eval_trials, seed=EVAL_SEED, split=split)
    return on_main(accelerator, lambda: report(tasks)) or {**tasks.get("passkey", {}), "tasks": tasks}


# ---------------------------------------------------------------- the run and the command line

def run(args: Args) -> RunResult:
    """The whole run; returns the trained model (for in-process use and tests)."""
    from accelerate.utils import set_seed

    from train.parallel.fsdp import gathered_trainable_state
    from train.parallel.placement import layout_text, place_model
    from train.recipe.model import build_model, patch

    started = time.time()
    silence_library_noise()
    torch.set_num_threads(cpu_threads(args))
    plan = preflight(args)
    tokenizer = plan.tokenizer
    accelerator = make_accelerator(args)
    main_process = accelerator.is_main_process
    # The main process first (it fills the datasets cache, the others reuse it); a data error there
    # stops every rank with the same message.
    dataset = on_main(accelerator, lambda: load_data(args, tokenizer))
    if not main_process:
        dataset = load_data(args, tokenizer, main_process=False)
    layout = make_layout(accelerator.num_processes, accelerator.process_index, args)
    steps = loop.total_steps(len(dataset), args, layout.data_world)
    if plan.resume_path:
        on_main(accelerator, lambda: check_resume(plan.resume_path, args, accelerator.num_processes, steps))

    set_seed(args.seed)
    zero3 = plan.zero3
    # Resuming: every rank loads the whole adapter, before slicing (TP), sharding (FSDP, ZeRO-3) or wrapping (DDP).
    model = build_model(args, plan.config, accelerator.device, shardable=zero3 is not None,
                        weights_from=plan.resume_path)

    def optimize(placed):
        optimizer = loop.make_optimizer(placed, args)
        return optimizer, loop.make_scheduler(optimizer, args, steps)

    model, optimizer, scheduler = place_model(model, args, layout, patch=lambda sliced: patch(sliced, args),
                                              optimize=optimize, accelerator=accelerator, zero3=zero3)
    if main_process:
        print(f"{trainable_text(model, layout.tensor_parallel)}; {len(dataset)} rows of {args.max_seq_len} tokens; "
              f"{steps} steps on {accelerator.num_processes} process(es)"
              + layout_text(layout, model, cpu_offload=args.fsdp_cpu_offload, zero3=zero3)
              + ("; layer checkpoints offloaded to host memory" if args.offload_checkpoints else "")
              + (f"; one layer checkpoint in {args.checkpoint_stride} kept, the others remade in backward"
                 if args.checkpoint_stride > 1 else "")
              + (f"; RoPE {args.rope_scaling} x{plan.rope_factor:g}" if plan.rope_factor else "")
              + (f"; {torch.get_num_threads()} CPU thread(s) (--torch_threads)" if accelerator.device.type == "cpu"
                 else ""), file=sys.stderr)
        if warmup_note(args, steps):
            print(warmup_note(args, steps), file=sys.stderr)
    start_step, position = start_position(accelerator, args, plan.resume_path, model, optimizer, scheduler, steps)
    if args.report_to != "none":
        init_trackers(accelerator, args)

    out = args.output_dir
    eval_path = os.path.join(out, run_dir.EVAL_FILE)
    evals = plan.evals  # a resumed run keeps its "before"
    if args.eval_passkey and "before" not in evals:
        evals["before"] = _evaluate(accelerator, model, tokenizer, args, "before", eval_path, evals, start_step,
                                    layout)

    losses = loop.train_loop(model, optimizer, scheduler, dataset, tokenizer, accelerator, args, layout=layout,
                             start_step=start_step, position=position, steps=steps,
                             last_checkpoint=plan.resume_path)
    trained = accelerator.unwrap_model(model)
    weights = gathered_trainable_state(trained, keep=main_process)  # whole, under FSDP too
    # All or nothing (a full disk: one line, and resuming from the final checkpoint-N writes it again).
    loop.save_on_main(accelerator, f"the final adapter to {out}",
                      lambda: run_dir.write_adapter(out, trained, weights, tokenizer), None)
    if args.eval_passkey:
        evals["after"] = _evaluate(accelerator, model, tokenizer, args, "after", eval_path, evals, steps, layout)
    if args.merge:
        from train.recipe.model import merge_adapter

        on_main(accelerator, lambda: merge_adapter(args, plan.config, out, os.path.join(out, run_dir.MERGED_DIR),
                                                  tokenizer))
    if main_process:
        from train.evaluation.plots import write_run_pictures

        pictures = write_run_pictures(out, evals, run_dir.METRICS_FILE)  # loss.png, accuracy_<task>.png
        if args.report_to != "none":
            log_heatmaps(accelerator, pictures, steps)
    if main_process:  # last: the marker that the run finished
        from train.run.model_card import write_model_card

        write_model_card(out, args, steps=steps, evals=evals, final_loss=losses[-1] if losses else None,
                         rope_parameters=plan.config.rope_parameters if plan.rope_factor else None,
                         positions=getattr(plan.config, "max_position_embeddings", None))  # in place of peft's
        run_dir.write_json(os.path.join(out, run_dir.RUN_INFO_FILE), {
            "finished": True, "steps": steps, "final_loss": losses[-1] if losses else None,
            "wall_time_s": round(time.time() - started, 1), "model_name_or_path": args.model_name_or_path,
            "trust_remote_code": args.trust_remote_code, "bits": args.bits,
            "rope_parameters": plan.config.rope_parameters if plan.rope_factor else None,
            "max_position_embeddings": getattr(plan.config, "max_position_embeddings", None),
            "eval": evals or None, "args": args.to_dict()})
        print(finished_message(args, steps), file=sys.stderr, flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return RunResult(model=trained, tokenizer=tokenizer, losses=losses, eval=evals or None)


def trainable_text(model, tensor_parallel: int) -> str:
    """The opening line's count of trainable parameters; under tensor parallelism a process's own, its slice."""
    from train.parallel import deepspeed

    count = sum(deepspeed.numel(p) for p in model.parameters() if p.requires_grad)
    if tensor_parallel == 1:
        return f"trainable parameters: {count:,}"
    return f"trainable parameters per process: {count:,} (each holds a 1/{tensor_parallel} slice of the split layers)"


def warmup_note(args: Args, steps: int) -> str | None:
    """A note when the warm-up is as long as the run: the learning rate then never reaches --learning_rate (kept as
    given, as HF Trainer keeps it)."""
    if args.lr_scheduler_type == "constant" or args.warmup_steps < steps:
        return None
    # Step k trains at lr * (k - 1) / warmup_steps during the warm-up (transformers' schedules).
    return (f"note: --warmup_steps {args.warmup_steps} is not shorter than the run's {steps} steps, so the learning "
            f"rate never reaches --learning_rate {args.learning_rate:g} (the last step's is "
            f"{args.learning_rate * (steps - 1) / args.warmup_steps:.3g}); lower --warmup_steps to reach it")


def finished_message(args: Args, steps: int) -> str:
    """The run's last line: where its results are."""
    out = args.output_dir
    parts = [f"adapter and tokenizer in {out}", f"metrics in {os.path.join(out, run_dir.METRICS_FILE)}"]
    if args.eval_passkey:
        parts.append(f"{', '.join(eval_tasks(args))} evaluation in {os.path.join(out, run_dir.EVAL_FILE)}")
    if args.merge:
        parts.append(f"merged model in {os.path.join(out, run_dir.MERGED_DIR)}")
    return (f"done: {steps} step{'s' if steps != 1 else ''}; {'; '.join(parts)}; evaluate with python -m train.eval "
            f"--adapter {out}; extend with --resume_from_checkpoint latest and a larger --max_steps")
