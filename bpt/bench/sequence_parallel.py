"""Sequence-parallel mode of the benchmark: one sequence split over N processes (and, with --tensor_parallel T, every
layer over T: N x T processes in train.qlora's layout), per rank memory, time and traffic.

- `run_sp_group`: the rank side (worker task "sp_train"): join the group, build the seeded patched model, and for
  every (length, mode) of the spec one warm-up step and the measured steps of a user's loop (`shard_batch`,
  `sequence_parallel`, `reduce_gradients`, as in patches/sequence_parallel.py); memory and time by
  `measure.measure_step`, bytes sent by `bpt.sequence_parallel.traffic`
- `theory_bytes`: the bytes the ring / Ulysses algorithm sends per rank per step (derivation in its docstring; under
  tensor parallelism with each rank's own heads)
- `combine`: the ranks' results of one (mode, N, length) -> one run (max over ranks, the group's step time)

One process group per N runs every (length, mode), shortest length first: starting N processes (torch,
transformers, peft imports) costs more than the short runs themselves. Each step's memory is what it adds over
the RSS right before it, and freed large blocks are unmapped (see `workers.worker_env`), so earlier steps do not
inflate later ones. Each rank writes its finished runs to a partial file, so a run that times out or dies keeps
the lengths done before it.
"""
from __future__ import annotations

import datetime
import json
import statistics

import torch
import torch.distributed as dist

from bpt import attention_once
from bpt.bench.measure import MIB, measure_step
from bpt.bench.models import DTYPES, build_model
from bpt.sequence_parallel import traffic
from bpt.sequence_parallel.ulysses import kv_head_ranges

SP_MODES = ("ring", "ulysses")
ACC_BYTES = 4  # ring's dK / dV accumulators travel in fp32 (fp64 for fp64 inputs: not benchmarked)


