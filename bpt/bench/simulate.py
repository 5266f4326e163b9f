"""The `--simulate DEVICE` task: one training step of the real code on a simulated device, bytes counted.

- `run_simulation(spec)`: the worker task (a process started with the gpusim shim for CUDA devices): builds the
  model on meta, materialises fake weights on the device, runs forward + backward under the tracker; with
  spec["layers"] below the depth it runs depths L and L+1 and extends the (exactly linear) bytes, FLOPs and op
  count to the model's depth (the largest holders and attention paths stay those of the L-layer step)
- `build_simulated_model`: the model of a spec, as the recipe builds it (4-bit base prepared by
  patches.kbit.prepare_kbit_model: the other weights bf16; or 16-bit; LoRA; the patch)
- `transformers_sees_real_tensors`: transformers takes fake tensors for compile tracing and then builds an
  O(N^2) packed mask no GPU run builds; inside, it sees them as real
- `fits`, `longest_fitting`: the simulated peak against the device's usable memory; doubling then bisection

Fake tensors hold no data: the DataOracle answers every read "true" (and the row lists where). For the patch that
means an all-ones attention mask is dropped (an unpadded batch, as in a real run) and "are there query rows with no
visible key?" is answered yes, so blockwise backward also runs its empty-row step (FLOPs of eager-attention families
such as gemma2 are overstated by it; bpt.engine.without_host_reads would instead keep every mask, which a real
unpadded run does not).

Every figure is allocated bytes on a simulated device (see bpt.gpusim): kernel workspaces other than flash
backward's, fragmentation and the CUDA context are in gpus.RESERVE_BYTES, uncalibrated.
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from bpt.bench.host_limit import host_memory, kept_where_the_host_is_over
from bpt.bench.models import PEER, checkpoint_stride, model_from_config, patch_options, quantise_with_bitsandbytes
from bpt.bench.rank_share import model_tensors, rank_share
from bpt.gpusim.gpus import device as simulated_device

WEIGHT_DTYPES = {32: torch.float32, 16: torch.bfloat16}


@contextlib.contextmanager
def transformers_sees_real_tensors():
    """transformers treats fake tensors as torch.compile tracing and then builds an O(N^2) packed-sequence mask that no
    GPU run builds; inside this block it sees them as the real tensors they stand for."""
    from transformers.utils import import_utils

    saved = import_utils.is_fake_tensor
    import_utils.is_fake_tensor = lambda tensor: False
    try:
        yield
    finally:
        import_utils.is_fake_tensor = saved


@contextlib.contextmanager
def counting_blockwise_calls(paths):
    """Count calls of the attention paths that are not SDPA: the patch's blockwise kernel, torch's varlen one,
    torch's flash kernel with its backward in head groups (bpt.head_groups), and ring attention on the fused kernel
    (bpt.sequence_parallel.ring_fused)."""
    import bpt.attention as attention

    inner, varlen = attention._blockwise, attention.varlen_causal

    def counted(*args, **kwargs):
        paths["blockwise"] += 1
        return inner(*args, **kwargs)

    def counted_varlen(*args, **kwargs):
        paths["varlen"] += 1
        return varlen(*args, **kwargs)

    def counted_grouped(*args, **kwargs):
        out = grouped(*args, **kwargs)
        if out is not None:
            paths["flash-head-groups"] += 1
        return out

    import bpt.sequence_parallel.ring as ring

    def counted_ring(*args, **kwargs):
        paths["ring-fused"] += 1
        return fused_ring(*args, **kwargs)

    grouped, fused_ring = attention.head_grouped_attention, ring.fused_ring_attention
    attention._blockwise, attention.varlen_causal = counted, counted_varlen
    attention.head_grouped_attention = counted_grouped
    ring.fused_ring_attention = counted_ring
    try:
        yield
    finally:
        attention._blockwise, attention.varlen_causal = inner, varlen
        attention.head_grouped_attention = grouped
        ring.fused_ring_attention = fused_ring


def build_simulated_model(spec: dict, layers: int, device: torch.device | None = None):
    """(model, patch handle or None) for the spec with `layers` decoder layers: on meta (to be made fake), or with
    `device` built there with initialised weights (a real step). 4-bit on a real CUDA device with bitsandbytes
    installed uses its Linear4bit (models.quantise_with_bitsandbytes), else the simulation's emulated layer
    (bpt.gpusim.quant4)."""
    from transformers import AutoConfig

    values = {**spec["model_config"], "num_hidden_layers": layers}
    if values.get("layer_types") is not None:  # per-layer lists follow the depth (the config checks their length)
        values["layer_types"] = list(values["layer_types"])[:layers]
    config = AutoConfig.for_model(**values)
    bits = spec["bits"]
    dtype = WEIGHT_DTYPES.get(bits, torch.bfloat16)
    torch.manual_seed(spec.get("seed", 0))
    with torch.device(device or "meta"):
        model = model_from_config(config, dtype)
    model.config.use_cache = False
    model.train()
    if spec["side"] == PEER:
        from bpt.bench.models import apply_liger

        apply_liger(model)
    checkpointing = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    bitsandbytes = bits == 4 and quantiser(device) == "bitsandbytes"
    if bits == 4:
        from bpt.gpusim.quant4 import quantise_linears
        from patches.kbit import prepare_kbit_model

        if bitsandbytes:
            quantise_with_bitsandbytes(model)
        else:
            quantise_linears(model)
        model.is_loaded_in_4bit = True
        model = prepare_kbit_model(model, use_gradient_checkpointing=spec["gradient_checkpointing"], **checkpointing)
    elif spec["gradient_checkpointing"]:
        model.gradient_checkpointing_enable(**checkpointing)
    if spec["lora"]:
        from peft import LoraConfig, get_peft_model

        targets = spec.get("lora_targets") or "all-linear"
        lora = LoraConfig(r=spec["lora_r"], lora_alpha=2 * spec["lora_r"], lora_dropout=spec.get("lora_dropout", 0.0),
                          target_modules=targets, task_type="CAUSAL_LM", modules_to_save=spec.get("modules_to_save"))
        if bits == 4 and not bitsandbytes:  # peft's class for a bitsandbytes layer (it imports bitsandbytes)
            from bpt.gpusim.quant4 import lora_like_bitsandbytes

            lora = lora_like_bitsandbytes(lora)
        model = get_peft_model(model, lora)
    # compile as the run has it (auto: on CUDA): fake tensors run it eagerly, priced as compiled (bpt.compile)
    return model, patch(model, spec, compile=spec.get("bpt", {}).get("compile") if device is None else False)


def patch(model, spec: dict, compile: bool | None):
    """The patch of the spec's side on `model` (None for stock and liger); compile as given."""
    if spec["side"] not in ("patched", "patched+offload"):
        return None
    from patches import apply_bpt_patch
    from patches.apply import unwrap
    from patches.attention_once import DEPTH_ATTR

    handle = apply_bpt_patch(model, **{**patch_options(spec), "compile": compile})
    handle.set(unwrap(model), DEPTH_ATTR, spec["model_config"]["num_hidden_layers"])  # the depth it stands for
    return handle


