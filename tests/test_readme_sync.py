"""The family list and support table of docs/families.md, and the count the README states, are the registry's
(docs/DESIGN.md principle 6: every table has a sync test)."""
import re

from patches import FAMILIES
from support_table import FAMILIES_PAGE, README, readme_block, support_table


def test_readme_lists_exactly_the_supported_families():
    text = FAMILIES_PAGE.read_text()
    listed = re.search(r"<!-- families -->(.*?)<!-- /families -->", text, re.S).group(1)
    names = [name.strip() for name in listed.replace("\n", " ").split(",")]
    assert names == sorted(FAMILIES)
    for page in (README, FAMILIES_PAGE):
        assert f"(`config.model_type`, {len(FAMILIES)};" in page.read_text(), page


def test_readme_support_table_is_the_generated_one():
    """The per-feature table of docs/families.md between `<!-- support-table -->` markers is
    `python tests/support_table.py`'s output (regenerate with `--write`)."""
    assert readme_block(FAMILIES_PAGE.read_text()) == support_table()
