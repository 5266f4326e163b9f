"""Low precision the way users train: bf16 autocast over fp32 weights, and bf16 weights.

The rule (docs/DESIGN.md, precision): patched and stock are each compared with an fp32 reference, and the patched
error must be no worse than about 1.5x stock's own error, on the loss and on every gradient. Errors of one
batch are noise-dominated (stock sometimes lands within 1e-7 by luck), so each error is the RMS over several
batches: the loss's relative error, and per parameter the Frobenius error relative to the reference's norm.

Eight batches settle most ratios, not those of a parameter with a handful of values whose gradient sums over every
token (a Mamba layer's `A_log`: one value per head): its error does not average within the tensor, and which side's
kernels round luckier decides the ratio. Measured on bamba, packed, bf16 autocast, `A_log`: 1.37x, 0.76x and 0.98x
stock's over three disjoint sets of 8 batches (AVX2 kernels), 1.76x over the first 8 with
`ATEN_CPU_CAPABILITY=default`, and 1.03x / 1.06x over 64 batches on both. So a ratio over the limit after the first
batches is measured again over `MORE_SEEDS` (a superset) before it counts: a real gap survives that, a lucky draw
does not, and the suite's time stays that of 8 batches where nothing is close.

What it measures is the numerics of every op, with MoE routing made continuous: a config with top-k expert routing
runs here with top-k = the number of experts (and, for group-limited routing, topk_group = n_group), see
`all_experts_routing`. Top-k selection is a discontinuity: bf16 noise flips a near-tied choice in stock or patched
(whichever side flips gets a large expert / router gradient error), which says nothing about either side's precision.
The fp32 exactness tests (test_patches.py) keep the tiny configs' top-2 routing: that is where exactness of routing
itself is checked.
"""
from __future__ import annotations

import copy
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

from bpt import compile as bpt_compile
from bpt.attention import blockwise_attention
from bpt.engine import Workspace
from patches import apply_bpt_patch, is_patched
from test_patches import SMALL_BLOCKS, make_batch
from tiny_models import TINY_CONFIGS, tiny_config, tiny_model

WORSE_AT_MOST = 1.5
SEEDS = range(8)
MORE_SEEDS = range(64)  # where the first SEEDS put a ratio over the limit (module docstring)


AUTOCAST = {"autocast": torch.bfloat16, "fp16_autocast": torch.float16}  # mode -> autocast dtype


def _run(model, inputs, mode: str, device: str):
    """-> (each labelled token's loss, gradients) of one training forward + backward in `mode`."""
    with torch.autocast(device, dtype=AUTOCAST.get(mode, torch.bfloat16), enabled=mode in AUTOCAST):
        logits, grads = forward_backward(model, inputs)
        return _token_losses(model, inputs, logits), grads


# Config attributes for the number of routed experts and for how many of them each token picks (each family
# names them its own way); group-limited routing (n_group groups, the top topk_group of them) on top.
EXPERT_COUNT_ATTRIBUTES = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_ATTRIBUTES = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts")


def all_experts_routing(config) -> dict:
    """Config overrides that route every token to every expert (top-k = number of experts; every group kept):
    {} for a config without top-k routing."""
    top_k = [name for name in TOP_K_ATTRIBUTES if isinstance(getattr(config, name, None), int)]
    counts = {getattr(config, name) for name in EXPERT_COUNT_ATTRIBUTES if isinstance(getattr(config, name, None), int)}
    if not top_k or not counts:
        return {}
    assert len(counts) == 1, f"{config.model_type}: expert counts disagree ({counts}): set them all in its tiny config"
    overrides = dict.fromkeys(top_k, counts.pop())
    if isinstance(getattr(config, "n_group", None), int) and isinstance(getattr(config, "topk_group", None), int):
        overrides["topk_group"] = config.n_group
    return overrides


def forward_backward(model, inputs):
    """-> (the logits of a training forward with labels, None where it made none; the parameters' gradients)."""
    model.zero_grad(set_to_none=True)
    output = model(**inputs)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return None if output.logits is None else output.logits.detach(), grads


def _token_losses(model, inputs, logits: torch.Tensor | None) -> torch.Tensor:
    """Each labelled token's loss (fp32 cross entropy of the logits, shifted as the model's own loss is). Stock's
    training forward has made its logits; the patched forward with labels never makes any, so it runs once more
    without labels (the caller's precision)."""
    if logits is None:
        unlabelled = {key: value for key, value in inputs.items() if key != "labels"}
        with torch.no_grad():
            logits = model(**unlabelled).logits
    labels = inputs["labels"][:, 1:]
    losses = F.cross_entropy(logits.float()[:, :-1].transpose(1, 2), labels, reduction="none", ignore_index=-100)
    return losses[labels != -100]


