"""Hardware profiles: named, versioned JSON data the cost model prices Plans with.

A profile holds the attention kernel model (:class:`libra.sim.kernel.KernelModel`), the link
classes of the cluster (bandwidth per direction per GPU, latency, the port they share), the
cluster shape (GPUs per node, nodes per supernode) and the device-variability sigmas. Built-in
profiles live next to this file as ``<name>.json`` (package data); any other JSON file of the same
schema (e.g. one written by ``libra-bench calibrate`` on a GPU) loads through the same
:func:`load_profile`. No hardware number is a constant in code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from libra.sim.kernel import KernelModel

SCHEMA_VERSION = 1
PROFILE_DIR = Path(__file__).resolve().parent
DEFAULT_PROFILE = "h100-roce-v2"
LINK_CLASSES = ("nvlink", "roce", "inter_supernode")
"""Link classes every profile defines, fastest first (Libra sec. 6.1: NVLink in a node, RoCE between)."""


def _number(owner: str, name: str, value, minimum: float = 0.0, strict: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if not ok or (value <= minimum if strict else value < minimum):
        op = ">" if strict else ">="
        raise ValueError(f"{owner}.{name} must be a number {op} {minimum:g}, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class LinkClass:
    """One class of GPU-to-GPU path.

    Attributes:
        bandwidth_gbps: GB/s per direction per GPU (the figure one GPU can push while all do).
        latency_ms: fixed cost per transfer phase that uses this class.
        port: hardware the class goes through; classes sharing a port serialise on it
            (RoCE and inter-supernode traffic share the GPU's NIC, NVLink has its own).

    Raises:
        ValueError: bandwidth <= 0, latency < 0 or an empty port name.
    """

    bandwidth_gbps: float
    latency_ms: float
    port: str

    def __post_init__(self) -> None:
        _number("link", "bandwidth_gbps", self.bandwidth_gbps)
        _number("link", "latency_ms", self.latency_ms, strict=False)
        if not isinstance(self.port, str) or not self.port:
            raise ValueError(f"link.port must be a non-empty string, got {self.port!r}")


@dataclass(frozen=True)
class Variability:
    """Device-runtime variability (Libra sec. 3.2, Figure 3): log-normal speed multipliers.

    Attributes:
        sigma_gpu: sigma of a GPU's persistent speed factor (silicon/thermal lottery).
        sigma_step: sigma of the per-step, per-GPU factor (clock and contention noise).
    """

    sigma_gpu: float = 0.0
    sigma_step: float = 0.0

    def __post_init__(self) -> None:
        for name in ("sigma_gpu", "sigma_step"):
            value = _number("variability", name, getattr(self, name), strict=False)
            if value > 1.0:
                raise ValueError(f"variability.{name} must be <= 1 (a log-sigma), got {value!r}")


@dataclass(frozen=True)
class HardwareProfile:
    """A named, versioned description of one cluster for the cost model.

    Attributes:
        name, version: identity recorded with every result.
        description: one line.
        source: where each number comes from (fits, assumptions), recorded with results.
        peak_tflops: dense bf16 peak of one GPU (records; the kernel model carries the attained rate).
        kernel: attention kernel timing model.
        links: ``{class: LinkClass}`` for every name in :data:`LINK_CLASSES`.
        gpus_per_node, nodes_per_supernode: cluster shape for :class:`libra.sim.topology.Topology`.
        variability: device-runtime jitter.

    Raises:
        ValueError: any invalid field, naming it.
    """

    name: str
    version: int
    description: str
    source: dict
    peak_tflops: float
    kernel: KernelModel
    links: dict
    gpus_per_node: int
    nodes_per_supernode: int
    variability: Variability = field(default_factory=Variability)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"profile.name must be a non-empty string, got {self.name!r}")
        for name in ("version", "gpus_per_node", "nodes_per_supernode"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"profile.{name} must be a positive integer, got {value!r}")
        _number("profile", "peak_tflops", self.peak_tflops)
        if self.kernel.rate_inf_tflops > self.peak_tflops:
            raise ValueError(f"kernel.rate_inf_tflops={self.kernel.rate_inf_tflops} exceeds "
                             f"peak_tflops={self.peak_tflops}")
        missing = [c for c in LINK_CLASSES if c not in self.links]
        if missing:
            raise ValueError(f"profile.links lacks link classes {missing} (needs {list(LINK_CLASSES)})")
        for cls_name, link in self.links.items():
            if not isinstance(link, LinkClass):
                raise ValueError(f"profile.links[{cls_name!r}] must be a LinkClass, got {type(link).__name__}")

    @property
    def kernel_device_type(self) -> str:
        """``"cpu"`` or ``"cuda"``: the device type the kernel model was measured on, as ``libra-bench
        calibrate`` records it (``source["environment"]["device"]``); a profile without that record
        (the built-in ones, fitted to public H100 tables) describes a GPU."""
        env = self.source.get("environment") if isinstance(self.source, dict) else None
        device = env.get("device") if isinstance(env, dict) else None
        return str(device).split(":")[0] if device else "cuda"

    @property
    def gpus_per_supernode(self) -> int:
        return self.gpus_per_node * self.nodes_per_supernode

    def to_dict(self) -> dict:
        """JSON-ready dict of the schema :func:`profile_from_dict` reads (recorded in run.json)."""
        return {
            "schema": SCHEMA_VERSION, "name": self.name, "version": self.version,
            "description": self.description, "source": self.source, "peak_tflops": self.peak_tflops,
            "kernel": self.kernel.to_dict(),
            "links": {k: {"bandwidth_gbps": v.bandwidth_gbps, "latency_ms": v.latency_ms, "port": v.port}
                      for k, v in self.links.items()},
            "gpus_per_node": self.gpus_per_node, "nodes_per_supernode": self.nodes_per_supernode,
            "variability": {"sigma_gpu": self.variability.sigma_gpu,
                            "sigma_step": self.variability.sigma_step},
        }


_REQUIRED = ("name", "version", "peak_tflops", "kernel", "links", "gpus_per_node", "nodes_per_supernode")


def profile_from_dict(data: dict, origin: str = "<dict>") -> HardwareProfile:
    """Build and validate a profile from its JSON dict.

    Raises:
        ValueError: wrong schema version, a missing field or an invalid value; names ``origin``.
    """
    if not isinstance(data, dict):
        raise ValueError(f"profile {origin}: top level must be a JSON object, got {type(data).__name__}")
    schema = data.get("schema", SCHEMA_VERSION)
    if schema != SCHEMA_VERSION:
        raise ValueError(f"profile {origin}: schema {schema!r} not supported (expected {SCHEMA_VERSION})")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"profile {origin}: missing field(s) {missing}")
    try:
        kernel = KernelModel(**data["kernel"])
        if not isinstance(data["links"], dict):
            raise ValueError("links must be an object of link classes")
        links = {}
        for k, v in data["links"].items():
            try:
                links[k] = LinkClass(**v)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"links[{k!r}]: {exc}") from exc
        variability = Variability(**data.get("variability", {}))
        return HardwareProfile(
            name=data["name"], version=data["version"], description=data.get("description", ""),
            source=data.get("source", {}), peak_tflops=data["peak_tflops"], kernel=kernel, links=links,
            gpus_per_node=data["gpus_per_node"], nodes_per_supernode=data["nodes_per_supernode"],
            variability=variability)
    except TypeError as exc:  # unknown or missing keys inside kernel/links/variability
        raise ValueError(f"profile {origin}: {exc}") from exc
    except ValueError as exc:
        raise ValueError(f"profile {origin}: {exc}") from exc


def available_profiles() -> list[str]:
    """Names of the built-in profiles."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name_or_path: str | Path | HardwareProfile = DEFAULT_PROFILE) -> HardwareProfile:
    """Load a built-in profile by name or any profile JSON file by path.

    Args:
        name_or_path: a built-in name (see :func:`available_profiles`), a path to a ``.json`` file,
            or an already loaded profile (returned unchanged).

    Raises:
        ValueError: unknown name, unreadable or malformed file, or an invalid profile.
    """
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    text = str(name_or_path)
    path = Path(text)
    if not (path.suffix == ".json" or path.exists()):
        path = PROFILE_DIR / f"{text}.json"
        if not path.exists():
            raise ValueError(f"unknown hardware profile {text!r}; built-in: {available_profiles()} "
                             "(or pass a path to a profile .json)")
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read hardware profile {str(path)!r}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"hardware profile {str(path)!r} is not valid JSON: {exc}") from exc
    return profile_from_dict(data, origin=str(path))
