"""The actor as two FSDP2 ranks (Ray actors, gloo) against one: the same update, exact old log-probs for every
snapshot strategy a sharded actor allows, verl's snapshot calls on every rank's shard, and DCP checkpoints that
resume at world size 2 and at world size 1.

One Ray cluster and ONE world-size-2 trainer serve the whole module (starting two rank processes costs more
than the training steps); the tests drive its cycles themselves (BaseTrainer.run_cycle) and run in file order:
the comparison with world size 1 first, on fresh weights. All trainers read the same pre-generated groups.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import ray
import torch

from dppo.data import make_prompt_source
from dppo.models import as_state_dict, build_model
from dppo.batch import Group, collate
from dppo.trainer.base import find_resume_point
from dppo.config import load_config
from dppo.config.pi_old import choose_pi_old
from dppo.trainer.ppo import PPOTrainer
from dppo.trainer.worker_group import actor_settings
from dppo.trainer.rollout import RolloutFailedError, RolloutSource
from dppo.trainer.rollout.settings import worker_settings
from dppo.workers.rollout.worker import RolloutGenerator
import partial_rollout
from partial_rollout import PartialRollout  # tests/partial_rollout.py (tests/conftest.py puts tests/ on sys.path)

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # functions run on the ranks come from here
ray.cloudpickle.register_pickle_by_value(partial_rollout)  # and from tests/, which the ranks cannot import


def overrides(output_dir: Path, world_size: int, **extra) -> dict:
    return {
        "trainer.output_dir": str(output_dir),
        "trainer.n_gpus_per_node": world_size,
        "trainer.mode": "sync",
        "ray.enabled": world_size > 1,
        "trainer.total_steps": 100,  # the tests run the cycles themselves
        "trainer.parameter_sync_step": 2,
        "trainer.train_batch_size": 6,  # 3 groups of 3 per trigger: 9 sequences, split 5 + 4 (and one padding row)
        "trainer.eval_prompts": 8,
        "trainer.checkpoint_every": 0,
        "trainer.progress_bar": False,
        "trainer.verify_old_log_prob": True,
        "algorithm.prox_logp_method": "metrics",  # exact, and loglinear's error merged over the ranks
        "rollout.n": 3,
        "task.length": 3,
        "model.hidden_size": 32,
        "model.num_hidden_layers": 2,
        "model.num_attention_heads": 2,
        "model.intermediate_size": 64,
        "actor.micro_batch_size": 2,  # 3 micro-batches on each rank, the last one of rank 1 padding only
        "actor.lr": 0.01,
        # a constant lr: the tests run cycles of a 100-step run themselves, and the default's warmup (10 optimizer
        # steps from lr 0) would leave the first ones without a step to compare
        "actor.optim.lr_scheduler_type": "constant",
        "actor.optim.lr_warmup_steps_ratio": 0,
        "actor.entropy_coeff": 0.01,
        "actor.kl_loss_coef": 0.1,  # a KL reference model, sharded like the policy
        **extra,
    }


def make_cfg(output_dir: Path, world_size: int, **extra):
    return load_config([f"{k}={v}" for k, v in overrides(output_dir, world_size, **extra).items()])


class FixedRollout(RolloutSource):
    """The same groups, in the same order, for every trainer (stamped with the version that takes them)."""

    worker_restarts = 0

    def __init__(self, groups: list[Group]) -> None:
        self.groups, self.taken = groups, 0
        self.published: list[tuple[int, object]] = []  # (version, what was published), every publish

    def start(self) -> None:
        pass

    def publish(self, weights, version: int) -> None:
        self.published.append((version, weights))

    def published_weights(self) -> dict[str, torch.Tensor]:
        return published_state(self.published[-1][1])

    def fetch(self, num_groups: int, trainer_version: int):
        groups = self.groups[self.taken : self.taken + num_groups]
        assert len(groups) == num_groups, "the test ran out of groups"
        self.taken += num_groups
        return [dataclasses.replace(g, version=trainer_version) for g in groups], 0

    def fetch_ready(self, num_groups: int, trainer_version: int):
        return self.fetch(num_groups, trainer_version)  # every group is there already

    def discard(self, count: int) -> None:
        pass  # no budget to free: every group is there already

    def stats(self) -> dict[str, float]:
        return {}

    def describe(self) -> str:
        return "rollout: fixed groups (a test's)"

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> list[Group]:
    """Groups sampled from the initial weights, as a rollout worker would (behavior log-probs included)."""
    cfg = make_cfg(tmp_path_factory.mktemp("groups"), 1)
    source = make_prompt_source(cfg)
    model = build_model(cfg.model, source.vocab_size, seed=cfg.trainer.seed)
    generator = RolloutGenerator(worker_settings(cfg, source, model.config), source, model.config, 0)
    generator.load_weights(model.state_dict(), 0)
    generator.seed_ticket(0)
    return generator.generate(120)


@pytest.fixture(scope="module")
def cluster():
    """A new local Ray cluster (never one someone else left running) that can see this tree's dppo."""
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}},
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def ws2(cluster, groups, tmp_path_factory):
    trainer = PPOTrainer(make_cfg(tmp_path_factory.mktemp("ws2"), 2), rollout=FixedRollout(groups))
    yield trainer
    trainer.close()