def _sides(name: str, modes, checkpointing: str | None, device: str, overrides: dict):
    """-> (fp32 reference, {mode: (stock, patched)}): one reference for every mode asked."""
    reference = tiny_model(name, **overrides).to(device)
    sides = {}
    for mode in modes:
        stock, patched = copy.deepcopy(reference), copy.deepcopy(reference)
        apply_bpt_patch(patched, **SMALL_BLOCKS)
        if mode == "bf16_weights":
            stock.bfloat16(), patched.bfloat16()
        if checkpointing:
            for model in (stock, patched):
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "reentrant"})
        sides[mode] = stock, patched
    return reference, sides


def errors_by_mode(name: str, kind: str, modes, checkpointing: str | None = None, device: str = "cpu",
                   seeds=SEEDS, **overrides) -> dict:
    """-> {mode: {"token_loss": (patched, stock), parameter name: (patched, stock)}} RMS errors against one fp32
    reference, with MoE routing to every expert (module docstring). The loss is compared token by token: its batch
    mean averages bf16 errors of opposite signs down to ~1e-5 relative, where which side lands closer is a coin toss
    (measured: the scalar loss of 5 families' packed cases at 1.54-1.86x stock's, every gradient and every token's
    loss within the limit)."""
    overrides = {**all_experts_routing(tiny_config(name, **overrides)), **overrides}
    reference, sides = _sides(name, modes, checkpointing, device, overrides)
    squared = {mode: {"patched": {}, "stock": {}} for mode in modes}
    norms = {}
    for seed in seeds:
        inputs = {key: value.to(device) if isinstance(value, torch.Tensor) else value
                  for key, value in make_batch(kind, seed=seed).items()}
        ref_token_losses, ref_grads = _run(reference, inputs, "fp32", device)
        for mode, (stock, patched) in sides.items():
            for side, model in (("stock", stock), ("patched", patched)):
                token_losses, grads = _run(model, inputs, mode, device)
                errors = squared[mode][side]
                token_error = (token_losses - ref_token_losses).pow(2).sum().item()
                errors["token_loss"] = errors.get("token_loss", 0.0) + token_error
                assert grads.keys() == ref_grads.keys()
                for param, ref in ref_grads.items():
                    errors[param] = errors.get(param, 0.0) + (grads[param].float() - ref).pow(2).sum().item()
        norms["token_loss"] = norms.get("token_loss", 0.0) + ref_token_losses.pow(2).sum().item()
        for param, ref in ref_grads.items():
            norms[param] = norms.get(param, 0.0) + ref.pow(2).sum().item()
    return {mode: {key: ((squared[mode]["patched"][key] / norms[key]) ** 0.5,
                         (squared[mode]["stock"][key] / norms[key]) ** 0.5) for key in norms} for mode in modes}


def low_precision_errors(name: str, kind: str, mode: str, **options) -> dict:
    """errors_by_mode of one mode."""
    return errors_by_mode(name, kind, (mode,), **options)[mode]


def _worst(errors: dict) -> str:
    return max(errors, key=lambda key: errors[key][0] / errors[key][1] if errors[key][1] else float("inf"))


def _over(errors: dict) -> bool:
    patched, stock = errors[_worst(errors)]
    return stock > 0 and patched > WORSE_AT_MOST * stock


def assert_no_worse_than_stock(errors: dict, batches: int | None = None, mode: str | None = None):
    worst = _worst(errors)
    patched, stock = errors[worst]
    where = f"{mode}: " if mode else ""
    assert stock > 0, f"{where}{worst}: stock equals the fp32 reference exactly: the low precision did not apply"
    over = f" over {batches} batches" if batches else ""
    assert patched <= WORSE_AT_MOST * stock, \
        f"{where}{worst}: patched error {patched:.3e} is {patched / stock:.2f}x stock's {stock:.3e}{over}"


