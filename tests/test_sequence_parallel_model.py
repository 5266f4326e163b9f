"""A patched tiny causal LM with its sequence split over real gloo processes (patches.sequence_parallel) vs one
process: the group's total loss vs the patched and the stock single-process loss, the summed gradients vs the
patched single-process gradients (fp32).

One spawn per world size runs every case in a loop; rank 0 saves the group loss and the reduced gradients, and
the parent compares them with single-process runs of the same model on the same global batch.
"""
from __future__ import annotations


import pytest
import torch

from patches import (SequenceParallelContext, apply_bpt_patch, group_loss, reduce_gradients,
                     sequence_parallel_attention, shard_batch)
from patches.attention import SEQUENCE_PARALLEL_ATTR
from gloo_processes import run_on_ranks
from test_patches import SMALL_BLOCKS, make_batch
from tiny_models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

LOSS_TOL, GRAD_TOL = 1e-5, 1e-4

# name -> (tiny model, batch kind, mode, lora); W=2 runs all of them, W=3 the ones in CASES_3.
CASES = {
    f"{model}_{kind}_{mode}{'_lora' if lora else ''}": (model, kind, mode, lora)
    for model in ("llama",) for kind in ("right_padded", "packed") for mode in ("ring", "ulysses")
    for lora in (False, True)
}
CASES.update({f"llama_left_padded_{mode}": ("llama", "left_padded", mode, False) for mode in ("ring", "ulysses")})
CASES.update({f"mistral_{kind}_ring": ("mistral", kind, "ring", False) for kind in ("right_padded", "packed")})
# ALiBi as a per-key bias (Bloom, Falcon with alibi, MPT), re-based on global positions; padded rows (stock cannot keep
# packed documents apart for these families).
CASES.update({f"{model}_{kind}_{mode}": (model, kind, mode, False) for model in ("bloom", "falcon_alibi", "mpt")
              for kind in ("right_padded", "left_padded") for mode in ("ring", "ulysses")})
# Attention sinks and alternating sliding windows (one document per row: stock cannot keep packed ones apart).
CASES.update({f"gpt_oss_right_padded_{mode}": ("gpt_oss", "right_padded", mode, False) for mode in ("ring", "ulysses")})
CASES_3 = ("llama_left_padded_ring", "bloom_left_padded_ring")
RUNS = [(name, 2) for name in sorted(CASES)] + [(name, 3) for name in CASES_3]


def _model(name: str, lora: bool, patch: bool = True):
    model = tiny_model(name)
    if lora:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)  # init_lora_weights=False: B is random too, so A gets a non-zero gradient
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                 lora_dropout=0.0, init_lora_weights=False))
    if patch:
        apply_bpt_patch(model, **SMALL_BLOCKS)
    return model


def _batch(kind: str) -> dict:
    """test_patches' batches (45 tokens, not divisible by 2W), plus left padding: under a causal mask right
    padding is never seen by a real token, left padding is (the padding mask matters)."""
    if kind != "left_padded":
        batch = make_batch(kind)
        batch.pop("use_cache")
        return batch
    batch = make_batch("plain")
    batch.pop("use_cache")
    mask = torch.ones_like(batch["input_ids"])
    mask[1, :11] = 0
    batch["labels"][mask == 0] = -100
    # The first real token's label is predicted from the last pad row, whose output nobody defines (stock and the
    # blockwise kernel differ there): not a target either.
    batch["labels"][1, 11] = -100
    batch["attention_mask"] = mask
    return batch


def _grads(model) -> dict:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()
            if p.requires_grad and p.grad is not None}


def _run_case(name, group, world):
    model_name, kind, mode, lora = CASES[name]
    model = _model(model_name, lora)
    local, context = shard_batch(_batch(kind), group, mode)
    with sequence_parallel_attention(model, context):
        loss = model(**local).loss
        loss.backward()
    reduce_gradients(model, group)
    return {"loss": group_loss(loss, group), "grads": _grads(model)}


def _run_local_shift(group, world):
    """The labels shifted on each shard instead of the whole sequence: tokens at shard ends lose their target."""
    from bpt.sequence_parallel import zigzag_shard

    model = _model("llama", False)
    batch = _batch("packed")
    local, context = shard_batch(batch, group, "ring")
    rank = torch.distributed.get_rank(group)
    labels = zigzag_shard(batch["labels"], 1, rank, world, pad_value=-100)
    local["shift_labels"] = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
    with sequence_parallel_attention(model, context):
        loss = model(**local).loss
    return {"loss": group_loss(loss, group)}


def _run_ddp(group, world):
    """DDP over the same ranks (its own process group): loss x W undoes DDP's mean over the group."""
    from torch.nn.parallel import DistributedDataParallel

    model = _model("llama", False)
    ddp = DistributedDataParallel(model, process_group=torch.distributed.new_group(list(range(world))))
    local, context = shard_batch(_batch("left_padded"), group, "ring")
    with sequence_parallel_attention(model, context):
        loss = ddp(**local).loss
        (loss * world).backward()
    return {"loss": group_loss(loss, group), "grads": _grads(model)}


