"""Checkpoints of a training run, so an interrupted ``libra-bench train`` resumes where it stopped.

After every step rank 0 writes one file (atomically: a temporary file, then ``os.replace``) holding
the model and optimizer state after the steps done so far, their records and the device speeds
planned with. Every rank's parameters and optimizer state are the same (gradients are summed over
all ranks before AdamW steps), so rank 0's state is the run's. A rerun of the same command loads it
and trains the remaining steps: the same data, plans and -- up to the timing columns -- the same
records as an uninterrupted run. The file lives in the run's point cache
(:attr:`experiments.common.runner.ExperimentRun.points_dir`), keyed like a sweep's points by the config,
the input contents and the code, so a changed run never resumes from another's state.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

_log = logging.getLogger(__name__)

CHECKPOINT_NAME = "train-checkpoint.pt"


def save_checkpoint(path: Path, model, opt, steps: list[dict], device_speeds=None) -> None:
    """Write the state after ``len(steps)`` steps to ``path`` (atomically)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"next_step": len(steps), "steps": list(steps), "device_speeds": device_speeds,
             "model": {k: v.detach().cpu() for k, v in model.state_dict().items()}, "opt": opt.state_dict()}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict | None:
    """The checkpoint at ``path``, or None when there is none (or it cannot be read: a rerun then
    starts from step 0 rather than failing)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001  (a file from another torch version, or damaged: start over)
        _log.warning("warning: cannot read the checkpoint %s (%s): training starts from step 0", path, exc)
        return None
    return state if isinstance(state, dict) and "next_step" in state else None
