"""Profile ensembles: named transformations of a hardware profile, to score plans under models
that are wrong in known ways.

An ensemble is one JSON file (built-in ones live in ``libra/sim/profiles/ensembles/``; any other
path of the same schema loads too): a ``base`` profile name it was written for, and ``members``,
each a ``name`` plus the transformations it applies to the run's profile (none: the profile
itself). The transformations (:data:`TRANSFORMS`):

* ``heads_half``: ``kernel.heads_half = c``, an extra heads-per-call factor ``h(n) = n / (n + c)``
  normalised at the profile's ``reference_heads`` (:class:`libra.sim.kernel.KernelModel`); only on
  a profile without one (``heads_half = 0``), since two such factors do not compose into one;
* ``bandwidth_scale`` / ``latency_scale``: every link class's bandwidth / latency times the value;
* ``half_length_scale``: the length curve's half length (forward and, where there is one,
  backward) times the value; only on a length-curve kernel model;
* ``block_cost_scale``: the occupancy model's fixed cost per thread block (both passes) times the
  value, its counterpart of a longer half length (short segments and blocks run further below the
  best rate); only on an occupancy kernel model;
* ``rate_scale``: the kernel's best rate times the value: the length curve's best rates, and on an
  occupancy model also every block's and tile's cost divided by it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from libra.sim.profiles import PROFILE_DIR, HardwareProfile, profile_from_dict

ENSEMBLE_DIR = PROFILE_DIR / "ensembles"
DEFAULT_ENSEMBLE = "default-v2"
TRANSFORMS = ("heads_half", "bandwidth_scale", "latency_scale", "half_length_scale", "block_cost_scale",
              "rate_scale")
_CURVE = {"half_length_scale": ("half_length", "backward_half_length"),
          "rate_scale": ("rate_inf_tflops", "backward_rate_inf_tflops")}
_LENGTH_CURVE_ONLY, _OCCUPANCY_ONLY = ("half_length_scale",), ("block_cost_scale",)


@dataclass(frozen=True)
class Ensemble:
    """A loaded ensemble: its ``name``, the ``base`` profile it was written for, its ``members``
    (``{"name": ..., transformation: value}`` dicts, in file order) and the file's JSON
    (``record``, recorded in a run's config)."""

    name: str
    base: str
    members: tuple[dict, ...]
    record: dict

    def profiles(self, base: HardwareProfile) -> dict[str, HardwareProfile]:
        """``{member name: profile}``: every member applied to ``base``.

        Raises:
            ValueError: a transformation ``base`` cannot take (names the member).
        """
        return {m["name"]: member_profile(base, m) for m in self.members}

    def applicable_profiles(self, base: HardwareProfile) -> tuple[dict[str, HardwareProfile], tuple[str, ...]]:
        """``({member name: profile}, skipped member names)``: the members ``base`` can take applied
        to it, and the names of those it cannot (:func:`member_conflict`), for a caller that plans
        under the ensemble with any profile and records what it left out."""
        kept = {m["name"]: member_profile(base, m) for m in self.members if member_conflict(base, m) is None}
        return kept, tuple(m["name"] for m in self.members if m["name"] not in kept)


def _check_member(member, origin: str) -> dict:
    if not isinstance(member, dict) or not isinstance(member.get("name"), str) or not member["name"]:
        raise ValueError(f"ensemble {origin}: every member needs a non-empty name, got {member!r}")
    unknown = sorted(set(member) - {"name", *TRANSFORMS})
    if unknown:
        raise ValueError(f"ensemble {origin}: member {member['name']!r} has unknown transformation(s) {unknown}; "
                         f"known: {', '.join(TRANSFORMS)}")
    for key in set(member) - {"name"}:
        value = member[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"ensemble {origin}: member {member['name']!r}: {key} must be a number > 0, got {value!r}")
    return member


def load_ensemble(name_or_path: str | Path = DEFAULT_ENSEMBLE) -> Ensemble:
    """A built-in ensemble by name or an ensemble file by path, validated.

    Raises:
        ValueError: unknown name, unreadable or malformed file, a member without a unique name, an
            unknown transformation or a value that is not a positive number.
    """
    text = str(name_or_path)
    path = Path(text)
    if not (path.suffix == ".json" or path.exists()):
        path = ENSEMBLE_DIR / f"{text}.json"
        if not path.exists():
            known = sorted(p.stem for p in ENSEMBLE_DIR.glob("*.json"))
            raise ValueError(f"unknown profile ensemble {text!r}; built-in: {known} (or pass a path to an ensemble .json)")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read profile ensemble {str(path)!r}: {exc}") from exc
    members = data.get("members") if isinstance(data, dict) else None
    if not isinstance(members, list) or not members:
        raise ValueError(f"ensemble {path}: needs a non-empty 'members' list")
    members = tuple(_check_member(m, str(path)) for m in members)
    names = [m["name"] for m in members]
    if len(set(names)) != len(names):
        raise ValueError(f"ensemble {path}: member names must be unique, got {names}")
    return Ensemble(name=str(data.get("name") or path.stem), base=str(data.get("base", "")), members=members,
                    record=data)


def member_profile(base: HardwareProfile, member: dict) -> HardwareProfile:
    """``base`` with ``member``'s transformations applied (``base`` itself when it has none), named
    ``<base>+<member>`` and recording the member in its ``source``.

    Raises:
        ValueError: ``heads_half`` on a profile that already has one, a transformation of the other
            kernel model than ``base``'s, or a result the profile schema rejects.
    """
    if set(member) == {"name"}:
        return base
    conflict = member_conflict(base, member)
    if conflict is not None:
        raise ValueError(conflict)
    data = base.to_dict()
    kernel = data["kernel"]
    if "heads_half" in member:
        kernel["heads_half"] = float(member["heads_half"])
    for link in data["links"].values():
        link["bandwidth_gbps"] *= member.get("bandwidth_scale", 1.0)
        link["latency_ms"] *= member.get("latency_scale", 1.0)
    for transform, keys in _CURVE.items():
        for key in keys:
            if kernel.get(key) is not None:
                kernel[key] *= member.get(transform, 1.0)
    for cost in (kernel["occupancy"]["forward"], kernel["occupancy"]["backward"]) if "occupancy" in kernel else ():
        cost["block_ms"] *= member.get("block_cost_scale", 1.0) / member.get("rate_scale", 1.0)
        cost["tile_ms"] /= member.get("rate_scale", 1.0)
    data["name"] = f"{base.name}+{member['name']}"
    data["source"] = {**data["source"], "ensemble_member": dict(member)}
    return profile_from_dict(data, origin=f"{base.name} + ensemble member {member['name']!r}")


def member_conflict(base: HardwareProfile, member: dict) -> str | None:
    """Why ``base`` cannot take ``member``'s transformations (None: it can): a heads-per-call factor
    on a profile that has one (two such factors do not compose into one), or a scale of the other
    kernel model than ``base``'s (the half length on an occupancy model, the block cost on a length
    curve)."""
    if "heads_half" in member and base.kernel.heads_half:
        return (f"ensemble member {member['name']!r} adds a heads-per-call factor, and profile "
                f"{base.name} already has one (heads_half = {base.kernel.heads_half})")
    if base.kernel.occupancy is not None and any(t in member for t in _LENGTH_CURVE_ONLY):
        return (f"ensemble member {member['name']!r} scales the length curve's half length, which profile "
                f"{base.name}'s occupancy kernel model does not price with")
    if base.kernel.occupancy is None and any(t in member for t in _OCCUPANCY_ONLY):
        return (f"ensemble member {member['name']!r} scales the occupancy model's block cost, and profile "
                f"{base.name} prices with the length curve")
    return None
