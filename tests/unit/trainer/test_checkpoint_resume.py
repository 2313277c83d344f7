"""Atomic checkpoints and in-process resume: state restored bitwise, metrics after the checkpoint dropped."""

import json
import os

import pytest
import torch

from dppo.trainer import checkpoint as ckpt
from dppo.trainer.ppo import PPOTrainer
from dppo.trainer.report import read_metrics


def test_atomic_write_leaves_old_file_on_failure(tmp_path):
    path = tmp_path / "x.bin"
    ckpt.atomic_write_bytes(path, lambda f: f.write(b"old"))

    def failing(f):
        f.write(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ckpt.atomic_write_bytes(path, failing)
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["x.bin"]  # no temporary file left behind


def test_keeps_the_newest_and_ignores_temporaries(tmp_path):
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, {"step": step}, keep=2)
    (tmp_path / ".step_00000009.pt.abc.tmp").write_bytes(b"torn")
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000002.pt", "step_00000003.pt"]
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(tmp_path))["step"] == 3
    (tmp_path / "step_00000004.pt").write_bytes(b"garbage")
    with pytest.raises(ckpt.CheckpointError, match="step_00000004"):
        ckpt.load_checkpoint(tmp_path / "step_00000004.pt")


@pytest.mark.parametrize("anchor", ["current", "cycle_start"])
def test_resume_restores_state_and_continues_after_the_checkpoint(small_cfg, anchor):
    # The KL reference model is state too: it must be the run's initial weights after a resume.
    common = {"trainer.checkpoint_every": 2, "actor.kl_loss_coef": 0.1, "algorithm.prox_anchor": anchor}
    first = PPOTrainer(small_cfg(**{"trainer.total_steps": 3, **common}))
    initial = {k: v.clone() for k, v in first.model.state_dict().items()}
    first.fit()
    out = first.output_dir
    saved = ckpt.load_checkpoint(ckpt.latest_checkpoint(out / "checkpoints"))
    assert [p.name for p in ckpt.list_checkpoints(out / "checkpoints")] == ["step_00000002.pt", "step_00000003.pt"]
    assert saved["global_step"] == 3 and saved["version"] == 3
    for name, tensor in first.model.state_dict().items():
        assert torch.equal(saved["model"][name], tensor)

    # A run killed after step 3's checkpoint had logged steps 4 and 5 (the last line torn mid-write).
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 4, "critic/score/mean": -1.0}) + "\n" + '{"step": 5, "crit')

    resumed = PPOTrainer(small_cfg(**{"trainer.total_steps": 5, "trainer.resume": True, **common}))
    assert resumed.resumed_from.name == "step_00000003.pt"
    assert (resumed.global_step, resumed.version) == (3, 3)
    for name, tensor in resumed.model.state_dict().items():
        assert torch.equal(saved["model"][name], tensor)
    opt_state = resumed.optimizer.state_dict()["state"]
    for index, tensors in saved["optimizer"]["state"].items():
        for key, value in tensors.items():
            assert torch.equal(opt_state[index][key], value)
    for name, tensor in resumed.ref_model.state_dict().items():  # the run's initial weights, not step 3's
        assert torch.equal(initial[name], tensor)
    resumed.fit()
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
    assert [json.dumps(r) for r in records[:3]] == lines  # steps up to the checkpoint are kept as they were
    assert records[3]["critic/score/mean"] >= 0.0  # step 4 was re-run, not the stale line
    assert ckpt.load_checkpoint(ckpt.latest_checkpoint(out / "checkpoints"))["global_step"] == 5


def test_resume_without_checkpoint_starts_fresh(small_cfg):
    trainer = PPOTrainer(small_cfg(**{"trainer.resume": True, "algorithm.prox_anchor": "current"}))
    assert trainer.resumed_from is None and trainer.global_step == 0


def test_a_fresh_run_discards_an_earlier_runs_checkpoints(small_cfg):
    cfg = small_cfg(**{"trainer.total_steps": 2, "trainer.checkpoint_every": 1, "algorithm.prox_anchor": "current"})
    PPOTrainer(cfg).fit()
    out = cfg.trainer.output_dir
    assert [p.name for p in ckpt.list_checkpoints(f"{out}/checkpoints")] == ["step_00000001.pt", "step_00000002.pt"]
    fresh = PPOTrainer(small_cfg(**{"trainer.total_steps": 1, "trainer.checkpoint_every": 1,
                                    "algorithm.prox_anchor": "current"}))  # fmt: skip
    assert ckpt.list_checkpoints(f"{out}/checkpoints") == []
    fresh.fit()
    assert [p.name for p in ckpt.list_checkpoints(f"{out}/checkpoints")] == ["step_00000001.pt"]
    assert [r["step"] for r in read_metrics(f"{out}/metrics.jsonl")] == [1]