def assert_low_precision_no_worse(name: str, kind: str, modes, seeds=SEEDS, **options):
    """The rule over `seeds` batches in each of `modes` (a mode or several, sharing one fp32 reference); a mode whose
    ratio is over the limit is measured again over MORE_SEEDS before it counts."""
    modes = (modes,) if isinstance(modes, str) else tuple(modes)
    errors = errors_by_mode(name, kind, modes, seeds=seeds, **options)
    batches = dict.fromkeys(modes, len(seeds))
    again = tuple(mode for mode in modes if _over(errors[mode]))
    if again and len(MORE_SEEDS) > len(seeds):
        errors.update(errors_by_mode(name, kind, again, seeds=MORE_SEEDS, **options))
        batches.update(dict.fromkeys(again, len(MORE_SEEDS)))
    for mode in modes:
        assert_no_worse_than_stock(errors[mode], batches=batches[mode], mode=mode)


@pytest.mark.parametrize("kind", ["right_padded", "left_padded", "packed"])
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_low_precision_no_worse_than_stock(name, kind):
    """bf16 autocast over fp32 weights, and bf16 weights: one fp32 reference for both."""
    assert_low_precision_no_worse(name, kind, ("autocast", "bf16_weights"))


def test_a_real_gap_survives_more_batches(monkeypatch):
    """The second measurement cannot rescue a real gap: with every patched gradient 5% off (every batch), the first
    batches fail, the verdict is taken again over MORE_SEEDS, and it still fails."""
    exact = forward_backward

    def skewed(model, inputs):
        logits, grads = exact(model, inputs)
        return logits, {name: grad * 1.05 for name, grad in grads.items()} if is_patched(model) else grads

    monkeypatch.setattr(sys.modules[__name__], "forward_backward", skewed)
    with pytest.raises(AssertionError, match=f"autocast: .* over {len(MORE_SEEDS)} batches"):
        assert_low_precision_no_worse("llama", "right_padded", ("autocast", "bf16_weights"), seeds=range(2))


def test_mpt_attention_under_autocast_no_worse_than_stock():
    """MPT's attention module alone (its own ALiBi tensor and boolean mask, right padding), bf16 autocast vs fp32:
    the bound blockwise forward's output error (RMS over real tokens, 16 batches) is no worse than stock's."""
    from transformers.masking_utils import create_causal_mask

    stock = tiny_model("mpt")
    patched = copy.deepcopy(stock)
    apply_bpt_patch(patched, **SMALL_BLOCKS)
    padding = torch.ones(2, 45, dtype=torch.long)
    padding[0, -9:] = 0
    squared, norm = {"stock": 0.0, "patched": 0.0}, 0.0

    def attention(model, x, autocast: bool):
        base = model.transformer
        alibi = base.build_mpt_alibi_tensor(base.num_heads, model.config.max_seq_len)
        mask = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=padding,
                                  past_key_values=None).to(torch.bool)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return base.blocks[0].attn(x, position_bias=alibi, attention_mask=mask)[0].float()[padding.bool()]

    for seed in range(16):
        x = torch.randn(2, 45, stock.config.d_model, generator=torch.Generator().manual_seed(seed))
        reference = attention(stock, x, autocast=False)
        norm += reference.pow(2).sum().item()
        for side, model in (("stock", stock), ("patched", patched)):
            squared[side] += (attention(model, x, autocast=True) - reference).pow(2).sum().item()
    assert 0 < squared["patched"] <= squared["stock"], {side: (error / norm) ** 0.5 for side, error in squared.items()}


@pytest.mark.parametrize("name", ["llama", "gemma2", "falcon_alibi", "gpt2"])
def test_fp16_autocast_no_worse_than_stock(name):
    """fp16 errors are ~4x smaller than bf16's, so a scalar loss needs more batches to rise above the noise:
    16 (with 8, gemma2's loss ratio measured 1.55; with 16, 0.89)."""
    assert_low_precision_no_worse(name, "right_padded", "fp16_autocast", seeds=range(16))


@pytest.mark.parametrize("name,checkpointing", [("llama", "non_reentrant"), ("gemma2", "non_reentrant"),
                                                ("falcon_alibi", "reentrant"), ("gpt2", "reentrant")])
def test_low_precision_with_gradient_checkpointing(name, checkpointing):
    assert_low_precision_no_worse(name, "right_padded", "autocast", checkpointing=checkpointing)


# ------------------------------------------------------------------------------------------------------
# The kernel under autocast: mixed input dtypes, workspace on / off, compile on
# ------------------------------------------------------------------------------------------------------


