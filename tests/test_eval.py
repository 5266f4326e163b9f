"""train.eval: passkey accuracy, perplexity, and the CLI, on tiny models built here (never downloaded)."""
import json
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from train.evaluation.eval import main
from train.evaluation.metrics import answer_is_correct, passkey_accuracy, perplexity
from train.pretrain_tiny import build_tokenizer
from train.recipe.args import TINY_LLAMA_DIR

LENGTHS, DEPTHS = [120, 160], [0.0, 1.0]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def random_model(tok):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return LlamaForCausalLM(cfg).eval()


class OracleModel(torch.nn.Module):
    """Answers every passkey prompt correctly: copies the digits that follow the first "is "."""

    def __init__(self, tok):
        super().__init__()
        self.tok = tok
        self.weight = torch.nn.Parameter(torch.zeros(1))  # gives the model a device

    def generate(self, input_ids, max_new_tokens, **_):
        outs = []
        for row in input_ids.tolist():
            text = self.tok.decode(row, skip_special_tokens=True)
            key = text.split("The pass key is ")[1].split(".")[0]
            new = self.tok(" " + key + ". ", add_special_tokens=False)["input_ids"][:max_new_tokens]
            outs.append(row + new + [self.tok.pad_token_id] * (max_new_tokens - len(new)))
        return torch.tensor(outs)


def test_answer_matching():
    # The key must come first; what follows it is not judged (as when generating exactly its tokens).
    assert answer_is_correct(" 12345. Remember", "12345") and answer_is_correct("12345</s>", "12345")
    assert not answer_is_correct(" 1234", "12345") and not answer_is_correct(" 112345", "12345")
    assert not answer_is_correct(" the key 12345", "12345")


def test_passkey_accuracy_structure_on_random_model(random_model, tok):
    random_model.train()
    res = passkey_accuracy(random_model, tok, lengths=LENGTHS, depths=DEPTHS, trials=2)
    assert random_model.training  # mode restored
    assert set(res) == {"by_length_depth", "by_length", "accuracy"}
    assert list(res["by_length_depth"]) == LENGTHS and all(list(v) == DEPTHS for v in res["by_length_depth"].values())
    assert 0.0 <= res["accuracy"] <= 1.0 and res["accuracy"] < 0.5  # random weights cannot retrieve


def test_passkey_accuracy_is_one_for_an_oracle(tok):
    res = passkey_accuracy(OracleModel(tok), tok, lengths=LENGTHS, depths=[0.0, 0.5, 1.0], trials=3)
    assert res["accuracy"] == 1.0 and set(res["by_length"].values()) == {1.0}


def test_passkey_accuracy_on_peft_model(random_model, tok):
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(LlamaForCausalLM(random_model.config),
                                LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    res = passkey_accuracy(peft_model, tok, lengths=[120], depths=[0.5], trials=2)
    assert 0.0 <= res["accuracy"] <= 1.0


@pytest.mark.skipif(not (TINY_LLAMA_DIR / "model.safetensors").exists(), reason="tiny model not built yet")
def test_shipped_tiny_model_retrieves_at_its_pretraining_length():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(TINY_LLAMA_DIR)
    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA_DIR)
    res = passkey_accuracy(model, tokenizer, lengths=[model.config.max_position_embeddings],
                           depths=[0.0, 0.5, 1.0], trials=2)
    assert res["accuracy"] == 1.0


def test_perplexity_matches_stock_loss(random_model, tok):
    texts = ["The cat sat on the mat. " * 3, "Short one.", "A third document, a bit longer than the second."]
    max_seq_len = 32
    nll, count = 0.0, 0
    with torch.no_grad():
        for text in texts:
            ids = tok(text)["input_ids"]
            for s in range(0, len(ids), max_seq_len):
                x = torch.tensor([ids[s:s + max_seq_len]])
                if x.shape[1] < 2:
                    continue
                logits = random_model(input_ids=x).logits[0, :-1]
                nll += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
                count += x.shape[1] - 1
    assert perplexity(random_model, tok, texts, max_seq_len=max_seq_len) == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_cli_writes_json_and_reports_user_errors(random_model, tok, tmp_path, capsys):
    model_dir = tmp_path / "model"
    random_model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data = tmp_path / "docs.jsonl"
    data.write_text("\n".join(json.dumps({"body": "Some held-out text number " + "x" * i}) for i in range(3)))
    out = tmp_path / "res.json"
    rc = main(["--model_name_or_path", str(model_dir), "--lengths", "120", "--depths", "0", "0.5", "--trials", "1",
               "--rope_factor", "2", "--rope_type", "yarn", "--dataset", str(data), "--text_field", "body", "--output_json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["by_length_depth"]["120"]) == {"0.0", "0.5"} and res["perplexity"] > 1.0
    assert "passkey accuracy" in capsys.readouterr().out

    assert main(["--model_name_or_path", str(tmp_path / "nope")]) == 2
    assert main(["--model_name_or_path", str(model_dir), "--lengths", "30"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and "does not exist" in errors[0] and "at least" in errors[1]


def test_cli_without_output_json_writes_the_results_to_a_default_place(random_model, tok, tmp_path, monkeypatch,
                                                                         capsys):
    model_dir = tmp_path / "my-model"
    random_model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    monkeypatch.chdir(tmp_path)
    assert main(["--model_name_or_path", str(model_dir), "--lengths", "120", "--depths", "0.5", "--trials", "1"]) == 0
    written = tmp_path / "outputs" / "eval" / "my-model.json"
    assert json.loads(written.read_text())["args"]["model_name_or_path"] == str(model_dir)
    assert capsys.readouterr().err.strip().splitlines()[-1] == "results written to outputs/eval/my-model.json"
