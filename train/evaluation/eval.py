"""`python -m train.eval`: passkey retrieval and RULER-style task accuracy (train.evaluation.tasks) and long-document
perplexity (train.evaluation.metrics) of a model.

    python -m train.eval --adapter DIR                       # the model a train.qlora run trained, as it trained it
    python -m train.eval --model_name_or_path M [--rope_scaling yarn --rope_factor 4] [--bits 4]
        [--tasks passkey niah_multikey variable_tracking] [--lengths 256 1024] [--depths 0 0.5 1] [--trials N]
        [--dataset FILE --text_field text] [--max_seq_len N] [--output_json F]
        [--lm_eval_tasks ruler | niah_single_1 ... --lm_eval_limit N [--lm_eval_stock]]

Under `accelerate launch` (or torchrun) it evaluates in training's layout (train.evaluation.split_eval): the prompts and
documents shared out over the data-parallel groups, each split over --sequence_parallel N ranks, the layers sliced over
--tensor_parallel N ranks, the weights sharded over all ranks with --fsdp; the results are one process's, written by
the main process.

--adapter DIR reads the run's own files: its base model, RoPE scaling and bits from run_info.json (for
a directory without one, such as checkpoint-N, the base from peft's adapter_config.json), and, unless
given, the settings of the run's own evaluation (tasks, lengths, depths, trials, seed), so it reproduces
eval.json's "after". Flags override the run; one that contradicts it prints a warning line. RoPE flags are applied by
train.recipe.rope, exactly as training applies them. With neither --adapter nor a model named
it evaluates the tiny model shipped in train/assets/tiny-llama. The results go to --output_json, by default
DIR/eval_results.json with --adapter, else outputs/eval/<model directory name>.json: one entry per task under
"tasks" (each {"by_length_depth", "by_length", "accuracy"}), and passkey's also at the top level, as before tasks.
A file already there is merged into (merge_results: what an earlier call measured and this one did not is kept, its
args under "earlier_calls"), or refused before any weights load when it measured another model or other depths,
trials, seed or bits; --overwrite replaces it. A bar per task on stderr counts the prompts decoded and the time left.
--lm_eval_tasks runs lm-evaluation-harness's own RULER tasks on the same model, patched (train.evaluation.harness):
their scores by length go under "lm_eval".
Flags follow train.qlora's conventions (train.recipe.args): a mistake is one `error:` line, exit 2.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from train.errors import UserError
from train.evaluation.eval_results import check_earlier, merge_results, rope_text, same_model
from train.evaluation.metrics import EVAL_SEED, format_perplexity, format_table, perplexity_by_position
from train.evaluation.tasks import (DEFAULT_TASKS, TASKS, check_task_lengths, check_task_names, evaluate_tasks,
                                    planned_work)
from train.parallel.deepspeed import LAUNCHER_ENV as DEEPSPEED_LAUNCH_ENV
from train.parallel.layout import launched_world_size, start_layout
from train.recipe import run_dir
from train.recipe.args import TINY_LLAMA_DIR, build_parser, flag, parse_tokens
from train.recipe.lifecycle import silence_library_noise
from train.recipe.rope import ROPE_TYPES, check_rope_flags, set_rope_scaling

DEFAULT_DEPTHS = [0.0, 0.25, 0.5, 0.75, 1.0]
DEFAULT_OUTPUT_DIR = "outputs/eval"  # results of a model evaluated without --adapter: <model directory name>.json


@dataclass
class EvalArgs:
    """Model and measurements"""

    adapter: str | None = flag(
        None, "output_dir of a train.qlora run (or a checkpoint-N): evaluates the model it trained, with the base, "
        "RoPE scaling and bits it records; the flags below override them. No default: without it, --model_name_or_path.")
    model_name_or_path: str | None = flag(
        None, "Base model (default: the run's with --adapter, else the shipped tiny model).")
    rope_scaling: str | None = flag(None, "RoPE scaling, applied as train.qlora applies it (default: the run's, else "
                                    "none).", choices=ROPE_TYPES, aliases=("--rope_type",))
    rope_factor: float | None = flag(
        None, "RoPE scaling factor (default with --rope_scaling: the longest --lengths over the model's positions, "
        "as training derives it from --max_seq_len).")
    bits: int | None = flag(None, "Base weights: 4 = NF4, 8 = int8, 16 = unquantised (default: the run's, else 16).",
                            choices=(4, 8, 16))
    load_in_4bit: bool = flag(False, "Same as --bits 4.")
    tasks: list[str] | None = flag(
        None, "Tasks to evaluate, each a table of accuracy by length x depth (train.evaluation.tasks): "
        f"{', '.join(TASKS)} (default: the run's --eval_tasks, else passkey).")
    lengths: list[int] | None = flag(None, "Context lengths of every task (default: the run's evaluation, else the "
                                     "run's --max_seq_len, else 256 1024).")
    depths: list[float] | None = flag(
        None, f"Depths of the needle asked about (default: the run's evaluation, else {' '.join(map(str, DEFAULT_DEPTHS))}).")
    trials: int | None = flag(None, "Trials per (length, depth) (default: the run's, else 5).")
    seed: int | None = flag(None, "Prompt seed (default: the run's evaluation seed, else 0).")
    batch_size: int = flag(8, "Prompts decoded together (bounds memory); lm-eval's, left-padded to the longest.")
    dataset: str | None = flag(None, "Held-out documents for perplexity (local file/dir or hub name); no default: "
                               "without it, no perplexity.")
    text_field: str = flag("text", "Column of --dataset holding the documents.")
    max_seq_len: int | None = flag(None, "Perplexity context (default: the largest --lengths).")
    max_docs: int = flag(100, "At most this many documents of --dataset are scored.")
    ppl_buckets: int = flag(8, "Perplexity is also reported for this many equal ranges of positions in a chunk "
                            "([0, L/8), [L/8, L/4), ... with 8): whether the model uses the far context. Each range "
                            "is one forward per chunk; 1 for a single forward.")
    sequence_parallel: int = flag(
        1, "Split every prompt and document over groups of N processes (launch W processes, W a multiple of N, with "
        "accelerate launch or torchrun): each holds 1/N of the sequence, so a length that a training step fits "
        "evaluates in the same memory per process. Results equal one process's; the main process writes them.")
    sp_mode: str = flag("ring", "Sequence-parallel attention with --sequence_parallel: ring or ulysses (query "
                        "heads must divide by N).", choices=("ring", "ulysses"))
    tensor_parallel: int = flag(
        1, "Slice every layer over groups of N processes, as train.qlora --tensor_parallel does (its checks, its "
        "slicing); composes with --sequence_parallel (launch a multiple of N x SP processes).")
    fsdp: bool = flag(False, "Shard the weights over every process with FSDP2, as train.qlora --fsdp does (also on "
                      "when launched with an accelerate FSDP config); composes with --sequence_parallel.")
    lm_eval_tasks: list[str] | None = flag(
        None, "lm-evaluation-harness's RULER tasks (pip install -e \".[ruler]\"), run by lm-eval's own HF wrapper on "
        "the patched model at each --lengths: ruler (all of these) or some of niah_single_1, niah_multikey_2, "
        "niah_multikey_3, ruler_vt, ruler_cwe, ruler_fwe (the others download data). With it, --tasks runs only "
        "when named.")
    lm_eval_limit: int | None = flag(None, "The first N of lm-eval's prompts per task and length (default: all 500, "
                                     "RULER's count).")
    lm_eval_stock: bool = flag(False, "Run --lm_eval_tasks on the unpatched model (stock transformers), to compare.")
    output_json: str | None = flag(
        None, "Where the results go (default: ADAPTER/eval_results.json with --adapter, else outputs/eval/<model "
        "directory name>.json). An earlier call's results there are kept: this call's tasks and lengths replace the "
        "same ones, the others stay (the output line says which); a file of another model or other --depths, "
        "--trials, --seed or --bits is refused (see --overwrite).")
    overwrite: bool = flag(False, "Replace the results already in --output_json instead of merging into them.")


# ---------------------------------------------------------------- what to evaluate

@dataclass
class EvalModel:
    """The model to evaluate, settled before any weights are read."""

    model_name_or_path: str  # the base
    config: object  # RoPE scaling applied
    bits: int
    trust_remote_code: bool
    tokenizer_source: str
    run: object | None  # train.recipe.model.TrainedRun when --adapter is given


def plan_model(args: EvalArgs) -> EvalModel:
    """Base, RoPE scaling and bits: a run's own (--adapter), each replaced by its flag when given, with one
    warning line per flag that contradicts what the run was trained with. Cheap: configs only."""
    from train.recipe.model import check_weight_files, load_config, read_run

    run = read_run(args.adapter, model_name_or_path=args.model_name_or_path) if args.adapter else None
    fill_passkey_defaults(args, run.info if run else None)
    if run is None:
        base, trust_remote_code = args.model_name_or_path or str(TINY_LLAMA_DIR), False
        config = load_config(base, trust_remote_code)
    else:
        base, trust_remote_code, config = run.model_name_or_path, run.trust_remote_code, run.config
        if run.info is None:
            print(f"note: {args.adapter} has no run_info.json (not a finished train.qlora run), so the RoPE scaling "
                  f"and bits it was trained with are unknown: evaluating it on {base} with the base's own RoPE and "
                  "16-bit weights; pass --rope_scaling, --rope_factor and --bits as trained", file=sys.stderr)
    if args.rope_scaling or args.rope_factor:
        # From the base's own config, exactly as training scales it.
        config = load_config(base, trust_remote_code)
        _scale_rope(config, args, run)
    check_weight_files(base)
    bits = args.bits or (run.bits if run else 16)
    if run is not None and run.info is not None:
        _warn_contradictions(run, base, config, bits)
    if run is not None:  # what load_run_model will load
        run.config, run.bits = config, bits
    args.model_name_or_path, args.bits = base, bits  # recorded in the output as evaluated
    adapter_tokenizer = args.adapter and (Path(args.adapter) / "tokenizer_config.json").is_file()
    return EvalModel(base, config, bits, trust_remote_code, args.adapter if adapter_tokenizer else base, run)


def fill_passkey_defaults(args: EvalArgs, info: dict | None) -> None:
    """Passkey settings not given as flags: those of the run's own evaluation when `info` (run_info.json)
    has them, so `--adapter DIR` alone reproduces the run's eval.json "after"; else the defaults."""
    trained = (info or {}).get("args") or {}
    if trained.get("eval_passkey"):  # the run evaluated: its own settings
        defaults = {"tasks": trained.get("eval_tasks") or DEFAULT_TASKS,
                    "lengths": trained.get("eval_lengths") or [trained["max_seq_len"]],
                    "depths": trained.get("eval_depths") or DEFAULT_DEPTHS,
                    "trials": trained.get("eval_trials") or 5, "seed": EVAL_SEED}
    elif "max_seq_len" in trained:  # it evaluated nothing: the defaults, at the length it trained for
        defaults = {"tasks": DEFAULT_TASKS, "lengths": [trained["max_seq_len"]], "depths": DEFAULT_DEPTHS,
                    "trials": 5, "seed": 0}
    else:
        defaults = {"tasks": DEFAULT_TASKS, "lengths": [256, 1024], "depths": DEFAULT_DEPTHS, "trials": 5, "seed": 0}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, list(value) if isinstance(value, list) else value)