def attention_shape(config) -> dict:
    """Layers, query / kv heads and head dim of a transformers config (what the traffic depends on)."""
    heads = config.num_attention_heads
    return {"layers": config.num_hidden_layers, "q_heads": heads,
            "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads}


def theory_bytes(mode: str, *, world: int, rank: int, seq_len: int, batch: int, layers: int, q_heads: int,
                 kv_heads: int, head_dim: int, elem: int, checkpointing: bool, attention_kept: bool = False) -> int:
    """Bytes rank `rank` sends per training step through the sequence-parallel attention (K = V head dim D).

    Every layer's attention runs its forward F times (F = 2 with gradient checkpointing: the checkpointed layer
    is recomputed in backward) and its backward once. e = bytes per element of q / k / v (the model dtype).
    attention_kept: the step kept its attention outputs (bpt.attention_once): ring's recompute takes them and sends
    nothing (F = 1); Ulysses' recompute still moves q / k / v and the output (only its kernel is skipped).

    ring (zigzag, local length n = 2 * ceil(N / 2W)): a K/V shard is B * Hkv * n * 2D elements, plus the key-side
    mask (uint8, B * n bytes) when the length is padded to the layout (N not a multiple of 2W).
      forward:  the shards travel W - 1 hops                            -> (W - 1) * (B Hkv n 2D e + mask)
      backward: the shards travel W - 1 hops again, and the fp32 dK / dV accumulator travels one hop behind its
                shard: W - 1 hops plus the hop home                     -> (W - 1) * (B Hkv n 2D e + mask)
                                                                          + W * B Hkv n 2D * 4
    ulysses (contiguous, S = ceil(N / W), Hl = Hq / W query heads per rank, kv heads per rank from
    `kv_head_ranges`): bytes leave the rank for the W - 1 others (its own split stays local).
      forward:  q / k / v to head-split: sum over j != r of B S (Hl D + kv_j 2D) e; the output back to
                sequence-split: (W - 1) B S Hl D e
      backward: the inverse all-to-alls: (W - 1) B S Hl D e for dO, (W - 1) B S (Hl D + kv_r 2D) e for dq, dk, dv
    Per step: L * (F * forward + backward). W = 1 sends nothing. Not included: the all-reduce of the trainable
    gradients (reduce_gradients) and of the loss (group_loss), which run outside the attention.
    """
    if world == 1:
        return 0
    b, d = batch, head_dim
    forwards = 2 if checkpointing and not (mode == "ring" and attention_kept) else 1
    if mode == "ring":
        n = 2 * -(-seq_len // (2 * world))
        mask = b * n if world * n > seq_len else 0
        shard = b * kv_heads * n * 2 * d * elem + mask
        forward = (world - 1) * shard
        backward = (world - 1) * shard + world * b * kv_heads * n * 2 * d * ACC_BYTES
    elif mode == "ulysses":
        s, hl = -(-seq_len // world), q_heads // world
        kv = [e - a for a, e in kv_head_ranges(q_heads, kv_heads, world)]
        to_heads = sum(b * s * (hl * d + kv[j] * 2 * d) for j in range(world) if j != rank) * elem
        to_sequence = (world - 1) * b * s * hl * d * elem
        forward = to_heads + to_sequence
        backward = to_sequence + (world - 1) * b * s * (hl * d + kv[rank] * 2 * d) * elem
    else:
        raise ValueError(f"sequence-parallel mode must be one of {SP_MODES}, got {mode!r}")
    return layers * (forwards * forward + backward)


def run_sp_group(spec: dict) -> dict:
    """Rank side of one group: every (seq_len, mode) of the spec -> {"ok", "runs": [per-run rank result]}."""
    from bpt.mesh import mesh_groups

    rank, world, device = spec["rank"], spec["world"], spec["device"]
    tp = spec.get("tensor_parallel", 1)
    if device == "cuda":
        torch.cuda.set_device(rank)  # one GPU per rank
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{spec['port']}",
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=spec["comm_timeout"]))  # a lost peer: error, not hang
    try:
        runs = []
        groups = mesh_groups(world // tp, tp)  # (sp group, tp group, same-slices group), as train.qlora's layout
        model, _ = build_model({**spec, "side": "patched"}, tp_group=groups[1])
        for seq_len in spec["seq_lens"]:
            for mode in spec["sp_modes"]:
                runs.append(_run_one(spec, model, mode, seq_len, groups))
                with open(spec["result_path"] + ".partial", "w") as f:
                    json.dump({"ok": True, "runs": runs}, f)
        dist.barrier()
        return {"ok": True, "runs": runs}
    finally:
        dist.destroy_process_group()


def _run_one(spec: dict, model, mode: str, seq_len: int, groups: tuple) -> dict:
    """One warm-up and spec["steps"] measured steps of one (mode, seq_len) on this rank."""
    from bpt.tensor_parallel import reduce_tensor_parallel_gradients
    from patches import group_loss, reduce_gradients, sequence_parallel_attention as sequence_parallel, shard_batch

    sp_group, tp_group, same_slices = groups
    tp = spec.get("tensor_parallel", 1)

    device, batch_size = spec["device"], spec["batch_size"]
    generator = torch.Generator().manual_seed(spec["seed"])  # the same global batch on every rank
    ids = torch.randint(0, model.config.vocab_size, (batch_size, seq_len), generator=generator).to(device)
    batch = {"input_ids": ids, "labels": ids}  # [B, N], what a data loader hands every rank

    split = sp_group is not None or tp == 1  # tensor parallel alone: every rank of the group reads the whole rows

    def train_step():
        if not split:
            loss = model(**batch).loss
            loss.backward()
            reduce_tensor_parallel_gradients(model, tp_group)
            return loss.detach()
        local, context = shard_batch(batch, sp_group, mode)  # this rank's shard [B, ~N/W]
        with sequence_parallel(model, context):
            loss = model(**local).loss
            loss.backward()  # inside: the checkpointed layers recompute their attention here
        if tp > 1:  # the whole LoRA factors' shares over tp, then every gradient over the sp ranks with my slices
            reduce_tensor_parallel_gradients(model, tp_group, same_slices)
        else:
            reduce_gradients(model, sp_group)
        return loss.detach()

    def measured_step():
        model.zero_grad(set_to_none=True)
        dist.barrier()  # the ranks start each step together: a step's time is the group's
        traffic.reset()
        step = measure_step(train_step, device)
        return step | {"sent": traffic.total()}

    warmup = measured_step()
    attention_once.last_decision(forget=True)
    steps = [measured_step() for _ in range(spec["steps"])]
    kept = (attention_once.last_decision() or {}).get("kept", False)
    worst = max(steps, key=lambda s: s["added_mib"])
    trainable = [p for p in model.parameters() if p.requires_grad]
    elem = torch.finfo(DTYPES[spec["dtype"]]).bits // 8
    shape = attention_shape(model.config)  # the whole model's; a tensor-parallel rank holds 1/tp of the heads
    shape.update(q_heads=shape["q_heads"] // tp, kv_heads=shape["kv_heads"] // tp)
    sp_world = spec["world"] // tp
    theory = theory_bytes(mode, world=sp_world, rank=dist.get_rank(sp_group) if sp_world > 1 else 0,
                          seq_len=seq_len, batch=batch_size, elem=elem, checkpointing=spec["gradient_checkpointing"],
                          attention_kept=kept, **shape)
    return {
        "mode": mode, "seq_len": seq_len, "rank": spec["rank"], "tensor_parallel": tp,
        "step_mib": worst["added_mib"], "step_mib_each": [s["added_mib"] for s in steps],
        "before_mib": worst["before_mib"], "peak_mib": worst["peak_mib"],
        "step_s_each": [s["seconds"] for s in steps], "warmup_s": warmup["seconds"],
        "warmup_mib": warmup["added_mib"],
        "sent_bytes": max(s["sent"] for s in steps), "theory_bytes": theory, "attention_kept": kept,
        # the gradient all-reduce (not counted in sent_bytes): its payload, what each rank contributes
        "grad_allreduce_payload_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "loss": float(group_loss(steps[0]["out"], sp_group) if split else steps[0]["out"]),
        "trainable_params": sum(p.numel() for p in trainable),
        "threads": torch.get_num_threads(),
    }


def combine(rank_runs: list[dict], batch_size: int) -> dict:
    """The ranks' results of one (mode, N, length) -> one run: memory and bytes the max over ranks, step time
    the median over measured steps of the slowest rank's time."""
    step_s = [max(times) for times in zip(*(r["step_s_each"] for r in rank_runs))]
    median_s = statistics.median(step_s)
    sent, theory = max(r["sent_bytes"] for r in rank_runs), max(r["theory_bytes"] for r in rank_runs)
    ratios = [r["sent_bytes"] / r["theory_bytes"] if r["theory_bytes"] else (1.0 if r["sent_bytes"] == 0 else None)
              for r in rank_runs]  # measured / theory per rank
    first = rank_runs[0]
    return {
        "ok": True, "mode": first["mode"], "seq_len": first["seq_len"], "tensor_parallel": first["tensor_parallel"],
        "step_mib": max(r["step_mib"] for r in rank_runs),
        "step_mib_per_rank": [r["step_mib"] for r in rank_runs],
        "peak_mib": max(r["peak_mib"] for r in rank_runs),  # a rank's whole footprint: its weights (1/T of them) too
        "peak_mib_per_rank": [r["peak_mib"] for r in rank_runs],
        "median_s": median_s, "step_s_each": step_s, "tokens_per_s": batch_size * first["seq_len"] / median_s,
        "warmup_s": max(r["warmup_s"] for r in rank_runs),
        "sent_bytes": sent, "sent_bytes_per_rank": [r["sent_bytes"] for r in rank_runs],
        "theory_bytes": theory, "theory_bytes_per_rank": [r["theory_bytes"] for r in rank_runs],
        "sent_over_theory_per_rank": ratios,
        "sent_over_theory": None if None in ratios else max(ratios, key=lambda x: abs(x - 1)),  # the worst rank
        "grad_allreduce_payload_bytes": first["grad_allreduce_payload_bytes"],
        "loss": first["loss"], "trainable_params": first["trainable_params"], "threads": first["threads"],
        "sent_mib": sent / MIB, "theory_mib": theory / MIB,
    }
