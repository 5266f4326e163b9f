"""train.evaluation.split_eval on 2 real gloo processes vs one process: the split loss equals the whole sequence's loss,
and split greedy decoding (no KV cache) produces the tokens of `model.generate` with its cache, ring and Ulysses, with
and without the patch's eval logits."""
from __future__ import annotations

import pytest
import torch

from gloo_processes import run_on_ranks
from patches import apply_bpt_patch
from test_patches import SMALL_BLOCKS
from tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [(mode, eval_logits) for mode in ("ring", "ulysses") for eval_logits in (True, False)]
NEW_TOKENS = 5


def _model(eval_logits: bool):
    torch.manual_seed(0)
    model = tiny_model("llama")
    apply_bpt_patch(model, **SMALL_BLOCKS, eval_logits=eval_logits)
    return model.eval()


def _inputs():
    generator = torch.Generator().manual_seed(3)
    documents = torch.randint(3, VOCAB, (2, 45), generator=generator)  # 45: not a multiple of 2 x 2 (padded shards)
    prompts = torch.randint(3, VOCAB, (2, 37), generator=generator)
    return documents, prompts


def _on_rank(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from train.evaluation.split_eval import SplitEval, split_greedy, split_loss

    documents, prompts = _inputs()
    results = {}
    for mode, eval_logits in CASES:
        model = _model(eval_logits)
        split = SplitEval(dist.group.WORLD, mode)
        results[(mode, eval_logits)] = (split_loss(model, documents, split).item(),
                                        split_greedy(model, prompts, NEW_TOKENS, split))
    return results


def test_split_loss_and_greedy_equal_one_process(tmp_path):
    per_rank = run_on_ranks(_on_rank, 2, str(tmp_path))
    documents, prompts = _inputs()
    for mode, eval_logits in CASES:
        model = _model(eval_logits)
        with torch.no_grad():
            loss = model(input_ids=documents, labels=documents).loss.item()
            generated = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                       max_new_tokens=NEW_TOKENS, pad_token_id=0)[:, prompts.shape[1]:]
        for rank_result in per_rank:
            split_loss_value, split_tokens = rank_result[(mode, eval_logits)]
            assert abs(split_loss_value - loss) <= 1e-5 * abs(loss), (mode, eval_logits, split_loss_value, loss)
            assert torch.equal(split_tokens, generated), (mode, eval_logits)


LOCKSTEP_NEW_TOKENS = (2, 6, 3)  # three batches with answers of different lengths: rank 0 decodes 2 and 3, rank 1 6


def _lockstep_on_rank(rank: int, world: int) -> dict:
    """Two data-parallel groups of one rank each, in lockstep (as under weights sharded over both): `spread` deals the
    three batches out, split_greedy keeps forwarding until both ranks are done. Returns the gathered answers and this
    rank's count of model forwards."""
    import torch.distributed as dist

    from train.evaluation.split_eval import SplitEval, spread, split_greedy

    _, prompts = _inputs()
    model = _model(eval_logits=False)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    own = [dist.new_group([r]) for r in range(world)][rank]  # each rank its own (one-rank) sequence group
    split = SplitEval(own, "ring", data_rank=rank, data_world=world, lockstep=True)
    answers = spread(split, list(LOCKSTEP_NEW_TOKENS), lambda n: split_greedy(model, prompts, n, split).tolist(),
                     "prompts", lambda n: 1)
    return {"answers": answers, "forwards": len(calls), "done": dict(split.done)}


def test_lockstep_sharing_keeps_every_rank_in_every_forward(tmp_path):
    per_rank = run_on_ranks(_lockstep_on_rank, 2, str(tmp_path))
    model = _model(eval_logits=False)
    _, prompts = _inputs()
    with torch.no_grad():
        expected = [model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                                   max_new_tokens=n, pad_token_id=0)[:, prompts.shape[1]:].tolist()
                    for n in LOCKSTEP_NEW_TOKENS]
    for result in per_rank:
        assert result["answers"] == expected
    # Round 1: batches of 2 and 6 tokens (6 forwards each); round 2: 3 tokens on rank 0, a repeat on rank 1.
    assert [result["forwards"] for result in per_rank] == [9, 9]
    assert [result["done"] for result in per_rank] == [{"prompts": 2}, {"prompts": 1}]
