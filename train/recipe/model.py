"""Model side of the recipe: config checks, RoPE scaling, tokenizer, and the load order

    base (4-bit NF4 / 8-bit / 16-bit) -> patches.kbit.prepare_kbit_model -> LoRA -> apply_bpt_patch

(the patch goes on where the model is placed, train.parallel.placement, after tensor-parallel slicing).

Cheap checks (`load_config`, `check_weight_files`, `check_bpt_support`, `load_tokenizer`; RoPE: train.recipe.rope) run
before any weights are read, so user mistakes fail in a second.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from train.errors import UserError, one_line
from train.recipe.args import BPT_OPTIONS
from train.recipe.file_modes import as_umask_allows
from train.recipe.run_dir import ADAPTER_CONFIG_FILE, RUN_INFO_FILE, read_adapter_dir

def load_config(name_or_path: str, trust_remote_code: bool):
    """The model's config, or UserError when the model cannot be found or read."""
    local = os.path.expanduser(name_or_path)
    if os.path.isdir(local):
        if not os.path.isfile(os.path.join(local, "config.json")):
            raise UserError(f"model directory {name_or_path} has no config.json; point --model_name_or_path at a "
                            "directory written by save_pretrained or at a hub model name")
    elif os.path.exists(local) or name_or_path.startswith((".", "/", "~")) or name_or_path.count("/") > 1:
        raise UserError(f"--model_name_or_path {name_or_path} is not a model directory (it does not exist or is a "
                        "file); give a directory written by save_pretrained or a hub name like org/model")
    try:
        return AutoConfig.from_pretrained(local if os.path.isdir(local) else name_or_path,
                                          trust_remote_code=trust_remote_code)
    except ValueError as error:
        if "trust_remote_code" in str(error):
            raise UserError(f"model {name_or_path} needs its own code from the hub: review it, then add "
                            "--trust_remote_code") from None
        raise UserError(f"cannot read the config of model {name_or_path}: {one_line(error)}") from None
    except OSError as error:
        if os.path.isdir(local):
            raise UserError(f"cannot read the config of model {name_or_path}: {one_line(error)}") from None
        raise UserError(f"cannot load model {name_or_path}: not a local directory and not available from the hub "
                        f"(offline or misspelled?): {one_line(error)}") from None


def check_bpt_support(config) -> None:
    """UserError when apply_bpt_patch cannot handle this family (checked before loading weights)."""
    from patches import UnsupportedModelError, check_supported

    try:
        check_supported(config)
    except UnsupportedModelError as error:
        message = one_line(error)
        if "--no_bpt" not in message:
            message += "; pass --no_bpt to train without the blockwise patch"
        raise UserError(message) from None


def check_packing(config, packing: bool) -> None:
    """UserError when packing would let documents attend to each other: a family whose stock masks ignore the
    restarting position ids, or whose recurrent layers carry state across (Family.packing). Patched or not."""
    from patches import FAMILIES

    family = FAMILIES.get(getattr(config, "model_type", None))
    if packing and family is not None and not family.packs():
        raise UserError(f"{config.model_type} models let packed documents attend to each other (stock transformers "
                        "builds their attention without the restarting position ids, or carries recurrent state "
                        "across documents); pass --no_packing to train one document per row")


# Files of which a saved tokenizer has at least one (fast tokenizers, sentencepiece, BPE / WordPiece vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt")


def load_tokenizer(name_or_path: str, trust_remote_code: bool):
    local = os.path.expanduser(name_or_path)
    if os.path.isdir(local) and not any(os.path.isfile(os.path.join(local, name)) for name in TOKENIZER_FILES):
        raise UserError(f"model directory {name_or_path} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save "
                        f"the base model's tokenizer there with tokenizer.save_pretrained(\"{name_or_path}\")")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as error:
        raise UserError(f"cannot load the tokenizer of {name_or_path}: {' '.join(str(error).split())}; save a "
                        f"working tokenizer there with tokenizer.save_pretrained") from None
    if tokenizer.pad_token is None:
        fallback = tokenizer.eos_token or tokenizer.unk_token
        if fallback is None:
            raise UserError(f"the tokenizer of {name_or_path} has no pad, eos or unk token to pad with")
        tokenizer.pad_token = fallback
    return tokenizer


def check_weight_files(name_or_path: str) -> None:
    """UserError naming the first unreadable *.safetensors file of a local model directory (a download cut short,
    a full disk): found from the files' headers alone, before any data work or weight loading."""
    from safetensors import safe_open

    local = os.path.expanduser(name_or_path)
    if not os.path.isdir(local):
        return  # a hub name: the hub's files are checked on download
    for name in sorted(os.listdir(local)):
        if name.endswith(".safetensors"):
            path = os.path.join(local, name)
            try:
                with safe_open(path, framework="pt"):
                    pass
            except Exception as error:  # SafetensorError, OSError: either way the file cannot be loaded
                raise UserError(f"model file {path} is unreadable ({one_line(error)}): it is incomplete or corrupt; "
                                "copy or download it again") from None


