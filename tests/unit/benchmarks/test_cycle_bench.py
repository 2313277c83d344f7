"""benchmarks/cycle_bench.py end to end on the smallest size: every mode at every parameter_sync_step, the
figures consistent with their definitions, and the old-log-prob check passing bitwise."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "cycle_bench.py"


def test_cycle_bench_runs_every_mode_and_checks_the_old_log_probs(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("cycle_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cycle.json"
    bench.main(["--sizes", "tiny", "--ps", "1", "2", "--repeats", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    (result,) = data["results"]
    assert result["check"]["ok"] and result["check"]["bitwise_equal"] and result["check"]["live_moved"]
    rows = {(r["ps"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(ps, mode) for ps in (1, 2) for mode in bench.MODES}
    for (ps, mode), r in rows.items():  # one round: the medians are the round's own differences
        assert r["overhead_vs_bypass_s"] == r["cycles_s"][0] - rows[ps, "bypass"]["cycles_s"][0]
        assert r["exposed_snapshot_s"] == r["cycles_s"][0] - rows[ps, "recompute-only"]["cycles_s"][0]
        if mode in ("bypass", "loglinear"):
            assert r["reader"] == mode and r["moved_mb"] == 0  # no snapshot at all
        else:
            assert r["reader"] == {1: "current"}.get(ps, r["reader"])
    assert rows[2, "decoupled-auto"]["reader"] == "view" and rows[2, "decoupled-reference"]["reader"] == "reference"
    nbytes_mb = result["bytes"] / 1e6
    assert rows[2, "decoupled-auto"]["moved_mb"] == nbytes_mb  # the save of trigger 0 only
    assert rows[2, "decoupled-reference"]["moved_mb"] == 4 * nbytes_mb  # save + save, restore, restore at k = 1
    assert rows[1, "decoupled-auto"]["moved_mb"] == 0
    assert rows[2, "score-ahead"]["reader"] == "ahead" and rows[2, "score-ahead"]["moved_mb"] == 0  # no snapshot
    assert any(
        line.startswith(
            (
                "PASS  exact Decoupled target, tiny: score-ahead - bypass",
                "FAIL  exact Decoupled target, tiny: score-ahead - bypass",
            )
        )
        for line in printed.splitlines()
    )
    assert "exposed snap = cycle(mode) - cycle(recompute-only)" in printed
    targets = [line[6:] for line in printed.splitlines() if line.startswith(("PASS  CPU target", "FAIL  CPU target"))]
    assert len(targets) == 2  # as the issue words it (vs bypass), and on the snapshot work alone
    assert targets[0].startswith("CPU target, tiny: decoupled-auto - bypass")
    assert targets[1].startswith("CPU target, snapshot work only, tiny: exposed snapshot (vs recompute-only)")
    assert [t["line"] for t in data["targets"][:2]] == targets
    assert data["meta"]["malloc_tuning"] is not None  # glibc here: freed memory stays mapped
    assert "PASS  old log-probs, tiny" in printed
    (loglinear,) = [t for t in data["targets"] if t["line"].startswith("loglinear target, tiny: loglinear - bypass")]
    assert "x of recompute-only - bypass" in loglinear["line"] and "target <= 0.1x" in loglinear["line"]