def _scale_rope(config, args: EvalArgs, run) -> None:
    """--rope_scaling / --rope_factor on the base config, through training's own set_rope_scaling; --rope_factor
    alone keeps the run's RoPE type."""
    trained = (run.info or {}).get("rope_parameters") if run else None  # None: the run set no scaling
    kind = args.rope_scaling or (trained or {}).get("rope_type")
    check_rope_flags(kind, args.rope_factor)
    factor, original = args.rope_factor, getattr(config, "max_position_embeddings", None)
    if factor is None and original:
        # As training derives it from --max_seq_len: the longest evaluated length over the model's positions.
        if max(args.lengths) <= original:
            raise UserError(f"--rope_scaling {kind} without --rope_factor: the longest --lengths, {max(args.lengths)}, "
                            f"fits the model's {original} positions, so no factor can be derived; give --rope_factor")
        factor = max(args.lengths) / original
    # No check that --lengths fit the stretched positions: evaluating past them is a legitimate extrapolation test.
    set_rope_scaling(config, kind, factor)


def _warn_contradictions(run, base: str, config, bits: int) -> None:
    """One warning line per flag that changes the model the run trained (run.config: the run's RoPE)."""
    source = Path(run.adapter_dir) / run_dir.RUN_INFO_FILE
    lines = []
    if not same_model(base, run.trained_base):
        lines.append(f"--model_name_or_path {base} replaces the base the run was trained on ({run.trained_base})")
    if (config.rope_parameters, getattr(config, "max_position_embeddings", None)) != \
            (run.config.rope_parameters, getattr(run.config, "max_position_embeddings", None)):
        lines.append(f"the RoPE flags give {rope_text(config.rope_parameters)}, the run was trained with "
                     f"{rope_text(run.config.rope_parameters)}")
    if bits != run.bits:
        lines.append(f"--bits {bits} loads the base unlike the run, which trained on {run.bits}-bit weights")
    for text in lines:
        print(f"warning: {text} (from {source}): this evaluates another model than the one trained", file=sys.stderr)