def compute_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU (where the kernels for it exist), fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def quantization_config(bits: int, dtype: torch.dtype, *, shardable: bool = False) -> BitsAndBytesConfig | None:
    """shardable: keep the packed 4-bit data in `dtype` tensors instead of uint8 ones (the same bytes), which FSDP
    can shard next to the float parameters (train.parallel.fsdp)."""
    if bits == 4:
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=dtype,
                                  bnb_4bit_quant_storage=dtype if shardable else torch.uint8)
    if bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def load_base(name_or_path: str, config, *, bits: int, device: torch.device, trust_remote_code: bool,
              quantize: bool = True, shardable: bool = False):
    """The base model with `config` (RoPE scaling already on it), quantised per `bits` (4-bit data in a float
    dtype when `shardable`, for FSDP)."""
    dtype = compute_dtype(device)
    kwargs = {"config": config, "dtype": dtype, "trust_remote_code": trust_remote_code}
    if quantize and bits < 16:
        kwargs["quantization_config"] = quantization_config(bits, dtype, shardable=shardable)
    if device.type == "cuda":
        kwargs["device_map"] = {"": device.index or 0}  # each process loads onto its own GPU
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except OSError as error:
        raise UserError(f"cannot load the weights of {name_or_path}: {one_line(error)}") from None
    if device.type != "cuda":
        model.to(device)
    keep_4bit_layout(model)
    return model


def keep_4bit_layout(model) -> None:
    """Turn off bitsandbytes' CPU inference repacking of 4-bit weights.

    In eval mode without grad (e.g. the passkey evaluation) Linear4bit on an AVX512-BF16 CPU rewrites
    its weight in place into another layout computed in bf16: the model that training continues with
    is then not the one it was, a reloaded adapter no longer reproduces the trained model's outputs,
    and layers narrower than a quantisation block fail outright.
    """
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False


def lora_config(model, args):
    """LoRA on the target modules; with train_embeddings_and_norms also the input embedding and every
    norm layer as full trainable copies saved with the adapter (peft modules_to_save), as in LongLoRA."""
    from peft import LoraConfig

    modules_to_save = None
    if args.train_embeddings_and_norms:
        embedding = model.get_input_embeddings()
        names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                 if module is embedding or "norm" in type(module).__name__.lower()}
        modules_to_save = sorted(names)
    target = args.lora_target_modules
    return LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, bias="none",
        task_type="CAUSAL_LM", target_modules="all-linear" if target == ["all-linear"] else target,
        modules_to_save=modules_to_save,
        # Tied input/output embeddings must stay tied when the embedding becomes trainable.
        ensure_weight_tying=bool(modules_to_save) and bool(getattr(model.config, "tie_word_embeddings", False)),
    )


@contextlib.contextmanager
def _quiet_checkpointing_renames():
    """transformers 5 renamed gradient_checkpointing_* to activation_checkpointing_*; peft still calls the
    old names. The warning is not actionable for a user of this recipe."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*gradient_checkpointing.* is deprecated", category=FutureWarning)
        yield


def build_model(args, config, device: torch.device, *, shardable: bool = False, weights_from: str | None = None):
    """The peft model to train, whole on this process: base, k-bit preparation, LoRA, in the order the recipe
    requires; train.parallel.placement.place_model then slices, patches and shards it. shardable (implied by
    --fsdp): 4-bit data in a float storage, which FSDP2 and ZeRO-3 can split. `weights_from`: a checkpoint whose
    (whole) adapter replaces the fresh one: the factors are drawn (or loaded) whole, as one process has them, and
    sliced by the placement under --tensor_parallel."""
    from peft import get_peft_model

    from patches.kbit import prepare_kbit_model

    model = load_base(args.model_name_or_path, config, bits=args.bits, device=device,
                      trust_remote_code=args.trust_remote_code, shardable=shardable or args.fsdp)
    model.config.use_cache = False  # no KV cache in training
    checkpointing = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    with _quiet_checkpointing_renames():
        if args.bits < 16:
            model = prepare_kbit_model(
                model, use_gradient_checkpointing=args.gradient_checkpointing, **checkpointing)
        elif args.gradient_checkpointing:
            model.gradient_checkpointing_enable(**checkpointing)
        try:
            model = get_peft_model(model, lora_config(model, args))
        except ValueError as error:
            raise UserError(f"cannot apply LoRA with --lora_target_modules {' '.join(args.lora_target_modules)}: "
                            f"{one_line(error)}") from None
    if weights_from:
        from train.recipe.checkpoint import load_weights

        load_weights(weights_from, model)
    return model


def patch(model, args):
    """apply_bpt_patch with the block sizes given on the command line (others: BPTConfig defaults)."""
    if not args.bpt:
        return None
    from patches import apply_bpt_patch

    options = {name: getattr(args, name) for name in BPT_OPTIONS
               if getattr(args, name) is not None}
    try:
        # The recipe never reads logits of a labelled batch: evaluation stays O(N) memory as training is.
        return apply_bpt_patch(model, compile=args.bpt_compile, eval_logits=False,
                               offload_checkpoints=args.offload_checkpoints,
                               offload_keep_last=args.offload_keep_last,
                               checkpoint_stride=args.checkpoint_stride, **options)
    except ValueError as error:  # impossible block sizes and the like
        raise UserError(f"cannot apply the BPT patch: {one_line(error)}") from None


def merge_adapter(args, config, adapter_dir: str, merged_dir: str, tokenizer) -> None:
    """Reload the base unquantised (with the same RoPE config), merge the adapter into it, save it."""
    from peft import PeftModel

    device = torch.device("cpu")  # merging is a one-off; CPU memory is usually the larger pool
    base = load_base(args.model_name_or_path, config, bits=16, device=device,
                     trust_remote_code=args.trust_remote_code, quantize=False)
    with _quiet_checkpointing_renames():
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.config.use_cache = True
    merged.save_pretrained(merged_dir)
    tokenizer.save_pretrained(merged_dir)
    as_umask_allows(merged_dir)  # safetensors writes model.safetensors -rw-------


@dataclass
class TrainedRun:
    """What rebuilding a run's model takes, read from its output_dir before any weights are loaded."""

    adapter_dir: str
    model_name_or_path: str  # the base to load
    trained_base: str  # the base the run recorded (differs from the above when the caller replaced it)
    config: object  # the base's config with the run's RoPE scaling on it
    bits: int
    trust_remote_code: bool
    info: dict | None  # run_info.json; None for an adapter directory without one (e.g. a checkpoint-N)


