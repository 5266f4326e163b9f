"""bpt.loss.chunked_lm_loss against transformers' ForCausalLMLoss on full logits: loss and every gradient."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from probes import LargestOutput
from torch.utils.checkpoint import checkpoint

from bpt.loss import chunked_lm_loss
from transformers.loss.loss_utils import ForCausalLMLoss

B, N, H, V = 2, 127, 8, 50
CHUNK = 32  # counted tokens per head call, gathered over the batch; does not divide their count


def _head(bias=True, dtype=torch.float32, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(H, V, bias=bias).to(dtype)


def _hidden(dtype=torch.float32, seed=1) -> torch.Tensor:
    return (torch.randn(B, N, H, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype).requires_grad_()


def _labels(seed=2, ignored=0.3) -> torch.Tensor:
    """[B, N] labels with scattered ignore_index and a long ignored stretch (longer than a chunk)."""
    gen = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (B, N), generator=gen)
    labels[torch.rand(B, N, generator=gen) < ignored] = -100
    labels[0, 40:110] = -100  # a long masked stretch, like a prompt
    return labels


def _reference(hidden, head, labels, softcap=None, scale=None, **kwargs):
    logits = head(hidden)  # [B, N, V]: the full logits the chunked loss never builds
    if scale is not None:
        logits = logits * scale  # as Cohere's / Granite's CausalLM do after lm_head
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return ForCausalLMLoss(logits, labels, V, **kwargs)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


def _assert_close(actual, expected, rel=1e-5):
    for a, e in zip(actual, expected, strict=True):
        a, e = a.float(), e.float()
        scale = e.abs().max().item() or 1.0
        assert (a - e).abs().max().item() <= rel * scale, (a - e).abs().max().item() / scale


def _check(chunk=CHUNK, softcap=None, scale=None, labels=None, **kwargs):
    head, hidden = _head(), _hidden()
    labels = _labels() if labels is None else labels
    wrt = [hidden, head.weight, head.bias]
    expected = _reference(hidden, head, labels, softcap, scale, **kwargs)
    loss = chunked_lm_loss(hidden, head, labels, chunk=chunk, logit_softcap=softcap, logit_scale=scale, **kwargs)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    _assert_close([loss], [expected])
    _assert_close(_grads(loss * 2.5, wrt), _grads(expected * 2.5, wrt))  # grad_output != 1 (e.g. a loss scaler)


@pytest.mark.parametrize("chunk", [CHUNK, 1, 7, 4 * B * N])
def test_matches_transformers_loss(chunk):
    _check(chunk=chunk)


@pytest.mark.parametrize("num_items", [173, torch.tensor(173)], ids=["int", "tensor"])
def test_num_items_in_batch(num_items):
    _check(num_items_in_batch=num_items)


def test_shift_labels_given():
    shifted = _labels(seed=5)
    head, hidden = _head(), _hidden()
    expected = ForCausalLMLoss(head(hidden), None, V, shift_labels=shifted)
    loss = chunked_lm_loss(hidden, head, None, shift_labels=shifted, chunk=CHUNK)
    _assert_close([loss], [expected])
    _assert_close(_grads(loss, [hidden, head.weight]), _grads(expected, [hidden, head.weight]))


def test_logit_softcap():
    _check(softcap=3.0)  # hidden * 2 makes |logits| reach the cap's nonlinear range


@pytest.mark.parametrize("softcap", [None, 3.0], ids=["no_softcap", "softcap"])
@pytest.mark.parametrize("scale", [0.5, 1 / 3, 4.0])
def test_logit_scale(scale, softcap):
    """Cohere's logits * logit_scale, Granite's logits / logits_scaling (factor 1 / logits_scaling): loss and
    gradients include the factor; with a softcap too, the scale comes first (no family has both today)."""
    _check(scale=scale, softcap=softcap)


def test_custom_ignore_index():
    labels = _labels()
    labels[labels == -100] = 7
    _check(labels=labels, ignore_index=7)


def test_ignored_tokens_never_reach_the_head():
    head, hidden, labels = _head(), _hidden(), _labels()
    rows = []
    head.register_forward_hook(lambda module, args, out: rows.append(out.shape[-2]))
    chunked_lm_loss(hidden, head, labels, chunk=CHUNK).backward()
    counted = int((labels[:, 1:] != -100).sum())
    assert sum(rows) == counted < B * N and max(rows) == CHUNK
    assert len(rows) == math.ceil(counted / CHUNK)


def test_zero_counted_tokens_like_transformers():
    head, hidden = _head(), _hidden()
    labels = torch.full((B, N), -100)
    for kwargs in ({}, {"num_items_in_batch": 5}):  # mean: nan (0/0); sum: 0
        expected = _reference(hidden, head, labels, **kwargs)
        loss = chunked_lm_loss(hidden, head, labels, chunk=CHUNK, **kwargs)
        assert torch.equal(loss.isnan(), expected.isnan()) and (loss.isnan() or loss == expected)
        grads = _grads(loss, [hidden, head.weight, head.bias])
        assert all(torch.count_nonzero(g) == 0 for g in grads)


def test_tied_embedding_gets_both_contributions():
    torch.manual_seed(0)
    embed = nn.Embedding(V, H)
    head = nn.Linear(H, V, bias=False)
    head.weight = embed.weight  # tied, as in many causal LMs
    mix = nn.Linear(H, H)
    ids = torch.randint(0, V, (B, N))
    labels = _labels()
    wrt = [embed.weight, mix.weight]

    def hidden():
        return torch.tanh(mix(embed(ids)))  # [B, N, H] depends on the embedding too

    expected = ForCausalLMLoss(head(hidden()), labels, V)
    loss = chunked_lm_loss(hidden(), head, labels, chunk=CHUNK)
    _assert_close([loss], [expected])
    _assert_close(_grads(loss, wrt), _grads(expected, wrt))


def test_peft_lora_on_head():
    import peft

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = _head()

    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head"], init_lora_weights=False)
    head = peft.inject_adapter_in_model(config, Wrapper()).lm_head
    trainable = [p for p in head.parameters() if p.requires_grad]
    assert len(trainable) == 2 and not head.base_layer.weight.requires_grad
    hidden, labels = _hidden(), _labels()
    expected = ForCausalLMLoss(head(hidden), labels, V)
    loss = chunked_lm_loss(hidden, head, labels, chunk=CHUNK)
    _assert_close([loss], [expected])
    _assert_close(_grads(loss, [hidden, *trainable]), _grads(expected, [hidden, *trainable]))


def test_frozen_hidden_trainable_head_and_no_grad():
    head, labels = _head(), _labels()
    hidden = _hidden().detach()
    expected = _reference(hidden, head, labels)
    loss = chunked_lm_loss(hidden, head, labels, chunk=CHUNK)
    _assert_close(_grads(loss, [head.weight]), _grads(expected, [head.weight]))
    with torch.no_grad():
        loss = chunked_lm_loss(_hidden(), head, labels, chunk=CHUNK, logit_softcap=3.0)
        expected = _reference(hidden, head, labels, softcap=3.0)
    assert loss.grad_fn is None
    _assert_close([loss], [expected])


def test_inside_checkpoint_and_cpu_offload_hooks():
    # The per-chunk gradients are taken during forward; the caller's saved-tensor hooks must not see them.
    head, hidden, labels = _head(), _hidden(), _labels()
    wrt = [hidden, head.weight, head.bias]
    expected = _grads(_reference(hidden, head, labels), wrt)
    loss = checkpoint(lambda h: chunked_lm_loss(h * 1.0, head, labels, chunk=CHUNK), hidden, use_reentrant=False)
    _assert_close(_grads(loss, wrt), expected)
    with torch.autograd.graph.save_on_cpu():
        loss = chunked_lm_loss(hidden, head, labels, chunk=CHUNK)
    _assert_close(_grads(loss, wrt), expected)


def test_bf16_sanity():
    head, hidden, labels = _head(dtype=torch.bfloat16), _hidden(dtype=torch.bfloat16), _labels()
    wrt = [hidden, head.weight, head.bias]
    expected = _reference(hidden, head, labels)
    loss = chunked_lm_loss(hidden, head, labels, chunk=CHUNK)
    assert loss.dtype == torch.float32
    _assert_close([loss], [expected], rel=1e-2)
    grads = _grads(loss, wrt)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    _assert_close(grads, _grads(expected, wrt), rel=3e-2)


def test_no_sequence_by_vocab_tensor_saved_or_created():
    head, hidden, labels = _head(), _hidden(), _labels()
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    recorder = LargestOutput()
    with recorder:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = chunked_lm_loss(hidden, head, labels, chunk=CHUNK)
        loss.backward()
    # Largest legitimate tensors: one chunk's logits, [B*N, H] hidden gradient, [V, H] head gradient.
    bound = max(CHUNK * V, B * N * H, V * H)
    assert bound < B * N * V
    assert max(saved) <= B * N * H and recorder.largest <= bound
    # Saved: denominator, hidden grad, weight and bias grads. The per-chunk graphs stay private: the
    # caller's hooks (checkpoint, CPU offload) never see them.
    assert len(saved) == 4


def test_bad_arguments_raise():
    head, hidden = _head(), _hidden()
    with pytest.raises(ValueError, match="labels must be"):
        chunked_lm_loss(hidden, head, torch.zeros(B, N + 1, dtype=torch.long), chunk=CHUNK)
    with pytest.raises(ValueError, match="positive integer"):
        chunked_lm_loss(hidden, head, _labels(), chunk=0)
    with pytest.raises(TypeError, match="nn.Module"):
        chunked_lm_loss(hidden, lambda h: head(h), _labels(), chunk=CHUNK)
