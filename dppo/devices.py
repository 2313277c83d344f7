"""trainer.device as a torch.device, in one place (the trainer's evaluation model, every actor rank, dppo eval)."""

from __future__ import annotations

import torch


def resolve_device(name: str, current_gpu: bool = False) -> torch.device:
    """trainer.device ("cpu", "cuda" or "auto") as a torch.device: "auto" is cuda where this process sees a GPU (the
    config has checked "cuda"); current_gpu: a cuda device carries the index of this process's current GPU (the one
    Ray gave an actor rank), else none."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and current_gpu:
        return torch.device(name, torch.cuda.current_device())
    return torch.device(name)