def run_cycles(trainer: PPOTrainer, cycles: int) -> list[dict]:
    """Metrics of every trigger of `cycles` sync cycles."""
    triggers = []
    train_trigger = trainer.train_trigger
    trainer.train_trigger = lambda *args: triggers.append(train_trigger(*args)) or triggers[-1]
    try:
        records = [trainer.run_cycle() for _ in range(cycles)]
    finally:
        trainer.train_trigger = train_trigger
    return triggers, records


def published_state(weights) -> dict[str, torch.Tensor]:
    """A state dict from what the trainer publishes: [ObjectRef of SharedWeights] under Ray, else a state dict."""
    return as_state_dict(ray.get(weights[0]) if isinstance(weights, list) else weights)


def full_weights(trainer: PPOTrainer) -> dict[str, torch.Tensor]:
    return published_state(trainer.actor_group.rollout_weights())


def assert_weights_close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float = 1e-4) -> None:
    """Every tensor within tol (relative, and absolute near 0), naming the worst."""
    assert got.keys() == expected.keys()
    worst = max((float(((got[k] - v).abs() / (v.abs() + 1)).max()), k) for k, v in expected.items())
    assert worst[0] <= tol, f"{worst[1]} differs by {worst[0]:.2e}"


def full_optimizer_state(rank) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(
        rank.model, rank.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )


def reconfigure(trainer: PPOTrainer, **extra) -> None:
    """Other algorithm settings for the driver and every rank, over the same weights and optimizer."""
    from dppo.trainer.filter_groups import GroupFilter

    cfg = make_cfg(Path(trainer.cfg.trainer.output_dir), trainer.actor_group.world_size, **extra)
    trainer.cfg, trainer.pi_old_choice = cfg, choose_pi_old(cfg)
    trainer.group_filter = GroupFilter(cfg.algorithm.filter_groups, cfg.groups_per_trigger)  # a trigger's draw size
    trainer.actor_group.reconfigure(actor_settings(cfg), trainer.pi_old_choice)


# ---- tests, in this order ------------------------------------------------------------------------


