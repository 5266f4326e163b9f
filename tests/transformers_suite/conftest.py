"""Run transformers' own modeling test suites with every causal LM they build patched by `apply_bpt_patch` (issue 18).

This conftest is inert where it lives (our own `python -m pytest` loads it and does nothing). It acts when it is the
`tests/conftest.py` of a transformers test tree: the top-level test files from the release's sdist
(`test_modeling_common.py`, ...) plus `tests/causal_lm_tester.py`, `tests/generation/`, `tests/exporters/`,
`tests/utils/` and `tests/models/<name>/` from a snapshot of the transformers repository near the installed release.

    cp tests/transformers_suite/conftest.py <tree>/tests/conftest.py
    cd <tree>
    BPT_SUITE_PATCH=0 python -m pytest -q -p no:cacheprovider tests/models/llama/test_modeling_llama.py   # stock
    python -m pytest -q -p no:cacheprovider tests/models/llama/test_modeling_llama.py                    # patched
    (likewise tests/models/{mistral,qwen2,gemma2}/test_modeling_*.py)

Patched, every causal LM of a supported family is patched with q_block = kv_block = mlp_chunk = loss_chunk =
BPT_SUITE_BLOCKS tokens (default 4: the testers' sequences are 7 tokens long, so attention, MLP and loss really run
in several blocks), whether the test builds it with `Model(config)` (wrapped `PreTrainedModel.post_init`) or through
`from_pretrained` / `from_config` (the loaders' patch, `apply_bpt_patch(**options)` with no model). The run ends
with one line counting the models patched each way. Failures that are by design are listed in docs/patch.md
("transformers' own test suites, patched").
"""
from __future__ import annotations

import contextvars
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
# Active only as a transformers tree's tests/conftest.py, and not when BPT_SUITE_PATCH=0 (the stock run).
ACTIVE = (os.path.exists(os.path.join(_HERE, "test_modeling_common.py"))
          and os.environ.get("BPT_SUITE_PATCH", "1") != "0")

_state = {"constructed": 0, "loaded": 0, "undo": []}
_in_loader = contextvars.ContextVar("bpt_suite_in_loader", default=False)


def _options():
    size = int(os.environ.get("BPT_SUITE_BLOCKS", "4"))
    return dict(q_block=size, kv_block=size, mlp_chunk=size, loss_chunk=size)


def _install():
    from transformers import PreTrainedModel

    from patches import apply_bpt_patch, is_patched
    from patches.families import FAMILIES

    options = _options()
    loaders_handle = apply_bpt_patch(**options)  # models from from_pretrained / from_config
    _state["undo"].append(loaders_handle.remove)

    def is_causal_lm(model):  # the loaders' rule (patches.apply._patch_models_loaded_later)
        family = FAMILIES.get(getattr(getattr(model, "config", None), "model_type", None))
        return family is not None and hasattr(model, family.head) and hasattr(model, family.base)

    # Loaders: the model is patched by the loaders' handle once loading is complete, not at its post_init.
    for name in ("from_pretrained", "_from_config"):
        bpt_loader = vars(PreTrainedModel)[name].__func__

        def loader(cls, *args, __loader=bpt_loader, **kwargs):
            token = _in_loader.set(True)
            try:
                loaded = __loader(cls, *args, **kwargs)
            finally:
                _in_loader.reset(token)
            model = loaded[0] if isinstance(loaded, tuple) else loaded
            if not _in_loader.get() and is_causal_lm(model) and is_patched(model):
                _state["loaded"] += 1
            return loaded

        original = vars(PreTrainedModel)[name]
        setattr(PreTrainedModel, name, classmethod(loader))
        _state["undo"].append(lambda name=name, original=original: setattr(PreTrainedModel, name, original))

    # Model(config): post_init ends every model's __init__; the causal LM's own call is the last one.
    original_post_init = PreTrainedModel.post_init

    def post_init(self, *args, **kwargs):
        result = original_post_init(self, *args, **kwargs)
        if not _in_loader.get() and is_causal_lm(self) and not is_patched(self):
            apply_bpt_patch(self, **options)
            _state["constructed"] += 1
        return result

    PreTrainedModel.post_init = post_init
    _state["undo"].append(lambda: setattr(PreTrainedModel, "post_init", original_post_init))


def pytest_configure(config):
    if ACTIVE and not _state["undo"]:
        _install()


def pytest_unconfigure(config):
    while _state["undo"]:
        _state["undo"].pop()()


def pytest_report_header(config):
    if ACTIVE:
        return f"bpt: every causal LM patched with {_options()} (BPT_SUITE_PATCH=0 runs stock)"
    if os.path.exists(os.path.join(_HERE, "test_modeling_common.py")):
        return "bpt: BPT_SUITE_PATCH=0, models are stock"


def pytest_terminal_summary(terminalreporter):
    if ACTIVE:
        terminalreporter.write_line(f"bpt: patched {_state['constructed']} causal LMs built as Model(config) and "
                                    f"{_state['loaded']} loaded by from_pretrained/from_config")
