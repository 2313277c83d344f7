"""A rollout worker on a GPU (rollout.n_gpus_per_node, docs/rollout_placement.md): the model copy and the sampling
loop on the GPU, the published host weights copied onto it, the groups back on the host; and on Ray, a worker of
the rollout's pool is handed its GPU and generates there. Their behavior log-probs match a host re-score of the same
tokens with the same weights (fp32)."""

from __future__ import annotations

import pytest
import torch
from tiny_run import small_overrides  # tests/tiny_run.py (tests/conftest.py puts tests/ on sys.path)

from dppo.config import load_config
from dppo.data import make_prompt_source
from dppo.models import model_from_config, response_log_probs, tiny_model_config

pytestmark = pytest.mark.cuda

TOLERANCE = 1e-4  # fp32 on the GPU against fp32 on the host, the same weights and tokens


def host_weights(vocab_size: int):
    """A tiny model's config and its (randomly initialised) weights on the host, as a publish carries them."""
    config = tiny_model_config(vocab_size, 32, 1, 2, 64)
    torch.manual_seed(0)
    model = model_from_config(config, "float32")
    torch.nn.init.normal_(model.get_input_embeddings().weight, std=0.5)  # sharper than the init: varied tokens
    return config, {name: t.detach().clone() for name, t in model.state_dict().items()}


def check_groups(groups, config, weights, temperature: float) -> None:
    """Every group on the host; its behavior log-probs those of a host forward pass of the same tokens."""
    scorer = model_from_config(config, "float32").requires_grad_(False)
    scorer.load_state_dict(weights)
    for group in groups:
        for t in (group.prompt, group.responses, group.response_mask, group.behav_logp):
            assert t.device.type == "cpu", t.device
        ids = torch.cat([group.prompt.expand(group.size, -1), group.responses], 1)  # (n, P + R)
        want = response_log_probs(scorer, ids, group.responses.shape[1], temperature, 64)  # (n, R)
        mask = group.response_mask.bool()
        diff = (want - group.behav_logp).abs()[mask].max().item()
        assert diff <= TOLERANCE, diff


def test_a_gpu_generator_loads_host_weights_and_returns_its_groups_on_the_host(tmp_path):
    from dppo.trainer.rollout.settings import worker_settings
    from dppo.workers.rollout.worker import RolloutGenerator

    cfg = load_config(small_overrides(tmp_path))
    source = make_prompt_source(cfg)
    config, weights = host_weights(source.vocab_size)
    generator = RolloutGenerator(worker_settings(cfg, source, config), source, config, 0, torch.device("cuda", 0))
    generator.load_weights(weights, 0)
    for name, t in generator.engine.model.state_dict().items():
        assert t.device.type == "cuda" and torch.equal(t.cpu(), weights[name]), name
    generator.seed_ticket(0)
    groups = generator.generate(3)
    assert len(groups) == 3
    check_groups(groups, config, weights, cfg.rollout.temperature)


def test_a_worker_of_the_rollout_pool_generates_on_its_gpu(tmp_path):
    ray = pytest.importorskip("ray")
    from dppo.trainer.state import RolloutStart
    from dppo.trainer.rollout import RayRollout

    overrides = small_overrides(
        tmp_path,
        **{"ray.enabled": True, "trainer.device": "cpu", "rollout.num_workers": 1, "rollout.n_gpus_per_node": 1},
    )
    cfg = load_config(overrides)  # sync mode: the trainer asks for each trigger's groups
    source = make_prompt_source(cfg)
    config, weights = host_weights(source.vocab_size)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING")
    rollout = None
    try:
        rollout = RayRollout(cfg, source, config, RolloutStart())
        worker = rollout.workers[0].actor
        gpu_ids, device = ray.get(
            worker.__ray_call__.remote(
                lambda self: (ray.get_gpu_ids(), str(next(self.core.engine.model.parameters()).device))
            ),
            timeout=120,
        )
        assert len(gpu_ids) == 1 and device == "cuda:0", (gpu_ids, device)
        rollout.publish(weights, 0)
        groups, dropped = rollout.fetch(2, 0)
        assert len(groups) == 2 and dropped == 0
        check_groups(groups, config, weights, cfg.rollout.temperature)
    finally:
        if rollout is not None:
            rollout.close()
        ray.shutdown()
