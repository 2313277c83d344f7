"""Tools for agents, safe to run on input a model wrote: a Python sandbox (sandbox.py). Standard library only (no
torch): rollout worker processes import it."""

from dppo.tools.sandbox import Limits, LimitsError, ToolResult, arun_python, run_python

__all__ = ["Limits", "LimitsError", "ToolResult", "arun_python", "run_python"]