def quantiser(device: torch.device | None) -> str:
    """Who stores a 4-bit base: "bitsandbytes" on a real CUDA device where it is installed, else
    "emulated" (the simulation's layer: the same bytes, no values)."""
    import importlib.util

    if device is None or torch.device(device).type != "cuda":
        return "emulated"
    return "bitsandbytes" if importlib.util.find_spec("bitsandbytes") else "emulated"


def step_inputs(spec: dict, device: torch.device, real: bool, seq_len: int | None = None) -> dict:
    """input_ids and labels of one step ([batch, seq_len]): seeded random tokens on a real device, zeros on a
    simulated one (fake tensors hold no values); packed rows get positions restarting at every document."""
    batch, n = spec["batch_size"], seq_len or spec["seq_len"]
    vocab = spec["model_config"]["vocab_size"]
    if real:
        generator = torch.Generator().manual_seed(spec.get("seed", 0))
        ids = torch.randint(0, vocab, (batch, n), generator=generator).to(device)
    else:
        ids = torch.zeros(batch, n, dtype=torch.long, device=device)
    inputs = {"input_ids": ids, "labels": ids}
    documents = spec.get("packed_documents") or 0
    if documents > 1:  # packed rows: positions restart at every document
        length = -(-n // documents)
        inputs["position_ids"] = (torch.arange(n, device=device) % length).expand(batch, n)
    return inputs


def training_step(model, inputs: dict, autocast: bool) -> torch.Tensor:
    """Forward with labels and backward, bf16 autocast on the GPU as the recipe trains; -> the detached loss."""
    with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach()


def tracked_step(model, share, sim, real: bool, top: int = 10, clock: bool = True, unseen_bytes: int = 0) -> dict:
    """One training step under the AllocationTracker (the simulation's figures; on real tensors too), with
    torch.cuda's own peak beside them on a real GPU, inside `sim`'s device rules (entered by the caller).
    share: this rank's `bpt.bench.rank_share.RankShare` (its inputs; the sequence-parallel attention's block and the
    gradients' sum over the group, counted too).
    unseen_bytes: what the model's layers that are not simulated would hold, and what the run keeps beside the step
    (spec["resident_bytes"]: optimizer state, kept gradients); the simulated device's free memory (which sizes the
    patch's chunks) is what the whole run's step would leave."""
    from bpt.gpusim.tracker import AllocationTracker, flash_backward_workspace

    from bpt import attention_once
    from bpt.compile import regions_told_to
    from bpt.gpusim.clock import StepClock, rates_for

    gpu = sim.device
    clock = StepClock(rates_for(gpu.name)) if clock else None  # a CPU's rates cost ~25 s the first time
    exchange = _exchange_clock(clock, share)
    # On a real card the unseen layers are a ballast, so that its free memory (the chunk budget's) is the whole
    # model's; made before the tracker counts, and left out of the allocator's figures.
    ballast = _ballast(unseen_bytes, sim.torch_device) if real else None
    held = 0 if ballast is None else ballast.numel()
    with contextlib.ExitStack() as stack:
        stack.enter_context(counting_blockwise_calls(sim.attention_paths))
        if exchange is not None:
            from bpt.sequence_parallel import traffic

            stack.enter_context(traffic.listening(exchange))
        tracker = AllocationTracker(top=top, workspace=flash_backward_workspace, host_apart=gpu.is_cuda, clock=clock)
        stack.enter_context(tracker)
        if clock is not None:  # code a real run compiles (bpt.compile) is priced as compiled kernels
            stack.enter_context(regions_told_to(clock))
        tracker.track(*model.parameters(), *model.buffers(), *model_tensors(share.inputs))
        before = tracker.live
        if gpu.usable_bytes is not None:
            sim.free_bytes = lambda: max(0, gpu.usable_bytes - tracker.live - unseen_bytes)
        allocator = stack.enter_context(_real_cuda_peak(sim.torch_device, held) if real else contextlib.nullcontext({}))
        # Simulated: autograd on this thread. Its device thread releases a finished graph (the loss chunk's rows'
        # gradient, 16 MiB at 64K for a 1B model) a moment after handing back: when, varies with the machine's load,
        # and the step's peak with it (x14 at a 1B model's depth from 2 layers).
        stack.enter_context(torch.autograd.set_multithreading_enabled(real))
        attention_once.last_decision(forget=True)
        tracker.phase = "forward"
        # bf16 autocast on the GPU, as the recipe trains (made inside `simulate`: torch refuses it outside)
        with share.attention():
            with torch.autocast("cuda", dtype=torch.bfloat16) if gpu.is_cuda else contextlib.nullcontext():
                loss = model(**share.inputs).loss
            tracker.phase = "backward"
            loss.backward()  # inside the block: checkpointed layers recompute their sequence-parallel attention
        share.after_backward()
        loss_value = float(loss.detach()) if real else None
        del loss
    del ballast
    timed = clock.summary(share.tokens) if clock else {}
    if exchange is not None:
        timed["exchange"] = exchange.summary()
    return {**tracker.summary(), **timed, "before_bytes": before, "step_bytes": tracker.peak - before, **allocator,
            "loss": loss_value, "attention_paths": dict(sim.attention_paths),
            "attention_once": attention_once.last_decision(),
            "oracle_answers": dict(sim.oracle.answers), "tokens_per_rank": share.inputs["input_ids"].shape[-1],
            "sent_bytes": share.sent_bytes()}


def _exchange_clock(clock, share):
    """The exchange stream beside the clock (bpt.gpusim.exchange) where this rank has peers to price, else None."""
    if clock is None or share.links is None:
        return None
    from bpt.gpusim.exchange import ExchangeClock

    return ExchangeClock(clock, share.links)


def simulate_step(spec: dict, layers: int, real: bool = False) -> dict:
    """One forward + backward of the spec's model with `layers` layers on the simulated device; `real`: on real
    tensors of that device type instead (initialised weights), the same tracker counting, for calibration
    (with torch.cuda.max_memory_allocated beside it on a GPU) and to check the simulation against real tensors."""
    from bpt.gpusim.device import Simulation, simulate
    from bpt.gpusim.tracker import DataOracle, materialize_fake

    gpu = simulated_device(spec["simulate"])
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        stack.enter_context(transformers_sees_real_tensors())
        if real:
            sim = Simulation(gpu, None, DataOracle())
            model, handle = build_simulated_model(spec, layers, sim.torch_device)
        else:
            model, handle = build_simulated_model(spec, layers)
            sim = stack.enter_context(simulate(gpu))
            materialize_fake(model, sim.fake_mode, sim.torch_device)
        share = stack.enter_context(rank_share(spec, model, step_inputs(spec, sim.torch_device, real)))
        unseen = unseen_layers_bytes(spec, model, layers, share.tokens) + spec.get("resident_bytes", 0)
        step = tracked_step(model, share, sim, real, spec.get("top", 10), spec.get("clock", True), unseen)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if handle is not None:
        handle.remove()
    return {**step, "trainable_params": sum(p.numel() for p in trainable),
            "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "seconds": time.perf_counter() - start}


def unseen_layers_bytes(spec: dict, model, layers: int, tokens: int) -> int:
    """What the decoder layers a step of `layers` does not simulate would hold on the device: each its weights and,
    unless offloaded, its checkpointed input (`tokens` of this rank, all rows, x hidden in the embeddings' dtype): with
    a checkpoint stride k, the outputs of layers 1..L kept are those of every k-th (patches/checkpoint_stride.py)."""
    depth = spec["model_config"]["num_hidden_layers"]
    unseen = depth - layers
    if unseen <= 0 or layers <= 0:
        return 0
    stack = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == layers)
    unseen_bytes = unseen * sum(p.numel() * p.element_size() for p in stack[0].parameters())
    if spec.get("gradient_checkpointing", True) and spec["side"] != "patched+offload":
        embeddings = model.get_input_embeddings().weight
        stride = checkpoint_stride(spec)
        unseen_bytes += (depth // stride - layers // stride) * tokens * embeddings.shape[1] * embeddings.element_size()
    return unseen_bytes


def _ballast(size: int, device: torch.device) -> torch.Tensor | None:
    """`size` bytes held on a real CUDA device, or None (none asked, another device, or they do not fit)."""
    if size <= 0 or device.type != "cuda":
        return None
    try:
        return torch.empty(size, dtype=torch.uint8, device=device)
    except torch.cuda.OutOfMemoryError:
        return None


@contextlib.contextmanager
def _real_cuda_peak(device: torch.device, held: int = 0):
    """On a real GPU: yields a dict that gets the allocator's own figures for the block (calibration), less `held`
    bytes the caller keeps allocated throughout."""
    figures = {}
    if device.type != "cuda":
        yield figures
        return
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated() - held
    torch.cuda.reset_peak_memory_stats()
    yield figures
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - held
    figures.update(cuda_peak_bytes=peak, cuda_before_bytes=before, cuda_step_bytes=peak - before)


def run_simulation(spec: dict) -> dict:
    """Worker task "simulate": the row of one (side, seq_len) on the simulated device (spec["real"]: on real
    tensors, see simulate_step)."""
    depth = spec["model_config"]["num_hidden_layers"]
    layers = min(spec.get("layers") or depth, depth)
    real = bool(spec.get("real"))
    layers, period = extrapolation_steps(spec, layers, depth)
    step = simulate_step(spec, layers, real)
    row = {"ok": True, "device": ("real " + spec["simulate"]) if real else simulated_device(spec["simulate"]).label, "layers": layers, "depth": depth,
           "extrapolated": layers != depth, "threads": torch.get_num_threads(), **step}
    if layers != depth:
        row.update(extrapolated_to_depth(step, simulate_step(spec, layers + period, real), layers, depth, period))
    tokens = spec["batch_size"] * row["tokens_per_rank"]
    row["peak_gib"] = row["peak_bytes"] / 2**30
    row["bytes_per_token"] = row["step_bytes"] / tokens
    usable = simulated_device(spec["simulate"]).usable_bytes
    row["fits"] = None if usable is None else row["peak_bytes"] <= usable
    row.update(host_memory(spec, row.get("host_peak_bytes")))
    if row.get("host_fits") is False:  # a layout is refused where the machine's host memory is over, too
        row["device_fits"], row["fits"] = row["fits"], False
    return kept_where_the_host_is_over(spec, row, run_simulation)


EXTENDED = ("peak_bytes", "before_bytes", "weight_bytes", "host_peak_bytes", "ops", "cuda_peak_bytes",
            "cuda_before_bytes", "kernel_launches", "clock_ops", "host_syncs", "clock_flops", "sent_bytes")


EXCHANGE_EXTENDED = ("exchange_seconds", "exposed_exchange_seconds", "exchange_local_bytes", "exchange_remote_bytes",
                     "exchanges")


def extrapolation_steps(spec: dict, layers: int, depth: int) -> tuple[int, int]:
    """(layers to simulate, period): the figures are linear in the depth in steps of the period, the side's
    checkpoint stride (one layer input kept per stride layers), so the simulated depth is raised to one the full depth
    is whole periods away from (the full depth where that is as deep)."""
    period = checkpoint_stride(spec)
    layers += (depth - layers) % period
    return (depth, 1) if layers + period > depth else (layers, period)


def extrapolated_to_depth(step: dict, more: dict, layers: int, depth: int, period: int = 1) -> dict:
    """The figures of a step with `depth` layers from steps with `layers` and `layers` + `period` (depth - layers a
    multiple of it): peak(L) = a + b L exactly at period 1 (checkpoints and weights per layer; with a checkpoint stride
    k, along L in steps of k), so every count in EXTENDED and the FLOPs by dtype are extended linearly; the largest
    holders and attention paths stay those of the `layers` step."""
    grow = (depth - layers) // period
    row = {key: step[key] + (more[key] - step[key]) * grow for key in EXTENDED if key in step and key in more}
    row["step_bytes"] = row["peak_bytes"] - row["before_bytes"]
    if "cuda_peak_bytes" in row:
        row["cuda_step_bytes"] = row["cuda_peak_bytes"] - row["cuda_before_bytes"]
    row["flops_by_dtype"] = {dtype: flops + (more["flops_by_dtype"].get(dtype, 0) - flops) * grow
                             for dtype, flops in step["flops_by_dtype"].items()}
    row["bytes_per_layer"] = (more["peak_bytes"] - step["peak_bytes"]) // period
    if "timelines" in step:  # the clock: each timeline and each kind of work is a + b L too; the step ends with
        for key in ("time_breakdown", "timelines"):  # the last timeline of the extended ones
            row[key] = {k: v + (more[key][k] - v) * grow for k, v in step[key].items()}
        if "exchange" in step:  # the exchange's seconds and bytes too (its links as they are)
            row["exchange"] = {k: v + (more["exchange"][k] - v) * grow if k in EXCHANGE_EXTENDED else v
                               for k, v in step["exchange"].items()}
        row["step_seconds"] = max(row["timelines"].values())
        row.update(clock_rates(row, step["clock_tokens"], step["clock_peak_flops"]))
    row["seconds"] = step["seconds"] + more["seconds"]
    return row


def clock_rates(row: dict, tokens: int, peak_flops: float) -> dict:
    """tokens/s and MFU (the FLOPs the clock counted, causal attention halved, over the card's dense bf16 peak) of
    a row's predicted step, after its figures were extended to the depth."""
    step = row["step_seconds"]
    return {"tokens_per_second": tokens / step, "mfu": row["clock_flops"] / (step * peak_flops)}


def longest_fitting(fits: Callable[[int], bool], start: int, cap: int, resolution: int = 1024,
                    over: int | None = None) -> tuple[int | None, int | None]:
    """(longest length that fits, shortest that does not) by doubling from `start`, then bisection to `resolution`
    tokens; lengths stay multiples of `resolution`. `over`: a longer length already known not to fit (the bisection
    starts below it). (None, start) when even `start` does not fit; (cap', None) when the cap fits."""
    start = max(resolution, start // resolution * resolution)
    if not fits(start):
        return None, start
    good, bad = start, over
    while bad is None:
        if good >= cap:
            return good, None
        n = min(good * 2, cap // resolution * resolution)
        if n <= good:
            return good, None
        good, bad = (n, None) if fits(n) else (good, n)
    while bad - good > resolution:
        mid = (good + bad) // 2 // resolution * resolution
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good, bad
