"""The rates a step-time clock needs, measured on this device by short microbenchmarks (worker task "rates").

- matmul: FLOP/s per dtype on a large square product, and bf16 at the 8B MLP's shape by rows per call (the chunk
  size question: how small a chunk keeps the GEMM at full rate);
- memory: bytes/s of a device-to-device copy (read + write counted);
- dispatch: seconds per small op, as the host enqueues them (no sync) and as they complete (synced): the cost
  every kernel adds whatever its size;
- attention: causal SDPA forward and forward+backward FLOP/s at head dim 128 with grouped KV heads, the backend
  torch picks for it;
- elementwise: elements/s of exp and of a log_softmax row (transcendental ops are compute-bound on a CPU);
- fresh memory (CPU): bytes/s of first touching a freshly mapped block (page faults);
- copies (CUDA): host <-> device bytes/s from pinned and pageable memory (checkpoint offload's link).
Each figure is the median of a few repeats after a warm-up; everything is small enough to take ~20 s on an H100
and ~30 s on a 2-core CPU (sizes shrink there).
"""
from __future__ import annotations

import statistics
import time

import torch

MLP_SHAPE = (4096, 14336)  # Llama-3.1-8B: hidden -> intermediate
ATTENTION_HEADS = (32, 8, 128)  # query heads, KV heads, head dim (Llama-3.1-8B)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn, device: torch.device, repeats: int = 5) -> float:
    """Median wall seconds of fn() after one warm-up, each call synchronised."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_rates(device: torch.device, size: int, dtypes) -> dict:
    """FLOP/s of a size x size x size product per dtype."""
    out = {}
    for dtype in dtypes:
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        out[str(dtype).removeprefix("torch.")] = 2 * size ** 3 / _seconds(lambda: a @ b, device)
        del a, b
    return out


def matmul_by_rows(device: torch.device, rows_list, shape=MLP_SHAPE, dtype=torch.bfloat16) -> list[dict]:
    """bf16 FLOP/s of (rows x k) @ (k x n) for each row count: the efficiency of a chunk of that many tokens."""
    k, n = shape
    w = torch.randn(k, n, device=device, dtype=dtype)
    out = []
    for rows in rows_list:
        x = torch.randn(rows, k, device=device, dtype=dtype)
        seconds = _seconds(lambda: x @ w, device)
        out.append({"rows": rows, "k": k, "n": n, "seconds": seconds, "flops_per_second": 2 * rows * k * n / seconds})
        del x
    return out


def copy_rate(device: torch.device, nbytes: int) -> float:
    """Bytes/s moved by a device-to-device copy (each byte read once and written once)."""
    src = torch.empty(nbytes // 2, device=device, dtype=torch.bfloat16).fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / _seconds(lambda: dst.copy_(src), device)


def dispatch_cost(device: torch.device, count: int = 1000) -> dict:
    """Seconds per tiny op: as enqueued by the host (what a launch costs the CPU) and as completed (synced)."""
    x = torch.zeros(16, device=device)
    for _ in range(100):
        x.add_(1)
    _sync(device)
    start = time.perf_counter()
    for _ in range(count):
        x.add_(1)
    enqueued = time.perf_counter() - start
    _sync(device)
    completed = time.perf_counter() - start
    return {"host_seconds_per_op": enqueued / count, "seconds_per_op_synced": completed / count, "ops": count}


def attention_rates(device: torch.device, seq_lens, dtypes=(torch.bfloat16,), heads=ATTENTION_HEADS) -> list[dict]:
    """Causal SDPA (grouped KV heads, head dim 128): forward and forward+backward FLOP/s per length and dtype."""
    heads, kv_heads, dim = heads
    out = []
    for n, dtype in ((n, d) for d in dtypes for n in seq_lens):
        q = torch.randn(1, heads, n, dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, kv_heads, n, dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(1, kv_heads, n, dim, device=device, dtype=dtype, requires_grad=True)
        grad = torch.randn(1, heads, n, dim, device=device, dtype=dtype)

        def forward():
            with torch.no_grad():
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def forward_backward():
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            o.backward(grad)
            q.grad = k.grad = v.grad = None

        forward_flops = 2 * 2 * heads * n * n * dim / 2  # QK^T and PV, causal half
        fwd, both = _seconds(forward, device, 3), _seconds(forward_backward, device, 3)
        out.append({"seq_len": n, "dtype": str(dtype).removeprefix("torch."), "heads": heads, "kv_heads": kv_heads,
                    "head_dim": dim, "forward_seconds": fwd, "forward_flops_per_second": forward_flops / fwd,
                    "forward_backward_seconds": both,
                    # backward = 2.5 forwards of matmul work (dS, dP, dQ, dK, dV and the recomputed S)
                    "forward_backward_flops_per_second": 3.5 * forward_flops / both,
                    "backward_flops_per_second": 2.5 * forward_flops / max(both - fwd, 1e-9)})
        del q, k, v, grad
    return out


def transcendental_rate(device: torch.device, numel: int) -> float:
    """Elements/s of an exp over fp32 (a CPU computes exp-like ops slower than it moves their bytes)."""
    x = torch.randn(numel, device=device)
    out = torch.empty_like(x)
    return numel / _seconds(lambda: torch.exp(x, out=out), device)


def softmax_rate(device: torch.device, rows: int, vocab: int = 32000) -> float:
    """Elements/s of a log_softmax over a [rows, vocab] fp32 block (the LM head's loss: several passes a row),
    its output freshly allocated as in a step."""
    x = torch.randn(rows, vocab, device=device)
    return x.numel() / _seconds(lambda: torch.log_softmax(x, dim=-1), device)


def fresh_rate(device: torch.device, nbytes: int) -> float:
    """Bytes/s of filling a freshly allocated block, less a fill of a held one: on a CPU whose large blocks are
    fresh mmaps (the bench's malloc setting), the cost of faulting the pages in."""
    held = torch.empty(nbytes, dtype=torch.uint8, device=device)
    warm = _seconds(lambda: held.fill_(1), device)
    cold = _seconds(lambda: torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1), device)
    return nbytes / max(cold - warm, 1e-9)


def host_link_rates(device: torch.device, nbytes: int) -> dict:
    """Host <-> device bytes/s, from pinned and from pageable host memory."""
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for kind, pin in (("pinned", True), ("pageable", False)):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        out[f"host_to_device_{kind}"] = nbytes / _seconds(lambda: gpu.copy_(host, non_blocking=pin), device, 3)
        out[f"device_to_host_{kind}"] = nbytes / _seconds(lambda: host.copy_(gpu, non_blocking=pin), device, 3)
        del host
    return out


def measure_rates(device: str = "cuda", small: bool | None = None) -> dict:
    """Every rate on `device`; `small` (default: on CPU) shrinks the sizes to seconds on a few cores."""
    dev = torch.device(device)
    small = dev.type == "cpu" if small is None else small
    start = time.perf_counter()
    dtypes = (torch.bfloat16, torch.float32) if small else (torch.bfloat16, torch.float16, torch.float32)
    result = {"device": str(dev), "small": small,
              "matmul": matmul_rates(dev, 2048 if small else 8192, dtypes),  # a CPU: 1024^3 ran ~20% under the step's
              "matmul_by_rows": matmul_by_rows(dev, (128, 512, 2048) if small else
                                               (256, 512, 1024, 2048, 4096, 8192, 16384)),
              "copy_bytes_per_second": copy_rate(dev, (256 if small else 1024) * 2 ** 20),
              "dispatch": dispatch_cost(dev),
              "attention": attention_rates(dev, (4096,), (torch.bfloat16, torch.float32), (8, 2, 128)) if small
              else attention_rates(dev, (8192, 32768)),
              "transcendental_per_second": transcendental_rate(dev, 2 ** 24),
              "softmax_per_second": softmax_rate(dev, 2048 if small else 16384)}
    if dev.type == "cpu":
        result["fresh_bytes_per_second"] = fresh_rate(dev, 256 * 2 ** 20)
    if dev.type == "cuda":
        result["host_link"] = host_link_rates(dev, 512 * 2 ** 20)
        result["torch_allow_tf32"] = torch.backends.cuda.matmul.allow_tf32
    result["seconds"] = time.perf_counter() - start
    return result


def run_rates(spec: dict) -> dict:
    """Worker task "rates": spec {"device": "cuda" | "cpu", "small": optional bool}."""
    return {"ok": True, **measure_rates(spec.get("device", "cuda"), spec.get("small"))}
