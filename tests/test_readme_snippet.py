"""The README's snippet, run as written (a tiny local model in place of the hub name): `from_pretrained` leaves the
model in eval mode, and the patched forward with labels still makes no [B, N, vocab] logits, in the forward or among
what autograd keeps for the backward; the loss it returns trains."""
from __future__ import annotations

import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cli_helpers import REPO

VOCAB, TOKENS = 997, 2100  # more tokens than a loss chunk (1024), and a vocabulary no other dimension equals


class LogitsSeen(TorchDispatchMode):
    """Records every op output and every tensor saved for backward that holds a whole sequence's logits."""

    def __init__(self, tokens: int):
        super().__init__()
        self.tokens, self.made, self.saved = tokens, [], []

    def whole(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == VOCAB and t.numel() >= self.tokens * VOCAB

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made += [tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out]) if self.whole(t)]
        return out

    def pack(self, t):
        if self.whole(t):
            self.saved.append(tuple(t.shape))
        return t


def _snippet() -> str:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    return next(b for b in blocks if "apply_bpt_patch(model)" in b and "from_pretrained(" in b)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("snippet-model")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
                     ).save_pretrained(directory)
    return directory


def _run(code: str, ids: torch.Tensor) -> tuple[dict, LogitsSeen]:
    seen = LogitsSeen(ids.numel())
    scope = {"ids": ids}
    with seen, torch.autograd.graph.saved_tensors_hooks(seen.pack, lambda t: t):
        exec(compile(code, "README.md", "exec"), scope)
    return scope, seen


def test_the_readme_snippet_makes_no_logits(model_dir):
    code = _snippet()
    hub_name = re.search(r'from_pretrained\("([^"]+)"\)', code).group(1)
    ids = torch.randint(0, VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(0))
    scope, seen = _run(code.replace(hub_name, str(model_dir)), ids)
    assert not scope["model"].training  # as from_pretrained leaves it, and the snippet does not change it
    assert seen.made == [] and seen.saved == []
    loss = scope["loss"]
    assert loss.requires_grad and torch.isfinite(loss)
    loss.backward()
    assert scope["model"].lm_head.weight.grad is not None

    # The same lines without the patch (stock's forward) are caught holding them: the probe sees what it looks for.
    stock = "\n".join(line for line in code.replace(hub_name, str(model_dir)).splitlines() if "handle" not in line)
    scope, seen = _run(stock, ids)
    assert (1, TOKENS, VOCAB) in seen.made and (TOKENS, VOCAB) in seen.saved
    torch.testing.assert_close(scope["loss"], loss, rtol=1e-5, atol=1e-5)  # and the patched loss equals its loss
