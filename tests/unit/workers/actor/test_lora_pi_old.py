"""Every way of reading pi_old gives a LoRA run the same losses whether a snapshot holds the adapter alone (what dppo
keeps) or every tensor of the model (what a snapshot of the merged weights would be): the frozen base never changes
within a cycle, so the adapter is all of pi_old that moves."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("peft")

import dppo.snapshot  # noqa: E402
from dppo.launch.run import run  # noqa: E402
from dppo.workers.actor import pi_old_sources  # noqa: E402

LORA = {
    "model.lora_rank": 4,
    "model.lora_alpha": 16,
    "actor.lr": 0.05,
    "trainer.total_steps": 2,
    "trainer.parameter_sync_step": 2,
    "snapshot.score_ahead": False,  # trigger 1 reads slot 0 (score-ahead would have scored it at trigger 0)
}


def losses(output_dir) -> list[dict]:
    """Each step's metrics but its timings and byte counts (the latter differ by design)."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing_s/") and k != "snapshot/bytes"} for r in rows]


@pytest.mark.parametrize(
    "pi_old",
    [
        {"snapshot.strategy": "view"},
        {"snapshot.strategy": "swap"},
        {"snapshot.strategy": "stream"},
        {"snapshot.strategy": "reference"},
    ],
    ids=lambda d: next(iter(d.values())),
)
def test_adapter_only_snapshots_give_the_losses_of_whole_model_snapshots(small_cfg, tmp_path, monkeypatch, pi_old):
    ours = run(small_cfg(**{**LORA, **pi_old, "trainer.output_dir": tmp_path / "adapter"}))
    with monkeypatch.context() as m:  # every snapshot of every tensor, frozen ones included
        inner = dppo.snapshot.SnapshotPool.__init__
        m.setattr(
            dppo.snapshot.SnapshotPool,
            "__init__",
            lambda self, *a, **k: inner(self, *a, **{**k, "trainable_only": False}),
        )
        m.setattr(pi_old_sources, "trainable_parameters", lambda model: list(model.named_parameters()))
        whole = run(small_cfg(**{**LORA, **pi_old, "trainer.output_dir": tmp_path / "whole"}))
    a, w = losses(ours.output_dir), losses(whole.output_dir)
    assert len(a) == 2 and a == w
    records = [json.loads(line) for line in (ours.output_dir / "metrics.jsonl").read_text().splitlines()]
    whole_records = [json.loads(line) for line in (whole.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["snapshot/bytes"] < whole_records[0]["snapshot/bytes"] / 4
