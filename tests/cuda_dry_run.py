"""The CUDA dry run: every attention path and option, the chunked MLP and loss, patched tiny models (LoRA, 4-bit)
and the sequence-parallel kernels, forward + backward on a simulated GPU, next to stock on the same device.

bpt.gpusim runs the real code on fake CUDA tensors (shapes, dtypes, no data) with the chosen card's answers: SDPA
goes to the fused kernel that card would pick (flash / memory-efficient) or to the O(N^2) math one, autocast("cuda")
casts as on a GPU. So a case costs the same at N = 4096 as at N = 64, and every case here uses N = 4096 tokens,
longer than any block or chunk (kernel cases: query blocks of 512, key blocks of 1024; models: 1024 x 1024; MLP and
loss chunks of 1024). Per case it records:
- what came out: device, dtype and shape of the output and of every gradient, beside stock's (the unpatched model,
  F.scaled_dot_product_attention or an eager reference, run the same way on the same simulated device);
- the attention path taken: the routed SDPA's kernel ("sdpa-flash" / "sdpa-efficient" / "sdpa-math"), or bpt's own
  kernels ("blockwise", "varlen", "flash-head-groups": the fused kernel with its backward in head groups, taken in
  a checkpointed layer, "ring" / "ring-fused": ring attention block by block / on the fused kernel);
- `wide`: every op output that is N x N, N x I (MLP intermediate) or N x V (vocabulary), as "op[shape] (kind)",
  from AllocationTracker's record of every op output's shape (stock's too: it must show them, or the probe is blind);
- `problems`: each way the case differs from what it must be (empty = the case passes); an exception is recorded
  with its traceback, and the next case runs.

Fake tensors have no data: the DataOracle answers every read as "all nonzero / true", so a padding mask reads as
"no padding" and segment ids as "one document". Cases marked dense run the plan without reading data (as under
torch.compile: `no_host_reads`), so that every padding / segment mask is built and applied in every block.

Run it in a process that has the gpusim shim (tests/test_simulated_cuda.py does), with tests/ and the repository
root on PYTHONPATH:  python -c "from bpt.gpusim import shim; import subprocess; subprocess.run(shim.boot_command(
'cuda_dry_run', 'results.json'))". Writes {"cases": [...], "seconds": ...} to the path given ("-": stdout); a second
argument runs only the cases whose "group/name" starts with it (e.g. "models/gemma2").
"""
from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback
import warnings
from collections import Counter

import torch

from bpt.bench.simulate import transformers_sees_real_tensors

N = 4096  # tokens: above every block / chunk size below
Q_BLOCK, KV_BLOCK, CHUNK = 512, 1024, 1024  # kernels: query and key blocks of different sizes
# models: half the block steps; chunk_budget 0: the sizes as set (the automatic budget of a simulated 80 GB card would
# run these short sequences in whole-sequence chunks, the N x I / N x V tensors the probes look for)
MODEL_BLOCKS = dict(q_block=1024, kv_block=1024, mlp_chunk=CHUNK, loss_chunk=CHUNK, chunk_budget=0)

# mode -> (dtype of weights / leaf inputs, autocast dtype or None)
MODES = {
    "bf16-autocast": (torch.float32, torch.bfloat16),
    "fp16-autocast": (torch.float32, torch.float16),
    "bf16-weights": (torch.bfloat16, None),
    "fp32": (torch.float32, None),
}
TRAINING_MODES = ("bf16-autocast", "fp16-autocast", "bf16-weights")

GROUPS = ("attention", "attention-sm89", "attention-sm75", "mlp", "loss", "models", "sequence-parallel",
          "probe-catches-stock")

CASES: list[tuple[str, str, callable]] = []  # (group, name, run() -> facts with "problems")


def case(group: str, name: str):
    assert group in GROUPS, group

    def register(fn):
        CASES.append((group, name, fn))
        return fn

    return register


# ----------------------------------------------------------------------------------------------------
# Simulation helpers
# ----------------------------------------------------------------------------------------------------


def gpu(name: str):
    from bpt.gpusim.gpus import Device, device

    if name == "t4-16gb":  # sm75: no FlashAttention, no bf16 kernels (not in the bench's device table)
        return Device("t4-16gb", 15360 << 20, (7, 5))
    return device(name)


def autocast(mode: str):
    dtype = MODES[mode][1]
    return torch.autocast("cuda", dtype=dtype) if dtype is not None else contextlib.nullcontext()


@contextlib.contextmanager
def counting_paths(paths: Counter):
    """Count calls of bpt's own kernels beside the routed SDPA's: those the bench counts (bpt.bench.simulate:
    "blockwise", "varlen", "flash-head-groups", "ring-fused") and the blockwise ring ("ring")."""
    import bpt.sequence_parallel.ring as ring
    from bpt.bench.simulate import counting_blockwise_calls

    ring_function = ring._RingAttention

    class CountedRing:
        @staticmethod
        def apply(*args):
            paths["ring"] += 1
            return ring_function.apply(*args)

    ring._RingAttention = CountedRing
    try:
        with counting_blockwise_calls(paths):
            yield
    finally:
        ring._RingAttention = ring_function


def no_host_reads(enabled: bool = True):
    """bpt's plan and masks without reading tensor data, as under torch.compile: every padding / segment mask is kept
    and applied in every block the causal / window rules leave (the DataOracle would read them as "no mask")."""
    from bpt.engine import without_host_reads

    return without_host_reads() if enabled else contextlib.nullcontext()


def tracker():
    from bpt.gpusim.tracker import AllocationTracker, flash_backward_workspace

    return AllocationTracker(top=0, workspace=flash_backward_workspace, shapes=True)


def is_wide(shape: tuple, n: int, width: int) -> bool:
    """A dim >= n (tokens, or batch x tokens flattened) beside another dim >= width, or one dim >= n * width."""
    for i, a in enumerate(shape):
        if a >= n * width or a >= n and any(b >= width for j, b in enumerate(shape) if j != i):
            return True
    return False


def wide_outputs(shapes: Counter, widths: dict[str, int], n: int = N) -> list[str]:
    """Every (op, shape) recorded that is N x N / N x I / N x V: "op[shape] (N x V)", named by the widest that fits."""
    found = set()
    for op, shape in shapes:
        for kind, width in sorted(widths.items(), key=lambda item: -item[1]):
            if is_wide(shape, n, width):
                found.add(f"{op}{list(shape)} ({kind})")
                break
    return sorted(found)


