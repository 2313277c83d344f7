"""How a worker-group call reaches the ranks: the data-parallel split (equal row counts, padding that adds nothing
to any loss or normalizer), and how the ranks' metrics combine into the whole mini-batch's."""

import dataclasses

import pytest
import torch

from dppo.algo import LOSS_AGG_MODES, agg_loss, loss_normalizers
from dppo.batch import TrainBatch
from dppo.workers.actor.collectives import as_share, combine
from dppo.workers.dispatch import (
    ALL,
    DP,
    RANK0,
    collect,
    dispatch_mode,
    gather_rows,
    register,
    shard_index,
    split_args,
    split_each,
    split_rows,
)


def make_batch(num_rows: int, groups: int = 3, R: int = 4) -> TrainBatch:
    gen = torch.Generator().manual_seed(num_rows)
    mask = torch.rand(num_rows, R, generator=gen) > 0.3
    mask[:, 0] = True
    return TrainBatch(
        input_ids=torch.arange(num_rows * 7).reshape(num_rows, 7),
        response_mask=mask,
        behav_logp=-torch.rand(num_rows, R, generator=gen),
        scores=torch.rand(num_rows, generator=gen),
        group_index=torch.arange(num_rows) * groups // num_rows,
        versions=torch.arange(groups),
        attention_mask=torch.ones(num_rows, 7, dtype=torch.long),  # every field must travel with its rows
    )


