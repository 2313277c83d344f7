"""Where the trainer's groups come from: one interface (source.RolloutSource), three sources, one factory.

    source.py        RolloutSource: what the trainer and the launch call, with each method's contract
    ray_source.py    RayRollout: rollout workers and the replay buffer as Ray actors (async or lockstep)
    local_source.py  LocalRollout: worker processes beside the trainer, the buffer in its process (no Ray)
    in_process.py    InProcessRollout: trainer.mode=sync without Ray, generated in the trainer's process
    scheduled.py     ScheduledRollout: `dppo replay`'s, a run's schedule (dppo.trainer.schedule) followed take by take
    supervised.py    what RayRollout and LocalRollout share: the worker records, their checks and restarts,
                     the fetch that waits while it watches the workers
    common.py        RolloutFailedError, RolloutSettings, the replay buffer's start, groups_of, cloned_state
    settings.py      what the workers and engines get of the config, read once here: RolloutWorkerSettings and
                     EngineSettings (they never see the config)

make_rollout picks the source a config asks for.
"""

from __future__ import annotations

from dppo.trainer.state import RolloutStart
from dppo.config import DppoConfig
from dppo.data.source import PromptSource
from dppo.trainer.rollout.common import RolloutFailedError
from dppo.trainer.rollout.in_process import InProcessRollout
from dppo.trainer.rollout.local_source import LocalRollout
from dppo.trainer.rollout.ray_source import RayRollout
from dppo.trainer.rollout.source import RolloutSource

__all__ = ["InProcessRollout", "LocalRollout", "RayRollout", "RolloutFailedError", "RolloutSource", "make_rollout"]


def make_rollout(
    cfg: DppoConfig, source: PromptSource, model_config, start: RolloutStart | None = None, early: bool = False
) -> RolloutSource:
    """The rollout source cfg asks for (cfg.use_ray, trainer.mode); source is the trainer's PromptSource,
    model_config the policy's HF config, start where it picks up (a fresh run's start by default); early: made
    before the actor's rank was built (local workers may then be forked)."""
    start = start or RolloutStart()
    if cfg.use_ray:
        return RayRollout(cfg, source, model_config, start)
    if cfg.trainer.mode == "separate_async":
        return LocalRollout(cfg, source, model_config, start, fork=early)
    return InProcessRollout(cfg, source, model_config, start)