def describe(t) -> dict | None:
    if t is None:
        return None
    return {"device": t.device.type, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def compare(problems: list, what: str, got: dict | None, want: dict | None, *, shape=True):
    """got vs stock's (want): both present, on cuda, same dtype (and shape)."""
    if want is None and got is None:
        return
    if got is None or want is None:
        problems.append(f"{what}: patched {got}, stock {want}")
        return
    if got["device"] != "cuda":
        problems.append(f"{what} on {got['device']}")
    keys = ("dtype", "shape") if shape else ("dtype",)
    for key in keys:
        if got[key] != want[key]:
            problems.append(f"{what} {key}: patched {got[key]}, stock {want[key]}")


def check_paths(problems: list, paths: dict, expected: str | set, at_least: int = 1):
    expected = {expected} if isinstance(expected, str) else set(expected)
    if set(paths) != expected or any(paths[p] < at_least for p in expected):
        problems.append(f"attention paths {paths}, expected only {sorted(expected)} (>= {at_least} calls each)")


def leaf(shape, dtype, grad=True):
    return torch.randn(shape, device="cuda", dtype=dtype).requires_grad_(grad)


def fresh(t):
    return t.detach().clone().requires_grad_(t.requires_grad)


# ----------------------------------------------------------------------------------------------------
# Attention: bpt.attention.blockwise_attention on every path and option
# ----------------------------------------------------------------------------------------------------

B, HQ, HKV, D = 2, 8, 2, 64


def side_inputs(names: tuple, b: int, hq: int, n: int, dtype: torch.dtype) -> dict:
    """The O(N) side inputs a case names (fake values: their data is never read)."""
    from bpt.attention import segment_ids_from_position_ids

    options = {}
    for name in names:
        if name == "padding":
            options["padding_mask"] = torch.ones(b, n, dtype=torch.bool, device="cuda")
        elif name == "segments":
            options["segment_ids"] = torch.zeros(b, n, dtype=torch.long, device="cuda")
        elif name == "positions":  # packed documents given as position ids that restart
            positions = torch.arange(n, device="cuda").remainder(1000).expand(b, n)
            options["segment_ids"] = segment_ids_from_position_ids(positions)
        elif name == "alibi":
            options["alibi_slopes"] = torch.rand(hq, device="cuda")
        elif name == "key_bias":
            options["key_bias"] = torch.rand(b, hq, n, device="cuda")
        elif name == "sinks":  # a learned parameter: the weights' dtype
            options["sinks"] = leaf((hq,), dtype)
        else:
            raise ValueError(name)
    return options


def eager_attention(q, k, v, *, scale=None, causal=True, padding_mask=None, segment_ids=None, sliding_window=None,
                    alibi_slopes=None, key_bias=None, softcap=None, sinks=None, dropout=0.0, **_blocks):
    """Stock eager attention (transformers' eager_attention_forward with the model's N x N mask): scores in the inputs'
    (autocast) precision, fp32 softmax cast back to the value dtype, probabilities @ v."""
    b, hq, nq, d = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    k, v = (t.repeat_interleave(hq // hkv, dim=1) for t in (k, v))
    scores = torch.matmul(q, k.transpose(2, 3)) * (d ** -0.5 if scale is None else scale)  # [B, H, Nq, Nk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    qpos = torch.arange(nk - nq, nk, device=q.device)[:, None]
    kpos = torch.arange(nk, device=q.device)[None, :]
    visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible & (kpos <= qpos)
    if sliding_window is not None:
        visible = visible & (qpos - kpos < sliding_window)
    visible = visible.expand(b, 1, nq, nk)
    if padding_mask is not None:
        visible = visible & padding_mask[:, None, None, :]
    if segment_ids is not None:
        visible = visible & (segment_ids[:, None, nk - nq:, None] == segment_ids[:, None, None, :])
    bias = torch.zeros(b, hq, nq, nk, device=q.device)
    if alibi_slopes is not None:
        bias = bias + alibi_slopes[None, :, None, None] * (kpos - qpos)
    if key_bias is not None:
        bias = bias + key_bias[:, :, None, :]
    scores = scores.float() + bias.masked_fill(~visible, torch.finfo(torch.float32).min)
    if sinks is not None:
        sink = sinks.float()[None, :, None, None].expand(b, hq, nq, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    probs = torch.nn.functional.dropout(probs.to(v.dtype), dropout, training=True)
    return torch.matmul(probs, v)


def sdpa_reference(q, k, v, *, dropout=0.0, **_options):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                          enable_gqa=q.shape[1] != k.shape[1])


def run_attention(gpu_name: str, mode: str, expected_path: str, *, names=(), hq=HQ, hkv=HKV, d=D, dense=False,
                  reference=eager_attention, **scalars) -> dict:
    """blockwise_attention forward + backward next to stock's attention (`reference`) on the same leaves."""
    from bpt.attention import blockwise_attention
    from bpt.gpusim.device import simulate

    dtype, _ = MODES[mode]
    problems, facts = [], {"gpu": gpu_name, "mode": mode, "dense": dense, "hq": hq, "hkv": hkv, "d": d}
    with simulate(gpu(gpu_name)) as sim, counting_paths(sim.attention_paths), no_host_reads(dense):
        q, k, v = leaf((B, hq, N, d), dtype), leaf((B, hkv, N, d), dtype), leaf((B, hkv, N, d), dtype)
        options = {**side_inputs(names, B, hq, N, dtype), **scalars}
        leaves = {"q": q, "k": k, "v": v, **({"sinks": options["sinks"]} if "sinks" in options else {})}
        probe = tracker()
        with probe:
            with autocast(mode):
                out = blockwise_attention(q, k, v, q_block=Q_BLOCK, kv_block=KV_BLOCK, **options)
            out.backward(torch.randn_like(out))
        paths = dict(sim.attention_paths)
        sim.attention_paths.clear()
        stock_leaves = {name: fresh(t) for name, t in leaves.items()}
        stock_options = {**options, **({"sinks": stock_leaves["sinks"]} if "sinks" in options else {})}
        stock_probe = tracker()
        with stock_probe:
            with autocast(mode):
                want = reference(stock_leaves["q"], stock_leaves["k"], stock_leaves["v"], **stock_options)
            want.backward(torch.randn_like(want))
        facts.update(out=describe(out), stock_out=describe(want), paths=paths, stock_paths=dict(sim.attention_paths),
                     grads={n: describe(t.grad) for n, t in leaves.items()},
                     stock_grads={n: describe(t.grad) for n, t in stock_leaves.items()},
                     wide=wide_outputs(probe.output_shapes, {"N x N": N}),
                     stock_wide=wide_outputs(stock_probe.output_shapes, {"N x N": N}),
                     peak_bytes=probe.peak, stock_peak_bytes=stock_probe.peak, oracle=dict(sim.oracle.answers))
    compare(problems, "output", facts["out"], facts["stock_out"])
    autocast_dtype = MODES[mode][1] or dtype
    if facts["out"]["dtype"] != str(autocast_dtype).removeprefix("torch."):
        problems.append(f"output dtype {facts['out']['dtype']} in {mode}")
    for name in leaves:
        compare(problems, f"grad of {name}", facts["grads"][name], facts["stock_grads"][name])
        if facts["grads"][name] and facts["grads"][name]["dtype"] != str(leaves[name].dtype).removeprefix("torch."):
            problems.append(f"grad of {name} is {facts['grads'][name]['dtype']}, the leaf {leaves[name].dtype}")
    check_paths(problems, paths, expected_path)
    if facts["wide"]:
        problems.append(f"N x N outputs: {facts['wide'][:5]}")
    if reference is eager_attention:
        expect_wide(problems, facts["stock_wide"], "N x N", "the eager reference")
    facts["problems"] = problems
    return facts


def judged_against_stock(problems: list, facts: dict, value: tuple[str, str], kind: str, who: str) -> dict:
    """The verdict of an op case: its value (label, key: facts[key] vs facts["stock_" + key]) and every gradient equal
    to stock's in shape, dtype and device, no `kind` output on our side, and stock's own `kind` output seen."""
    label, key = value
    compare(problems, label, facts[key], facts[f"stock_{key}"])
    for name, want in facts["stock_grads"].items():
        compare(problems, f"grad of {name}", facts["grads"][name], want)
    if facts["wide"]:
        problems.append(f"{kind} outputs: {facts['wide'][:5]}")
    expect_wide(problems, facts["stock_wide"], kind, who)
    facts["problems"] = problems
    return facts


def expect_wide(problems: list, wide: list, kind: str, who: str) -> None:
    """Stock's own O(N^2) / O(N x V) tensor must show up in the probe: else the probe is blind and proves nothing."""
    if not any(w.endswith(f"({kind})") for w in wide):
        problems.append(f"probe blind: {who} made no {kind} output that it recorded ({wide[:3]})")


H100 = "h100-80gb"
KERNEL_OPTIONS = {  # name -> (side inputs, scalar options, dense plan, path)
    "padding": (("padding",), {}, True, "blockwise"),
    "padding-oracle-plan": (("padding",), {}, False, "blockwise"),  # the plan read through the oracle: no block masked
    "padding-empty-rows-uniform": (("padding",), {"empty_rows": "uniform"}, True, "blockwise"),  # eager's empty rows
    "padding-no-compile": (("padding",), {"compile": False}, True, "blockwise"),  # the eager Workspace path
    # packed documents and windows: torch's varlen flash kernel (the document lengths read once), blockwise where
    # no data may be read (dense: as under torch.compile)
    "segments": (("segments",), {}, True, "blockwise"),
    "segments-varlen": (("segments",), {}, False, "varlen"),
    "position-ids": (("positions",), {}, True, "blockwise"),
    "position-ids-varlen": (("positions",), {}, False, "varlen"),
    "sliding-window": ((), {"sliding_window": 1500}, False, "varlen"),
    "alibi": (("alibi",), {}, False, "blockwise"),
    "key-bias": (("key_bias",), {}, False, "blockwise"),
    "softcap": ((), {"softcap": 30.0}, False, "blockwise"),
    "sinks": (("sinks",), {}, False, "blockwise"),
    "dropout-padding": (("padding",), {"dropout": 0.1}, True, "blockwise"),  # dropout on the blockwise path
    "window-softcap-sinks": (("sinks",), {"sliding_window": 1500, "softcap": 30.0}, False, "blockwise"),  # gpt-oss
}

# every option in bf16 autocast; in fp16 autocast and bf16 weights the options whose inputs or gradients have dtypes of
# their own (masks, slopes, biases, sinks, dropout's keep-masks, empty rows)
OTHER_MODE_OPTIONS = ("padding", "padding-empty-rows-uniform", "segments", "position-ids-varlen", "alibi", "key-bias",
                      "sinks", "dropout-padding", "window-softcap-sinks")
for _mode in TRAINING_MODES:
    # plain causal with GQA: FlashAttention (SDPA, enable_gqa) on an H100, never the blockwise kernel
    case("attention", f"plain-gqa/{_mode}")(
        lambda mode=_mode: run_attention(H100, mode, "sdpa-flash", reference=sdpa_reference))
    case("attention", f"plain-mha/{_mode}")(
        lambda mode=_mode: run_attention(H100, mode, "sdpa-flash", hkv=HQ, reference=sdpa_reference))
    case("attention", f"dropout/{_mode}")(  # SDPA's own dropout
        lambda mode=_mode: run_attention(H100, mode, "sdpa-flash", dropout=0.1, reference=sdpa_reference))
    for _name, (_names, _scalars, _dense, _path) in KERNEL_OPTIONS.items():
        if _mode != "bf16-autocast" and _name not in OTHER_MODE_OPTIONS:
            continue
        case("attention", f"{_name}/{_mode}")(
            lambda mode=_mode, names=_names, scalars=_scalars, dense=_dense, path=_path:
            run_attention(H100, mode, path, names=names, dense=dense, **scalars))

# fp32: no flash kernel takes it; memory-efficient SDPA does, but not with grouped-query heads
case("attention", "plain-mha/fp32")(lambda: run_attention(H100, "fp32", "sdpa-efficient", hkv=HQ,
                                                          reference=sdpa_reference))
case("attention", "plain-gqa/fp32")(lambda: run_attention(H100, "fp32", "blockwise", reference=sdpa_reference))
case("attention", "padding/fp32")(lambda: run_attention(H100, "fp32", "blockwise", names=("padding",), dense=True))

# sm89 (L40S): FlashAttention's backward refuses head_dim > 192; memory-efficient takes it, but not with GQA
L40S = "l40s-48gb"
case("attention-sm89", "head-dim-256-gqa/bf16-autocast")(
    lambda: run_attention(L40S, "bf16-autocast", "blockwise", d=256, reference=sdpa_reference))
case("attention-sm89", "head-dim-256-mha/bf16-autocast")(
    lambda: run_attention(L40S, "bf16-autocast", "sdpa-efficient", hkv=HQ, d=256, reference=sdpa_reference))
case("attention-sm89", "head-dim-256-gqa/bf16-weights")(
    lambda: run_attention(L40S, "bf16-weights", "blockwise", d=256, reference=sdpa_reference))
case("attention-sm89", "head-dim-128-gqa/bf16-autocast")(
    lambda: run_attention(L40S, "bf16-autocast", "sdpa-flash", d=128, reference=sdpa_reference))
case("attention-sm89", "head-dim-256-padding/fp16-autocast")(
    lambda: run_attention(L40S, "fp16-autocast", "blockwise", d=256, names=("padding",), dense=True))

# sm75 (T4): no FlashAttention at all; memory-efficient takes fp16 / fp32 but not bf16
T4 = "t4-16gb"
case("attention-sm75", "plain-mha/fp16-autocast")(
    lambda: run_attention(T4, "fp16-autocast", "sdpa-efficient", hkv=HQ, reference=sdpa_reference))
case("attention-sm75", "plain-mha/fp32")(
    lambda: run_attention(T4, "fp32", "sdpa-efficient", hkv=HQ, reference=sdpa_reference))
case("attention-sm75", "plain-gqa/fp32")(lambda: run_attention(T4, "fp32", "blockwise", reference=sdpa_reference))
case("attention-sm75", "plain-mha/bf16-weights")(
    lambda: run_attention(T4, "bf16-weights", "blockwise", hkv=HQ, reference=sdpa_reference))


# ----------------------------------------------------------------------------------------------------
# Chunked MLP and chunked loss
# ----------------------------------------------------------------------------------------------------

HIDDEN, INTERMEDIATE, VOCAB = 64, 512, 2048


def _mlp(kind: str, dtype: torch.dtype, dropout: float = 0.0):
    """(module on meta, number of inputs) of a family's MLP."""
    from transformers import BloomConfig, LlamaConfig, MixtralConfig
    from transformers.models.bloom.modeling_bloom import BloomMLP
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    heads = dict(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        if kind == "llama":
            module, inputs = LlamaMLP(LlamaConfig(intermediate_size=INTERMEDIATE, **heads)), 1
        elif kind == "bloom":  # (hidden, residual); intermediate 4 x hidden
            module, inputs = BloomMLP(BloomConfig(hidden_size=HIDDEN, n_head=4, hidden_dropout=dropout)), 2
        elif kind == "mixtral":
            config = MixtralConfig(intermediate_size=INTERMEDIATE, num_local_experts=4, num_experts_per_tok=2, **heads)
            config._experts_implementation = experts_implementation(dtype)
            module, inputs = MixtralSparseMoeBlock(config), 1
        else:
            raise ValueError(kind)
    return module.to(dtype), inputs


def experts_implementation(dtype: torch.dtype) -> str:
    """transformers' default MoE experts (grouped_mm) take bf16 weights only on CUDA (torch's _grouped_mm rule, which
    the fake kernel enforces); its eager experts loop on data (`if expert_idx == num_experts`, which the oracle answers
    True: every expert skipped). fp32 expert weights (autocast, 4-bit bases) run the data-free batched_mm instead."""
    return "grouped_mm" if dtype == torch.bfloat16 else "batched_mm"


def run_mlp(kind: str, mode: str, dropout: float = 0.0) -> dict:
    from bpt.gpusim.device import simulate
    from bpt.gpusim.tracker import materialize_fake
    from bpt.mlp import chunked_mlp

    dtype, _ = MODES[mode]
    module, count = _mlp(kind, dtype, dropout)
    module.train()
    width = INTERMEDIATE if kind != "bloom" else 4 * HIDDEN
    problems, facts = [], {"mode": mode, "intermediate": width}
    with simulate(gpu(H100)) as sim:
        materialize_fake(module, sim.fake_mode, sim.torch_device)
        # one sequence: an MoE chunk's token x expert pairs (batch x chunk x top-k) stay below N
        inputs = [leaf((1, N, HIDDEN), dtype) for _ in range(count)]
        params = dict(module.named_parameters())
        probe = tracker()
        with probe:
            with autocast(mode):
                out = chunked_mlp(module.forward, list(module.parameters()), *inputs, chunk=CHUNK)
            out.backward(torch.randn_like(out))
        grads = {**{f"input{i}": describe(x.grad) for i, x in enumerate(inputs)},
                 **{name: describe(p.grad) for name, p in params.items()}}
        for p in params.values():
            p.grad = None
        stock_inputs = [fresh(x) for x in inputs]
        stock_probe = tracker()
        with stock_probe:
            with autocast(mode):
                want = module(*stock_inputs)
            want.backward(torch.randn_like(want))
        stock_grads = {**{f"input{i}": describe(x.grad) for i, x in enumerate(stock_inputs)},
                       **{name: describe(p.grad) for name, p in params.items()}}
        widths = {"N x I": width}
        facts.update(out=describe(out), stock_out=describe(want), grads=grads, stock_grads=stock_grads,
                     wide=wide_outputs(probe.output_shapes, widths), stock_wide=wide_outputs(stock_probe.output_shapes,
                                                                                             widths),
                     peak_bytes=probe.peak, stock_peak_bytes=stock_probe.peak, oracle=dict(sim.oracle.answers))
    return judged_against_stock(problems, facts, ("output", "out"), "N x I", "the stock MLP")


def run_loss(mode: str, **options) -> dict:
    from torch import nn
    from transformers.loss.loss_utils import ForCausalLMLoss

    from bpt.gpusim.device import simulate
    from bpt.gpusim.tracker import materialize_fake
    from bpt.loss import chunked_lm_loss

    dtype, _ = MODES[mode]
    with torch.device("meta"):
        head = nn.Linear(HIDDEN, VOCAB, bias=options.pop("bias", False), dtype=dtype)
    problems, facts = [], {"mode": mode, "options": dict(options)}
    with simulate(gpu(H100)) as sim:
        materialize_fake(head, sim.fake_mode, sim.torch_device)
        hidden = leaf((B, N, HIDDEN), dtype)
        labels = torch.randint(0, VOCAB, (B, N), device="cuda")
        params = dict(head.named_parameters())
        probe = tracker()
        with probe:
            with autocast(mode):
                loss = chunked_lm_loss(hidden, head, labels, chunk=CHUNK, **options)
            loss.backward()
        grads = {"hidden": describe(hidden.grad), **{n: describe(p.grad) for n, p in params.items()}}
        for p in params.values():
            p.grad = None
        stock_hidden = fresh(hidden)
        stock_probe = tracker()
        with stock_probe:
            with autocast(mode):
                logits = head(stock_hidden)
                if options.get("logit_scale") is not None:
                    logits = logits * options["logit_scale"]
                if options.get("logit_softcap") is not None:
                    logits = torch.tanh(logits / options["logit_softcap"]) * options["logit_softcap"]
                want = ForCausalLMLoss(logits, labels, VOCAB, num_items_in_batch=options.get("num_items_in_batch"))
            want.backward()
        stock_grads = {"hidden": describe(stock_hidden.grad), **{n: describe(p.grad) for n, p in params.items()}}
        widths = {"N x V": VOCAB}
        facts.update(loss=describe(loss), stock_loss=describe(want), grads=grads, stock_grads=stock_grads,
                     wide=wide_outputs(probe.output_shapes, widths),
                     stock_wide=wide_outputs(stock_probe.output_shapes, widths),
                     peak_bytes=probe.peak, stock_peak_bytes=stock_probe.peak, oracle=dict(sim.oracle.answers))
    return judged_against_stock(problems, facts, ("loss", "loss"), "N x V", "the stock head + loss")


for _mode in TRAINING_MODES:
    for _kind in ("llama", "bloom", "mixtral"):
        case("mlp", f"{_kind}/{_mode}")(lambda kind=_kind, mode=_mode: run_mlp(kind, mode))
    # dropout inside the chunks: backward replays the CUDA RNG state captured in forward
    case("mlp", f"bloom-dropout/{_mode}")(lambda mode=_mode: run_mlp("bloom", mode, dropout=0.1))
    case("loss", f"plain/{_mode}")(lambda mode=_mode: run_loss(mode))
    case("loss", f"bias-softcap-scale/{_mode}")(
        lambda mode=_mode: run_loss(mode, bias=True, logit_softcap=30.0, logit_scale=0.5))
    case("loss", f"num-items/{_mode}")(lambda mode=_mode: run_loss(mode, num_items_in_batch=3000))


# ----------------------------------------------------------------------------------------------------
# Patched tiny models: LoRA (peft) and emulated 4-bit, through apply_bpt_patch
# ----------------------------------------------------------------------------------------------------

# family -> (tiny_models name, config overrides, patched attention path on an H100). Widths are chosen so that every
# legitimate per-token tensor (q/k/v projections, Bloom's fused qkv 96, Bamba's mamba in_proj 148) stays narrower
# than the MLP intermediate and the vocabulary: anything N x I or N x V is then the MLP's or the logits'.
# One decoder layer where the family's layers are all alike; two where they differ (sliding + full attention, Mamba +
# attention).
FAMILIES = {
    "llama": ("llama", dict(intermediate_size=256, vocab_size=1024, num_hidden_layers=1), "sdpa-flash"),
    "gemma2": ("gemma2", dict(intermediate_size=256, vocab_size=1024), "blockwise"),  # softcaps, sliding + full
    "gpt_oss": ("gpt_oss", dict(intermediate_size=256, vocab_size=1024), "blockwise"),  # sinks, MoE, sliding + full
    "bloom": ("bloom", dict(vocab_size=1024, n_layer=1), "blockwise"),  # ALiBi (key bias), own attention binding
    "mixtral": ("mixtral", dict(intermediate_size=256, vocab_size=1024, num_hidden_layers=1), "sdpa-flash"),  # MoE
    "bamba": ("bamba", dict(intermediate_size=256, vocab_size=1024), "sdpa-flash"),  # hybrid: Mamba-2 + attention
    # head_dim 256: the q projection is 1024 wide, so wider I and V (V below N: logits are N x V, not N x N)
    "llama-hd256": ("llama", dict(head_dim=256, intermediate_size=2048, vocab_size=3072, num_hidden_layers=1),
                    "blockwise"),
}


MOE_FAMILIES = ("gpt_oss", "mixtral")


def build_model(family: str, mode: str, *, side: str, bits: int, lora: bool, checkpointing: bool,
                blocks: dict | None = None):
    """The tiny model of `family` on meta as the recipe builds it: weights in the mode's dtype (4-bit: Linear layers
    as emulated NF4, the rest fp32 as prepare_model_for_kbit_training leaves them), LoRA on every linear layer,
    gradient checkpointing (non-reentrant), patched with `blocks` (default MODEL_BLOCKS) when side == "patched"."""
    from transformers import AutoModelForCausalLM
    from tiny_models import tiny_config

    name, overrides, _ = FAMILIES[family]
    config = tiny_config(name, **overrides)
    config.use_cache = False
    dtype = MODES[mode][0] if bits == 16 else torch.float32
    if family in MOE_FAMILIES:
        config._experts_implementation = experts_implementation(dtype)
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
        except ValueError:  # families without SDPA in transformers (eager attention)
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype)
    model.train()
    no_reentrant = {"gradient_checkpointing_kwargs": {"use_reentrant": False}}
    if bits == 4:
        from peft import prepare_model_for_kbit_training

        from bpt.gpusim.quant4 import quantise_linears

        quantise_linears(model)
        model.is_loaded_in_4bit = True
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing, **no_reentrant)
    elif checkpointing:
        model.gradient_checkpointing_enable(**no_reentrant)
    if lora:
        from peft import LoraConfig, get_peft_model

        from bpt.gpusim.quant4 import lora_like_bitsandbytes

        model = get_peft_model(model, lora_like_bitsandbytes(LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")))
    if side == "patched":
        from patches import apply_bpt_patch

        apply_bpt_patch(model, **(blocks or MODEL_BLOCKS))
    return model


def model_inputs(kind: str) -> dict:
    ids = torch.zeros(1, N, dtype=torch.long, device="cuda")
    inputs = {"input_ids": ids, "labels": ids}
    if kind == "padding":
        inputs["attention_mask"] = torch.ones(1, N, dtype=torch.long, device="cuda")
    elif kind == "packed":  # documents of 1000 tokens: position ids restart
        inputs["position_ids"] = torch.arange(N, device="cuda").remainder(1000)[None]
    return inputs


def model_step(family: str, mode: str, side: str, *, gpu_name=H100, bits=16, lora=True, checkpointing=False,
               inputs="plain", dense=False, blocks=None) -> dict:
    """One forward with labels + backward of the model on the simulated GPU: what came out, the attention paths, the
    output shapes."""
    from bpt.gpusim.device import simulate
    from bpt.gpusim.tracker import materialize_fake

    model = build_model(family, mode, side=side, bits=bits, lora=lora, checkpointing=checkpointing, blocks=blocks)
    config = model.config
    intermediate = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    widths = {"N x N": N, "N x I": intermediate, "N x V": config.vocab_size}
    with simulate(gpu(gpu_name)) as sim, counting_paths(sim.attention_paths), transformers_sees_real_tensors(), \
            no_host_reads(dense):
        materialize_fake(model, sim.fake_mode, sim.torch_device)
        batch = model_inputs(inputs)
        probe = tracker()
        probe.track(*model.parameters(), *model.buffers())
        before = probe.live
        with probe:
            with autocast(mode):
                output = model(**batch)
            output.loss.backward()
        return {"loss": describe(output.loss), "logits": describe(output.logits),
                "grads": {n: describe(p.grad) for n, p in model.named_parameters() if p.requires_grad},
                "paths": dict(sim.attention_paths), "wide": wide_outputs(probe.output_shapes, widths),
                "step_bytes": probe.peak - before, "oracle": dict(sim.oracle.answers)}


def run_model(family: str, mode: str, *, expected_path: str | None = None, stock_path: str | None = None,
              **options) -> dict:
    """Stock and patched side by side: same loss and gradient dtypes, on cuda; the patched side's attention path is
    the family's intended one and it makes no N x N / N x I / N x V tensor, which stock (its logits) does make.
    stock_path: the SDPA kernel stock must take (its N x N then shows up too)."""
    stock = model_step(family, mode, "stock", **options)
    patched = model_step(family, mode, "patched", **options)
    problems = []
    compare(problems, "loss", patched["loss"], stock["loss"])
    if patched["logits"] is not None:
        problems.append(f"patched logits {patched['logits']} with labels (expected None)")
    if set(patched["grads"]) != set(stock["grads"]):
        problems.append(f"trainable parameters differ: {sorted(set(patched['grads']) ^ set(stock['grads']))[:5]}")
    if not stock["grads"]:
        problems.append("nothing trainable")
    for name, want in stock["grads"].items():
        compare(problems, f"grad of {name}", patched["grads"].get(name), want)
    check_paths(problems, patched["paths"], expected_path or FAMILIES[family][2])
    if patched["wide"]:
        problems.append(f"O(N x N / I / V) outputs: {patched['wide'][:5]}")
    expect_wide(problems, stock["wide"], "N x V", "stock (its logits)")
    if stock_path is not None:
        check_paths(problems, stock["paths"], stock_path)
        if stock_path == "sdpa-math":
            expect_wide(problems, stock["wide"], "N x N", "stock's SDPA math kernel")
    return {"family": family, "mode": mode, **options, "problems": problems, "patched": patched, "stock": stock}


# LoRA in each mode (fp16 autocast where the model itself does something fp16-specific: the kernels' fp16 cases cover
# sinks, ALiBi biases and MoE routing inputs), and QLoRA (4-bit, fp32 rest, non-reentrant gradient checkpointing)
FP16_FAMILIES = ("llama", "gemma2")
QLORA_FAMILIES = ("llama", "gpt_oss", "bloom", "bamba")
for _family in ("llama", "gemma2", "gpt_oss", "bloom", "mixtral", "bamba"):
    for _mode in TRAINING_MODES:
        if _mode == "fp16-autocast" and _family not in FP16_FAMILIES:
            continue
        case("models", f"{_family}/lora/{_mode}")(lambda family=_family, mode=_mode: run_model(family, mode))
    if _family in QLORA_FAMILIES:
        case("models", f"{_family}/qlora-4bit/bf16-autocast")(
            # checkpointed: a dense call takes the fused kernel with its backward in head groups (bpt.head_groups)
            lambda family=_family: run_model(family, "bf16-autocast", bits=4, checkpointing=True,
                                             expected_path=None if FAMILIES[family][2] == "blockwise"
                                             else "flash-head-groups"))
for _inputs in ("padding", "packed"):  # the masks the dense plan applies in every block
    case("models", f"llama/lora/{_inputs}/bf16-autocast")(
        lambda inputs=_inputs: run_model("llama", "bf16-autocast", inputs=inputs, dense=True,
                                         expected_path="blockwise"))
# sm89: head_dim 256 with GQA: no fused kernel for training (flash refuses the backward, memory-efficient GQA), so
# stock SDPA falls to the math kernel (N x N); the patch goes blockwise
case("models", "llama-hd256/lora/bf16-autocast/l40s")(
    lambda: run_model("llama-hd256", "bf16-autocast", gpu_name=L40S, stock_path="sdpa-math"))


# ----------------------------------------------------------------------------------------------------
# Sequence parallel: ring and Ulysses kernels over a fake process group
# ----------------------------------------------------------------------------------------------------

WORLD, RANK = 4, 1  # a middle rank: its zigzag chunks and head range are neither the first nor the last
SHORT = 256  # tokens of the one-device reference


@contextlib.contextmanager
def fake_process_group():
    """torch.distributed's fake backend: collectives and P2P return at once without moving data (shapes only)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    started = not dist.is_initialized()
    if started:
        dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=WORLD)
    try:
        yield
    finally:
        if started:
            dist.destroy_process_group()


def run_sequence_parallel(kind: str, mode: str, expected_path: str, *, names=(), dense=False, **scalars) -> dict:
    """This rank's shard through ring_attention / ulysses_attention, forward + backward, next to blockwise_attention on
    the whole sequence on one device (the dtypes it must give)."""
    from bpt.attention import blockwise_attention
    from bpt.gpusim.device import simulate
    from bpt.sequence_parallel import ring_attention, ulysses_attention

    dtype, _ = MODES[mode]
    n = N // WORLD
    problems, facts = [], {"mode": mode, "world": WORLD, "rank": RANK, "dense": dense}
    with fake_process_group(), simulate(gpu(H100)) as sim, counting_paths(sim.attention_paths), no_host_reads(dense):
        q, k, v = leaf((B, HQ, n, D), dtype), leaf((B, HKV, n, D), dtype), leaf((B, HKV, n, D), dtype)
        # ring: side inputs are this rank's shard; ulysses: the global ones
        options = {**side_inputs(names, B, HQ, n if kind == "ring" else N, dtype), **scalars}
        leaves = {"q": q, "k": k, "v": v, **({"sinks": options["sinks"]} if "sinks" in options else {})}
        attention = ring_attention if kind == "ring" else ulysses_attention
        probe = tracker()
        with probe:
            with autocast(mode):
                out = attention(q, k, v, q_block=Q_BLOCK, kv_block=KV_BLOCK, **options)
            out.backward(torch.randn_like(out))
        paths = dict(sim.attention_paths)
        sim.attention_paths.clear()
        # the same options on one device (a short sequence: only its dtypes are compared)
        whole = {name: leaf((B, t.shape[1], SHORT, D), dtype) for name, t in (("q", q), ("k", k), ("v", v))}
        one = {**side_inputs(names, B, HQ, SHORT, dtype), **scalars}
        with autocast(mode):
            want = blockwise_attention(whole["q"], whole["k"], whole["v"], **one)
        want.backward(torch.randn_like(want))
        facts.update(out=describe(out), one_device_out=describe(want), paths=paths,
                     grads={name: describe(t.grad) for name, t in leaves.items()},
                     one_device_grads={name: describe(t.grad) for name, t in whole.items()},
                     wide=wide_outputs(probe.output_shapes, {"N x N": N}), peak_bytes=probe.peak,
                     oracle=dict(sim.oracle.answers))
    if facts["out"]["shape"] != [B, HQ, n, D]:
        problems.append(f"output shape {facts['out']['shape']}, expected this rank's shard {[B, HQ, n, D]}")
    compare(problems, "output", facts["out"], facts["one_device_out"], shape=False)
    for name, t in leaves.items():  # each gradient: the leaf's shard shape and dtype, as on one device
        got = facts["grads"][name]
        compare(problems, f"grad of {name}", got, facts["one_device_grads"].get(name, describe(t)), shape=False)
        if got and (got["shape"], got["dtype"]) != (list(t.shape), str(t.dtype).removeprefix("torch.")):
            problems.append(f"grad of {name}: {got}, the leaf {describe(t)}")
    check_paths(problems, paths, expected_path)
    if facts["wide"]:
        problems.append(f"N x N outputs: {facts['wide'][:5]}")
    facts["problems"] = problems
    return facts


def run_sequence_parallel_model(family: str, mode: str, sp_mode: str, expected_path: str) -> dict:
    """A patched model trained sequence-parallel as patches.sequence_parallel documents it (shard_batch, the attention
    context, reduce_gradients, group_loss), this rank's share, next to stock on one device (the dtypes it must give)."""
    from bpt.gpusim.device import simulate
    from bpt.gpusim.tracker import materialize_fake
    from patches import group_loss, reduce_gradients, sequence_parallel_attention, shard_batch

    stock = model_step(family, mode, "stock")
    model = build_model(family, mode, side="patched", bits=16, lora=True, checkpointing=False)
    config = model.config
    intermediate = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    widths = {"N x N": N, "N x I": intermediate, "N x V": config.vocab_size}
    problems = []
    with fake_process_group(), simulate(gpu(H100)) as sim, counting_paths(sim.attention_paths), \
            transformers_sees_real_tensors():
        materialize_fake(model, sim.fake_mode, sim.torch_device)
        ids = torch.zeros(1, N, dtype=torch.long, device="cuda")
        probe = tracker()
        with probe:
            local, context = shard_batch({"input_ids": ids, "labels": ids}, None, sp_mode)
            with sequence_parallel_attention(model, context):
                with autocast(mode):
                    output = model(**local)
                output.loss.backward()
            reduce_gradients(model)
            total = group_loss(output.loss)
        patched = {"loss": describe(output.loss), "group_loss": describe(total), "logits": describe(output.logits),
                   "tokens": describe(local["input_ids"]),
                   "grads": {n: describe(p.grad) for n, p in model.named_parameters() if p.requires_grad},
                   "paths": dict(sim.attention_paths), "wide": wide_outputs(probe.output_shapes, widths),
                   "oracle": dict(sim.oracle.answers)}
    compare(problems, "loss", patched["loss"], stock["loss"])
    compare(problems, "group loss", patched["group_loss"], stock["loss"])
    if patched["tokens"]["shape"] != [1, N // WORLD]:
        problems.append(f"this rank's tokens {patched['tokens']['shape']}, expected [1, {N // WORLD}]")
    if set(patched["grads"]) != set(stock["grads"]):
        problems.append(f"trainable parameters differ: {sorted(set(patched['grads']) ^ set(stock['grads']))[:5]}")
    for name, want in stock["grads"].items():
        compare(problems, f"grad of {name}", patched["grads"].get(name), want)
    check_paths(problems, patched["paths"], expected_path)
    if patched["wide"]:
        problems.append(f"O(N x N / I / V) outputs: {patched['wide'][:5]}")
    return {"family": family, "mode": mode, "sp_mode": sp_mode, "problems": problems, "patched": patched,
            "stock": stock}


SP_OPTIONS = {  # name -> (side inputs, scalars, dense, ring path, ulysses path)
    "plain": ((), {}, False, "ring-fused", "sdpa-flash"),
    "padding": (("padding",), {}, True, "ring", "blockwise"),
    "segments": (("segments",), {}, True, "ring", "blockwise"),
    "sliding-window": ((), {"sliding_window": 1500}, False, "ring", "varlen"),  # Ulysses' whole-sequence attention
    "alibi": (("alibi",), {}, False, "ring", "blockwise"),
    "softcap": ((), {"softcap": 30.0}, False, "ring", "blockwise"),
    "sinks": (("sinks",), {}, False, "ring", "blockwise"),
}
for _name, (_names, _scalars, _dense, _ring, _ulysses) in SP_OPTIONS.items():
    for _kind, _path in (("ring", _ring), ("ulysses", _ulysses)):
        case("sequence-parallel", f"{_kind}/{_name}/bf16-autocast")(
            lambda kind=_kind, path=_path, names=_names, scalars=_scalars, dense=_dense:
            run_sequence_parallel(kind, "bf16-autocast", path, names=names, dense=dense, **scalars))
case("sequence-parallel", "ulysses/key-bias/bf16-autocast")(
    lambda: run_sequence_parallel("ulysses", "bf16-autocast", "blockwise", names=("key_bias",)))
for _family, _sp_mode, _path in (("llama", "ring", "ring-fused"), ("llama", "ulysses", "sdpa-flash"),
                                 ("gpt_oss", "ring", "ring"), ("gemma2", "ulysses", "blockwise")):
    # (Bloom's ALiBi is refused here: sequence parallelism checks on the data that its bias is linear in the key
    # index, and the oracle's "true" answer to that check reads as "it is not")
    case("sequence-parallel", f"model/{_family}/{_sp_mode}/bf16-autocast")(
        lambda family=_family, sp_mode=_sp_mode, path=_path:
        run_sequence_parallel_model(family, "bf16-autocast", sp_mode, path))
for _mode in ("fp16-autocast", "bf16-weights"):
    for _kind, _path in (("ring", "ring-fused"), ("ulysses", "sdpa-flash")):
        case("sequence-parallel", f"{_kind}/plain/{_mode}")(
            lambda kind=_kind, path=_path, mode=_mode: run_sequence_parallel(kind, mode, path))


# ----------------------------------------------------------------------------------------------------
# The probe is not blind: stock's N x N and N x V tensors show up in it
# ----------------------------------------------------------------------------------------------------


def expect_caught(facts: dict, wide: list, kind: str) -> dict:
    problems = []
    expect_wide(problems, wide, kind, "stock")
    return {**facts, "wide": wide, "problems": problems}


@case("probe-catches-stock", "sdpa-fp32-gqa-math-NxN")
def _sdpa_math():
    import torch.nn.functional as F

    from bpt.gpusim.device import simulate

    with simulate(gpu(H100)) as sim:
        q, k, v = (leaf((B, heads, N, D), torch.float32) for heads in (HQ, HKV, HKV))
        probe = tracker()
        with probe:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
        facts = expect_caught({"paths": dict(sim.attention_paths)}, wide_outputs(probe.output_shapes, {"N x N": N}),
                              "N x N")
    if set(facts["paths"]) != {"sdpa-math"}:
        facts["problems"].append(f"paths {facts['paths']}: expected the math kernel")
    return facts


@case("probe-catches-stock", "patched-with-whole-sequence-chunks-NxI-NxV")
def _whole_chunks():
    """A patch whose MLP and loss chunks hold the whole sequence makes the N x I / N x V tensors it exists to avoid."""
    step = model_step("llama", "bf16-autocast", "patched", blocks={**MODEL_BLOCKS, "mlp_chunk": N, "loss_chunk": N})
    facts = expect_caught({"paths": step["paths"]}, step["wide"], "N x V")
    expect_wide(facts["problems"], step["wide"], "N x I", "the whole-sequence MLP chunk")
    return facts


@case("probe-catches-stock", "is-wide-rule")
def _rule():
    """The shape rule itself, on shapes a blockwise kernel makes and on those it must never make."""
    legit = [(4, 2048, 1024), (1, N, 255), (8192, 32), (N,), (2, 8, N, 64), (N * 255,)]
    quadratic = [(N, N), (1, 4, N, N), (N, 256), (8192, 256), (2, N, 1024), (N * 256,), (256, N)]
    problems = [f"{s} taken for N x 256" for s in legit if is_wide(s, N, 256)]
    problems += [f"{s} missed" for s in quadratic if not is_wide(s, N, 256)]
    return {"problems": problems}


# ----------------------------------------------------------------------------------------------------
# Runner
# ----------------------------------------------------------------------------------------------------


def run_all(only: str | None = None) -> dict:
    from bpt.gpusim.shim import active

    if not active():
        raise SystemExit("cuda_dry_run needs the bpt.gpusim shim loaded before torch (bpt.gpusim.shim.boot_command)")
    warnings.simplefilter("ignore")  # compile-unavailable, deprecation and transformers notices: not findings
    start = time.perf_counter()
    results = []
    for group, name, fn in CASES:
        if only and not f"{group}/{name}".startswith(only):
            continue
        began = time.perf_counter()
        try:
            facts = fn()
            entry = {"ok": not facts["problems"], **facts}
        except Exception:  # recorded: the next case runs
            entry = {"ok": False, "problems": ["raised"], "error": traceback.format_exc()}
        results.append({"group": group, "name": name, "seconds": round(time.perf_counter() - began, 3), **entry})
    return {"cases": results, "seconds": round(time.perf_counter() - start, 3), "n": N,
            "kernel_blocks": [Q_BLOCK, KV_BLOCK], "model_blocks": MODEL_BLOCKS,
            "torch": torch.__version__}


def main(argv: list[str]) -> None:
    path = argv[0] if argv else "-"
    only = argv[1] if len(argv) > 1 else None
    report = json.dumps(run_all(only), indent=1, default=str)
    if path == "-":
        print(report)
    else:
        with open(path, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main(sys.argv[1:])