def load_for_eval(args: EvalArgs, output: str | None = None):
    """(model, tokenizer) that `args` name, on one process: for --adapter, the run's own model, loaded by
    train.recipe.model's code. Every check comes before the weights are read, that `output` (the results file) can be
    written included."""
    plan, tokenizer = _prepare(args, output)
    return _load_weights(plan), tokenizer


def _prepare(args: EvalArgs, output: str | None):
    """(EvalModel, tokenizer) after every check that needs no weights, the layout's (training's own) included."""
    from train.parallel.fsdp import check_fsdp, use_launcher_fsdp
    from train.parallel.layout import check_mesh, check_tensor_parallel_model
    from train.recipe.model import load_tokenizer

    if os.environ.get(DEEPSPEED_LAUNCH_ENV, "false").lower() == "true":
        raise UserError("train.eval does not run under a DeepSpeed launch; launch with configs/accelerate/cpu_ddp.yaml "
                        "or multi_gpu.yaml and pass --fsdp to shard the weights over the processes")
    use_launcher_fsdp(args)
    plan = plan_model(args)  # resolves --bits, which the checks read
    check_mesh(args)
    check_fsdp(args, plan.config)
    check_tensor_parallel_model(args, plan.config)
    tokenizer = load_tokenizer(plan.tokenizer_source, plan.trust_remote_code)
    check_task_lengths(tokenizer, args.tasks, args.lengths)
    if output is not None:
        run_dir.check_writable(os.path.dirname(output) or ".", "--output_json's directory")
        check_earlier(args, output, plan.config)
    return plan, tokenizer