def test_world_size_2_updates_as_world_size_1(ws2, groups, tmp_path):
    assert ws2.global_step == 0, "runs first, on the initial weights"
    ranks = ws2.actor_group.nodes
    assert [n["rank"] for n in ranks] == [0, 1] and ranks[0]["pid"] != ranks[1]["pid"] != os.getpid()
    ws1 = PPOTrainer(make_cfg(tmp_path, 1), rollout=FixedRollout(groups))
    assert ws1.actor_group.world_size == 1 and ws1.actor_group.local_rank.sharded is False  # the plain module
    one, one_records = run_cycles(ws1, 3)
    two, two_records = run_cycles(ws2, 3)
    # trigger 0: pi_theta = pi_old, so the PPO term is ~0; its gradient, the entropy and the grad norm are not
    for key in ("actor/grad_norm", "actor/entropy", "rollout_corr/kl_k1"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-5), key
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/pg_clipfrac"):  # trigger 1: all moved
        assert two[1][key] == pytest.approx(one[1][key], rel=1e-5, abs=1e-7), key
    # loglinear's error, merged over micro-batches and ranks: from cycle 1 on, pi_prox has left the initial weights
    # that sampled the groups (stamped with the current version, so loglinear takes pi_behav): a real error
    for key in (
        "prox_approx/abs_err_mean",
        "prox_approx/abs_err_max",
        "prox_approx/is_weight_abs_err_mean",
        "prox_approx/is_weight_abs_err_max",
    ):
        assert two[3][key] == pytest.approx(one[3][key], rel=1e-4, abs=1e-7), key
    assert one[3]["prox_approx/abs_err_max"] > 1e-4
    assert one[1]["actor/kl_loss"] > 0 and one[1]["actor/pg_loss"] != 0
    assert [r["debug/old_log_prob_max_abs_diff"] for r in two_records] == [0.0] * 3
    assert_weights_close(full_weights(ws2), ws1.actor_group.local_rank.model.state_dict())
    ws1.close()


@pytest.mark.parametrize("strategy", ["auto", "swap", "reference"])
def test_every_strategy_allowed_under_fsdp2_gives_exact_old_log_probs(ws2, strategy):
    reconfigure(
        ws2,
        **{
            "trainer.parameter_sync_step": 4,
            "trainer.train_batch_size": 8,
            "snapshot.strategy": strategy,
            "snapshot.score_ahead": False,
        },
    )
    triggers, records = run_cycles(ws2, 2)
    assert [r["debug/old_log_prob_max_abs_diff"] for r in records] == [0.0, 0.0]
    assert all(t["actor/grad_norm"] > 0 for t in triggers)  # the live weights moved between the triggers
    used = ws2.actor_group.execute(
        lambda rank: rank.pi_old.source.reader_name if rank.pi_old_choice.source == "slot" else rank.pi_old.source.name
    )
    assert used == [{"auto": "swap", "swap": "swap", "reference": "reference"}[strategy]] * 2


def set_fuse_live(rank, fuse: bool) -> None:
    rank.pi_old.source.fuse_live = fuse


def local_grads(rank) -> dict[str, torch.Tensor]:
    from dppo.workers.actor.fsdp import local_tensor

    return {name: local_tensor(p.grad).clone() for name, p in rank.model.named_parameters()}


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_world_size_2_takes_live_pi_old_from_the_training_forward_as_a_separate_pass_would(ws2, groups, mode):
    """Trigger 0 from the same weights (slot 2), once from the training forward and once with the separate no-grad
    pass: every rank's gradient shards and the whole mini-batch's metrics agree (the optimizer state does not
    enter the gradients), and verify_old_log_prob finds the training forward's log-probs exact."""
    reconfigure(
        ws2,
        **{
            "actor.loss_agg_mode": mode,
            "algorithm.rollout_correction.rollout_rs": "token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold": 1.02,
        },
    )
    batch = collate(groups[:3], ws2.source.pad_token)  # 9 sequences: 5 + 4 and one padding row
    advantages = ws2.advantages(batch.scores, batch.group_index, batch.response_mask)
    ws2.actor_group.save_model_to_cpu(2)
    results = {}
    for fuse in (True, False):
        ws2.actor_group.restore_model_from_cpu(2)
        ws2.actor_group.execute(set_fuse_live, fuse)
        metrics = ws2.actor_group.update_actor(0, batch, advantages, ws2.version)
        results[fuse] = metrics, ws2.actor_group.execute(local_grads), ws2.actor_group.end_cycle()
    ws2.actor_group.restore_model_from_cpu(2)
    ws2.actor_group.clear_cpu_model(2)
    (fused, fused_grads, fused_check), (separate, separate_grads, separate_check) = results[True], results[False]
    assert 0 < fused["rollout_corr/token_rejected_frac"] < 1  # the case under test: some tokens rejected
    for key, value in separate.items():
        if not key.startswith("timing_s/"):
            assert fused[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    for got, want in zip(fused_grads, separate_grads, strict=True):  # rank by rank
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-7)
    assert fused_check["debug/old_log_prob_max_abs_diff"] == separate_check["debug/old_log_prob_max_abs_diff"] == 0.0


