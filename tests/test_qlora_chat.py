"""`python -m train.qlora` on chat data as users bring it: a messages jsonl and a chat template file trains on the
answers (the loss falls, the adapter and the template are saved, the first loss is not that of the same
conversations fed as text); --text_field pointed at the turns is refused in one line before torch loads."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli_helpers import ENV, REPO, base_argv, losses
from test_data_formats import CHAT_TEMPLATE, CONVERSATIONS
from train.recipe.args import TINY_LLAMA_DIR
from train.run.command import main

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    (root / "template.jinja").write_text(CHAT_TEMPLATE)
    with open(root / "chat.jsonl", "w") as f:
        for _ in range(6):
            for conversation in CONVERSATIONS:
                f.write(json.dumps({"messages": conversation}) + "\n")
    return root


def test_a_chat_run_trains_on_the_answers_and_saves_the_template(tiny, chat, tmp_path, capsys):
    out = tmp_path / "chat-run"
    # The bundled tiny llama (pretrained on English characters): its loss tells answers from markup.
    common = ("--model_name_or_path", TINY_LLAMA_DIR, "--max_seq_len", 128, "--max_steps", 12,
              "--per_device_train_batch_size", 4, "--lora_dropout", 0, "--learning_rate", 1e-2)
    assert main(base_argv(tiny, out, "--dataset", chat / "chat.jsonl", "--chat_template", chat / "template.jinja",
                          *common)) == 0
    err = capsys.readouterr().err
    # CONVERSATIONS[1], six times in the file, renders to 149 tokens.
    assert ("data: chat format (detected from column 'messages'); 18 of 24 rows kept; 6 longer than --max_seq_len 128 "
            "dropped (longest 149 tokens; raise --max_seq_len to keep them); the loss covers the assistant turns; "
            "packed whole into rows of --max_seq_len") in err
    chat_losses = losses(out)
    assert len(chat_losses) == 12 and sum(chat_losses[-3:]) / 3 < sum(chat_losses[:3]) / 3 - 0.2, chat_losses
    assert (out / "adapter_model.safetensors").is_file() and (out / "run_info.json").is_file()
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE  # saved with the adapter's tokenizer

    # The same conversations as plain text (rendered by the same template, BOS and EOS as the tokenizer adds them):
    # every token is trained, so the first loss is another one.
    tokenizer = AutoTokenizer.from_pretrained(out)
    text = tmp_path / "as_text.jsonl"
    with open(text, "w") as f, open(chat / "chat.jsonl") as rows:
        for row in rows:
            rendered = tokenizer.apply_chat_template(json.loads(row)["messages"], tokenize=False)
            f.write(json.dumps({"text": rendered.removeprefix(tokenizer.bos_token)}) + "\n")
    assert main(base_argv(tiny, tmp_path / "text-run", "--dataset", text, *common)) == 0
    assert "data: text format (detected from column 'text')" in capsys.readouterr().err
    assert abs(losses(tmp_path / "text-run")[0] - chat_losses[0]) > 1, (losses(tmp_path / "text-run"), chat_losses)


def test_a_chat_dataset_without_a_template_is_refused_naming_the_flag(tiny, chat, tmp_path, capsys, monkeypatch):
    def no_weights(*args, **kwargs):
        raise AssertionError("the model was loaded before the mistake was found")

    monkeypatch.setattr("train.recipe.model.build_model", no_weights)
    assert main(base_argv(tiny, tmp_path / "o", "--dataset", chat / "chat.jsonl", "--max_seq_len", 128)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the tokenizer of ") and "has no chat template" in err[-1]
    assert "--chat_template FILE" in err[-1]


def test_turns_given_as_text_are_refused_in_one_line_before_torch_loads(tiny, chat, tmp_path):
    """The refusal comes before torch, transformers and datasets are imported: timed by hand (docs/training.md),
    within a second or two, not the 7-24 s of their imports."""
    probe = ("import sys; from train.run.command import main; code = main(); "
             "print(code, sorted(m for m in ('torch', 'transformers', 'datasets') if m in sys.modules))")
    argv = [sys.executable, "-c", probe, "--model_name_or_path", str(tiny / "model"), "--dataset",
            str(chat / "chat.jsonl"), "--text_field", "messages", "--output_dir", str(tmp_path / "o")]
    done = subprocess.run(argv, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "2 []", (done.stdout, done.stderr)  # exit status 2, none of them imported
    assert done.stderr.strip().splitlines() == [
        f"error: column 'messages' of dataset {chat / 'chat.jsonl'} holds lists (chat turns?), not text: pass "
        "--dataset_format chat (or leave --text_field out: the format is found from the columns)"]
