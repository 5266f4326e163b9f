"""What `--plan GPU` prints (train.run.plan; `p` is its Planned): the verdict with its peak, the predicted time and
whether attention runs once, the sequence-parallel exchange, host memory per machine, the largest tensors at the
peak, and the longest --max_seq_len found."""
from __future__ import annotations

GIB, MIB = 1 << 30, 1 << 20


def size(n: int) -> str:
    if abs(n) >= 100 * MIB:
        return f"{n / GIB:.2f} GiB"
    return f"{n / MIB:.1f} MiB" if abs(n) >= MIB else f"{n / 1024:.1f} KiB"


def format_verdict(args, p) -> list[str]:
    from bpt.bench.models import checkpoint_stride
    from bpt.gpusim.gpus import RESERVE_BYTES, device

    row, gpu = p.row, device(p.device)
    what = f"{args.bits}-bit QLoRA" if args.bits < 16 else "16-bit LoRA"
    what += f" r {args.lora_r}" + (" + embeddings and norms" if args.train_embeddings_and_norms else "")
    what += ", BPT patch" if args.bpt else ", no BPT patch"
    what += ", checkpointing" if args.gradient_checkpointing else ", no checkpointing"
    what += " offloaded to host memory" if args.offload_checkpoints else ""
    what += f", one layer checkpoint in {args.checkpoint_stride} kept" if args.checkpoint_stride > 1 else ""
    rope = p.spec["model_config"].get("rope_parameters") or {}
    if args.rope_scaling and rope.get("rope_type") == args.rope_scaling:
        what += f", RoPE {args.rope_scaling} x{rope['factor']:g}"
    tokens = f"{args.per_device_train_batch_size} x {row['tokens_per_rank']} tokens per device"
    if args.sequence_parallel > 1:
        tokens += (f" (--max_seq_len {args.max_seq_len} split {args.sequence_parallel} ways, {args.sp_mode}: one "
                   "rank's step over a fake process group, its exchange buffers counted)")
    more = row["layers"] + checkpoint_stride(p.spec)  # the depths simulated.extrapolation_steps took
    depth = (f"{row['layers']} and {more} of {row['depth']} layers run, extrapolated"
             if row["extrapolated"] else f"all {row['depth']} layers run")
    spare = p.usable_bytes - p.peak_bytes
    verdict = (f"FITS, {size(spare)} to spare" if spare >= 0 else f"DOES NOT FIT, {size(-spare)} over")
    if p.host_over:
        verdict = (f"DOES NOT FIT: host memory, {size(row['host_bytes_per_machine'] - row['host_memory_per_machine'])} "
                   "over the machine's" + ("" if spare >= 0 else f"; and the device, {size(-spare)} over"))
    lines = [
        f"--plan {p.device}: simulated, not measured; no weights loaded, no training",
        f"  model    {args.model_name_or_path}: {p.source}",
        f"  run      {what}; {tokens}; {row['trainable_params']:,} trainable parameters",
        f"  peak     {size(p.peak_bytes)} per device",
        f"    {size(row['peak_bytes']):>10}  one forward + backward, simulated ({depth}): weights, activations, "
        "trainable gradients",
        *(f"    {size(b):>10}  {label}, analytic" for label, b in p.extras),
        f"  usable   {size(p.usable_bytes)} = {size(gpu.memory_bytes)} less a {size(RESERVE_BYTES)} reserve for the "
        "CUDA context, workspaces and fragmentation (about half of it measured on one H100)",
        f"  verdict  {verdict} (simulated)",
        *time_lines(args, row),
        *exchange_lines(row),
        *([f"  host     {size(row['host_peak_bytes'])} per process of host memory for the offloaded checkpoints "
           "(pinned), simulated", *host_machine_lines(row)] if args.offload_checkpoints else []),
        "  largest tensors live at the peak (simulated" + (f", {row['layers']}-layer step):" if row["extrapolated"]
                                                         else "):"),
    ]
    for holder in row["peak_holders"][:5]:
        made = "held before the step (weights, inputs)" if holder["op"] == "before" else f"made by {holder['op']}"
        lines.append(f"    {size(holder['bytes']):>10}  {holder['dtype']} {list(holder['shape'])}  {made}")
    if args.mixed_precision == "no":
        lines.append("  note     simulated with bf16 autocast (the GPU default), not --mixed_precision no")
    lines += [f"  note     {note}" for note in p.notes]
    return lines


