"""`dppo replay`: an asynchronous run (the demo's settings, rollout workers as local processes) recorded in its
schedule.jsonl and trained again along it ends with the run's weights bitwise and the same metrics step for step
(after a SIGKILL and a resume too: integration/test_stop_resume.py); --samples re-trains the run's stored samples; a
schedule edited by hand makes the replay differ; a mid-ticket version switch is replayed at the look and the token the
run's worker made it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dppo.cli import main
from dppo.commands.replay import replay
from dppo.config import ConfigError, load_config
from dppo.data import make_prompt_source
from dppo.models import build_model, policy_config
from dppo.trainer.rollout.scheduled import ScheduledRollout
from dppo.trainer.rollout.settings import worker_settings
from dppo.trainer.schedule import SCHEDULE_FILE, Schedule, ScheduleError, ScheduleRecorder
from dppo.workers.rollout.buffer_client import BufferClient, run_ticket
from dppo.workers.rollout.replay_buffer import ReplayBufferCore, map_weights
from dppo.workers.rollout.worker import RolloutGenerator, StateDictWeights
from tests.tiny_run import small_overrides

# The demo (`make demo`: dppo train with the defaults: separate_async, local worker processes) for a few steps, its
# groups stored too; the evaluation left out (it decodes the same weights in both: time, not evidence)
DEMO = ["trainer.total_steps=3", "trainer.progress_bar=false", "trainer.eval_prompts=0", "trainer.record_samples=true"]


def demo_run(out: Path, *extra: str) -> Path:
    assert main(["train", f"trainer.output_dir={out}", *DEMO, *extra]) == 0
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return demo_run(tmp_path_factory.mktemp("demo") / "run")


def test_the_demos_async_run_replayed_ends_with_its_weights_bitwise_and_its_metrics(demo, tmp_path):
    lines = Schedule.read(demo).lines
    assert [(line["step"], line["trigger"]) for line in lines] == [(s, t) for s in (1, 2, 3) for t in range(4)]
    result = replay(demo, out=tmp_path / "replay")
    assert result.weights_equal and result.weights.startswith("bitwise equal"), result.weights
    assert result.metric_differences == [] and result.metric_keys > 30
    assert result.tickets == len(Schedule.read(demo).tickets) > 0
    # the replay is a run too: its own schedule is the run's, line for line
    assert (tmp_path / "replay" / SCHEDULE_FILE).read_text() == (demo / SCHEDULE_FILE).read_text()


def test_samples_replayed_with_the_runs_settings_give_its_weights_and_another_loss_other_ones(demo, tmp_path):
    same = replay(demo, out=tmp_path / "same", samples=True)
    assert same.weights_equal and same.metric_differences == [] and same.tickets == 0
    bypass = replay(
        demo, out=tmp_path / "bypass", samples=True, overrides=["algorithm.rollout_correction.bypass_mode=true"]
    )
    assert bypass.counterfactual and bypass.weights_equal is False
    # the same samples: every step's sampled rewards and staleness are the run's, whatever the loss
    assert not [d for d in bypass.metric_differences if "critic/score" in d or "staleness" in d]


def test_a_group_moved_to_another_trigger_makes_the_replay_differ(demo, tmp_path, capsys):
    edited = tmp_path / "edited"
    edited.mkdir()
    for name in ("config.yaml", "metrics.jsonl", SCHEDULE_FILE):
        (edited / name).write_bytes((demo / name).read_bytes())
    (edited / "hf_model").symlink_to(demo / "hf_model")
    header, *lines = [json.loads(line) for line in (edited / SCHEDULE_FILE).read_text().splitlines()]
    # the first two takes with groups: trigger 0's and trigger 1's (taken ahead at trigger 0, or at trigger 1)
    takes = [take for line in lines for take in line["takes"] if take["groups"]][:2]
    takes[0]["groups"][-1], takes[1]["groups"][0] = takes[1]["groups"][0], takes[0]["groups"][-1]
    (edited / SCHEDULE_FILE).write_text("".join(json.dumps(line) + "\n" for line in [header, *lines]))
    assert main(["replay", str(edited), "--out", str(tmp_path / "replay")]) == 7
    out = capsys.readouterr().out
    assert "weights: differ first at" in out, "the planted move did not change the replay"
    assert "step 1 actor/" in out  # the first step's update already differs


def test_keys_the_schedule_fixes_cannot_be_overridden(demo, tmp_path):
    with pytest.raises(ConfigError, match="trainer.parameter_sync_step is fixed by the run's schedule"):
        replay(demo, out=tmp_path / "r", overrides=["trainer.parameter_sync_step=2"])
    with pytest.raises(ScheduleError, match="--until 9: the run's schedule holds global steps 1-3"):
        replay(demo, until=9, out=tmp_path / "r")
    with pytest.raises(ConfigError, match="the run's own directory"):
        replay(demo, out=demo)


def test_until_stops_at_the_step_with_a_checkpoint_and_its_metrics_are_the_runs(demo, tmp_path):
    result = replay(demo, until=2, out=tmp_path / "at2")
    assert result.metric_differences == [] and result.steps == 2
    assert (tmp_path / "at2" / "checkpoints" / "step_00000002" / "trainer.pt").is_file()
    assert len((tmp_path / "at2" / "metrics.jsonl").read_text().splitlines()) == 2


# ---- a mid-ticket switch (rollout.partial_rollout) -------------------------------------------------------------------


class _SwitchAtLook(BufferClient):
    """A worker's buffer client whose trainer publishes version 1 during the ticket's `at`-th look (deterministic:
    a run's worker finds the newer version at whichever look it arrives by)."""

    looks_mid_ticket = True

    def __init__(self, core: ReplayBufferCore, weights_1: dict, at: int) -> None:
        self.core, self.weights_1, self.at, self.looks = core, weights_1, at, 0

    def acquire(self, version, num_groups):
        return map_weights(self.core.acquire(version, num_groups), StateDictWeights)

    def newer(self, version):
        self.looks += 1
        if self.looks == self.at:
            self.core.publish(self.weights_1, 1)
        return map_weights(self.core.newer(version), StateDictWeights)

    def put(self, finished):
        self.core.put(finished)


def test_a_partial_rollout_ticket_replays_its_switch_at_the_recorded_look_and_token(tmp_path):
    cfg = load_config(
        small_overrides(tmp_path, **{
            "trainer.mode": "separate_async", "rollout.partial_rollout": True, "rollout.partial_chunk": 1,
            "task.length": 4, "trainer.train_batch_size": 2, "trainer.parameter_sync_step": 1,
        })
    )  # fmt: skip
    source = make_prompt_source(cfg)
    model_config = policy_config(cfg.model, source.vocab_size)
    weights = [
        build_model(cfg.model, source.vocab_size, seed).state_dict() for seed in (0, 1)
    ]  # versions 0 and 1: unlike
    # the run's worker: a ticket of 2 groups under version 0 that loads version 1 at its third look
    core = ReplayBufferCore(1, "wait", 2)
    core.publish(weights[0], 0)
    worker = RolloutGenerator(worker_settings(cfg, source, model_config), source, model_config, 0)
    assert run_ticket(_SwitchAtLook(core, weights[1], at=3), worker, 2) == 2
    groups, dropped = core.take(2, 1)
    assert groups[0].ticket["looks"] == [[3, 1]]
    recorder = ScheduleRecorder(tmp_path, cfg.trainer.seed)
    recorder.fresh()
    recorder.took("fetch", 2, (groups, dropped))
    recorder.commit(1, 0, 1)
    schedule = Schedule.read(tmp_path)
    token = schedule.tickets[0]["switches"][0][0]
    assert token == 3  # chunks of one token: the third look comes after three tokens, the fourth is version 1's
    assert bool((groups[0].token_versions[:, token:] == 1).all() and (groups[0].token_versions[:, :token] == 0).all())

    replayed = ScheduledRollout(cfg, source, model_config, schedule)
    replayed.publish(weights[0], 0)
    replayed.publish(weights[1], 1)
    again, _ = replayed.fetch(2, 1)
    for a, b in zip(groups, again, strict=True):
        for name in ("prompt", "responses", "response_mask", "behav_logp", "scores", "token_versions"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    # the switch moved one look earlier: the replay's groups are not the run's, and it says so
    moved = json.loads((tmp_path / SCHEDULE_FILE).read_text().splitlines()[1])
    moved["tickets"][0]["looks"] = [[2, 1]]
    (tmp_path / SCHEDULE_FILE).write_text(
        "\n".join([json.dumps({"schedule": 1, "seed": 0, "from_step": 0}), json.dumps(moved)]) + "\n"
    )
    late = ScheduledRollout(cfg, source, model_config, Schedule.read(tmp_path))
    late.publish(weights[0], 0)
    late.publish(weights[1], 1)
    with pytest.raises(ScheduleError, match="version 1 sampled from token 2 in the replay, from token 3 in the run"):
        late.fetch(2, 1)