@pytest.mark.parametrize("num_rows, world_size", [(9, 2), (8, 2), (7, 3), (2, 3), (5, 1)])
def test_split_rows_gives_every_rank_the_same_row_count_and_loses_or_adds_nothing(num_rows, world_size):
    batch = make_batch(num_rows)
    shards = split_rows(batch, world_size)
    assert len(shards) == world_size
    rows = {s.num_sequences for s in shards}
    assert rows == {-(-num_rows // world_size)}  # ceil: the same forward/backward passes on every rank
    real = [s.response_mask.any(-1) for s in shards]
    # the real rows, in order, are the batch's; every field travels (group fields whole)
    kept = torch.cat([s.input_ids[r] for s, r in zip(shards, real)])
    assert torch.equal(kept, batch.input_ids[batch.response_mask.any(-1)])
    for shard, index in zip(shards, shard_index(num_rows, world_size)):
        for field in dataclasses.fields(TrainBatch):
            value = getattr(shard, field.name)
            if field.name == "versions":  # per group: the shard's groups, renumbered 0.. in group_index
                assert torch.equal(value, batch.versions[batch.group_index[index].unique()])
                assert torch.equal(value[shard.group_index], batch.versions[batch.group_index[index]])
            elif value is not None:
                assert value.shape[0] == shard.num_sequences, field.name
    # padding adds no token and no sequence: the ranks' normalizers sum to the batch's
    whole = loss_normalizers(batch.response_mask)
    parts = [loss_normalizers(s.response_mask) for s in shards]
    assert sum(int(p.batch_num_tokens) for p in parts) == int(whole.batch_num_tokens)
    assert sum(int(p.global_batch_size) for p in parts) == int(whole.global_batch_size)


@pytest.mark.parametrize("mode", list(LOSS_AGG_MODES))
def test_micro_batches_of_every_rank_with_the_global_normalizers_add_up_to_the_whole_loss(mode):
    """Each rank aggregates its micro-batches with the whole mini-batch's normalizers: the sum over every rank's
    micro-batches (padding included) is the loss of the whole batch."""
    batch = make_batch(9)
    loss_mat = torch.randn(9, 4, generator=torch.Generator().manual_seed(3))
    whole = loss_normalizers(batch.response_mask)
    norm = dict(batch_num_tokens=whole.batch_num_tokens, global_batch_size=whole.global_batch_size)
    index = [torch.arange(5), torch.tensor([5, 6, 7, 8, 8])]  # split_rows' rows: rank 1 padded with its last row
    total, padding_only = 0.0, []
    for shard, rows in zip(split_rows(batch, 2), index):
        for i in range(0, shard.num_sequences, 2):
            mask = shard.response_mask[i : i + 2]
            part = agg_loss(loss_mat[rows][i : i + 2], mask, mode, **norm)
            total += part
            if not mask.any():
                padding_only.append(float(part))
    torch.testing.assert_close(total, agg_loss(loss_mat, batch.response_mask, mode), rtol=1e-6, atol=1e-7)
    assert padding_only == [0.0]  # rank 1's last micro-batch is padding only and weighs nothing


def test_split_args_splits_the_batch_and_its_row_tensors_and_repeats_the_rest():
    batch = make_batch(5)
    advantages = torch.arange(5.0)[:, None].expand(5, 4)
    per_rank = split_args((3, batch, advantages, torch.zeros(2)), 2)
    (t0, b0, a0, z0), (t1, b1, a1, z1) = per_rank
    assert t0 == t1 == 3 and torch.equal(z0, torch.zeros(2)) and z1 is z0
    assert torch.equal(a0[:, 0], torch.tensor([0.0, 1.0, 2.0])) and torch.equal(a1[:, 0], torch.tensor([3.0, 4.0, 4.0]))
    assert torch.equal(b1.input_ids[2], b1.input_ids[1]) and not b1.response_mask[2].any()
    with pytest.raises(TypeError, match="exactly one TrainBatch"):
        split_args((advantages,), 2)
    assert split_args((batch, advantages), 1) == [[batch, advantages]]  # one rank: nothing copied


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_dp_gather_returns_each_batchs_rows_in_order_and_a_row_tensor_splits_back_alike(world_size):
    """What score_ahead gathers (one row per row of each rank's shard, padding rows included) is each batch's rows
    in order; split again as update_actor's argument, every rank gets exactly the rows it computed (its shard
    of the batch being the one update_actor gets)."""
    batches = [make_batch(9), make_batch(7), make_batch(2)]
    per_rank = split_each((batches, True), world_size)
    assert all(args[1] is True for args in per_rank)
    results = [[shard.input_ids[:, :4].float() for shard in args[0]] for args in per_rank]  # a row-wise result
    gathered = gather_rows(results, [b.num_sequences for b in batches])
    for i, batch in enumerate(batches):
        assert torch.equal(gathered[i], batch.input_ids[:, :4].float())
        for rank, again in enumerate(split_args((batch, gathered[i]), world_size)):
            assert torch.equal(again[0].input_ids, per_rank[rank][0][i].input_ids)
            assert torch.equal(again[1], results[rank][i])
    with pytest.raises(TypeError, match="a list of TrainBatches as its first argument, got TrainBatch"):
        split_each((batches[0],), 2)


def test_dispatch_modes_are_registered_and_unknown_methods_name_the_registered_ones():
    class Rank:
        @register(ALL)
        def a(self): ...

        @register(DP)
        def b(self, batch): ...

        def helper(self): ...

    assert dispatch_mode(Rank, "a") == ALL and dispatch_mode(Rank, "b") == DP
    with pytest.raises(AttributeError, match=r"Rank.helper is not a worker-group method; registered: a, b"):
        dispatch_mode(Rank, "helper")
    with pytest.raises(ValueError, match="unknown dispatch mode 'most'"):
        register("most")
    assert collect(ALL, [1, 2]) == [1, 2] and collect(RANK0, [1, 2]) == 1 and collect(DP, [1, 2]) == 1


def test_rank_metrics_combine_into_the_whole_batch_ones():
    # rank 0 holds 3 of the 4 valid tokens, rank 1 the last one
    rank0 = as_share({"rollout_corr/kl_k1": 0.4, "rollout_corr/weight_max": 1.5, "actor/ratio_min": 0.9}, 0.75)
    rank1 = as_share({"rollout_corr/kl_k1": 0.8, "rollout_corr/weight_max": 2.0, "actor/ratio_min": 0.7}, 0.25)
    times = [
        {"timing_s/update_actor": 1.0, "actor/grad_norm": 3.0},
        {"timing_s/update_actor": 2.0, "actor/grad_norm": 3.0},
    ]
    out = combine([{**rank0, **times[0]}, {**rank1, **times[1]}])
    assert out["rollout_corr/kl_k1"] == pytest.approx(0.75 * 0.4 + 0.25 * 0.8)  # the mean over all 4 tokens
    assert out["rollout_corr/weight_max"] == 2.0 and out["actor/ratio_min"] == 0.7
    assert out["timing_s/update_actor"] == 2.0 and out["actor/grad_norm"] == 3.0  # the slowest rank; not summed
    assert as_share({"rollout_corr/kl_k1": 0.4}, 0.0) == {}  # a rank of padding only reports nothing
    assert combine(
        [{"debug/old_log_prob_max_abs_diff": 0.0}, {"debug/old_log_prob_max_abs_diff": 0.5}], default="max"
    ) == {"debug/old_log_prob_max_abs_diff": 0.5}