def read_run(output_dir: str, *, model_name_or_path: str | None = None) -> TrainedRun:
    """The base model, RoPE scaling and bits a run used, from its own files (cheap: no weights).

    run_info.json (written by train.qlora when a run finishes) records all three. Without it (a
    checkpoint-N, an adapter trained elsewhere) the base is peft's adapter_config.json
    base_model_name_or_path, with the base's own RoPE and 16 bits. `model_name_or_path` replaces the base."""
    info, adapter_config = read_adapter_dir(output_dir)
    recorded = (info or {}).get("model_name_or_path") or adapter_config.get("base_model_name_or_path")
    base = model_name_or_path or recorded
    if not base:
        raise UserError(f"{output_dir} does not say which base model it adapts; pass --model_name_or_path")
    trust_remote_code = bool((info or {}).get("trust_remote_code", False))
    try:
        config = load_config(base, trust_remote_code)
    except UserError as error:
        if model_name_or_path:
            raise
        source = RUN_INFO_FILE if info else ADAPTER_CONFIG_FILE
        raise UserError(f"{error} (the base recorded in {os.path.join(output_dir, source)}; pass "
                        "--model_name_or_path to name where it is now)") from None
    if info and info.get("rope_parameters") is not None:
        config.rope_parameters = info["rope_parameters"]
        config.max_position_embeddings = info["max_position_embeddings"]
    bits = int((info or {}).get("bits", 16))
    return TrainedRun(output_dir, base, recorded, config, bits, trust_remote_code, info)


def load_run_model(run: TrainedRun, device: torch.device | str = "cpu", *, shardable: bool = False):
    """The run's base (its config, quantised to run.bits; 4-bit data in a float storage when `shardable`, for FSDP)
    with the adapter on it."""
    from peft import PeftModel

    base = load_base(run.model_name_or_path, run.config, bits=run.bits, device=torch.device(device),
                     trust_remote_code=run.trust_remote_code, shardable=shardable)
    try:
        with _quiet_checkpointing_renames():
            return PeftModel.from_pretrained(base, run.adapter_dir)
    except RuntimeError as error:  # the state dict does not fit: another base than the one trained
        if "size mismatch" not in str(error):
            raise
        raise UserError(f"the adapter in {run.adapter_dir} does not fit base model {run.model_name_or_path} (its "
                        "weights have other shapes); use the base it was trained on") from None
    except (OSError, ValueError) as error:
        raise UserError(f"cannot load the LoRA adapter in {run.adapter_dir}: {one_line(error)}") from None


def load_trained(output_dir: str, *, device: torch.device | str = "cpu", bits: int | None = None):
    """(model, tokenizer) of a finished run: its base with the run's RoPE settings plus the adapter,
    quantised as in the run unless `bits` says otherwise."""
    run = read_run(output_dir)
    if bits is not None:
        run.bits = bits
    return load_run_model(run, device), load_tokenizer(output_dir, run.trust_remote_code)
