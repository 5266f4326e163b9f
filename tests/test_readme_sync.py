"""The README's family list is the registry's (docs/DESIGN.md principle 6: every table has a sync test)."""
import re
from pathlib import Path

from patches import FAMILIES
from support_table import readme_block, support_table

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_lists_exactly_the_supported_families():
    text = README.read_text()
    listed = re.search(r"<!-- families -->(.*?)<!-- /families -->", text, re.S).group(1)
    names = [name.strip() for name in listed.replace("\n", " ").split(",")]
    assert names == sorted(FAMILIES)
    assert f"(`config.model_type`, {len(FAMILIES)};" in text


def test_readme_support_table_is_the_generated_one():
    """The per-feature table between `<!-- support-table -->` markers is `python tests/support_table.py`'s output
    (regenerate with `--write`)."""
    assert readme_block(README.read_text()) == support_table()
