"""Sample-length workloads: synthetic presets, file loaders, arrival streams, fixed-token packing."""

from libra.data.loaders import load_lengths
from libra.data.packing import PackedSequence, gbs_windows, pack_fixed_tokens, window_workloads
from libra.data.presets import PRESETS, LengthDistribution, get_preset
from libra.data.source import FileSource, LengthSource, PresetSource, resolve_workload

__all__ = [
    "PRESETS", "FileSource", "LengthDistribution", "LengthSource", "PackedSequence", "PresetSource",
    "gbs_windows", "get_preset", "load_lengths", "pack_fixed_tokens", "resolve_workload", "window_workloads",
]
