import json
import os
import random
import sys

import pytest
import torch

# tests share tiny model builders (tests/tiny_models.py); keep CPU threads modest on small CI machines
sys.path.insert(0, os.path.dirname(__file__))

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing softly".split()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests (tiny models on a shared CPU: more threads mostly wait on each
    other). Not autouse: a module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama with the char-level tokenizer of train.pretrain_tiny, and a jsonl of short documents."""
    from cli_helpers import save_tiny_llama

    root = tmp_path_factory.mktemp("tiny")
    save_tiny_llama(root / "model")
    rng = random.Random(0)
    with open(root / "data.jsonl", "w") as f:
        for i in range(24):
            words = [rng.choice(WORDS) for _ in range(rng.randint(8, 30))]
            f.write(json.dumps({"text": " ".join(words), "id": i}) + "\n")
    return root