def _load_weights(plan: EvalModel, shardable: bool = False):
    from train.recipe.model import load_base, load_run_model

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if plan.run is not None:
        return load_run_model(plan.run, device, shardable=shardable)
    return load_base(plan.model_name_or_path, plan.config, bits=plan.bits, device=device,
                     trust_remote_code=plan.trust_remote_code, shardable=shardable)


def _split_patch(args: EvalArgs):
    """What place_model patches the slices with: under --sequence_parallel the blockwise patch, where the split
    attention runs (loss-only in eval mode, as training patches it); else nothing (the model as loaded)."""
    if args.sequence_parallel == 1:
        return None
    from patches import apply_bpt_patch, is_patched

    return lambda sliced: None if is_patched(sliced) else apply_bpt_patch(sliced, eval_logits=False)


def parse_args(argv=None) -> EvalArgs:
    parser = build_parser((EvalArgs,), prog="python -m train.eval", default_run=None, config_flag=False,
                          description="Passkey retrieval and long-document perplexity of a model or a train.qlora run.")
    args = EvalArgs(**parse_tokens(parser, sys.argv[1:] if argv is None else [str(a) for a in argv]))
    if args.load_in_4bit:
        args.bits = 4
    if args.tasks is not None:
        args.tasks = check_task_names(args.tasks)
    if args.lm_eval_tasks is not None:
        from train.evaluation import harness

        if args.sequence_parallel > 1 or args.tensor_parallel > 1 or args.fsdp or launched_world_size() > 1:
            raise UserError("--lm_eval_tasks runs in one process (lm-eval's loop cannot share or split its prompts "
                            "over processes); run it without accelerate launch, --sequence_parallel, "
                            "--tensor_parallel and --fsdp")
        args.lm_eval_tasks = harness.check_tasks(args.lm_eval_tasks)
        if args.tasks is None:
            args.tasks = []  # only lm-eval's, unless --tasks names ours too
    if any(not 0 <= depth <= 1 for depth in args.depths or []):
        raise UserError(f"--depths must be fractions in [0, 1], got {args.depths}")
    if (args.trials is not None and args.trials < 1) or any(length < 1 for length in args.lengths or []):
        raise UserError("--trials and every --lengths value must be positive integers")
    for name in ("batch_size", "max_docs", "max_seq_len", "ppl_buckets", "sequence_parallel", "tensor_parallel",
                 "lm_eval_limit"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UserError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    return args


def output_path(args: EvalArgs) -> str:
    if args.output_json:
        return args.output_json
    if args.adapter:
        return os.path.join(args.adapter, run_dir.EVAL_RESULTS_FILE)
    name = Path(args.model_name_or_path or TINY_LLAMA_DIR).name or "model"
    return os.path.join(DEFAULT_OUTPUT_DIR, f"{name}.json")


def run(args: EvalArgs) -> dict:
    from train.evaluation.split_eval import SplitEval, work_done
    from train.parallel.placement import layout_text, place_model

    output = output_path(args)
    plan, tokenizer = _prepare(args, output)
    prompts = None
    if args.lm_eval_tasks:  # built before any weights load (train.evaluation.harness)
        from train.evaluation import harness

        prompts = harness.build_tasks(tokenizer, plan.tokenizer_source, args.lm_eval_tasks, args.lengths)
    layout = start_layout(args)
    main_process = layout is None or layout.rank == 0
    if main_process and args.tasks:  # the planned work, before the weights load
        shared = (f", shared over {layout.data_world} data-parallel groups (the bars count the main process's share)"
                  if layout is not None and layout.data_world > 1 else "")
        print(f"evaluating {planned_work(args.tasks, args.lengths, args.depths, args.trials)}, in batches of up to "
              f"{args.batch_size}{shared}", file=sys.stderr, flush=True)
    if layout is None:
        model = _load_weights(plan)
    else:  # placed as training places it, by training's own code; nothing trains: FSDP keeps every weight as loaded
        model = _load_weights(plan, shardable=args.fsdp).requires_grad_(False)
        model, _, _ = place_model(model, args, layout, patch=_split_patch(args))
    # Work shared over the data-parallel groups, each sequence over its sequence-parallel group
    # (train.evaluation.split_eval).
    split = None if layout is None else SplitEval.of(layout, lockstep=args.fsdp)
    if main_process and layout is not None:
        print(f"evaluating on {layout.world} processes: {layout.data_world} data-parallel group(s)"
              + layout_text(layout, model), file=sys.stderr, flush=True)
    tasks = evaluate_tasks(model, tokenizer, args.tasks, lengths=args.lengths, depths=args.depths,
                           trials=args.trials, seed=args.seed, batch_size=args.batch_size, split=split,
                           progress=main_process)
    result = dict(tasks.get("passkey", {}))  # passkey at the top level too, as before there were tasks
    result["tasks"] = tasks
    for name, task_result in tasks.items():
        if main_process:
            print(format_table(task_result, name))
    if args.dataset:
        from train.recipe.data import load_text_dataset

        ds = load_text_dataset(args.dataset)
        if args.text_field not in ds.column_names:
            raise UserError(f"--text_field '{args.text_field}' is not a column of {args.dataset}; "
                            f"available: {', '.join(ds.column_names)}")
        texts = list(ds.select(range(min(len(ds), args.max_docs)))[args.text_field])
        max_seq_len = args.max_seq_len or max(args.lengths)
        by_position = perplexity_by_position(model, tokenizer, texts, max_seq_len=max_seq_len,
                                             n_buckets=args.ppl_buckets, split=split)
        result["perplexity"] = by_position["perplexity"]
        result["perplexity_max_seq_len"] = max_seq_len
        result["perplexity_by_position"] = by_position["buckets"]
        if main_process:
            print(format_perplexity(by_position, max_seq_len))
    if prompts is not None:
        from train.evaluation import harness

        raw = harness.simple_evaluate(model, tokenizer, prompts, limit=args.lm_eval_limit,
                                      batch_size=args.batch_size, patched=not args.lm_eval_stock)
        result["lm_eval"] = harness.summarise(raw, prompts, args.lm_eval_limit, patched=not args.lm_eval_stock)
        print(harness.format_results(result["lm_eval"]))
    config = model.get_base_model().config if args.adapter else model.config
    result["rope_parameters"] = config.rope_parameters
    result["max_position_embeddings"] = getattr(config, "max_position_embeddings", None)
    result["args"] = dataclasses.asdict(args)  # as resolved: the run's base, bits and passkey settings filled in
    if split is not None:  # what each rank evaluated: prompts decoded, scoring forwards run (repeats not counted)
        result["work_by_rank"] = work_done(split)
    if not main_process:
        return result
    written, merged = merge_results(None if args.overwrite else run_dir.read_json(output), result)
    run_dir.write_json(output, written)
    _pictures(args, output, written)
    print(f"results written to {output}" + (f" ({merged})" if merged else ""), file=sys.stderr)
    return result


def _pictures(args: EvalArgs, output: str, result: dict) -> None:
    """<output>_accuracy_<task>.png beside the results (with --adapter, the run's own "before" beside them); when
    the results go into the run's directory, its loss.png too."""
    from train.evaluation import plots

    before = None
    if args.adapter:
        try:
            before = (run_dir.read_json(os.path.join(args.adapter, run_dir.EVAL_FILE)) or {}).get("before")
        except UserError:  # an unreadable eval.json: this evaluation alone
            before = None
    if plots.write_eval_pictures(result, output, before) and args.adapter and \
            os.path.abspath(os.path.dirname(output) or ".") == os.path.abspath(args.adapter):
        plots.write_run_pictures(args.adapter, None, run_dir.METRICS_FILE)


def main(argv=None) -> int:
    silence_library_noise()  # before bitsandbytes is imported: it logs its noise at import
    try:
        run(parse_args(argv))
    except UserError as e:
        if os.environ.get("RANK", "0") == "0":  # every rank meets the same error: the main one says it
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():  # several processes
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
    return 0