def exchange_lines(row: dict) -> list[str]:
    """The sequence-parallel exchange on the clock (bpt/gpusim/exchange.py), when the row has it."""
    x = row.get("exchange")
    if not x or not row.get("step_seconds"):
        return []
    where = "one machine" if x["machines"] == 1 else f"{x['machines']} machines"
    return [f"           of it exchanging shards: {x['exchange_seconds']:.2f} s on the links ({where} of "
            f"{x['gpus_per_machine']} GPUs: NVLink within, the network across), {x['exposed_exchange_seconds']:.2f} s "
            f"of it not hidden behind compute ({x['exposed_exchange_seconds'] / row['step_seconds']:.1%}), predicted"]


def host_machine_lines(row: dict) -> list[str]:
    """The host memory a machine needs for the run's processes on it, against the machine's (bpt.gpusim.gpus
    MACHINES: the card's usual machine)."""
    if not row.get("host_bytes_per_machine"):
        return []
    n = row["processes_per_machine"]
    kept = row.get("offload_keep_last")
    return [f"           {size(row['host_bytes_per_machine'])} per machine ({n} process{'es' if n > 1 else ''} of this "
            f"run on one) of the machine's {size(row['host_memory_per_machine'])} (bpt/gpusim/gpus.py MACHINES): "
            + ("fits" if row["host_fits"] else "DOES NOT FIT")
            + (f" with the last {kept} saved tensors kept on the device: add --offload_keep_last {kept}"
               if kept else "")]


def time_lines(args, row: dict) -> list[str]:
    """The clock's predicted time of a step and of the run (bpt.gpusim.clock), when the row has it."""
    if not row.get("step_seconds"):
        return []
    step = row["step_seconds"] * args.gradient_accumulation_steps
    idle = row["time_breakdown"]["launch_bound_idle"] / row["step_seconds"]
    total = (f"; {args.max_steps} steps ~{duration(step * args.max_steps)}" if args.max_steps > 0
             else "; the run's total: this times its steps (--max_steps)")
    compiled = "compiled as the run compiles" if args.bpt_compile is not False else "eager (--no_bpt_compile)"
    return [f"  time     ~{step:.2f} s per optimizer step ({row['tokens_per_second']:,.0f} tokens/s per device, MFU "
            f"{row['mfu']:.0%}, {row['kernel_launches']:,} kernel launches, launch-bound idle {idle:.0%}){total}; "
            f"predicted by the clock ({compiled}; rates in bpt/gpusim/clock.py)", *attention_lines(row)]


def attention_lines(row: dict) -> list[str]:
    """Whether the step computes its attention once (bpt.attention_once: the forward's outputs kept for the
    recompute) or twice, and what keeping takes over the depth."""
    once = row.get("attention_once")
    if not once or not once["bytes"]:
        return []
    how = "--attention_once" if once["setting"] else "--no_attention_once" if once["setting"] is False else "auto"
    if once["kept"]:
        return [f"           attention computed once per step: its outputs kept for the recompute, "
                f"{size(once['bytes'])} over the depth (in the peak; {how})"]
    return [f"           attention computed twice per step (again in each layer's recompute): keeping it would take "
            f"{size(once['bytes'])} over the depth ({how}; --attention_once keeps it)"]


def duration(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min" if seconds >= 60 \
        else f"{seconds:.0f} s"


def format_longest(args, p, why: str, probes: int, seconds: float, resolution: int) -> list[str]:
    if p.longest is None:
        found = f"none fits, not even {p.first_over} tokens"
    elif p.first_over is None:
        found = f"{p.longest} fits, the longest allowed ({why})"
    else:
        found = f"{p.longest} fits, {p.first_over} does not (searched to {resolution} tokens)"
    how = f"{p.row['layers']}-layer extrapolation" if p.row["extrapolated"] else "all layers run"
    steps = f"{probes} step{'s' if probes > 1 else ''}"
    return [f"  longest  --max_seq_len {found}; simulated, {how}, {steps} in {seconds:.0f} s",
            "  not counted: ring/Ulysses communication buffers, DDP gradient buckets; no training was run"]
