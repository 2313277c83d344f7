"""trainer.eval_engine=rollout (the evaluation decoded by an engine of the rollout's kind and dtype), and best@n."""

import numpy as np
import pytest
import torch

from dppo.data import make_prompt_source
from dppo.data.source import Scores
from dppo.models import model_from_config
from dppo.trainer import base
from dppo.trainer.evaluation import best_of, score_policy
from dppo.trainer.ppo import PPOTrainer


def test_the_trainers_evaluation_decodes_with_the_rollouts_engine_given_each_evaluated_versions_weights(
    small_cfg, monkeypatch
):
    """rollout.dtype=bfloat16 with the hf engine: every evaluation (steps 1 and 2 by test_freq, the final one at step 3)
    is one engine built once, given the weights of the version evaluated, and its figures are those of the final
    policy rounded to bfloat16 and decoded greedily by dppo's sampler."""
    built, loads = [], []

    def make_engine(*args, **kwargs):
        engine = base_make_engine(*args, **kwargs)
        load = engine.load_weights
        engine.load_weights = lambda weights: (loads.append({k: v.clone() for k, v in weights.items()}), load(weights))[
            1
        ]
        built.append(engine)
        return engine

    base_make_engine = base.make_engine
    monkeypatch.setattr(base, "make_engine", make_engine)
    cfg = small_cfg(
        **{
            "trainer.total_steps": 3,
            "trainer.test_freq": 1,
            "trainer.eval_engine": "rollout",
            "rollout.dtype": "bfloat16",
        }
    )
    trainer = PPOTrainer(cfg)
    result = trainer.fit()
    assert len(built) == 1 and next(built[0].model.parameters()).dtype == torch.bfloat16
    assert len(loads) == 3  # versions 1, 2 (test_freq) and 3 (the final evaluation)
    assert not all(torch.equal(loads[0][k], loads[1][k]) for k in loads[0])
    final = trainer.published.model()  # the last published weights, fp32
    assert all(torch.equal(loads[-1][k], v) for k, v in final.state_dict().items())
    assert [("eval/reward" in r) for r in result.records] == [True, True, True]
    rounded = model_from_config(trainer.model_config, "bfloat16")
    rounded.load_state_dict(final.state_dict())
    expected = score_policy(rounded, trainer.source, trainer.response_length, torch.device("cpu"))
    assert result.evaluation == expected and result.records[-1]["eval/reward"] == expected["eval/reward"]
    assert trainer.published.engine.engine is None  # closed with the run


def test_a_lora_runs_evaluation_engine_loads_the_adapters_targets_merged_in_its_dtype(small_cfg, monkeypatch):
    """model.lora_rank with rollout.dtype=bfloat16: the evaluation engine loads as a rollout worker does, the whole
    merged model at the first evaluation and the adapter's targets alone after it, each merge computed in fp32 and
    rounded once to the engine's bfloat16 (never an fp32 copy of the targets); the engine then holds the final
    merged policy rounded to bfloat16, bitwise, and the final figures are that model's greedy decoding."""
    from dppo.lora import is_adapter

    built, whole, partial, held = [], [], [], []

    def make_engine(*args, **kwargs):
        engine = base_make_engine(*args, **kwargs)
        load, load_partial = engine.load_weights, engine.load_partial
        engine.load_weights = lambda weights: (whole.append(dict(weights)), load(weights))[1]
        engine.load_partial = lambda tensors, held: (partial.append(dict(tensors)), load_partial(tensors, held))[1]
        close = engine.close  # the engine's weights read as the run closes it
        engine.close = lambda: (held.append(dict(engine.model.state_dict())), close())[1]
        built.append(engine)
        return engine

    base_make_engine = base.make_engine
    monkeypatch.setattr(base, "make_engine", make_engine)
    cfg = small_cfg(
        **{
            "trainer.total_steps": 3,
            "trainer.test_freq": 1,
            "trainer.eval_engine": "rollout",
            "rollout.dtype": "bfloat16",
            "model.lora_rank": 4,
            "model.lora_alpha": 16,
            "actor.lr": 0.05,
        }
    )
    trainer = PPOTrainer(cfg)
    result = trainer.fit()
    assert len(built) == 1 and len(whole) == 1 and len(partial) == 2  # versions 1 (whole), 2 and 3 (targets)
    final = trainer.published.model().state_dict()  # the merged policy, fp32
    targets = partial[-1]
    assert targets and all(t.dtype == torch.bfloat16 for t in targets.values())
    assert all(torch.equal(t, final[name].to(torch.bfloat16)) for name, t in targets.items())
    assert set(targets) < set(final) and all(name.endswith("_proj.weight") for name in targets)
    assert all(torch.equal(held[0][name], t.to(torch.bfloat16)) for name, t in final.items())
    assert not any(is_adapter(name) for name in held[0])
    rounded = model_from_config(trainer.model_config, "bfloat16")
    rounded.load_state_dict(final)
    expected = score_policy(rounded, trainer.source, trainer.response_length, torch.device("cpu"))
    assert result.evaluation == expected


