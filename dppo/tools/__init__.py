"""Tools for agents, safe to run on input a model wrote: a Python sandbox (sandbox.py) and a calculator
(calculator.py). Standard library only (no torch): rollout worker processes import it."""

from dppo.tools.calculator import CalculatorError, calculate, find_calls
from dppo.tools.sandbox import Limits, LimitsError, ToolResult, arun_python, run_python

__all__ = [
    "CalculatorError",
    "Limits",
    "LimitsError",
    "ToolResult",
    "arun_python",
    "calculate",
    "find_calls",
    "run_python",
]
