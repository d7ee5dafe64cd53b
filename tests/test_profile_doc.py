"""docs/profile.md documents every field of the profile JSON schema."""

import re
from pathlib import Path

from libra.sim.profiles import load_profile

DOC = Path(__file__).resolve().parents[1] / "docs" / "profile.md"


def test_every_profile_field_has_a_row_with_a_unit():
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([a-z_]+)` \| ([^|]+) \|", DOC.read_text(), re.M)}
    data = load_profile("h100-roce-v1").to_dict()
    fields = set(data) | set(data["kernel"]) | set(data["variability"]) | set(next(iter(data["links"].values())))
    missing = sorted(fields - set(rows))
    assert not missing, f"docs/profile.md lacks {missing}"
    assert all(unit.strip() for unit in rows.values())
