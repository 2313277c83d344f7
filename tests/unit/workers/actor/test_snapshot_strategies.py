"""snapshot.strategy: which reader auto picks for a device and a slot tier, what each strategy copies, the
trigger-0 save overlapping the forward pass (fenced before the first optimizer step), and the fallbacks."""

from __future__ import annotations

import functools
import time

import pytest
import torch

import dppo.snapshot
from dppo.batch import TrainBatch
from dppo.trainer.ppo import PPOTrainer
from dppo.workers.actor.pi_old_sources import ReferenceSource, SlotSource
from dppo.workers.actor.slot_readers import choose_reader


@pytest.mark.parametrize("device, tier, streamable, expected", [
    ("cpu", "host", True, "view"),       # CPU weights: the host slot feeds the model in place
    ("cpu", "host", False, "view"),
    ("cuda", "device", True, "view"),    # the slot fits snapshot.device_budget_bytes: zero transfers
    ("cuda", "device", False, "view"),
    ("cuda", "host", True, "stream"),    # host slot, CUDA weights: stream it layer by layer
    ("cuda", "host", False, "swap"),     # ... unless the model's forward pass cannot be split into blocks
])  # fmt: skip
def test_auto_picks_the_fastest_reader_that_fits(device, tier, streamable, expected):
    asked = []

    def can_stream():
        asked.append(True)
        return streamable

    assert choose_reader(device, tier, can_stream) == expected
    assert bool(asked) == (device == "cuda" and tier == "host")  # tracing is paid for only when it decides


def strategy_cfg(small_cfg, ps=4, **extra):
    # snapshot.score_ahead=false: the readers of slot 0 are under test, which sync mode's score-ahead would not use
    return small_cfg(
        **{
            "trainer.parameter_sync_step": ps,
            "trainer.train_batch_size": 2 * ps,
            "trainer.total_steps": 1,
            "actor.lr": 0.05,
            "snapshot.score_ahead": False,
            **extra,
        }
    )


def read_embedding_outside_its_block(model):
    """Make the model's forward pass read the embedding weight before any block runs (so it cannot stream)."""

    def hook(module, args):
        module.model.embed_tokens.weight.sum()

    model.register_forward_pre_hook(hook)


class _FakeTierPool:
    """A real pool whose tier(0) answers what a CUDA pool with a given device budget would."""

    def __init__(self, pool, tier):
        self._pool, self._tier = pool, tier

    def tier(self, slot):
        return self._tier

    def __contains__(self, slot):
        return slot in self._pool

    def __getattr__(self, name):
        return getattr(self._pool, name)


@pytest.mark.parametrize(
    "tier, model_streamable, expected", [("device", True, "view"), ("host", True, "stream"), ("host", False, "swap")]
)
def test_auto_on_a_cuda_like_strategy_picks_by_tier_and_model(small_cfg, monkeypatch, tier, model_streamable, expected):
    monkeypatch.setattr(SlotSource, "device_type", property(lambda self: "cuda"))
    trainer = PPOTrainer(strategy_cfg(small_cfg))
    source = trainer.actor_group.local_rank.pi_old.source
    source._pool = _FakeTierPool(source.pool, tier)
    if not model_streamable:  # a parent reads a block's weight directly: no block order exists
        read_embedding_outside_its_block(trainer.actor_group.local_rank.model)
    trainer.fit()
    assert source.reader_name == expected
    streamed = source.stream is not None and source.stream.passes == 6  # 3 triggers x 2 micro-batches
    assert streamed == (expected == "stream")
    if expected == "swap":
        assert "outside every block" in source.stream_error


def test_auto_chooses_again_when_slot_0_lands_in_another_tier(small_cfg, monkeypatch):
    """A device-tier slot is read in place; when a later cycle's save lands on the host, auto must not keep
    the view reader (it would raise on CUDA weights) but stream it."""
    monkeypatch.setattr(SlotSource, "device_type", property(lambda self: "cuda"))
    trainer = PPOTrainer(strategy_cfg(small_cfg, **{"trainer.total_steps": 2}))
    source = trainer.actor_group.local_rank.pi_old.source
    fake = _FakeTierPool(source.pool, "device")
    source._pool = fake
    chosen = []
    inner = source.compute

    def compute(trigger, batch):
        if trigger == 0 and chosen:  # the second cycle's save goes to the host
            fake._tier = "host"
        logp = inner(trigger, batch)
        chosen.append(source.reader_name)
        return logp

    source.compute = compute
    trainer.fit()
    assert chosen[1:4] == ["view"] * 3 and chosen[5:8] == ["stream"] * 3, chosen


def test_stream_out_of_device_memory_warns_and_swaps_with_the_same_old_log_probs(small_cfg, monkeypatch):
    from dppo._errors import SnapshotMemoryError
    from dppo.workers.actor.streaming import StreamedWeights

    trainer = PPOTrainer(
        strategy_cfg(small_cfg, **{"snapshot.strategy": "stream", "trainer.verify_old_log_prob": True})
    )
    source = trainer.actor_group.local_rank.pi_old.source
    score = source.score

    def score_without_staging_memory(module, batch, params):
        if isinstance(params, StreamedWeights):
            raise SnapshotMemoryError("staging buffers: out of device memory (injected)")
        return score(module, batch, params)

    source.score = score_without_staging_memory
    with pytest.warns(RuntimeWarning, match="out of device memory .*using 'swap'"):
        result = trainer.fit()
    assert source.reader_name == "swap"
    assert source.pool.stats()["swap"]["count"] == 2 * 3  # in and out, at triggers 1..3
    assert result.records[-1]["debug/old_log_prob_max_abs_diff"] == 0.0


