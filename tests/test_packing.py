"""Packed documents: `Family.packing` says whether stock transformers keeps them apart, checked against stock
itself for every tiny config; train.qlora refuses to pack a family where it does not."""
from __future__ import annotations

import shutil

import pytest
import torch

from cli_helpers import base_argv
from patches import FAMILIES
from test_patches import make_batch
from tiny_models import TINY_CONFIGS, VOCAB, tiny_model
from train.run.command import main

FIRST_DOCUMENT = 17  # make_batch("packed"): documents of 17, 20 and 8 tokens in each row


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_packing_field_matches_stock(name):
    """Change the first document's tokens: the later documents' logits stay put iff stock keeps documents apart."""
    model = tiny_model(name).eval()
    inputs = make_batch("packed")
    changed = inputs["input_ids"].clone()
    changed[:, :FIRST_DOCUMENT] = 3 + (changed[:, :FIRST_DOCUMENT] - 3 + 1) % (VOCAB - 3)  # still no special tokens
    with torch.no_grad():
        later = [model(input_ids=ids, position_ids=inputs["position_ids"], use_cache=False).logits[:, FIRST_DOCUMENT:]
                 for ids in (inputs["input_ids"], changed)]
    moved = ((later[1] - later[0]).abs().max() / later[0].abs().max()).item()
    kept_apart = moved < 1e-5  # float noise; documents that mix move by 1e-3 and more
    assert FAMILIES[model.config.model_type].packs() == kept_apart, (
        f"{name}: the later documents moved by {moved:.1e} of the logits' scale; set Family.packing to {kept_apart} "
        f"(or packing_since to the transformers release that changed it)")


def test_cli_refuses_to_pack_a_family_that_mixes_documents(tiny, tmp_path, capsys):
    bloom = tmp_path / "bloom"
    tiny_model("bloom").save_pretrained(bloom)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny / "model" / name).exists():
            shutil.copy(tiny / "model" / name, bloom / name)
    argv = base_argv(tiny, tmp_path / "run", "--max_steps", 1)
    argv[argv.index("--model_name_or_path") + 1] = str(bloom)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Loading weights" not in err  # refused before any heavy work
    assert err.strip().splitlines()[-1] == (
        "error: bloom models let packed documents attend to each other (stock transformers builds their attention "
        "without the restarting position ids, or carries recurrent state across documents); pass --no_packing "
        "to train one document per row")