def _run_ulysses_heads(group, world):
    """4 query heads over 3 ranks: ulysses must refuse and name ring."""
    model = _model("llama", False)
    local, context = shard_batch(_batch("packed"), group, "ulysses")
    try:
        with sequence_parallel_attention(model, context):
            model(**local)
    except ValueError as error:
        return {"error": str(error)}
    return {"error": None}


BF16_MODES = ("ring", "ulysses")


def _run_bf16(mode, group):
    """The packed llama case under bf16 autocast (the GPU recipe's precision): the model and its LoRA in fp32."""
    model = _model("llama", True)
    local, context = shard_batch(_batch("packed"), group, mode)
    with sequence_parallel_attention(model, context), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(**local).loss
        loss.backward()
    reduce_gradients(model, group)
    return {"loss": group_loss(loss.float(), group), "grads": _grads(model)}


def _run_attention_once(once: bool, group):
    """Ulysses over checkpointed layers (unpadded rows: the fused kernel) with the attention kept for the recompute
    or recomputed (bpt.attention_once); the attention forwards this rank ran."""
    from test_attention_once import _CountForwards

    model = _model("llama", True, patch=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    apply_bpt_patch(model, **SMALL_BLOCKS, attention_once=once)
    local, context = shard_batch(_batch("plain"), group, "ulysses")
    with sequence_parallel_attention(model, context), _CountForwards() as count:
        loss = model(**local).loss
        loss.backward()
    reduce_gradients(model, group)
    return {"loss": group_loss(loss, group), "grads": _grads(model), "forwards": count.calls}


def _worker(rank, world):
    group = None
    results = {name: _run_case(name, group, world) for name in (CASES if world == 2 else CASES_3)}
    if world == 2:
        results["local_shift"] = _run_local_shift(group, world)
        results["ddp"] = _run_ddp(group, world)
        results.update({f"bf16_{mode}": _run_bf16(mode, group) for mode in BF16_MODES})
        results.update({f"attention_once_{once}": _run_attention_once(once, group) for once in (True, False)})
    else:
        results["ulysses_heads"] = _run_ulysses_heads(group, world)
    return results


_RESULTS = {}


@pytest.fixture(scope="module")
def sp_results(tmp_path_factory):
    """world -> [per-rank {case -> result}], spawning each world size once (lazily)."""
    def get(world):
        if world not in _RESULTS:
            out_dir = str(tmp_path_factory.mktemp(f"sp{world}"))
            _RESULTS[world] = run_on_ranks(_worker, world, out_dir, timeout=300)
        return _RESULTS[world]

    return get


_REFERENCE = {}


def _reference(model_name, kind, lora):
    """(patched loss, patched gradients, stock loss) on one process."""
    key = (model_name, kind, lora)
    if key not in _REFERENCE:
        batch = _batch(kind)
        stock = _model(model_name, lora, patch=False)
        with torch.no_grad():
            stock_loss = stock(**batch, use_cache=False).loss
        model = _model(model_name, lora)
        loss = model(**batch, use_cache=False).loss
        loss.backward()
        _REFERENCE[key] = (loss.detach(), _grads(model), stock_loss)
    return _REFERENCE[key]


def _compare(result, model_name, kind, lora):
    ref_loss, ref_grads, stock_loss = _reference(model_name, kind, lora)
    loss_err = max(abs(result["loss"] - ref_loss).item() / abs(ref_loss).item(),
                   abs(result["loss"] - stock_loss).item() / abs(stock_loss).item())
    assert result["grads"].keys() == ref_grads.keys()
    if lora:
        assert ref_grads and all("lora_" in name for name in ref_grads)
    grad_err = max(((result["grads"][n] - g).abs().max() / g.abs().max().clamp_min(1e-12)).item()
                   for n, g in ref_grads.items())
    return loss_err, grad_err


@pytest.mark.parametrize("name, world", RUNS)
def test_sequence_parallel_matches_one_process(sp_results, world, name):
    per_rank = sp_results(world)
    model_name, kind, _, lora = CASES[name]
    loss_err, grad_err = _compare(per_rank[0][name], model_name, kind, lora)
    print(f"W={world} {name}: loss {loss_err:.1e} grad {grad_err:.1e}")
    assert loss_err <= LOSS_TOL and grad_err <= GRAD_TOL, (loss_err, grad_err)
    for other in per_rank[1:]:  # every rank ends with the same loss and gradients
        assert torch.equal(other[name]["loss"], per_rank[0][name]["loss"])
        assert all(torch.equal(other[name]["grads"][n], g) for n, g in per_rank[0][name]["grads"].items())


def _rms_error(grads: dict, reference: dict) -> float:
    diff = torch.cat([(grads[n].float() - g).flatten() for n, g in reference.items()])
    return (diff.pow(2).mean().sqrt() / torch.cat([g.flatten() for g in reference.values()]).pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("mode", BF16_MODES)
def test_sequence_parallel_under_bf16_autocast_is_no_worse_than_stock(sp_results, mode):
    """bf16 autocast: the split run's LoRA gradients and stock's on one process, each against the fp32 stock run;
    the split run's error no worse than stock's (x1.5, the low-precision tests' limit)."""
    def one_process(autocast: bool, patch: bool = False):
        model = _model("llama", True, patch=patch)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(**_batch("packed"), use_cache=False).loss
            loss.backward()
        return loss.float().detach(), _grads(model)

    ref_loss, ref_grads = one_process(False)
    stock_loss, stock_grads = one_process(True)
    patched_loss, _ = one_process(True, patch=True)
    split = sp_results(2)[0][f"bf16_{mode}"]
    grad_err, stock_grad_err = _rms_error(split["grads"], ref_grads), _rms_error(stock_grads, ref_grads)
    stock_loss_err, split_vs_patched = abs(stock_loss - ref_loss).item(), abs(split["loss"] - patched_loss).item()
    print(f"bf16 {mode}: gradient RMS error {grad_err:.2e} (stock {stock_grad_err:.2e}); loss: stock vs fp32 "
          f"{stock_loss_err:.2e}, split vs patched on one process {split_vs_patched:.2e}")
    assert split["grads"].keys() == ref_grads.keys()
    assert grad_err <= 1.5 * stock_grad_err
    # One scalar is too noisy to rank against stock's own error; instead: splitting the sequence moves the loss
    # less than bf16 itself does (the ranks merge their partial results in fp32).
    assert split_vs_patched <= stock_loss_err


def test_ulysses_keeps_the_attention_for_the_recompute_bitwise(sp_results):
    """Checkpointed layers under Ulysses: the kept attention gives the recomputing path's loss and gradients bitwise,
    with one attention forward per layer where recomputing runs two."""
    kept, recomputed = (sp_results(2)[0][f"attention_once_{once}"] for once in (True, False))
    assert 2 * kept["forwards"] == recomputed["forwards"] > 0
    assert torch.equal(kept["loss"], recomputed["loss"]) and kept["grads"].keys() == recomputed["grads"].keys()
    assert all(torch.equal(kept["grads"][name], recomputed["grads"][name]) for name in kept["grads"])


def test_labels_shifted_per_shard_would_be_wrong(sp_results):
    """The test can fail: shifting labels on each shard (not the whole sequence) changes the loss."""
    ref_loss = _reference("llama", "packed", False)[0]
    got = sp_results(2)[0]["local_shift"]["loss"]
    print(f"labels shifted per shard: loss off by {abs(got - ref_loss).item() / abs(ref_loss).item():.1e}")
    assert abs(got - ref_loss).item() / abs(ref_loss).item() > 1e-3


def test_ddp_with_loss_times_group_size(sp_results):
    """DDP over the sequence-parallel ranks averages: loss x W gives the summed (= single-process) gradient."""
    loss_err, grad_err = _compare(sp_results(2)[0]["ddp"], "llama", "left_padded", False)
    print(f"DDP: loss {loss_err:.1e} grad {grad_err:.1e}")
    assert loss_err <= LOSS_TOL and grad_err <= GRAD_TOL, (loss_err, grad_err)


def test_ulysses_refuses_heads_not_divisible(sp_results):
    for result in sp_results(3):
        error = result["ulysses_heads"]["error"]
        assert error is not None and "4 query heads" in error and "'ring'" in error, error


@pytest.mark.parametrize("option", ["key_bias", "dropout"])
def test_ring_refuses_what_it_cannot_do(option):
    """Checked before any communication: no process group needed."""
    q = torch.randn(1, 4, 8, 8)
    k = v = torch.randn(1, 2, 8, 8)
    kwargs = dict(causal=True, scaling=None, softcap=None, sliding_window=None, alibi_slopes=None, key_bias=None,
                  sinks=None, dropout=0.0, q_block=4, kv_block=4, compile=False)
    # A per-key bias that is not slope x key index cannot be re-based on global positions.
    kwargs[option] = {"key_bias": torch.arange(8.0).pow(2).expand(1, 4, 8), "dropout": 0.1}[option]
    context = SequenceParallelContext(None, "ring", 16)
    with pytest.raises(ValueError, match={"dropout": "dropout",
                                          "key_bias": "per-key ALiBi bias to be slope x key index"}[option]):
        context.attention(torch.nn.Identity(), q, k, v, **kwargs)


def test_context_manager_restores_and_needs_a_patched_model():
    model = _model("llama", False)
    attention = [m for m in model.modules() if hasattr(m, "bpt_config")]
    context = SequenceParallelContext(None, "ring", 45)
    with pytest.raises(RuntimeError, match="boom"):
        with sequence_parallel_attention(model, context):
            assert all(getattr(m, SEQUENCE_PARALLEL_ATTR) is context for m in attention)
            raise RuntimeError("boom")
    assert attention and not any(hasattr(m, SEQUENCE_PARALLEL_ATTR) for m in attention)
    with pytest.raises(ValueError, match="apply_bpt_patch"):
        with sequence_parallel_attention(tiny_model("llama"), context):
            pass
