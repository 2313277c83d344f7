"""Short in-process text runs on the example's model and data: metrics, evaluation, EOS, and every slot reader."""

import json

import numpy as np
import pytest

from dppo.batch import collate
from dppo.trainer.ppo import PPOTrainer


def test_a_text_run_logs_rewards_extras_and_the_evaluation_per_data_source(text_cfg, monkeypatch):
    from dppo.trainer.rollout import InProcessRollout

    trainer = PPOTrainer(text_cfg(**{"trainer.total_steps": 3, "trainer.test_freq": 2}))
    eos = trainer.source.tokenizer.convert_tokens_to_ids("<|im_end|>")
    groups_seen = []
    fetch = InProcessRollout.fetch

    def recording_fetch(self, num_groups, version):
        groups, dropped = fetch(self, num_groups, version)
        groups_seen.extend(groups)
        return groups, dropped

    monkeypatch.setattr(InProcessRollout, "fetch", recording_fetch)
    result = trainer.fit()
    records = [json.loads(line) for line in result.metrics_path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    # the score and each extra of the reward function (exact_match, response_chars), per data source
    val_keys = {
        f"val/{key}/{source}"
        for key in ("score", "exact_match", "response_chars")
        for source in ("reverse_short", "reverse_long")
    }
    assert val_keys <= set(records[1]) and val_keys <= set(records[2])  # test_freq=2, and the end
    assert not val_keys & set(records[0])
    assert set(result.evaluation) == val_keys
    assert all(0.0 <= v <= 1.0 for k, v in result.evaluation.items() if "response_chars" not in k)
    assert records[2]["val/score/reverse_long"] == result.evaluation["val/score/reverse_long"]
    table = result.summary_table()
    assert "greedy val/score/reverse_short" in table and "greedy val/score/reverse_long" in table
    for r in records:
        assert 0.0 <= r["critic/score/mean"] <= 1.0
        assert 0.0 <= r["reward/extra/exact_match"] <= 1.0 and r["reward/extra/response_chars"] >= 0.0

    # Prompts differ in length (left-padded in the batch); responses end at the tokenizer's EOS, right-padded.
    assert len({g.prompt.shape[0] for g in groups_seen}) > 1
    ended = 0
    for g in groups_seen:
        for tokens, mask in zip(g.responses, g.response_mask):
            length = int(mask.sum())
            assert mask[:length].all() and (tokens[: length - 1] != eos).all()
            if length < g.responses.shape[1] or tokens[length - 1] == eos:
                assert tokens[length - 1] == eos
                ended += 1
    assert ended > 0
    batch = collate(groups_seen[:4], trainer.source.pad_token)
    assert batch.attention_mask is not None


def test_the_evaluation_averages_the_score_and_each_extra_per_data_source(text_cfg):
    """val/<key>/<data_source>: the mean over that source's rows, an extra over the rows that have it (NaN: absent)."""
    from dppo.data import make_prompt_source
    from dppo.data.source import Scores

    source = make_prompt_source(text_cfg())
    prompts = source.eval_prompts()[:6]
    sources = [row.data_source for row in prompts.meta]
    assert len(set(sources)) == 2
    scores = np.array([0.0, 0.5, 1.0, 0.25, 0.75, 1.0], dtype=np.float32)
    acc = np.array([0.0, np.nan, 1.0, 0.0, 1.0, 1.0], dtype=np.float32)
    metrics = source.eval_metrics(prompts, Scores(scores, {"acc": acc}))
    expected = {}
    for name in set(sources):
        rows = [i for i, s in enumerate(sources) if s == name]
        expected[f"val/score/{name}"] = float(scores[rows].mean())
        expected[f"val/acc/{name}"] = float(np.nanmean(acc[rows]))
    assert metrics == pytest.approx(expected, abs=1e-7) and set(metrics) == set(expected)


@pytest.mark.parametrize("reader", ["view", "swap", "stream"])
def test_every_slot_reader_gives_the_cycle_start_old_log_probs_on_padded_batches(text_cfg, reader):
    """Decoupled PPO triggers k >= 1 read slot 0 with the reader; a deep copy of the cycle-start weights scores
    the same padded batches: the largest difference over the valid tokens must be 0 (CPU, fp32)."""
    # snapshot.score_ahead=false: in sync mode score-ahead would score triggers 1..3 at trigger 0, reading no slot
    trainer = PPOTrainer(
        text_cfg(
            **{
                "trainer.parameter_sync_step": 4,
                "trainer.train_batch_size": 8,
                "trainer.total_steps": 1,
                "actor.lr": 0.05,
                "snapshot.strategy": reader,
                "trainer.verify_old_log_prob": True,
                "snapshot.score_ahead": False,
            }
        )
    )
    result = trainer.fit()
    source = trainer.actor_group.local_rank.pi_old.source  # ray.enabled=false: the one actor rank, here
    assert source.reader_name == reader
    if reader == "stream":
        assert source.stream is not None and source.stream.passes == 3 * 2  # triggers 1..3, 2 micro-batches each
    assert result.records[0]["debug/old_log_prob_max_abs_diff"] == 0.0
    assert result.records[0]["actor/ppo_kl"] != 0.0  # the live weights did move between triggers


def test_the_training_forward_masks_padding_like_the_old_log_prob_forward(text_cfg):
    """One optimizer step per cycle: the update's log-probs (with grad) on the padded batch equal the old
    log-probs scored just before, so the PPO ratio is exactly 1 (it would not be if one pass saw the padding)."""
    record = PPOTrainer(text_cfg(**{"trainer.parameter_sync_step": 1, "trainer.total_steps": 1})).fit().records[0]
    assert record["actor/ratio_max"] == pytest.approx(1.0, abs=1e-6) and record["actor/ratio_min"] == pytest.approx(
        1.0, abs=1e-6
    )
    assert record["actor/ppo_kl"] == pytest.approx(0.0, abs=1e-7)