def test_a_run_that_raises_after_an_evaluation_closes_the_evaluation_engine(small_cfg, monkeypatch):
    """trainer.eval_engine=rollout: step 1's evaluation builds the engine, step 2's trigger raises; fit() re-raises
    with the engine closed (vLLM's processes and temporary directory go then, not at the process's exit), and close()
    of a trainer whose engine was built closes it too."""
    built, closed = [], []

    def make_engine(*args, **kwargs):
        engine = base_make_engine(*args, **kwargs)
        close = engine.close
        engine.close = lambda: (closed.append(engine), close())[1]
        built.append(engine)
        return engine

    base_make_engine = base.make_engine
    monkeypatch.setattr(base, "make_engine", make_engine)
    train_trigger = PPOTrainer.train_trigger

    def failing(self, batch, prox_logp=None):
        if self.global_step == 1:
            raise RuntimeError("a bug in step 2")
        return train_trigger(self, batch, prox_logp)

    monkeypatch.setattr(PPOTrainer, "train_trigger", failing)
    cfg = small_cfg(**{"trainer.total_steps": 3, "trainer.test_freq": 1, "trainer.eval_engine": "rollout"})
    trainer = PPOTrainer(cfg)
    with pytest.raises(RuntimeError, match="a bug in step 2"):
        trainer.fit()
    assert len(built) == 1 and closed == built  # step 1's evaluation built it; closed once
    assert trainer.published.engine.engine is None
    trainer.published.evaluate(trainer.response_length)  # a new engine, as a caller evaluating again would get
    assert len(built) == 2
    trainer.close()
    assert closed == built and trainer.published.engine.engine is None


def test_best_of_n_is_the_mean_over_prompts_of_each_prompts_best_response(text_cfg):
    """Rows prompt-major, n=2: the score's and each extra's best of a prompt's two responses, averaged per data
    source; an extra no response of a prompt has stays out of that prompt's average."""
    source = make_prompt_source(text_cfg())
    prompts = source.eval_prompts()[:4]
    sources = [row.data_source for row in prompts.meta]
    assert len(set(sources)) == 2
    scores = np.array([0.0, 0.5, 1.0, 0.25, 0.0, 0.0, 0.75, 0.5], dtype=np.float32)
    acc = np.array([0.0, 1.0, 1.0, 0.0, 0.0, 0.0, np.nan, np.nan], dtype=np.float32)
    metrics = best_of(source, prompts, Scores(scores, {"acc": acc}), n=2)
    best_score, best_acc = [0.5, 1.0, 0.0, 0.75], [1.0, 1.0, 0.0, None]
    expected = {}
    for name in set(sources):
        rows = [i for i, s in enumerate(sources) if s == name]
        expected[f"val/best@2/score/{name}"] = float(np.mean([best_score[i] for i in rows]))
        present = [best_acc[i] for i in rows if best_acc[i] is not None]
        if present:
            expected[f"val/best@2/acc/{name}"] = float(np.mean(present))
    assert metrics == pytest.approx(expected, abs=1e-7) and set(metrics) == set(expected)
