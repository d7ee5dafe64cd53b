"""Sample-length workloads: presets, file loaders, arrival streams, packing and GBS windows."""

from libra.data.loaders import load_lengths
from libra.data.packing import PackedSequence, pack_fixed_tokens
from libra.data.presets import PRESETS, LengthDistribution, get_preset
from libra.data.source import FileSource, LengthSource, PresetSource, resolve_workload
from libra.data.windows import gbs_windows, window_workloads

__all__ = [
    "PRESETS", "FileSource", "LengthDistribution", "LengthSource", "PackedSequence", "PresetSource",
    "gbs_windows", "get_preset", "load_lengths", "pack_fixed_tokens", "resolve_workload", "window_workloads",
]
