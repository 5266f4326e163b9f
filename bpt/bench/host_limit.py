"""Host memory as a machine has it: a row's offloaded bytes against the machine's, and where they are over, the last
saved tensors kept on the device instead (BPTConfig offload_keep_last, patches/offload.py).

A Llama-3.1-8B rank of SP 8 at 8,388,608 tokens (1M tokens a rank) offloads 32 layer inputs of 8 GiB, the final
norm's and the loss's input, one layer's q, k and v while it recomputes and the frozen embeddings: 286 GiB, where
eight ranks share 2 TiB. Kept on the device, the last saved (the loss's and final norm's inputs, then the last layers'
inputs) cost device memory only until the backward is past them, the first it needs."""
from __future__ import annotations

import math
from typing import Callable

ATTEMPTS = 4  # a count from the excess, then more while a guess left the host over (a kept tensor may free less)


def host_memory(spec: dict, host_peak_bytes: int | None) -> dict:
    """The host memory a machine needs for this row's offloaded tensors: each process's host peak times the run's
    processes on one machine (one per GPU, the machine's GPUs at most), against the machine's (bpt.gpusim.gpus
    MACHINES, or spec["host_bytes_per_machine"]). {} for a device with no machine or nothing on the host."""
    from bpt.gpusim.gpus import machine

    box = machine(spec["simulate"], spec.get("gpus_per_machine"), spec.get("host_bytes_per_machine"))
    if box is None or not host_peak_bytes:
        return {}
    processes = min(spec.get("sequence_parallel") or 1, box.gpus)
    needed = host_peak_bytes * processes
    return {"host_bytes_per_machine": needed, "host_memory_per_machine": box.host_bytes,
            "processes_per_machine": processes, "host_fits": needed <= box.host_bytes}


def kept_where_the_host_is_over(spec: dict, row: dict, simulate: Callable[[dict], dict]) -> dict:
    """`row`, or where its host memory is over and the side offloads with nothing kept yet, the row of the same step
    with as many of the last saved tensors kept on the device as the excess asks (`row["offload_keep_last"]`),
    simulated again by `simulate(spec)` with at least that many layers (the kept ones are then the last of the
    simulated layers, as of the full depth's, and the depth extension adds sent layers only)."""
    if row.get("host_fits") is not False or spec["side"] != "patched+offload" \
            or spec["bpt"].get("offload_keep_last"):
        return row
    per_tensor = row["tokens_per_rank"] * spec["batch_size"] * spec["model_config"]["hidden_size"] \
        * (4 if spec.get("dtype") == "fp32" else 2)  # one [B, N, hidden] in the residual stream's dtype
    layers, keep = spec.get("layers") or spec["model_config"]["num_hidden_layers"], 0
    for _ in range(ATTEMPTS):
        over = (row["host_bytes_per_machine"] - row["host_memory_per_machine"]) / row["processes_per_machine"]
        keep += math.ceil(over / per_tensor)
        row = simulate({**spec, "bpt": {**spec["bpt"], "offload_keep_last": keep}, "layers": max(layers, keep)})
        row["offload_keep_last"] = keep
        if row.get("host_fits") is not False:
            break
    return row
