"""LoRA against full fine-tuning on make real's task, in one run: the same seed, problems and steps, each variant a
`benchmarks/real_run.py` of its own (base measurement, then `dppo train`), one after the other.

    .venv/bin/python benchmarks/lora_real.py [--rank 16] [--alpha 32] [--lora-lr 2e-4] [--steps 120] [--out DIR]
                                             [--only lora|full] [key=value ...]

Per variant: held-out greedy accuracy over time (the time to 0.5 and 0.7, the final), pi_old's slot bytes
(snapshot/bytes), the bytes of each weight sync after the first (rollout/weight_sync_bytes: the full model, or LoRA's
adapter), and each process's peak resident memory (VmHWM, read from /proc every half second for every process of the
variant's tree, by role: the trainer, the rollout workers, the base measurement). Prints a table of LoRA / full and
writes OUT/lora_real.json. issue 45's targets: sync and snapshot bytes <= 5% of full, peak memory by process <= 0.7x,
0.7 within 1.2x full's time, final accuracy no lower than full's minus 0.03.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_run  # noqa: E402

REPO = real_run.REPO


def descendants(pid: int) -> list[int]:
    """pid and every process below it (from /proc/*/stat's parent ids)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def role(pid: int) -> str | None:
    """The part of a variant a process plays, from its command line (None: not one of dppo's)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    if "--measure-base" in cmd:
        return "base measurement"
    if comm.startswith("dppo-rollout") or "EngineCore" in comm or "VllmWorker" in comm:
        return "rollout worker"
    if "dppo train" in cmd or " -m dppo " in cmd:
        return "trainer"
    return None


class PeakMemory:
    """The largest VmHWM (bytes) seen of each role's processes while the variant runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peaks, self._stop = pid, {}, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.5):
            for pid in descendants(self.pid):
                name = role(pid)
                if name is None:
                    continue
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmHWM:"):
                            kib = int(line.split()[1])
                            self.peaks[name] = max(self.peaks.get(name, 0), kib * 1024)
                except OSError:
                    continue

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return dict(self.peaks)


def run_variant(name: str, out: Path, overrides: list[str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(REPO / "benchmarks" / "real_run.py"), "--out", str(out), *overrides]
    print(f"== {name}: {' '.join(cmd)}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO)
    peaks = PeakMemory(proc.pid)
    code = proc.wait()
    wall_s = time.perf_counter() - start
    memory = peaks.stop()
    if code != 0:
        raise SystemExit(f"lora_real: the {name} run failed (exit {code}); its log: {out / 'real_run.log'}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    result = json.loads((out / "real_run.json").read_text())
    syncs = [r["rollout/weight_sync_bytes"] for r in records if "rollout/weight_sync_bytes" in r]
    snapshots = [r["snapshot/bytes"] for r in records if "snapshot/bytes" in r]
    log = (out / "real_run.log").read_text(errors="replace").splitlines()
    estimate = next((line.strip() for line in log if line.strip().startswith("memory estimate:")), None)
    found = {
        "estimate": estimate,  # the preflight's line (dppo train prints it before it starts)
        "real_run": result,
        "wall_s": wall_s,
        "peak_bytes": memory,
        "sync_bytes_after_first": max(syncs[1:]) if len(syncs) > 1 else None,
        "snapshot_bytes": max(snapshots) if snapshots else None,
    }
    (out / "variant.json").write_text(json.dumps(found, indent=1) + "\n")  # kept should the other variant fail
    return found


def ratio(a, b) -> str:
    return "n/a" if a is None or not b else f"{a / b:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=32)
    parser.add_argument("--lora-lr", type=float, default=2e-4, help="LoRA's actor.lr (full keeps the YAML's)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--out", default=str(REPO / "outputs" / "lora_real"))
    parser.add_argument(
        "--only",
        choices=("lora", "full"),
        help="run this variant alone (the other's OUT/<variant>/variant.json, if there, fills the table)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for both variants")
    args = parser.parse_intermixed_args(argv)
    out = Path(args.out)
    common = [f"trainer.total_steps={args.steps}", *args.overrides]
    lora = [f"model.lora_rank={args.rank}", f"model.lora_alpha={args.alpha}", f"actor.lr={args.lora_lr}"]
    variants = {"lora": (f"LoRA r={args.rank}", [*common, *lora]), "full": ("full fine-tuning", common)}
    runs = {}
    for key, (name, overrides) in variants.items():  # LoRA first: a failure there costs no full run
        if args.only in (None, key):
            runs[key] = run_variant(name, out / key, overrides)
        elif (out / key / "variant.json").is_file():
            runs[key] = json.loads((out / key / "variant.json").read_text())
            print(f"== {name}: kept from {out / key / 'variant.json'} (not run: --only {args.only})", flush=True)
    if len(runs) < 2:
        print(f"\n{args.only}: {json.dumps(runs[args.only], indent=1)}")
        return 0
    full, lo = runs["full"], runs["lora"]
    rows = [
        ("snapshot bytes (pi_old's slot)", full["snapshot_bytes"], lo["snapshot_bytes"]),
        ("weight sync bytes (after the first)", full["sync_bytes_after_first"], lo["sync_bytes_after_first"]),
    ]
    for part in sorted(set(full["peak_bytes"]) | set(lo["peak_bytes"])):
        rows.append((f"peak memory: {part}", full["peak_bytes"].get(part), lo["peak_bytes"].get(part)))
    for t in ("0.5", "0.7"):
        at = [r["real_run"]["crossings"].get(t, {}).get("at_s") for r in (full, lo)]
        rows.append((f"seconds to held-out greedy {t}", *at))
    rows.append(("held-out greedy accuracy, final", full["real_run"]["final_greedy"], lo["real_run"]["final_greedy"]))
    rows.append(("wall seconds (base measurement included)", full["wall_s"], lo["wall_s"]))
    print("\n| | full | LoRA | LoRA / full |\n|---|---|---|---|")
    for label, f, lval in rows:
        print(f"| {label} | {f} | {lval} | {ratio(lval, f)} |")
    (out / "lora_real.json").write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1) + "\n")
    for name in ("full", "lora"):
        print(f"{name}: {runs[name]['estimate']}")
    print(f"\nwritten: {out / 'lora_real.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