def test_score_ahead_at_world_size_2_gives_exact_old_log_probs_and_takes_no_snapshot(ws2):
    """Every later mini-batch scored at trigger 0 (9 sequences a trigger: shards of 5 and 4 + a padding row, gathered
    and split again): the old log-probs equal the cycle-start copy's, as the slot reads' do above, and no rank
    copies any weight into a slot."""
    reconfigure(ws2, **{"trainer.parameter_sync_step": 4, "trainer.train_batch_size": 12})
    moved = lambda: ws2.actor_group.execute(lambda rank: rank.pi_old.source.moved_bytes)  # noqa: E731
    before = moved()
    triggers, records = run_cycles(ws2, 1)
    assert records[0]["debug/old_log_prob_max_abs_diff"] == 0.0 and records[0]["snapshot/scored_ahead_frac"] == 1.0
    assert all(t["actor/grad_norm"] > 0 for t in triggers)  # the live weights moved between the triggers
    assert moved() == before == [0, 0]


def test_a_partial_score_ahead_at_world_size_2_reads_slot_0_where_it_did_not_score_and_stays_exact(ws2, groups):
    """At trigger 0 one later mini-batch of three has arrived in the first cycle and two in the second (PartialRollout,
    by count): every rank takes its snapshot in both cycles, the triggers not scored ahead read slot 0 on every
    rank, and the old log-probs equal the cycle-start copy's."""
    reconfigure(ws2, **{"trainer.parameter_sync_step": 4, "trainer.train_batch_size": 12})
    ws2.actor_group.execute(lambda rank: setattr(rank, "slot_use", partial_rollout.record_slot_use(rank.pi_old.source)))
    # the module's groups from the first again (ws2's own FixedRollout has few left); 3 groups a mini-batch
    fixed, ws2.rollout = ws2.rollout, PartialRollout(FixedRollout(groups), [3, 6])
    try:
        triggers, records = run_cycles(ws2, 2)
    finally:
        partial, ws2.rollout = ws2.rollout, fixed
    assert partial.ready_calls == [True, False, True, True, False]
    assert [r["snapshot/scored_ahead_frac"] for r in records] == [1 / 3, 2 / 3]
    assert [r["debug/old_log_prob_max_abs_diff"] for r in records] == [0.0, 0.0]
    assert all(t["actor/grad_norm"] > 0 for t in triggers)  # the live weights moved between the triggers
    # on each rank: a snapshot in each cycle; slot 0 read at triggers 2 and 3 of the first, 3 of the second
    assert ws2.actor_group.execute(lambda rank: rank.slot_use) == [["save", 2, 3, "save", 3]] * 2


@pytest.mark.parametrize("reader", ["live", "view"])
def test_a_reader_that_computes_with_the_live_weights_is_caught(ws2, reader):
    """verify_old_log_prob would see a reader that reads the live weights: here one that does so on purpose, and
    the view reader (refused under FSDP2), whose functional_call FSDP2 overrides with its own gathered weights."""

    def force_reader(rank, reader):
        from dppo.workers.actor.slot_readers import SlotRead, SlotReader, ViewReader

        class LiveWeights(SlotReader):  # reads the live weights where slot 0 should be
            name = "live"

            def read(self, batch):
                return SlotRead(self.source.score(self.source.model, batch), 0.0, 0)

        source = rank.pi_old.source
        cls = ViewReader if reader == "view" else LiveWeights
        source._auto, source._reader = False, cls(source)

    reconfigure(ws2, **{"trainer.parameter_sync_step": 4, "trainer.train_batch_size": 8, "snapshot.score_ahead": False})
    ws2.actor_group.execute(force_reader, reader)
    _, records = run_cycles(ws2, 1)
    assert records[0]["debug/old_log_prob_max_abs_diff"] > 1e-4


