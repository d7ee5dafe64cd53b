"""Issue 13 item 5: `libra-bench calibrate --device cpu` sizes its sweep for a CPU profile."""

from __future__ import annotations

from experiments.measured.calibrate import CPU_DEFAULTS, _cpu_sized, calibrate

ORDER = list(CPU_DEFAULTS)
GPU_VALUES = ([1024, 2048, 4096], [1, 2, 4, 8, 16, 32], 32, 4, 128, 16384, 65536, 1024, 3, 10, 4)


def _sized(args, device):
    ctx = calibrate.make_context("calibrate", list(args))
    with ctx:
        return dict(zip(ORDER, _cpu_sized(ctx, device, *GPU_VALUES)))


def test_cpu_device_gets_cpu_sizes_unless_given():
    got = _sized(["--device", "cpu"], "cpu")
    assert got == CPU_DEFAULTS
    got = _sized(["--device", "cpu", "--head-dim", "128", "--repeats", "10"], "cpu")
    assert got["head_dim"] == 128 and got["repeats"] == 10 and got["q_heads"] == 8


def test_gpu_device_keeps_its_sizes():
    assert tuple(_sized(["--device", "cuda"], "cuda").values()) == GPU_VALUES
