"""The CLI schema of `python -m train.qlora`: dataclasses whose fields are the flags.

Every field becomes `--<name>` (booleans also get `--no_<name>`), its metadata["help"] is the
--help text and metadata["choices"] the allowed values. Values are layered, later wins:

    field defaults  <  DEFAULT_RUN (only when no model is named)  <  --config YAML  <  flags

YAML keys are the flag names; YAML and flags go through the same argparse parser, so a value is
converted and checked the same way wherever it comes from. Every mistake raises UserError.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

from bpt.gpusim.gpus import DEVICES
from train.errors import UserError
from train.recipe.formats import FORMAT_CHOICES
from train.recipe.presets import load_yaml, yaml_to_argv
from train.recipe.rope import ROPE_TYPES, check_rope_flags

TINY_LLAMA_DIR = Path(__file__).resolve().parent.parent / "assets" / "tiny-llama"
PLAN_DEVICES = tuple(name for name, gpu in DEVICES.items() if gpu.is_cuda)  # --plan: the simulated GPUs

SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
              "inverse_sqrt")


def flag(default, help: str, choices=None, aliases: tuple[str, ...] = (), bpt_default: bool = False):
    """A dataclass field that is a command-line flag (of train.qlora's schema or train.eval's), carrying its --help
    text, allowed values, other flag spellings and (bpt_default) that its None means "bpt.config.BPTConfig's value"
    as metadata. A help text that says "default" itself gets no "(default: ...)" appended."""
    metadata = {"help": help, "aliases": tuple(aliases), "bpt_default": bpt_default}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ModelArguments:
    """Model and precision"""

    model_name_or_path: str | None = flag(
        None, "Hub name or local directory of the base model. When no model is named (flag or --config), "
        "the embedded default run is used: the bundled train/assets/tiny-llama with the passkey data.")
    trust_remote_code: bool = flag(False, "Allow model code from the hub repository to run (off by default).")
    bits: int = flag(4, "Base weights: 4 = NF4 QLoRA with double quantisation, 8 = int8, 16 = not quantised "
                     "(bf16 on GPU, fp32 on CPU).", choices=(4, 8, 16))
    rope_scaling: str | None = flag(
        None, "RoPE scaling used to run past the model's max_position_embeddings.", choices=ROPE_TYPES)
    rope_factor: float | None = flag(
        None, "RoPE scaling factor; default max_seq_len / the model's max_position_embeddings.")
    mixed_precision: str | None = flag(
        None, "Autocast precision; default: the accelerate launch config's, else bf16 on a GPU that supports it, "
        "else no.", choices=("no", "fp16", "bf16"))


@dataclass
class DataArguments:
    """Data"""

    dataset: str = flag("passkey", "Hub dataset name, local json/jsonl/txt/parquet/csv file or directory, or "
                        "'passkey' (built-in synthetic passkey-retrieval data).")
    dataset_split: str = flag("train", "Split of the dataset to train on.")
    dataset_format: str = flag(
        "auto", "Format of the dataset's rows: text (a 'text' column, every token trained), chat ('messages': "
        "role / content turns rendered by the chat template, loss on the assistant turns), prompt_completion "
        "('prompt' + 'completion', plain text or lists of turns; loss on the completion) or alpaca ('instruction', "
        "optional 'input', 'output'; the Alpaca prompt, loss on the output); auto finds it from the columns, in "
        "that order of preference (chat first, text last).", choices=FORMAT_CHOICES)
    text_field: str = flag("text", "Column holding the raw text of the text format (setting it to another column "
                           "chooses the text format).")
    prompt_field: str | None = flag(None, "Column holding the prompt (no loss on it); needs --response_field; the "
                                    "prompt_completion format on these two columns, joined as written (no separator).")
    response_field: str | None = flag(None, "Column holding the response the loss is computed on (then EOS).")
    chat_template: str | None = flag(
        None, "File holding a Jinja chat template to render chat and conversational rows with, in place of the "
        "tokenizer's (needed where the tokenizer has none); saved with the adapter's tokenizer.")
    train_on_prompt: bool = flag(False, "Put every token of chat, prompt_completion and alpaca rows in the loss, "
                                 "not only the answers.")
    packing: bool = flag(True, "Pack rows of max_seq_len tokens (position ids restart per document): text documents "
                         "one after another, a long one continuing in the next row; samples of the other formats "
                         "whole, best fit, the rest of a row a padding document without loss.")
    max_seq_len: int = flag(4096, "Tokens per training row. A chat, prompt_completion or alpaca sample longer than "
                            "this is dropped (counted in the run's data line), never cut.")
    passkey_samples: int = flag(256, "Number of synthetic examples when --dataset passkey.")
    num_proc: int | None = flag(None, "Processes for tokenisation (datasets.map num_proc).")


@dataclass
class LoraArguments:
    """LoRA"""

    lora_r: int = flag(16, "LoRA rank.")
    lora_alpha: float = flag(32.0, "LoRA alpha (the update is scaled by alpha / r).")
    lora_dropout: float = flag(0.05, "Dropout on the LoRA input.")
    lora_target_modules: list[str] = flag(
        ["all-linear"], "Module names to adapt (space or comma separated), or all-linear.")
    train_embeddings_and_norms: bool = flag(
        False, "LongLoRA style: also train the input embeddings and all norm layers (saved with the adapter).")


BPT_SIZES = ("q_block", "kv_block", "mlp_chunk", "loss_chunk", "norm_chunk")  # tokens
BPT_OPTIONS = (*BPT_SIZES, "chunk_budget", "attention_once")  # flags passed to apply_bpt_patch (None: its default)


@dataclass
class BPTArguments:
    """Blockwise (BPT) patch"""

    bpt: bool = flag(True, "Patch the model with blockwise attention / MLP / loss (apply_bpt_patch).")
    q_block: int | None = flag(None, "Query block size of blockwise attention.", bpt_default=True)
    kv_block: int | None = flag(None, "Key/value block size of blockwise attention.", bpt_default=True)
    mlp_chunk: int | None = flag(None, "Tokens per chunk of the chunked MLP.", bpt_default=True)
    loss_chunk: int | None = flag(None, "Tokens per chunk of the chunked LM head + loss.", bpt_default=True)
    norm_chunk: int | None = flag(None, "Tokens per chunk of a norm's backward (its fp32 temporaries).",
                                  bpt_default=True)
    chunk_budget: int | None = flag(
        None, "Bytes a chunk (MLP, norm, loss) may hold: where the token sizes above hold less, chunks take more "
        "tokens (fewer kernel launches); default on CUDA: up to 1/8 of the device and a quarter of what is free "
        "beyond 1/4 of it, 0 on CPU; 0: the sizes exactly.")
    bpt_compile: bool | None = flag(None, "torch.compile the patch's blocks and module bodies (MLP, norms, LoRA "
                                    "projections, rotary); default: only on CUDA.")
    attention_once: bool | None = flag(
        None, "With gradient checkpointing, keep each layer's attention output and logsumexp from its forward so that "
        "its recompute in backward skips the attention (~a fifth of a long step) for one more [tokens, hidden] tensor "
        "per layer on the device; default: where that fits a quarter of the device (half with "
        "--offload_checkpoints); --plan says which.")
    offload_checkpoints: bool = flag(False, "Keep the layer checkpoints in host memory (pinned, copied on a side "
                                     "stream, prefetched one layer ahead): device memory then no longer grows with "
                                     "layers x tokens; host memory does. Needs gradient checkpointing.")
    offload_keep_last: int = flag(0, "With --offload_checkpoints, keep the last N saved tensors (the loss's and final "
                                  "norm's inputs, then the last layers' inputs: the first the backward needs) on the "
                                  "device: each keeps one [tokens, hidden] tensor there and frees as much host "
                                  "memory. --plan says how many a machine's host memory needs.")
    checkpoint_stride: int = flag(1, "Keep one layer checkpoint in N on the device and run the layers before each "
                                  "other one forward again when the backward needs it: the checkpoints' memory / N, "
                                  "for (N - 1) / 2 more layer forwards per layer (2: about 1/8 of a step's time). "
                                  "Without --offload_checkpoints; one process or data parallel.")


@dataclass
class TrainArguments:
    """Training loop and outputs"""

    output_dir: str = flag("outputs/qlora-run", "Where checkpoints, metrics.jsonl and the final adapter go.")
    overwrite_output_dir: bool = flag(False, "Start over in an output_dir that holds a finished run or checkpoints.")
    per_device_train_batch_size: int = flag(1, "Rows per micro-batch on each device.")
    gradient_accumulation_steps: int = flag(1, "Micro-batches per optimizer step.")
    learning_rate: float = flag(2e-4, "Peak learning rate.")
    weight_decay: float = flag(0.0, "AdamW weight decay.")
    lr_scheduler_type: str = flag("cosine", "Learning-rate schedule (transformers.get_scheduler).", choices=SCHEDULERS)
    warmup_steps: int = flag(0, "Linear warm-up steps.")
    max_steps: int = flag(-1, "Optimizer steps to run; -1 = run --num_train_epochs.")
    num_train_epochs: float = flag(1.0, "Epochs over the dataset (used when --max_steps is -1).")
    optim: str = flag("adamw", "Optimizer: torch AdamW or bitsandbytes paged 8-bit AdamW.",
                      choices=("adamw", "paged_adamw_8bit"))
    max_grad_norm: float = flag(1.0, "Gradient clipping norm; 0 disables clipping.")
    gradient_checkpointing: bool = flag(True, "Recompute layer activations in backward (use_reentrant=False).")
    sequence_parallel: int = flag(
        1, "Split every sequence over N processes (of those accelerate launch starts; data parallel over the "
        "groups). Needs the patch; the number of processes must be a multiple of N. Losses equal a one-process run's "
        "only with --lora_dropout 0: each process draws its own dropout masks for its shard.")
    tensor_parallel: int = flag(
        1, "Split every q/k/v/o and MLP layer (heads, MLP channels) over N processes, Megatron style (of those "
        "accelerate launch starts; data parallel over the groups; the number of processes must be a multiple of N). "
        "Families with a plain colwise / rowwise tp plan in transformers; at --bits 4 each slice must hold whole "
        "64-weight quantisation blocks. With --sequence_parallel M: groups of N x M processes, each sequence split M "
        "ways over ranks holding the same slices. With --fsdp each slice is sharded over the ranks holding it.")
    sp_mode: str = flag("ring", "Sequence-parallel attention: ring (any head count; not ALiBi-bias families or "
                        "attention sinks) or ulysses (query heads must divide by N).", choices=("ring", "ulysses"))
    fsdp: bool = flag(False, "Shard the (4-bit) base and LoRA over every process with FSDP2 (torch fully_shard), so "
                      "a model too large for one device trains (with --tensor_parallel N: each slice over the "
                      "processes holding it); also on when launched with an accelerate FSDP config.")
    fsdp_cpu_offload: bool = flag(False, "With --fsdp: keep each process's weight shards, gradients and optimizer "
                                  "state in host memory (FSDP2 CPUOffloadPolicy, pinned on GPUs); each layer's shards "
                                  "come to the device for its compute, and the optimizer steps on the CPU.")
    seed: int = flag(42, "Seed for LoRA init, data order and dropout.")
    torch_threads: int | None = flag(
        None, "CPU threads per process for torch ops (torch.set_num_threads); default: all but one of the cores this "
        "process may run on, shared by the processes a launch started on this machine, at least 1 (torch's own, every "
        "core, spins its threads against whatever else runs: docs/training.md).")
    save_steps: int = flag(200, "Write checkpoint-N every N optimizer steps; 0 = no intermediate checkpoints.")
    save_minutes: float = flag(30.0, "Also write checkpoint-N when this many minutes have passed since the last one "
                               "(or the start), so a crash loses at most that much work; 0 = by --save_steps only.")
    logging_steps: int = flag(1, "Log (metrics.jsonl, trackers) every N optimizer steps.")
    resume_from_checkpoint: str | None = flag(
        None, "Checkpoint directory to resume from, or 'latest' for the newest checkpoint-N in output_dir.")
    report_to: str = flag("none", "Experiment tracker (accelerate trackers).", choices=("none", "tensorboard", "wandb"))
    merge: bool = flag(False, "Also write the base merged with the adapter (unquantised) to output_dir/merged.")
    plan: str | None = flag(
        None, "Only plan: simulate one training step of this run on this GPU (nothing downloaded, no weights "
        "loaded), print its predicted peak memory, whether it fits, the longest --max_seq_len that fits and the "
        "largest tensors at the peak, then exit without training.", choices=PLAN_DEVICES)
    plan_longest: bool = flag(True, "With --plan, after the verdict search the longest --max_seq_len that fits: a few "
                              "more simulated steps, each about as long as the first (minutes for an 8B model on a "
                              "small CPU); --no_plan_longest stops after the verdict.")
    skip_memory_check: bool = flag(
        False, "Train even when the memory preflight refuses the run: before any data or weights load, this run's "
        "step, evaluation and --dataset passkey rows are estimated (--plan's simulation, on this CPU or GPU) and a "
        "run needing over 1.25x the memory available is stopped with the longest --max_seq_len that fits.")


@dataclass
class EvalArguments:
    """Evaluation before and after training"""

    eval_passkey: bool = flag(False, "Evaluate before and after training (eval.json): the --eval_tasks (passkey "
                              "retrieval accuracy unless given).")
    eval_tasks: list[str] | None = flag(
        None, "Tasks of the evaluation before and after training (train.evaluation.tasks: passkey, niah_single, "
        "niah_multikey, niah_multivalue, niah_multiquery, variable_tracking, ...); giving them turns the evaluation "
        "on. Default: passkey.")
    eval_lengths: list[int] | None = flag(None, "Context lengths of the passkey evaluation; default: max_seq_len.")
    eval_depths: list[float] = flag([0.1, 0.5, 0.9], "Relative depths of the passkey in the context.")
    eval_trials: int = flag(4, "Passkey trials per (length, depth).")


GROUPS = (ModelArguments, DataArguments, LoraArguments, BPTArguments, TrainArguments, EvalArguments)

# The embedded default run (configs/default.yaml mirrors it; a test keeps the two in sync): a real
# context extension of the bundled tiny char-level llama from its pretraining length (256) to 8x that.
DEFAULT_RUN = {
    "model_name_or_path": str(TINY_LLAMA_DIR),
    "dataset": "passkey",
    # 8x: 16x (4096) learns too slowly for the time budget (150 steps: passkey 0 -> 0.33, 170 s of CPU already).
    "max_seq_len": 2048,
    # YaRN, not linear: linear squeezes the offsets between neighbouring characters, which this char-level
    # model cannot read (at 4x: loss 4.0 at step 0, passkey 0 before and still 0 after 400 steps); YaRN leaves
    # the high-frequency dimensions alone (x8, 300 steps at lr 1e-3: README "The default run").
    "rope_scaling": "yarn",
    "bits": 4,
    "bpt": True,
    "passkey_samples": 400,
    "lora_r": 16,
    "lora_alpha": 32.0,
    "lora_dropout": 0.0,
    "train_embeddings_and_norms": True,
    "learning_rate": 1e-3,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 10,
    "max_steps": 300,  # the answer loss stays below 0.01 from step ~210; 300 leave a margin
    "per_device_train_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "save_steps": 100,
    "logging_steps": 10,
    "eval_passkey": True,
    # 5 depths x 10 trials = 50 prompts at 2048, so 0.9 is not luck; the key at the very start (depth 0) is the
    # farthest retrieval.
    "eval_depths": [0.0, 0.25, 0.5, 0.75, 1.0],
    "eval_trials": 10,
    "output_dir": "outputs/default-run",
    "torch_threads": 1,  # 150 steps at 1024 tokens: 35 s with 1 thread, 310 s with 2 on a busy 2-core machine (same losses)
}


@dataclass
class Args(ModelArguments, DataArguments, LoraArguments, BPTArguments, TrainArguments, EvalArguments):
    """All flags in one flat namespace (what the trainer reads)."""

    config: str | None = None  # the --config file the run was started with (recorded, not a schema field)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def schema_fields() -> dict[str, dataclasses.Field]:
    """Flag name -> dataclass field, over all argument groups."""
    return {f.name: f for group in GROUPS for f in dataclasses.fields(group)}


def _kind(group: type, name: str) -> tuple[type, bool]:
    """(scalar type, is_list) of a field, with Optional unwrapped."""
    hint = typing.get_type_hints(group)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, type(int | None)) and len(args) == 1:
        hint = args[0]
    if typing.get_origin(hint) is list:
        return typing.get_args(hint)[0], True
    return hint, False


class _Parser(argparse.ArgumentParser):
    """argparse that raises UserError (one line, exit 2 in the CLI) instead of printing usage."""

    def error(self, message):
        raise UserError(f"{message} (see {self.prog} --help)")


QLORA_DESCRIPTION = (
    "Long-context QLoRA fine-tuning of a HuggingFace causal LM with blockwise (BPT) attention, MLP and loss. "
    "With no model named (no --model_name_or_path, flag or --config) it runs the embedded default run: an 8x context "
    "extension of a bundled tiny llama on synthetic passkey data, evaluated before and after (configs/default.yaml). "
    "That run replaces some of the defaults listed below; each such flag shows its value as 'default run: ...'.")


def build_parser(groups=GROUPS, *, prog: str = "python -m train.qlora", description: str = QLORA_DESCRIPTION,
                 default_run: dict | None = DEFAULT_RUN, config_flag: bool = True) -> argparse.ArgumentParser:
    """An argparse parser whose flags are the fields of `groups` (one help section each)."""
    # Unset flags stay out of the namespace (defaults are layered by the caller); no abbreviations,
    # so a misspelt flag is an error instead of silently meaning another flag.
    parser = _Parser(prog=prog, description=description, argument_default=argparse.SUPPRESS, allow_abbrev=False)
    if config_flag:
        parser.add_argument("--config", help="YAML file of flag defaults (keys = flag names); flags override it.")
    for group in groups:
        section = parser.add_argument_group(group.__doc__)
        for f in dataclasses.fields(group):
            _add_flag(section, group, f, default_run or {})
    return parser


def _help(f: dataclasses.Field, default, default_run: dict) -> str:
    text = f.metadata["help"]
    if f.metadata.get("bpt_default"):
        from bpt.config import BPTConfig

        return f"{text} (default: {getattr(BPTConfig, f.name)}, bpt.config.BPTConfig's)"
    if "default" in text.lower():
        return text  # it says its default itself
    shown = f"default: {default}"
    if f.name in default_run and default_run[f.name] != default:
        shown += f"; default run: {default_run[f.name]}"
    return f"{text} ({shown})"


def _add_flag(section, group: type, f: dataclasses.Field, default_run: dict) -> None:
    scalar, is_list = _kind(group, f.name)
    default = f.default_factory() if f.default is dataclasses.MISSING else f.default
    help_text = _help(f, default, default_run)
    if scalar is bool:
        section.add_argument(f"--{f.name}", dest=f.name, action="store_true", help=help_text)
        section.add_argument(f"--no_{f.name}", dest=f.name, action="store_false", help=f"Turn --{f.name} off.")
        return
    kwargs = {"type": scalar, "help": help_text, "metavar": f.name.upper()}
    if "choices" in f.metadata:
        kwargs["choices"] = f.metadata["choices"]
        kwargs.pop("metavar")
    if is_list:
        kwargs["nargs"] = "+"
    section.add_argument(f"--{f.name}", *f.metadata.get("aliases", ()), dest=f.name, **kwargs)


def parse_tokens(parser: argparse.ArgumentParser, argv: list[str], source: str = "command line") -> dict:
    """The flags given in `argv` (only those), or UserError naming `source`."""
    try:
        return vars(parser.parse_args(argv))
    except UserError as error:
        raise UserError(f"{source}: {error}") from None


def parse_args(argv: list[str] | None = None) -> Args:
    """Layer field defaults, the embedded default run, --config YAML and flags into one validated Args."""
    parser = build_parser()
    cli = parse_tokens(parser, sys.argv[1:] if argv is None else argv, "command line")
    layers: dict = {}
    config_path = cli.pop("config", None)
    yaml_values = {}
    if config_path is not None:
        yaml_values = load_yaml(config_path)
        if "config" in yaml_values:
            raise UserError(f"--config {config_path}: a config file cannot name another config")
        yaml_values = parse_tokens(parser, yaml_to_argv(yaml_values, config_path, schema_fields()), config_path)
    if "model_name_or_path" not in cli and "model_name_or_path" not in yaml_values:
        layers.update(DEFAULT_RUN)
    layers.update(yaml_values)
    layers.update(cli)
    args = Args(**layers, config=config_path)
    validate(args)
    return args


def _split_commas(values: list[str]) -> list[str]:
    return [part for value in values for part in value.split(",") if part]


def validate(args: Args) -> None:
    """Value checks argparse cannot express; raises UserError naming the flag."""
    args.lora_target_modules = _split_commas(args.lora_target_modules)
    positive = ["max_seq_len", "per_device_train_batch_size", "gradient_accumulation_steps", "lora_r",
                "logging_steps", "passkey_samples", "eval_trials", "sequence_parallel",
                "tensor_parallel"]
    for name in positive:
        if getattr(args, name) <= 0:
            raise UserError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    for name in (*BPT_SIZES, "num_proc", "torch_threads"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise UserError(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if args.chunk_budget is not None and args.chunk_budget < 0:
        raise UserError(f"--chunk_budget must be a number of bytes >= 0, got {args.chunk_budget}")
    for name in ("save_steps", "save_minutes", "warmup_steps", "max_grad_norm", "weight_decay"):
        if getattr(args, name) < 0:
            raise UserError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.learning_rate <= 0:
        raise UserError(f"--learning_rate must be > 0, got {args.learning_rate}")
    if not 0 <= args.lora_dropout < 1:
        raise UserError(f"--lora_dropout must be in [0, 1), got {args.lora_dropout}")
    if args.max_steps == 0 or args.max_steps < -1:
        raise UserError(f"--max_steps must be a positive number of steps or -1 (use --num_train_epochs), "
                        f"got {args.max_steps}")
    if args.max_steps == -1 and args.num_train_epochs <= 0:
        raise UserError(f"--num_train_epochs must be > 0, got {args.num_train_epochs}")
    check_rope_flags(args.rope_scaling, args.rope_factor)
    if (args.prompt_field is None) != (args.response_field is None):
        raise UserError("--prompt_field and --response_field go together: give both, or neither to train on "
                        "--text_field")
    if args.eval_tasks is not None:  # the names are checked by train.qlora's preflight (train.evaluation.tasks)
        args.eval_passkey = True
    if any(not 0 <= depth <= 1 for depth in args.eval_depths):
        raise UserError(f"--eval_depths must be fractions in [0, 1], got {args.eval_depths}")
    if args.eval_lengths is not None and any(length <= 0 for length in args.eval_lengths):
        raise UserError(f"--eval_lengths must be positive, got {args.eval_lengths}")
    if args.bpt_compile and not args.bpt:
        raise UserError("--bpt_compile needs --bpt (it compiles the blockwise functions)")
    if args.attention_once and not (args.bpt and args.gradient_checkpointing):
        raise UserError("--attention_once keeps the attention for the layers' recompute: it needs --bpt and gradient "
                        "checkpointing (drop --no_gradient_checkpointing)")
    if args.checkpoint_stride < 1:
        raise UserError(f"--checkpoint_stride must be at least 1 (1: every layer checkpoint kept), got "
                        f"{args.checkpoint_stride}")
    if args.checkpoint_stride > 1:
        if not (args.bpt and args.gradient_checkpointing):
            raise UserError("--checkpoint_stride thins the layer checkpoints: it needs --bpt and gradient "
                            "checkpointing (drop --no_gradient_checkpointing / --no_bpt)")
        if args.offload_checkpoints:
            raise UserError("--checkpoint_stride and --offload_checkpoints both take the layer checkpoints off the "
                            "device: choose one")
        if args.fsdp or args.sequence_parallel > 1 or args.tensor_parallel > 1:
            raise UserError("--checkpoint_stride runs on one process or data parallel: drop it with --fsdp, "
                            "--sequence_parallel or --tensor_parallel (--offload_checkpoints works with them)")
    if args.offload_keep_last < 0 or (args.offload_keep_last and not args.offload_checkpoints):
        raise UserError(f"--offload_keep_last keeps the last N offloaded tensors on the device: it needs "
                        f"--offload_checkpoints and N >= 0, got {args.offload_keep_last}")
    if args.offload_checkpoints and not (args.bpt and args.gradient_checkpointing):
        raise UserError("--offload_checkpoints moves the layer checkpoints to host memory: it needs --bpt and "
                        "gradient checkpointing (drop --no_gradient_checkpointing / --no_bpt)")
