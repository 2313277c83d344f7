"""adv_estimator=remax: the rollout decodes one greedy response per prompt, scores it, and the group carries that
score as its baseline (not trained on) through collate to the advantages."""

import math

import pytest
import torch

from dppo.algo import get_advantage_estimator
from dppo.config import load_config
from dppo.data import make_prompt_source
from dppo.data.source import Prompts
from dppo.generation import sample_responses
from dppo.models import build_model
from dppo.batch import collate, left_pad
from dppo.trainer.rollout.settings import worker_settings
from dppo.workers.rollout.worker import RolloutGenerator

TINY = [
    "task.length=3",
    "rollout.n=3",
    "model.hidden_size=32",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.intermediate_size=64",
]


def generator_for(*overrides):
    cfg = load_config([*TINY, *overrides])
    source = make_prompt_source(cfg)
    model = build_model(cfg.model, source.vocab_size, seed=cfg.trainer.seed)
    gen = RolloutGenerator(worker_settings(cfg, source, model.config), source, model.config, 0)
    gen.load_weights(model.state_dict(), 0)
    gen.seed_ticket(0)
    return gen, source, model


def test_remax_groups_carry_the_greedy_responses_score():
    gen, source, model = generator_for("algorithm.adv_estimator=remax")
    groups = gen.generate(4)
    # the same prompts decoded greedily by hand, scored by the task
    prompts = [g.prompt for g in groups]
    ids, _ = left_pad([p.numpy() for p in prompts], source.pad_token)
    responses, mask = sample_responses(
        model, ids, gen.engine.max_new_tokens, 0.0, None, source.eos_token, source.pad_token
    )
    task_prompts = Prompts(ids.numpy())  # an integer task's prompts: token ids, no meta
    expected = [float(s) for s in source.score(task_prompts, responses.numpy(), mask.numpy()).scores]
    assert [g.baseline_score for g in groups] == pytest.approx(expected)
    batch = collate(groups, source.pad_token)
    assert torch.equal(batch.reward_baselines, torch.tensor(expected).repeat_interleave(3))
    assert torch.equal(batch[3:7].reward_baselines, batch.reward_baselines[3:7])
    adv = get_advantage_estimator("remax")(
        batch.scores, batch.group_index, batch.response_mask, reward_baselines=batch.reward_baselines
    )
    row = 4
    valid = batch.response_mask[row]
    assert torch.allclose(adv[row][valid], batch.scores[row] - batch.reward_baselines[row])


def test_other_estimators_generate_no_baseline():
    gen, source, _ = generator_for()
    groups = gen.generate(2)
    assert all(math.isnan(g.baseline_score) for g in groups)
    assert collate(groups, source.pad_token).reward_baselines is None


def test_under_partial_rollouts_the_baseline_is_decoded_with_the_groups_start_weights():
    """rollout.partial_rollout: the samples load newer weights at their first decode chunk; the greedy baseline is the
    start version's (decoded before them), and the samples are those of an estimator without a baseline."""
    partial = ("rollout.partial_rollout=true", "rollout.partial_chunk=1")
    newer = build_model(load_config(TINY).model, make_prompt_source(load_config(TINY)).vocab_size, seed=7)

    def generate(estimator: str):
        gen, source, model = generator_for(f"algorithm.adv_estimator={estimator}", *partial)
        greedy, decoded_at = gen.engine.greedy, []

        def recording_greedy(prompts):
            decoded_at.append(gen.version)
            return greedy(prompts)

        gen.engine.greedy = recording_greedy
        swapped = []

        def refresh():  # newer weights (version 1) at the first poll, as a trainer publishing mid-ticket
            if swapped:
                return None
            swapped.append(True)
            return lambda: (gen.load_weights(newer.state_dict(), 1), 1)[1]

        return gen.generate(4, refresh), decoded_at, source, model, gen.engine.max_new_tokens

    groups, decoded_at, source, model, max_new_tokens = generate("remax")
    assert decoded_at == [0]  # once, under the start weights
    assert all(g.version == 0 for g in groups) and any(g.token_versions is not None for g in groups)  # a swap happened
    ids, _ = left_pad([g.prompt.numpy() for g in groups], source.pad_token)
    responses, mask = sample_responses(model, ids, max_new_tokens, 0.0, None, source.eos_token, source.pad_token)
    expected = source.score(Prompts(ids.numpy()), responses.numpy(), mask.numpy()).scores.astype(float).tolist()
    assert [g.baseline_score for g in groups] == expected  # the start weights' greedy responses, scored
    plain, *_ = generate("grpo")
    for a, b in zip(groups, plain):
        assert torch.equal(a.responses, b.responses) and torch.equal(a.behav_logp, b.behav_logp)