def test_snapshot_calls_reach_every_rank_and_each_holds_its_own_shard(ws2):
    reconfigure(ws2)  # back to auto
    model_bytes = sum(t.nbytes for t in full_weights(ws2).values())
    before = full_weights(ws2)
    ws2.actor_group.save_model_to_cpu(1)
    memory = ws2.actor_group.snapshot_memory()
    assert sum(m["nbytes"] for m in memory) == model_bytes  # the shards partition the model
    for m in memory:  # host bytes per rank: model bytes / 2 (dim-0 shards; one row of padding at most)
        assert abs(m["nbytes"] - model_bytes / 2) <= 0.01 * model_bytes, (m, model_bytes)
        assert m["host_bytes"] >= m["nbytes"] and m["device_bytes"] == 0
    run_cycles(ws2, 1)
    moved = full_weights(ws2)
    assert any(not torch.equal(moved[k], v) for k, v in before.items())
    ws2.actor_group.restore_model_from_cpu(1)
    for name, value in full_weights(ws2).items():
        assert torch.equal(value, before[name]), name
    ws2.actor_group.clear_cpu_model(1)
    assert ws2.actor_group.execute(lambda rank: 1 in rank.pool) == [False, False]


def test_a_world_size_2_checkpoint_resumes_at_world_size_2_and_1_and_both_go_on_alike(ws2, groups):
    path = ws2.save_checkpoint()
    assert path.name == f"step_{ws2.global_step:08d}"
    manifest = ws2.checkpoints.store.trusted(path)
    shards = sorted(name for name in manifest["files"] if name.endswith(".distcp"))
    assert shards == ["actor/__0_0.distcp", "actor/__1_0.distcp"]  # each rank wrote its own
    saved, step = full_weights(ws2), ws2.global_step
    saved_optimizer = ws2.actor_group.execute(full_optimizer_state)[0]

    # 1: a fresh in-process trainer resumes the world-size-2 checkpoint (DCP reshards it)
    ws1 = PPOTrainer(
        make_cfg(Path(ws2.cfg.trainer.output_dir), 1, **{"trainer.resume": True}), rollout=FixedRollout(groups)
    )
    assert ws1.resumed_from == path and ws1.global_step == step
    rank = ws1.actor_group.local_rank
    for name, value in rank.model.state_dict().items():
        assert torch.equal(value, saved[name]), name
    optimizer = full_optimizer_state(rank)
    assert optimizer["param_groups"] == saved_optimizer["param_groups"]
    for name, state in saved_optimizer["state"].items():
        for key, value in state.items():
            assert torch.equal(optimizer["state"][name][key], value), (name, key)

    # 2: the world-size-2 ranks, moved on, resume it again
    run_cycles(ws2, 1)
    point = find_resume_point(ws2.cfg.trainer)
    assert point[0] == path
    ws2.resume(point)
    assert ws2.global_step == step
    for name, value in full_weights(ws2).items():
        assert torch.equal(value, saved[name]), name
    for name, state in ws2.actor_group.execute(full_optimizer_state)[0]["state"].items():
        for key, value in state.items():
            assert torch.equal(saved_optimizer["state"][name][key], value), (name, key)

    # From the same state, both take a cycle of bypass mode with rejection sampling, where each micro-batch finds
    # its own loss mask and the normalizers are known only once every micro-batch has run: the same update.
    bypass = {
        "algorithm.rollout_correction.bypass_mode": True,
        "algorithm.rollout_correction.rollout_rs": "token_k1",
        "algorithm.rollout_correction.rollout_rs_threshold": 2.0,
        "actor.loss_agg_mode": "seq-mean-token-mean",
        "trainer.verify_old_log_prob": False,
        "algorithm.prox_logp_method": "recompute",
    }
    ws1.rollout.taken = ws2.rollout.taken
    for trainer in (ws1, ws2):
        reconfigure(trainer, **bypass)
    one, _ = run_cycles(ws1, 1)
    two, _ = run_cycles(ws2, 1)
    assert (
        0 < one[1]["rollout_corr/token_rejected_frac"] < 1 and one[0]["actor/kl_loss"] > 0
    )  # KL to the initial weights
    for a, b in zip(one, two, strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "rollout_corr/token_rejected_frac"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    expected = ws1.actor_group.local_rank.model.state_dict()
    assert_weights_close(full_weights(ws2), expected)
    ws1.close()


@pytest.mark.parametrize("loss_mode", ["gspo", "cispo"])
def test_world_size_2_first_step_of_a_loss_mode_is_world_size_1s(ws2, groups, tmp_path, loss_mode):
    """The sequence-level loss (gspo: a sequence's ratio over its tokens) and the clipped-IS one (cispo): over the
    same weights and groups, world size 2's first step has world size 1's loss and gradient norm (1e-5). Last in
    the module: it trains ws2 on with other losses, which the tests above must not see."""
    extra = {"actor.policy_loss.loss_mode": loss_mode}
    reconfigure(ws2, **extra)
    ws2.rollout = FixedRollout(groups)  # the groups from the first again: the tests above took most of them
    ws1 = PPOTrainer(make_cfg(tmp_path, 1, **extra), rollout=FixedRollout(groups))
    ws1.actor_group.local_rank.model.load_state_dict(full_weights(ws2))  # the reference model stays the initial one
    one, _ = run_cycles(ws1, 1)
    two, _ = run_cycles(ws2, 1)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss", "actor/entropy", "actor/ppo_kl"):
        assert two[0][key] == pytest.approx(one[0][key], rel=1e-5, abs=1e-7), key
    assert one[0]["actor/pg_loss"] != 0 and one[0]["actor/grad_norm"] > 0
    ws1.close()


# auto's checks pass (sync samples are never older than pi_prox; a loose bound) every second cycle
PI_OLD_METHODS = {
    "recompute": {},
    "metrics": {},
    "loglinear": {"trainer.verify_old_log_prob": False},
    "auto": {"trainer.verify_old_log_prob": False, "algorithm.prox_check_every": 2, "algorithm.prox_max_is_err": 10.0},
}


@pytest.mark.parametrize(
    ("method", "score_ahead"),
    [
        ("recompute", False),
        ("recompute", True),
        ("metrics", False),
        ("metrics", True),
        ("loglinear", False),
        ("auto", False),
    ],
)
def test_a_mid_cycle_checkpoint_at_world_size_2_resumes_bitwise_in_every_prox_logp_method(
    ws2, groups, method, score_ahead
):
    """Issue 31 at world size 2: from a step-boundary checkpoint the ranks take two cycles (the uninterrupted run);
    resumed from it they take one and fail at the second's trigger 1, checkpoint there (pi_old's weights: the ranks'
    slot 0 shards, or the weights the rollout was given), and resumed again they finish that cycle: the cycle-start
    weights are published as its version again, and the weights and the cycle's metrics are the uninterrupted
    run's, bitwise. Score-ahead applies to recompute and metrics only (the strategies that read slot 0); sync mode
    takes a whole cycle ahead, so no snapshot is taken there. auto: cycle 0 checks, the failing cycle 1 runs
    loglinear."""
    reconfigure(
        ws2, **{"algorithm.prox_logp_method": method, "snapshot.score_ahead": score_ahead, **PI_OLD_METHODS[method]}
    )
    fixed, ws2.rollout = ws2.rollout, FixedRollout(groups)
    rollout = ws2.rollout
    try:
        boundary = ws2.save_checkpoint()
        version = ws2.version
        _, clean = run_cycles(ws2, 2)
        clean_weights, clean_published = full_weights(ws2), dict(rollout.published)
        if method == "auto":
            assert [r["prox_approx/method"] for r in clean] == [1.0, 0.0]

        ws2.resume((boundary, ckpt_state(boundary)))
        rollout.taken = 0
        # the groups consumed up to the boundary (its saved count: earlier tests of this module's trainer may have
        # consumed other than a full batch a step): the fixed rollout's group 0 is the one after them
        consumed_at_boundary = ws2.rollout_start.consumed
        train_trigger = ws2.train_trigger

        def failing(batch, prox_logp=None):
            if (ws2.global_step, ws2.local_trigger_step) == (version + 1, 1):
                raise RolloutFailedError("the replay buffer died")
            return train_trigger(batch, prox_logp)

        ws2.train_trigger = failing
        try:
            ws2.run_cycle()
            with pytest.raises(RolloutFailedError):
                ws2.run_cycle()
        finally:
            ws2.train_trigger = train_trigger
        mid = ws2.save_checkpoint()
        assert mid.name == f"step_{version + 1:08d}_trigger_1"
        state = ckpt_state(mid)
        slot_read = method in ("recompute", "metrics") and not score_ahead
        assert state["pi_old"]["weights"] == ("anchor" if slot_read else "file") and state["anchor"] is slot_read
        run_cycles(ws2, 2)  # the ranks (and auto's switch) move on before the resume puts them back

        ws2.resume((mid, state))
        rollout.taken = ws2.rollout_start.consumed - consumed_at_boundary
        rollout.published = []
        ws2.publish_start_weights()
        _, resumed = run_cycles(ws2, 1)
    finally:
        ws2.rollout = fixed
    first_version, first = rollout.published[0]
    assert first_version == version + 1
    cycle_start = published_state(clean_published[version + 1])
    for name, value in published_state(first).items():  # never the live weights a step on, labelled version + 1
        assert torch.equal(value, cycle_start[name]), name
    for name, value in full_weights(ws2).items():
        assert torch.equal(value, clean_weights[name]), name
    assert without_timing(resumed[0]) == without_timing(clean[1])


def ckpt_state(path: Path) -> dict:
    from dppo.checkpoint import store as ckpt
    from dppo.checkpoint.layout import TRAINER_FILE

    return ckpt.load_torch(path / TRAINER_FILE)


def without_timing(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("timing_s/")}


def adapter_bytes(rank) -> int:
    """The bytes of the rank's trainable tensors (LoRA's adapter), whole: a sharded rank's local shards summed over
    the ranks by the caller."""
    from dppo.workers.actor.fsdp import local_tensor

    return sum(local_tensor(p).numel() * p.element_size() for p in rank.model.parameters() if p.requires_grad)


def test_lora_at_world_size_2_updates_as_world_size_1_and_snapshots_the_adapter_alone(cluster, groups, tmp_path):
    """model.lora_rank at world size 2 (FSDP2 over a frozen base and its adapters): the same metrics, exact old
    log-probs (the verifier's reference a plain copy with the adapters injected), the same adapter and merged
    weights as world size 1, and pi_old's slot the adapter's bytes (its shards summed over the ranks)."""
    lora = {"model.lora_rank": 4, "model.lora_alpha": 8, "actor.lr": 0.05}
    ws1 = PPOTrainer(make_cfg(tmp_path / "ws1", 1, **lora), rollout=FixedRollout(groups))
    ws2 = PPOTrainer(make_cfg(tmp_path / "ws2", 2, **lora), rollout=FixedRollout(groups))
    try:
        one, one_records = run_cycles(ws1, 2)
        two, two_records = run_cycles(ws2, 2)
        whole = adapter_bytes(ws1.actor_group.local_rank)
        shards = ws2.actor_group.execute(adapter_bytes)
        assert sum(shards) == whole and all(0 < s < whole for s in shards)  # each rank holds a part
        assert whole == 4 * 4 * 2 * (4 * (32 + 32) + 3 * (32 + 64))  # fp32, r (in + out) per linear of 2 layers
        for trigger in (*one, *two):
            assert trigger["snapshot/bytes"] == whole
        assert [r["debug/old_log_prob_max_abs_diff"] for r in one_records + two_records] == [0.0] * 4
        for a, b in zip(one, two, strict=True):
            for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy"):
                assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
        assert one[-1]["actor/kl_loss"] > 0  # the adapters moved the policy off the reference
        published_one = ws1.actor_group.rollout_weights()
        published_two = ray.get(ws2.actor_group.rollout_weights()[0])
        assert published_two.adapter.keys() == published_one.adapter.keys()
        assert_weights_close(published_two.adapter, published_one.adapter)
        assert_weights_close(published_two.state_dict(), published_one.state_dict())
    finally:
        ws1.close()
        ws2.close()
