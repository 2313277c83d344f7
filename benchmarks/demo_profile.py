"""Where the time of one `dppo train` run goes: the run with timestamps around its phases.

    .venv/bin/python benchmarks/demo_profile.py [--out FILE] [key=value ...]

Runs `dppo train` in this process (the same code path as the console script, the same overrides) with the
driver's phases wrapped in timers: the imports, the preflight checks, Ray's start, the actor's ranks and their
model, the rollout workers' creation, the first weight publish, the wait for the rollout's first batch, each
global step (the first and the last apart), the checkpoints, the end of the loop (the last policy loaded, the
rollout and the ranks closed), the final evaluation, the plot and summary, Ray's shutdown and the exit. Each
phase is printed with its start and end in seconds since the process started (from /proc, so Python's own
start-up counts), and written as JSON (--out). Nothing in dppo changes: the wrappers only read the clock.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import time

EVENTS: list[tuple[str, float, float]] = []  # (phase, start, end), seconds on time.time()'s clock


def process_start_time(pid: int | str = "self") -> float:
    """When process pid started, on time.time()'s clock (from /proc: boot time + start ticks; 10 ms resolution)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    start_ticks = int(fields[19])  # field 22 of stat(5); fields[0] is field 3
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


def timed(name: str, fn):
    """fn, recording (name, start, end) of every call in EVENTS."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            EVENTS.append((name, start, time.time()))

    return wrapper


def patch(owner, attr: str, name: str) -> None:
    setattr(owner, attr, timed(name, getattr(owner, attr)))


def install() -> None:
    """Wrap the driver's phases (module attributes that dppo.launch.run and the trainer look up at call time)."""
    import ray

    import dppo.launch.run as train
    from dppo.trainer import base
    from dppo.trainer import rollout as rollout_source
    from dppo.trainer.ppo import PPOTrainer

    for attr in (
        "check_output_dir",
        "make_prompt_source",
        "plan_run",
        "check_sequence_length",
        "check_training_memory",
        "probe_cluster",
        "check_cluster_fits",
    ):
        patch(train, attr, f"preflight:{attr}")
    patch(train, "init_ray", "ray_init")
    patch(ray, "shutdown", "ray_shutdown")
    patch(base, "make_worker_group", "actor_ranks_and_model")
    patch(base, "make_rollout", "rollout_workers_created")
    patch(PPOTrainer, "__init__", "trainer_init")
    patch(PPOTrainer, "publish_weights", "publish_weights")
    patch(PPOTrainer, "run_cycle", "step")
    patch(PPOTrainer, "save_checkpoint", "checkpoint")
    patch(PPOTrainer, "_current_policy", "load_final_policy")
    patch(PPOTrainer, "evaluate", "evaluate")
    patch(PPOTrainer, "close", "close_ranks")
    patch(PPOTrainer, "_finish", "plot_and_summary")
    patch(rollout_source.RayRollout, "close", "close_rollout")
    patch(rollout_source.RayRollout, "fetch", "fetch")


def phases(events: list[tuple[str, float, float]], t0: float) -> list[dict]:
    """The events relative to t0: each phase's first call, its later calls summed (and the last step apart)."""
    calls: dict[str, list[tuple[float, float]]] = {}
    for name, start, end in events:
        calls.setdefault(name, []).append((start, end))
    rows = []
    for name, spans in calls.items():
        label = {
            "step": "first step",
            "fetch": "first fetch (the wait for the rollout's first batch)",
            "publish_weights": "first publish (waits for the replay buffer's process)",
        }.get(name, name)
        start, end = spans[0]
        rows.append({"phase": label, "start_s": start - t0, "end_s": end - t0, "seconds": end - start})
        later = spans[1:]
        if name == "step" and later:
            start, end = later.pop()
            rows.append({"phase": "last step", "start_s": start - t0, "end_s": end - t0, "seconds": end - start})
        if later:
            rows.append(
                {
                    "phase": f"{name}: {len(later)} more, summed",
                    "start_s": None,
                    "end_s": None,
                    "seconds": sum(e - s for s, e in later),
                }
            )
    rows.sort(key=lambda r: (r["start_s"] is None, r["start_s"] or 0.0))
    return rows


def report(t0: float, imported: float, out_path: str | None) -> None:
    end = time.time()
    rows = [
        {"phase": "python start-up and imports", "start_s": 0.0, "end_s": imported - t0, "seconds": imported - t0},
        *phases(EVENTS, t0),
        {"phase": "exit", "start_s": end - t0, "end_s": end - t0, "seconds": 0.0},
    ]
    print("\nphase                                              start s    end s  seconds", file=sys.stderr)
    for r in rows:
        start = "" if r["start_s"] is None else f"{r['start_s']:8.2f}"
        stop = "" if r["end_s"] is None else f"{r['end_s']:8.2f}"
        print(f"{r['phase'][:50]:<50} {start:>8} {stop:>8} {r['seconds']:8.2f}", file=sys.stderr)
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"process_start": t0, "rows": rows, "argv": sys.argv[1:]}, f, indent=2)


def main(argv: list[str]) -> int:
    out_path = None
    if argv[:1] == ["--out"]:
        out_path, argv = argv[1], argv[2:]
    t0 = process_start_time()
    from dppo import cli  # noqa: F401  (the imports `dppo train` makes before it runs)
    import dppo.launch.run  # noqa: F401

    install()
    imported = time.time()
    atexit.register(report, t0, imported, out_path)
    return cli.main(["train", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
