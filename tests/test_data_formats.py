"""Dataset formats (train.recipe.formats, chat, samples, packing): each format's labels equal those TRL's SFTTrainer
builds for the same rows and tokenizer (assistant-only on chat, completion-only on prompt-completion), packed and
unpacked; multi-turn masks; long and empty rows; templates that cannot be placed."""
from __future__ import annotations

import datasets
import pytest
import torch

from train.errors import UserError
from train.pretrain_tiny import build_tokenizer
from train.recipe.data import build_train_dataset
from train.recipe.formats import ALPACA_PROMPT, ALPACA_PROMPT_NO_INPUT

# A real chat template, with the {% generation %} markers TRL's assistant masks need (ours need none). The template
# engine drops the newline after a block tag, so newlines are written as expressions.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|assistant|>\n' }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{{ '\n' }}"
    "{% else %}{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


def _turn(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = [
    [_turn("system", "Answer in one word."), _turn("user", "Colour of the sky?"), _turn("assistant", "Blue.")],
    [_turn("user", "Hi!"), _turn("assistant", "Hello, how can I help?"), _turn("user", "Count to three."),
     _turn("assistant", "1, 2, 3."), _turn("user", "Thanks"), _turn("assistant", "You are welcome.")],
    [_turn("system", "Be terse."), _turn("user", "2+2?"), _turn("assistant", "4"), _turn("user", "3+3?"),
     _turn("assistant", "6")],
    [_turn("user", "Name a fruit."), _turn("assistant", "Apple")],
]
PAIRS = [("Q: capital of France?\nA:", " Paris."), ("Translate 'chat': ", "cat"), ("Say yes.", " Yes!"),
         ("Spell dog: ", "d-o-g")]
ALPACA = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
          {"instruction": "Say hello.", "input": "", "output": "Hello."},
          {"instruction": "Reverse the word.", "input": "abc", "output": "cba"}]
MAX = 512  # tokens: no row is cut


