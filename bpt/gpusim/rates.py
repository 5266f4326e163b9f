"""The rates a step-time clock needs, measured on this device by short microbenchmarks (worker task "rates").

- matmul: FLOP/s per dtype on a large square product, and (GPU) bf16 at the 8B MLP's shape by rows per call (the
  chunk size question: how small a chunk keeps the GEMM at full rate);
- memory: bytes/s of a device-to-device copy (read + write counted);
- dispatch: seconds per small op, as the host enqueues them (no sync) and as they complete (synced): the cost
  every kernel adds whatever its size;
- attention: causal SDPA forward and forward+backward FLOP/s at head dim 128 with grouped KV heads, the backend
  torch picks for it;
- elementwise: elements/s of exp and of a log_softmax row (transcendental ops are compute-bound on a CPU);
- fresh memory (CPU): bytes/s of first touching a freshly mapped block (page faults);
- copies (CUDA): host <-> device bytes/s from pinned and pageable memory (checkpoint offload's link).
Each figure is the median of a few repeats after a warm-up; everything is small enough to take ~20 s on an H100.
On a CPU (`small`) the products and attention climb a ladder of sizes and stop before one call would pass a second
or two: a dtype the CPU has no native kernels for (bf16 without AVX512-BF16 ran ~1 GFLOP/s here, a 2048^3
product 13 s a call) is measured at a size that takes seconds, where its rate is already flat, while fp32 reaches the
step's sizes. The whole CPU measurement takes ~20 s on 2 cores and stays within a minute.
"""
from __future__ import annotations

import statistics
import time

import torch

MLP_SHAPE = (4096, 14336)  # Llama-3.1-8B: hidden -> intermediate
ATTENTION_HEADS = (32, 8, 128)  # query heads, KV heads, head dim (Llama-3.1-8B)
# small: the longest one call may take (a size whose call is predicted longer is not measured). The attention's is
# the longer: fp32 at 4096 tokens, the step's own length, runs ~1.3 s a forward+backward on 2 cores here.
MATMUL_CALL_SECONDS = 1.0
ATTENTION_CALL_SECONDS = 2.0


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


def _once(fn, device: torch.device) -> float:
    """Wall seconds of one synchronised call of fn (the first call: a warm-up's cost included)."""
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def affordable(sizes, one_call, power: float, limit: float) -> int:
    """The largest of `sizes` (ascending) whose call fits in `limit` seconds: the sizes are climbed one timed call
    each (after a warm-up call at the smallest), the next size's call predicted from the last as growing with
    (size ratio) ** power. One size: no call."""
    size = sizes[0]
    if len(sizes) == 1:
        return size
    one_call(size)  # a first call pays one-time setup (kernel selection, thread pools)
    seconds = one_call(size)
    for bigger in sizes[1:]:
        if seconds * (bigger / size) ** power > limit:
            break
        size, seconds = bigger, one_call(bigger)
    return size


def matmul_rates(device: torch.device, sizes, dtypes) -> tuple[dict, dict]:
    """FLOP/s of an n x n x n product per dtype, n the largest of `sizes` within MATMUL_CALL_SECONDS a call.
    -> (rates, the n of each dtype)."""
    rates, used = {}, {}
    for dtype in dtypes:
        def product(n):
            a = torch.randn(n, n, device=device, dtype=dtype)
            b = torch.randn(n, n, device=device, dtype=dtype)
            return lambda: a @ b

        n = affordable(sizes, lambda n: _once(product(n), device), 3, MATMUL_CALL_SECONDS)
        name = str(dtype).removeprefix("torch.")
        rates[name], used[name] = 2 * n ** 3 / _seconds(product(n), device), n
    return rates, used


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


def attention_rates(device: torch.device, seq_lens, dtypes=(torch.bfloat16,), heads=ATTENTION_HEADS,
                    longest_only: bool = False) -> list[dict]:
    """Causal SDPA (grouped KV heads, head dim 128): forward and forward+backward FLOP/s per length and dtype.
    longest_only: per dtype only the longest of `seq_lens` whose forward+backward fits in ATTENTION_CALL_SECONDS."""
    heads, kv_heads, dim = heads
    out = []

    def tensors(n, dtype):
        q = torch.randn(1, heads, n, dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, kv_heads, n, dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(1, kv_heads, n, dim, device=device, dtype=dtype, requires_grad=True)
        return q, k, v, torch.randn(1, heads, n, dim, device=device, dtype=dtype)

    def forward_backward(q, k, v, grad):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o.backward(grad)
        q.grad = k.grad = v.grad = None

    for dtype in dtypes:
        lengths = seq_lens
        if longest_only:
            lengths = [affordable(seq_lens, lambda n: _once(lambda: forward_backward(*tensors(n, dtype)), device), 2,
                                  ATTENTION_CALL_SECONDS)]
        for n in lengths:
            q, k, v, grad = tensors(n, dtype)

            def forward():
                with torch.no_grad():
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            forward_flops = 2 * 2 * heads * n * n * dim / 2  # QK^T and PV, causal half
            fwd = _seconds(forward, device, 3)
            both = _seconds(lambda: forward_backward(q, k, v, grad), device, 3)
            out.append({"seq_len": n, "dtype": str(dtype).removeprefix("torch."), "heads": heads,
                        "kv_heads": kv_heads, "head_dim": dim, "forward_seconds": fwd,
                        "forward_flops_per_second": forward_flops / fwd, "forward_backward_seconds": both,
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
    """Every rate on `device`; `small` (default: on CPU) bounds the sizes to seconds on a few cores."""
    dev = torch.device(device)
    small = dev.type == "cpu" if small is None else small
    start = time.perf_counter()
    dtypes = (torch.bfloat16, torch.float32) if small else (torch.bfloat16, torch.float16, torch.float32)
    # a CPU: fp32 reaches 2048^3 (1024^3 ran ~20% under the step's own products)
    matmul, matmul_sizes = matmul_rates(dev, (256, 512, 1024, 2048) if small else (8192,), dtypes)
    result = {"device": str(dev), "small": small, "matmul": matmul, "matmul_sizes": matmul_sizes}
    if not small:  # the chunk size question of a GPU (bf16 at the 8B MLP's shape)
        result["matmul_by_rows"] = matmul_by_rows(dev, (256, 512, 1024, 2048, 4096, 8192, 16384))
    result.update({
        "copy_bytes_per_second": copy_rate(dev, (256 if small else 1024) * 2 ** 20),
        "dispatch": dispatch_cost(dev),
        "attention": attention_rates(dev, (512, 1024, 2048, 4096), (torch.bfloat16, torch.float32), (8, 2, 128),
                                     longest_only=True) if small else attention_rates(dev, (8192, 32768)),
        "transcendental_per_second": transcendental_rate(dev, 2 ** 24),
        "softmax_per_second": softmax_rate(dev, 2048 if small else 16384)})
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