def test_explicit_stream_on_a_model_that_cannot_stream_warns_and_swaps(small_cfg):
    trainer = PPOTrainer(strategy_cfg(small_cfg, **{"snapshot.strategy": "stream"}))
    rank = trainer.actor_group.local_rank
    read_embedding_outside_its_block(rank.model)
    with pytest.warns(RuntimeWarning, match="cannot be streamed .*using 'swap'"):
        trainer.fit()
    assert rank.pi_old.source.reader_name == "swap"
    assert rank.pi_old.source.pool.stats()["swap"]["count"] == 2 * 3  # in and out, at triggers 1..3


def test_view_with_a_host_slot_and_cuda_weights_is_a_clear_error(small_cfg, monkeypatch):
    monkeypatch.setattr(SlotSource, "device_type", property(lambda self: "cuda"))
    trainer = PPOTrainer(strategy_cfg(small_cfg, **{"snapshot.strategy": "view"}))
    with pytest.raises(ValueError, match=r"snapshot.strategy=view needs slot 0 where the model computes.*'cuda'"):
        trainer.fit()


@pytest.mark.parametrize("strategy, copies_per_cycle", [
    ("auto", 1),            # trigger 0's save; triggers 1..3 read the host slot in place
    ("view", 1),
    ("stream", 1),          # CPU: the streamer hands out views of the slot
    ("swap", 1 + 3 * 3),    # + per trigger k >= 1: live -> scratch, slot -> live, scratch -> live
    ("reference", 1 + 3 * 3),  # + per trigger k >= 1: save live, restore slot 0, restore live
])  # fmt: skip
def test_weight_bytes_each_strategy_moves_in_a_cycle(small_cfg, strategy, copies_per_cycle):
    trainer = PPOTrainer(strategy_cfg(small_cfg, **{"snapshot.strategy": strategy}))
    rank = trainer.actor_group.local_rank
    nbytes = sum(p.nbytes for p in rank.model.parameters())
    trainer.fit()
    assert rank.pi_old.source.moved_bytes == copies_per_cycle * nbytes
    pool = rank.pi_old.source.pool
    if pool is not None:  # the engine's own byte counts agree with the trainer's
        pool.synchronize()
        stats = pool.stats()
        engine_bytes = sum(stats[op]["bytes"] for op in ("save", "restore", "swap", "view", "stream"))
        assert engine_bytes == copies_per_cycle * nbytes


def test_trigger_0_save_overlaps_the_forward_pass_and_fences_the_first_step(small_cfg, monkeypatch):
    delay_s = 0.4  # every CPU copy task of the engine first sleeps this long
    slow_pool = functools.partial(dppo.snapshot.SnapshotPool, _copy_delay_s=delay_s)
    monkeypatch.setattr(dppo.snapshot, "SnapshotPool", slow_pool)
    trainer = PPOTrainer(strategy_cfg(small_cfg))
    rank = trainer.actor_group.local_rank
    source = rank.pi_old.source
    before = {name: p.detach().clone() for name, p in rank.model.named_parameters()}
    ids = torch.randint(0, trainer.source.vocab_size, (8, 10), generator=torch.Generator().manual_seed(0))
    batch = TrainBatch(
        ids,
        torch.ones(8, 4, dtype=torch.bool),
        torch.zeros(8, 4),
        torch.zeros(8),
        torch.arange(8),
        torch.zeros(8, dtype=torch.long),
    )
    start = time.perf_counter()
    assert source.compute(0, batch) is None  # save(0); pi_old's log-probs will be the training forward's own
    assert time.perf_counter() - start < delay_s, "the save must not block the training forward pass"
    source.compute = lambda trigger, batch: None  # the update below: trigger 0 again, without a second save
    advantages = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    rank.update_actor(0, batch, advantages, 0)  # pool.guard: the step waits for the pending save before it writes
    slot = source.pool.view(0)
    for name, value in before.items():
        assert torch.equal(slot[name], value), name
        assert not torch.equal(dict(rank.model.named_parameters())[name], value), name
    trainer.close()


def test_reference_strategy_is_only_chosen_by_name_and_ps1_takes_no_snapshot(small_cfg):
    rank = PPOTrainer(strategy_cfg(small_cfg, **{"snapshot.strategy": "reference"})).actor_group.local_rank
    assert isinstance(rank.pi_old.source, ReferenceSource)
    rank = PPOTrainer(strategy_cfg(small_cfg, ps=1, **{"snapshot.strategy": "reference"})).actor_group.local_rank
    assert rank.pi_old.source.name == "live"
    rank = PPOTrainer(strategy_cfg(small_cfg)).actor_group.local_rank
    assert isinstance(rank.pi_old.source, SlotSource) and rank.pi_old.source.reader_name == "auto"
    source = ReferenceSource(rank.model, rank.optimizer, rank.score, rank.pi_old.choice)
    with pytest.raises(RuntimeError, match="trigger 2: the reference slot 0 is empty"):
        source.compute(2, None)
