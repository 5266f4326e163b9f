"""`python -m train.qlora ... --plan GPU`: this run's training step on a simulated GPU, before any download.

What is simulated is the step `python -m train.qlora` would run with the same flags (bpt.bench.simulate: the real
model code, peft, the patch, checkpointing, bf16 autocast, on fake CUDA tensors whose allocated bytes are counted):
the model's config with this run's RoPE scaling, --bits, the LoRA targets / rank / dropout, the embeddings and norms
of --train_embeddings_and_norms, checkpointing, the patch and its block sizes, the per-device batch, packed rows,
and with --sequence_parallel N one rank's step of the N (bpt.bench.rank_share: the real ring / Ulysses code over a
fake process group, its shard of the sequence and its exchange buffers). Each step runs in a fresh worker process
(the simulated GPU must be loaded before torch); 2 layers and 3 are simulated and the (exactly linear) peak extended
to the depth.

Added analytically, not simulated: the optimizer state (OPTIMIZER_STATE_BYTES per trainable parameter), the
gradients kept between the micro-batches of --gradient_accumulation_steps, and the gradient of a tied output head
trained with the embedding. Not counted at all: DDP gradient buckets, the communication library's own buffers, and
what gpus.RESERVE_BYTES stands for (CUDA context, kernel workspaces, fragmentation; ~1.1 GiB of it measured on one H100).

The config comes from the model directory, else the hub cache (offline), else the built-in shape of a well-known
hub name (bpt.bench.models.HUB_MODELS): the plan never downloads anything.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import sys
import time
import warnings
from typing import Callable

from train.errors import UserError
from train.run.plan_lines import duration, format_longest, format_verdict, size

OPTIMIZER_STATE_BYTES = {"adamw": 8, "paged_adamw_8bit": 2}  # two moments per trainable parameter: fp32 / 8-bit
RESOLUTION = 1024  # the longest --max_seq_len is found to this many tokens
SEARCH_CAP = 1 << 20  # ... and at most this many, where the model's positions set no limit
SHALLOW_LAYERS = 2  # layers simulated (and one more) before extrapolating to the depth
GUIDED_PROBES = 6  # probes placed by linear interpolation of the peak before plain bisection takes over
SEARCH_STEPS = 4  # simulated steps the longest search usually takes after the verdict's (the 8B preset's: 4)
WORKER_TIMEOUT_S = 1800
RING_QUICK = 16384  # tokens a rank whose ring attention simulates in about a minute (an 8B model, 2 and 3 layers)


class PlanFailed(Exception):
    """A simulated step that failed (the simulation's problem, not a mistake in the flags): exit status 1."""


@dataclasses.dataclass
class Planned:
    """What `print_plan` found (returned for tests and callers in Python)."""

    device: str
    source: str  # where the model's config came from
    spec: dict  # the worker spec of this run's step
    row: dict  # run_simulation's row for it
    extras: list  # (label, bytes) added analytically
    peak_bytes: int  # row["peak_bytes"] + the extras
    usable_bytes: int
    longest: int | None = None
    first_over: int | None = None
    cap: int = 0
    notes: list = dataclasses.field(default_factory=list)
    host_over: bool = False  # the offloaded bytes of the run's processes on one machine are over its host memory


# ---------------------------------------------------------------- the model's config, offline

def model_config(name: str, trust_remote_code: bool):
    """(config without this run's RoPE scaling, where it came from); UserError when there is none offline."""
    from train.recipe.model import load_config

    local = os.path.expanduser(name)
    if os.path.exists(local) or name.startswith((".", "/", "~")) or name.count("/") > 1:
        return load_config(name, trust_remote_code), f"config.json of {name}"
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name, "config.json")
    except ValueError:  # not a valid repository id
        cached = None
    if isinstance(cached, str):
        return load_config(os.path.dirname(cached), trust_remote_code), "config.json from the hub cache"
    from transformers import AutoConfig

    from bpt.bench.models import HUB_MODELS, PRESETS

    known = {hub.lower(): hub for hub in HUB_MODELS}
    if name.lower() not in known:
        raise UserError(f"--plan: no config for model {name}: not a local directory, not in the hub cache, and not "
                        "a hub name with a built-in shape (bpt.bench.models.HUB_MODELS); fetch just its config with "
                        f"`hf download {name} config.json`, or pass a directory holding its config.json")
    preset, overrides = HUB_MODELS[known[name.lower()]]
    return (AutoConfig.for_model(**{**PRESETS[preset], **overrides}),
            f"built-in shape {preset} (its config.json is not here nor in the hub cache)")