@pytest.fixture(scope="module")
def tok():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def trl_rows(tok):
    """rows -> TRL's prepared rows (its SFTTrainer's own preprocessing), and its collator."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))

    def prepare(rows: list[dict], *, packing=False, **config):
        trainer = SFTTrainer(model=model, processing_class=tok, train_dataset=datasets.Dataset.from_list(rows),
                             args=SFTConfig(output_dir="/tmp/unused", report_to="none", use_cpu=True, packing=packing,
                                            **{"max_length": MAX, **config}))
        return list(trainer.train_dataset), trainer.data_collator

    return prepare


def _ours(tok, rows, **kwargs):
    return list(build_train_dataset(tok, datasets.Dataset.from_list(rows), **{"max_seq_len": MAX, **kwargs}))


def _pairs(rows):
    return [(list(r["input_ids"]), list(r["labels"])) for r in rows]


def _documents(ids, labels, positions):
    """A packed row split where positions restart: [(ids, labels)]."""
    starts = [i for i, p in enumerate(positions) if p == 0] + [len(ids)]
    return [(list(ids[a:b]), list(labels[a:b])) for a, b in zip(starts, starts[1:])]


def _our_documents(rows, pad_id):
    docs = [d for r in rows for d in _documents(r["input_ids"], r["labels"], r["position_ids"])]
    return sorted(d for d in docs if not (set(d[0]) == {pad_id} and set(d[1]) == {-100}))  # less the padding


def _trl_documents(rows, collator):
    docs = []
    for row in rows:
        batch = collator([row])  # padding-free: position ids from seq_lengths, a document's first label -100
        docs += _documents(batch["input_ids"][0].tolist(), batch["labels"][0].tolist(),
                           batch["position_ids"][0].tolist())
    return sorted(docs)


CASES = {
    "chat": ([{"messages": c} for c in CONVERSATIONS], {"assistant_only_loss": True}, None),
    "prompt_completion": ([{"prompt": p, "completion": c} for p, c in PAIRS], {"completion_only_loss": True}, None),
    "conversational prompt_completion": (
        [{"prompt": c[:-1], "completion": c[-1:]} for c in CONVERSATIONS],
        {"completion_only_loss": True, "assistant_only_loss": True}, None),
    "alpaca": (ALPACA, {"completion_only_loss": True},
               lambda r: {"prompt": (ALPACA_PROMPT if r["input"] else ALPACA_PROMPT_NO_INPUT).format(**r),
                          "completion": r["output"]}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_labels_equal_trls_unpacked_and_packed(tok, trl_rows, case):
    rows, trl_config, as_trl = CASES[case]
    trl_input = [as_trl(r) for r in rows] if as_trl else rows
    theirs, _ = trl_rows(trl_input, **trl_config)
    ours = _ours(tok, rows, packing=False)
    assert _pairs(ours) == _pairs(theirs)
    assert all(r["position_ids"] == list(range(len(r["input_ids"]))) for r in ours)
    assert all(any(t != -100 for t in r["labels"]) and any(t == -100 for t in r["labels"]) for r in ours)

    packed_theirs, collator = trl_rows(trl_input, packing=True, **trl_config)
    lengths = sorted(len(r["input_ids"]) for r in ours)
    row = lengths[-1] + lengths[0]  # the longest sample fits, and the shortest beside it
    packed = _ours(tok, rows, max_seq_len=row)
    assert all(len(r["input_ids"]) == row for r in packed)  # rows of exactly --max_seq_len, whole samples in each
    assert len(packed) < len(rows)  # (several samples share a row)
    assert _our_documents(packed, tok.pad_token_id) == _trl_documents(packed_theirs, collator) == sorted(
        (ids, [-100] + labels[1:]) for ids, labels in _pairs(ours))


def test_text_labels_equal_trls(tok, trl_rows):
    docs = ["The cat sat on the mat.", "A second, longer document with more words in it.", "Third."] * 3
    rows = [{"text": d} for d in docs]
    theirs, _ = trl_rows(rows)
    unpacked = _ours(tok, rows, packing=False)
    assert _pairs(unpacked) == _pairs(theirs)
    # Packed text is one stream cut into rows (a document may continue in the next row): the stream, and every
    # label TRL's padding-free collator gives but those at our row starts, equal TRL's documents laid end to end.
    packed = _ours(tok, rows, max_seq_len=24)
    stream = [t for r in packed for t in r["input_ids"]]
    _, padding_free = trl_rows(rows, padding_free=True, max_length=None)  # its collator: each document's first label -100
    collated = [padding_free([r]) for r in theirs]
    their_ids = [t for b in collated for t in b["input_ids"][0].tolist()]
    their_labels = [t for b in collated for t in b["labels"][0].tolist()]
    our_labels = [t for r in packed for t in r["labels"]]
    assert stream == their_ids[:len(stream)]
    row_starts = set(range(0, len(stream), 24))
    assert [lab for i, lab in enumerate(our_labels) if i not in row_starts] == \
        [lab for i, lab in enumerate(their_labels[:len(stream)]) if i not in row_starts]


def test_multi_turn_trains_every_assistant_turn_and_nothing_else(tok):
    rows = _ours(tok, [{"messages": CONVERSATIONS[1]}], packing=False)
    ids, labels = rows[0]["input_ids"], rows[0]["labels"]
    spans, current = [], []
    for token, label in zip(ids, labels):
        if label != -100:
            assert label == token
            current.append(token)
        elif current:
            spans.append(tok.decode(current))
            current = []
    assert spans == [t["content"] + tok.eos_token for t in CONVERSATIONS[1] if t["role"] == "assistant"]
    prompt_text = tok.decode([t for t, lab in zip(ids, labels) if lab == -100])
    for turn in CONVERSATIONS[1]:
        if turn["role"] != "assistant":
            assert turn["content"] in prompt_text  # system and user turns are all context, never targets
    everything = _ours(tok, [{"messages": CONVERSATIONS[1]}], packing=False, train_on_prompt=True)[0]
    assert everything["labels"] == everything["input_ids"] == ids


def test_a_long_conversation_is_dropped_and_counted_never_cut(tok):
    long = [_turn("user", "x" * 200), _turn("assistant", "~" * 50)]
    rows = [{"messages": c} for c in (CONVERSATIONS + [long, [_turn("user", "no answer here")]])]
    lines = []
    for packing in (True, False):
        built = build_train_dataset(tok, datasets.Dataset.from_list(rows), max_seq_len=160, packing=packing,
                                    report=lines.append)
        documents = ([d for r in built for d in _documents(r["input_ids"], r["labels"], r["position_ids"])]
                     if packing else [(r["input_ids"], r["labels"]) for r in built])
        assert not any(tok.convert_tokens_to_ids("~") in d[0] for d in documents)  # no piece of it
    # 277 = BOS + "<|user|>\n" (9) + 200 + "\n" + "<|assistant|>\n" (14) + 50 + EOS + "\n"
    assert lines[0] == (
        "data: chat format (detected from column 'messages'); 4 of 6 rows kept; 1 longer than --max_seq_len 160 "
        "dropped (longest 277 tokens; raise --max_seq_len to keep them); 1 with nothing to train on dropped (no "
        "assistant turn, or an empty answer); the loss covers the assistant turns; packed whole into rows of --max_seq_len")
    with pytest.raises(UserError, match="no row of dataset .* is left to train on .*raise --max_seq_len"):
        build_train_dataset(tok, datasets.Dataset.from_list([{"messages": long}]), max_seq_len=160)


def test_whole_sample_packing_fills_rows_best_fit():
    from train.recipe.packing import best_fit

    rows = best_fit([5, 3, 7, 2, 4, 1], 8)
    assert sorted(sorted(r) for r in rows) == [[0, 1], [2, 5], [3, 4]]
    assert all(sum([5, 3, 7, 2, 4, 1][i] for i in r) <= 8 for r in rows)


def test_a_template_that_rewrites_earlier_turns_is_refused(tok):
    tokenizer = build_tokenizer()
    # Earlier answers lose their reasoning once a later turn follows (as some reasoning models' templates do).
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'assistant' and not loop.last %}"
        "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}A:{% endif %}")
    rows = [{"messages": [_turn("user", "q"), _turn("assistant", "<think>hm</think>a"), _turn("user", "q2"),
                          _turn("assistant", "b")]}]
    with pytest.raises(UserError, match="row 1: the chat template renders turns 1-1 with the generation prompt "
                                        "differently .*--chat_template FILE.*--train_on_prompt"):
        build_train_dataset(tokenizer, datasets.Dataset.from_list(rows), max_seq_len=64)


def test_chat_without_a_template_names_the_flag():
    with pytest.raises(UserError, match="has no chat template .*--chat_template FILE"):
        build_train_dataset(build_tokenizer(), datasets.Dataset.from_list([{"messages": CONVERSATIONS[0]}]),
                            max_seq_len=64)


@pytest.mark.parametrize("columns, flags, expected", [
    ({"messages": [CONVERSATIONS[0]], "text": ["t"]}, {}, "chat format (detected from column 'messages')"),
    ({"prompt": ["p"], "completion": ["c"], "text": ["t"]}, {},
     "prompt_completion format (detected from columns 'prompt' + 'completion')"),
    ({"instruction": ["i"], "output": ["o"]}, {}, "alpaca format (detected from columns 'instruction' + 'output')"),
    ({"messages": [CONVERSATIONS[0]], "text": ["some text"]}, {"dataset_format": "text"},
     "text format (--dataset_format text)"),
    ({"q": ["p"], "a": ["c"]}, {"prompt_field": "q", "response_field": "a"},
     "prompt_completion format (--prompt_field/--response_field)"),
])
def test_the_format_is_found_from_the_columns_or_named_by_a_flag(tok, columns, flags, expected):
    lines = []
    build_train_dataset(tok, datasets.Dataset.from_dict(columns), max_seq_len=256, packing=False, report=lines.append,
                        **flags)
    assert lines[0].startswith(f"data: {expected}")


def test_a_column_of_turns_given_as_text_is_refused_naming_the_format_flag(tok):
    with pytest.raises(UserError, match="column 'messages' .* holds lists .*not text: pass --dataset_format chat"):
        build_train_dataset(tok, datasets.Dataset.from_list([{"messages": CONVERSATIONS[0]}]), max_seq_len=64,
                            text_field="messages")


def test_chat_rows_train_a_model_on_the_answers_only(tok):
    """The rows reach the model as the loss expects: the loss over the batch equals the mean cross entropy of the
    assistant tokens alone, computed by hand."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from train.recipe.data import Collator

    rows = _ours(tok, [{"messages": c} for c in CONVERSATIONS], packing=False)
    batch = Collator(tok.pad_token_id)(rows)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    with torch.no_grad():
        loss = model(**batch).loss
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    targets = batch["labels"][:, 1:]
    picked = targets != -100
    by_hand = torch.nn.functional.cross_entropy(logits[:, :-1][picked], targets[picked])
    assert torch.allclose(loss, by_hand, atol=1e-6)
    assert picked.sum() == sum(len(t["content"]) + 1 for c in CONVERSATIONS for t in c if t["role"] == "assistant")
