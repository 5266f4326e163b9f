"""Every causal-LM type of the installed transformers is classified: a FAMILIES row (then every exactness
test covers it through its tiny config) or an UNSUPPORTED entry with its reason. A transformers release that
adds a type fails here until someone classifies it."""
from collections import Counter

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from patches import FAMILIES, UnsupportedModelError, check_supported
from patches.unsupported import UNSUPPORTED
from tiny_models import tiny_config

CATEGORIES = ("encoder", "encoder-decoder", "state-space or recurrent", "multimodal-only",
              "feature not yet reproduced", "pending low-precision check", "not yet classified")


def test_every_causal_lm_type_is_classified():
    types = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert not set(FAMILIES) & set(UNSUPPORTED), "a type cannot be both supported and unsupported"
    assert types - set(FAMILIES) - set(UNSUPPORTED) == set(), "new transformers types to classify"
    assert set(FAMILIES) | set(UNSUPPORTED) <= types, "rows for types this transformers does not have"


def test_every_reason_names_its_category():
    categories = Counter(reason.split(":")[0] for reason in UNSUPPORTED.values())
    assert set(categories) <= set(CATEGORIES)
    for model_type, reason in UNSUPPORTED.items():
        assert len(reason.split(":", 1)[1].strip()) > 10, f"{model_type}: say why"


def test_an_unsupported_type_is_refused_with_its_reason():
    config = tiny_config("llama")
    config.model_type = "gptj"
    try:
        check_supported(config)
    except UnsupportedModelError as error:
        assert "attention interface" in str(error) and "--no_bpt" in str(error)
    else:
        raise AssertionError("gptj was accepted")