def scaled(config, args, seq_len: int, notes: list | None = None):
    """A copy of `config` with the RoPE scaling train.recipe.rope gives a run of `seq_len` tokens (its warnings in
    notes)."""
    from train.recipe.rope import apply_rope_scaling

    config = copy.deepcopy(config)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_rope_scaling(config, seq_len, args.rope_scaling, args.rope_factor)
    if notes is not None:
        notes += [str(w.message) for w in caught]
    return config


def length_cap(config, args) -> tuple[int, str]:
    """(longest --max_seq_len the run's flags let the model position, why)."""
    original = getattr(config, "max_position_embeddings", None)
    if original is None:
        return max(SEARCH_CAP, args.max_seq_len), f"the search's cap of {SEARCH_CAP} tokens"
    if args.rope_scaling is None:
        return original, "the model's positions; --rope_scaling goes further"
    if args.rope_factor is not None:
        return int(original * args.rope_factor), f"--rope_factor {args.rope_factor:g}"
    return max(SEARCH_CAP, args.max_seq_len), f"the search's cap of {SEARCH_CAP} tokens"


# ---------------------------------------------------------------- the step's spec

def adapter_layout(config, args) -> tuple[list | None, list | None]:
    """(LoRA target modules, modules_to_save) as train.recipe.model builds them, found on a one-layer model on the meta
    device (which also checks that the targets exist, as the run would)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from train.recipe.model import lora_config

    shallow = copy.deepcopy(config)
    shallow.num_hidden_layers = 1
    if getattr(shallow, "layer_types", None) is not None:
        shallow.layer_types = list(shallow.layer_types)[:1]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(shallow)
        lora = lora_config(model, args)
        try:
            get_peft_model(model, lora)
        except ValueError as error:
            raise UserError(f"cannot apply LoRA with --lora_target_modules {' '.join(args.lora_target_modules)}: "
                            f"{str(error).strip().splitlines()[0]}") from None
    targets = None if args.lora_target_modules == ["all-linear"] else list(args.lora_target_modules)
    return targets, lora.modules_to_save


def step_spec(args, config, seq_len: int, adapters: tuple, device: str | None = None,
              rope_len: int | None = None) -> dict:
    """The worker spec of one step of this run with --max_seq_len `seq_len` (one rank's of --sequence_parallel), on
    the simulated `device` (default --plan's; train.run.memory_check simulates the machine the run is on). RoPE is
    scaled for `rope_len` tokens (default `seq_len`): an evaluation at other lengths keeps the trained run's scaling."""
    from bpt.config import BPTConfig

    from train.recipe.args import BPT_OPTIONS

    blocks = {name: getattr(args, name) for name in BPT_OPTIONS
              if getattr(args, name) is not None}
    values = scaled(config, args, rope_len or seq_len).to_dict()
    values.pop("quantization_config", None)  # --bits decides the quantisation, as in the run
    values["use_cache"] = False
    depth, layers = values["num_hidden_layers"], SHALLOW_LAYERS
    if values.get("layer_types") is not None:  # a shallow build derives its own; fixed ones only fit the depth
        from transformers import AutoConfig

        derived = AutoConfig.for_model(**{k: v for k, v in values.items() if k != "layer_types"}).layer_types
        if derived == values["layer_types"]:
            del values["layer_types"]
        else:
            layers = depth  # a per-layer pattern of its own: every layer simulated
    return {
        "task": "simulate", "simulate": device or args.plan, "side": ("patched+offload" if args.offload_checkpoints else "patched") if args.bpt else "stock",
        "seq_len": seq_len, "sequence_parallel": args.sequence_parallel, "sp_mode": args.sp_mode,
        "model_config": values, "bits": args.bits,
        "lora": True, "lora_r": args.lora_r, "lora_targets": adapters[0], "lora_dropout": args.lora_dropout,
        "modules_to_save": adapters[1], "batch_size": args.per_device_train_batch_size,
        "gradient_checkpointing": args.gradient_checkpointing,
        "bpt": {**dataclasses.asdict(BPTConfig(**blocks, compile=args.bpt_compile, eval_logits=False,
                                               checkpoint_stride=args.checkpoint_stride)),
                "offload_keep_last": args.offload_keep_last},
        "layers": layers if depth > layers else None,
        "packed_documents": 2 if args.packing else 0, "top": 5, "malloc": "mmap", "threads": args.torch_threads,
    }


def simulate(spec: dict) -> dict:
    from bpt.bench.workers import run_worker

    row = run_worker(spec, WORKER_TIMEOUT_S)
    if not row.get("ok"):
        raise PlanFailed(f"the simulated step at {spec['seq_len']} tokens failed: {row.get('error')}")
    return row


def analytic_extras(args, config, trainable: int) -> list[tuple[str, int]]:
    """(label, bytes) of what the run holds beside a single simulated step."""
    per = OPTIMIZER_STATE_BYTES[args.optim]
    extras = [(f"optimizer state: {args.optim}, {per} B x {trainable:,} trainable parameters", per * trainable)]
    if args.gradient_accumulation_steps > 1:  # gradients live from the first micro-batch on (fp32: at most)
        extras.append((f"gradients kept over --gradient_accumulation_steps {args.gradient_accumulation_steps}, at most",
                       4 * trainable))
    elif args.train_embeddings_and_norms and getattr(config, "tie_word_embeddings", False):
        # The run ties the output head to the trained embedding copy (train.recipe.model.lora_config): its gradient
        # is there from the loss on; the simulation keeps the head frozen.
        element = 4 if args.bits < 16 else 2
        extras.append(("gradient of the tied output head", element * config.vocab_size * config.hidden_size))
    return extras


# ---------------------------------------------------------------- the longest --max_seq_len that fits

def longest_fitting_length(peak: Callable[[int], int], limit: int, cap: int, peaks: dict[int, int]) -> tuple:
    """(longest length that fits, shortest probed that does not) over the lengths RESOLUTION, 2 RESOLUTION, ...
    up to `cap`, and `cap` itself; (None, first) when not even the first fits, (cap, None) when the cap does.

    `peaks` holds lengths already simulated (the run's own); `peak(n)` simulates another. The peak grows almost
    linearly with the length, so each probe goes where the line through the two nearest known peaks crosses
    `limit` (then the next length up or down confirms it): 2-3 probes instead of doubling then bisection, which
    takes over after GUIDED_PROBES."""
    def down(n):  # the longest candidate length <= n (0: none)
        return cap if n >= cap else n // RESOLUTION * RESOLUTION

    def up(n):  # the shortest candidate length >= n
        return min(-(-n // RESOLUTION) * RESOLUTION, cap)

    guided = 0
    while True:
        good = max([down(n) for n, p in peaks.items() if p <= limit], default=0)
        bad = min([up(n) for n, p in peaks.items() if p > limit and n <= cap], default=None)
        following = min(good + RESOLUTION, cap)
        if good == cap or bad == following or (bad is not None and good >= bad):
            return good or None, bad if good != cap else None
        lo, hi = following, (bad - 1) // RESOLUTION * RESOLUTION if bad is not None else cap
        guess = _crossing(peaks, limit) if guided < GUIDED_PROBES else None
        if guess is not None:
            n = down(int(guess))
            guided += 1
        elif len(peaks) == 1 and good >= 2 * RESOLUTION:  # a second, cheaper point for the line: half the length
            n = down(good // 2)
            peaks[n] = peak(n)
            continue
        elif bad is None:
            n = 2 * good
        else:
            n = (good + bad) // 2
        n = down(min(max(n, lo), hi))
        peaks[n] = peak(n)


def _crossing(peaks: dict[int, int], limit: int) -> float | None:
    """Where the line through the two known peaks nearest `limit` (one each side where there are) reaches it."""
    under = sorted(n for n, p in peaks.items() if p <= limit)
    over = sorted(n for n, p in peaks.items() if p > limit)
    pair = (under[-1:] + over[:1]) if under and over else (under[-2:] or over[:2])
    if len(pair) < 2 or peaks[pair[0]] == peaks[pair[1]]:
        return None
    (a, b), (pa, pb) = pair, (peaks[pair[0]], peaks[pair[1]])
    return a + (limit - pa) * (b - a) / (pb - pa)


# ---------------------------------------------------------------- the plan

def check_plannable(args, config) -> None:
    """UserError for what the run itself would refuse, and for what the simulation does not model."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from train.parallel.layout import check_layout
    from train.recipe.model import check_bpt_support, check_packing

    if args.bits == 8:
        raise UserError("--plan simulates --bits 4 (NF4, as bitsandbytes stores it) and 16; 8-bit bases are not "
                        "emulated")
    if args.tensor_parallel > 1:
        raise UserError("--plan does not model --tensor_parallel; plan without it for one device holding every layer "
                        "whole (an upper bound)")
    if args.fsdp:
        raise UserError("--plan does not model --fsdp sharding; plan without --fsdp for one device holding the whole "
                        "model (an upper bound)")
    if config.model_type not in CONFIG_MAPPING:
        raise UserError(f"--plan cannot simulate {config.model_type} models: their code is not in transformers")
    if args.bpt:
        check_bpt_support(config)
    check_packing(config, args.packing)
    check_layout(args, world=args.sequence_parallel)


def print_plan(args, echo: Callable[[str], None] = print) -> Planned:
    """Simulate this run's step on args.plan, print the verdict, then (unless --no_plan_longest) the longest
    --max_seq_len that fits, with a line per length simulated; no weights."""
    from bpt.gpusim.gpus import device

    gpu = device(args.plan)
    config, source = model_config(args.model_name_or_path, args.trust_remote_code)
    check_plannable(args, config)
    notes: list = []
    scaled(config, args, args.max_seq_len, notes)  # the run's own RoPE checks and notes
    adapters = adapter_layout(config, args)
    started = time.perf_counter()
    print(f"plan: simulating this run's training step on a simulated {gpu.name} (nothing is downloaded or "
          "loaded) ...", file=sys.stderr, flush=True)
    spec = step_spec(args, config, args.max_seq_len, adapters)
    blockwise_ring = args.packing or getattr(config, "sliding_window", None)  # else ring takes the fused kernel
    long_ring = args.max_seq_len > RING_QUICK * args.sequence_parallel > RING_QUICK
    if args.sp_mode == "ring" and blockwise_ring and long_ring:
        print(f"plan: ring attention over packed documents or a sliding window is simulated block by block, as it "
              f"runs: past {RING_QUICK} tokens a rank this takes minutes to hours (unpacked rows take the fused "
              "kernel; --sp_mode ulysses simulates in seconds)", file=sys.stderr, flush=True)
    row = simulate(spec)
    extras = analytic_extras(args, config, row["trainable_params"])
    added = sum(b for _, b in extras)
    result = Planned(gpu.name, source, spec, row, extras, row["peak_bytes"] + added, gpu.usable_bytes, notes=notes)
    result.host_over = row.get("host_fits") is False
    result.notes += offload_notes(args, result) + stride_notes(args, result)
    for line in format_verdict(args, result):
        echo(line)
    sys.stdout.flush()
    if not args.plan_longest:
        echo("  longest  not searched (--no_plan_longest); no training was run")
        return result
    first = time.perf_counter() - started  # the search's steps each take about as long (longer lengths longer)
    print(f"plan: searching the longest --max_seq_len that fits: ~{SEARCH_STEPS} more simulated steps of ~"
          f"{duration(first)}, ~{duration(first * SEARCH_STEPS)} (--no_plan_longest: stop after the verdict)",
          file=sys.stderr, flush=True)
    result.cap, why = length_cap(config, args)
    limit = gpu.usable_bytes - added  # the optimizer state and kept gradients are on the device beside each step
    peaks = {args.max_seq_len: held(row, limit)}

    def probe(n: int) -> int:
        began = time.perf_counter()
        peak = held(simulate({**step_spec(args, config, n, adapters), "resident_bytes": added}), limit)
        print(f"plan:   --max_seq_len {n:,}: {size(peak + added)}, {'fits' if peak <= limit else 'does not fit'} "
              f"({duration(time.perf_counter() - began)})", file=sys.stderr, flush=True)
        return peak

    result.longest, result.first_over = longest_fitting_length(probe, limit, result.cap, peaks)
    for line in format_longest(args, result, why, len(peaks), time.perf_counter() - started, RESOLUTION):
        echo(line)
    return result


def held(row: dict, limit: int) -> int:
    """A step's device peak, or where the machine's host memory is the tighter of the two (offloaded checkpoints: the
    run's processes on one machine against its host memory), that on the device's scale (host needed x limit / host
    memory): over `limit` exactly where either is over, and linear in the length as both are."""
    host = row.get("host_bytes_per_machine")
    if not host:
        return row["peak_bytes"]
    return max(row["peak_bytes"], -(-host * limit // row["host_memory_per_machine"]))


def offload_notes(args, p: Planned) -> list[str]:
    """With --offload_checkpoints, whether the run fits without it: at most this peak with every offloaded byte back
    on the device. There offload only costs time, and its copies need long steps to hide behind."""
    offloaded = p.row.get("host_peak_bytes") or 0
    if not args.offload_checkpoints or not offloaded or p.peak_bytes + offloaded > p.usable_bytes:
        return []
    return [f"fits without --offload_checkpoints too (at most {size(p.peak_bytes + offloaded)}: this peak with the "
            f"{size(offloaded)} offloaded back on the device); there offload only costs time: its copies hide behind "
            "long steps, not short ones (measured on one H100: a slower step at 8K tokens, the same at 32K; "
            "docs/benchmark.md)"]


def stride_notes(args, p: Planned) -> list[str]:
    """Where a patched run that keeps every layer checkpoint on the device is over: what --checkpoint_stride 2 would
    take off (estimated: one in two of the depth's bf16 layer inputs, less the one remade at the peak), and what
    it costs; --offload_checkpoints beside it."""
    if (not args.bpt or not args.gradient_checkpointing or args.offload_checkpoints or args.checkpoint_stride > 1
            or p.peak_bytes <= p.usable_bytes):
        return []
    tokens = args.per_device_train_batch_size * p.row["tokens_per_rank"]
    saved = (p.row["depth"] // 2 - 1) * tokens * p.spec["model_config"]["hidden_size"] * 2
    if saved <= 0:
        return []
    return [f"--checkpoint_stride 2 keeps one layer checkpoint in two: about {size(saved)} less (estimated; --plan "
            "with it simulates), for one layer forward more in two (~1/8 more time per step); or "
            "--offload_checkpoints moves them all to host memory"]
