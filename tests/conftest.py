import json
import os
import random
import signal
import sys

import pytest
import setuptools  # noqa: F401  before anything imports distutils: see below
import torch

# setuptools first: a library that imports the standard library's distutils before setuptools is imported makes
# setuptools' distutils shim refuse later (AssertionError naming distutils/core.py), which in one suite run broke
# inductor's C++ build in the worker that had imported it (test_kernel_compiled_under_autocast_equals_eager).

# tests share tiny model builders (tests/tiny_models.py); keep CPU threads modest on small CI machines
sys.path.insert(0, os.path.dirname(__file__))

# The README's test command runs two pytest-xdist workers (`-n 2 --dist loadgroup`): on a 2-core machine each takes one
# core, one thread each (tiny models gain nothing from a second thread).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

@pytest.fixture(autouse=True)
def signal_handlers_restored():
    """SIGINT / SIGTERM as they were before each test. train.qlora's main() run in-process as one rank of a launch
    (WORLD_SIZE > 1, refused before any process group) leaves them ignored, as a worker on its way out should
    (lifecycle.leave); left so, every later process this pytest worker starts would inherit the ignore and a test
    signalling it would wait for nothing."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        if signal.getsignal(sig) is not handler:
            signal.signal(sig, handler)


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
def shim_library():
    """The simulated GPU's built shim, or a skip naming why it cannot be built here (no C++ compiler: the README says
    g++)."""
    from bpt.gpusim import shim

    try:
        return shim.library()
    except shim.ShimError as error:
        pytest.skip(f"the simulated GPU cannot be set up here: {error}")


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