def _attention_case(seed: int = 0):
    """q, k in fp32 and v in bf16, as RoPE leaves them under autocast; right padding (blockwise path)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 45, 16, generator=g)
    k = torch.randn(2, 2, 45, 16, generator=g)
    v = torch.randn(2, 2, 45, 16, generator=g).bfloat16()
    padding = torch.ones(2, 45, dtype=torch.bool)
    padding[0, -9:] = False
    return q, k, v, padding


def _stock_sdpa(q, k, v, padding):
    """What stock transformers runs here: SDPA with a boolean causal + padding mask, GQA repeated."""
    n = q.shape[2]
    mask = torch.ones(n, n, dtype=torch.bool).tril() & padding[:, None, None, :]
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _with_grads(fn, q, k, v, padding):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(q, k, v, padding)
    rows = padding[:, None, :, None].expand(out.shape)
    grad = torch.linspace(-1, 1, out.numel()).view(out.shape) * rows
    grads = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    return out.float() * rows, [g.float() for g in grads]


def _blockwise(q, k, v, padding, **options):
    return blockwise_attention(q, k, v, padding_mask=padding, q_block=16, kv_block=16, **options)


@pytest.mark.parametrize("workspace", [True, False])
def test_kernel_under_autocast_mixed_dtypes(monkeypatch, workspace):
    """Autocast casts q, k, v as it casts SDPA's inputs (no dtype error), the output is bf16 like stock's,
    and the error against fp64 is no worse than stock SDPA's; with the scratch workspace on or off."""
    if not workspace:
        monkeypatch.setattr(Workspace, "get", lambda self, name, shape, like: None)
    q, k, v, padding = _attention_case()
    exact = _with_grads(lambda q, k, v, m: _blockwise(q.double(), k.double(), v.double(), m), q, k, v, padding)
    stock = _with_grads(_stock_sdpa, q, k, v, padding)
    patched = _with_grads(_blockwise, q, k, v, padding)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _blockwise(q, k, v, padding).dtype == torch.bfloat16
    for (p, s, e) in zip([patched[0], *patched[1]], [stock[0], *stock[1]], [exact[0], *exact[1]]):
        assert (p - e).norm() <= WORSE_AT_MOST * (s - e).norm()


def test_kernel_compiled_under_autocast_equals_eager():
    """compile=True (the CUDA default) under bf16 autocast: the same dtypes and results as eager."""
    if bpt_compile.unavailable_reason("cpu"):
        pytest.skip(f"torch.compile unavailable here: {bpt_compile.unavailable_reason('cpu')}")
    q, k, v, padding = _attention_case()
    eager = _with_grads(lambda *a: _blockwise(*a, compile=False), q, k, v, padding)
    compiled = _with_grads(lambda *a: _blockwise(*a, compile=True), q, k, v, padding)
    for c, e in zip([compiled[0], *compiled[1]], [eager[0], *eager[1]]):
        # fp32 math that agrees to ~1e-6, rounded to bf16 at the end: at most one bf16 step (2^-7) apart
        torch.testing.assert_close(c, e, rtol=2 ** -7, atol=1e-5)


def test_mixed_dtypes_without_autocast_say_what_to_do():
    q, k, v, padding = _attention_case()
    with pytest.raises(ValueError, match="run under torch.autocast"):
        _blockwise(q, k, v, padding)


# ------------------------------------------------------------------------------------------------------
# bpt.compile: a known platform limitation falls back with one warning; other errors are not hidden
# ------------------------------------------------------------------------------------------------------


def test_compile_unavailable_warns_once_and_runs_eagerly(monkeypatch):
    monkeypatch.setattr(bpt_compile, "unavailable_reason", lambda device_type: "no C++ compiler (test)")
    fn = bpt_compile.compilable(lambda x: x * 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert torch.equal(fn(torch.ones(3), use_compile=True), torch.full((3,), 2.0))
        fn(torch.ones(3), use_compile=True)
    assert [str(w.message) for w in caught if "no C++ compiler (test)" in str(w.message)].__len__() == 1


def test_compile_errors_are_not_hidden(monkeypatch):
    monkeypatch.setattr(bpt_compile, "unavailable_reason", lambda device_type: None)

    def broken_compile(fn, **kwargs):
        def run(*args, **kw):
            raise RuntimeError("a real bug in the compiled function")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    fn = bpt_compile.compilable(lambda x: x)
    with pytest.raises(RuntimeError, match="a real bug"):
        fn(torch.ones(1), use_compile=True)
