"""train.evaluation.metrics.perplexity_by_position: the per-position-bucket NLL equals a direct computation from the
logits, its overall figure is perplexity()'s, and python -m train.eval writes the breakdown."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from train.evaluation.metrics import perplexity, perplexity_by_position, position_buckets
from train.pretrain_tiny import build_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")
TEXTS = ["The cat sat on the mat. " * 4, "Short one.", "A third document, a bit longer than the second one is."]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(config).eval()


def test_buckets_are_fixed_equal_ranges():
    assert position_buckets(64, 8) == [(i * 8, i * 8 + 8) for i in range(8)]
    assert position_buckets(10, 4) == [(0, 2), (2, 5), (5, 8), (8, 10)]  # edges rounded, every position once
    assert position_buckets(3, 8) == [(0, 1), (1, 2), (2, 3)]  # empty ranges dropped


def test_bucket_nll_matches_the_logits(model, tok):
    max_seq_len, n_buckets = 32, 4
    sums, counts = [0.0] * n_buckets, [0] * n_buckets
    with torch.no_grad():
        for text in TEXTS:
            ids = tok(text)["input_ids"]
            for start in range(0, len(ids), max_seq_len):
                x = torch.tensor([ids[start:start + max_seq_len]])
                token_nll = F.cross_entropy(model(input_ids=x).logits[0, :-1], x[0, 1:], reduction="none")
                for position, nll in enumerate(token_nll.tolist(), start=1):  # the token at `position` predicted
                    sums[position // 8] += nll
                    counts[position // 8] += 1
    result = perplexity_by_position(model, tok, TEXTS, max_seq_len=max_seq_len, n_buckets=n_buckets)
    assert [(row["start"], row["end"]) for row in result["buckets"]] == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert [row["tokens"] for row in result["buckets"]] == counts and counts[0] < counts[1]  # position 0 unpredicted
    for row, total, count in zip(result["buckets"], sums, counts):
        assert row["nll"] == pytest.approx(total / count, rel=1e-5)
        assert row["perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    assert result["tokens"] == sum(counts)
    assert result["perplexity"] == pytest.approx(math.exp(sum(sums) / sum(counts)), rel=1e-5)
    assert result["perplexity"] == pytest.approx(perplexity(model, tok, TEXTS, max_seq_len=max_seq_len), rel=1e-5)


def test_cli_writes_the_breakdown(model, tok, tmp_path, capsys):
    from train.evaluation.eval import main

    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"text": text}) for text in TEXTS))
    out = tmp_path / "res.json"
    assert main(["--model_name_or_path", str(tmp_path / "model"), "--lengths", "120", "--depths", "0.5",
                 "--trials", "1", "--dataset", str(data), "--max_seq_len", "40", "--ppl_buckets", "4",
                 "--output_json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["perplexity_by_position"]
    assert [(row["start"], row["end"]) for row in rows] == [(0, 10), (10, 20), (20, 30), (30, 40)]
    assert result["perplexity"] == pytest.approx(perplexity(model, tok, TEXTS, max_seq_len=40), rel=1e-5)
    assert "[    0,    10) |" in capsys.readouterr().out
