"""Prompts, scorers and evaluation sets: integer tasks (the demo), verl-format parquet text data, and reasoning-gym's
generated problems with their verifiers.

See dppo.data.source for the interface the trainer and the rollout workers use.
"""

from dppo.data.errors import (
    AgentFunctionError,
    DataColumnError,
    DataError,
    DataFileError,
    DataRowError,
    MissingExtraError,
    PromptTooLongError,
    RewardFunctionError,
    TokenizerError,
    require_extra,
)
from dppo.data.rewards import RewardFunction, gsm8k_compute_score
from dppo.data.source import Prompts, PromptSource, Scores, TaskSource
from dppo.data.reasoning_gym import ReasoningGymSource
from dppo.data.text import TextSource
from dppo.data.user_code import FileFunction

__all__ = [
    "AgentFunctionError",
    "DataColumnError",
    "DataError",
    "DataFileError",
    "DataRowError",
    "MissingExtraError",
    "PromptSource",
    "PromptTooLongError",
    "Prompts",
    "ReasoningGymSource",
    "RewardFunction",
    "RewardFunctionError",
    "Scores",
    "TaskSource",
    "TextSource",
    "TokenizerError",
    "gsm8k_compute_score",
    "make_prompt_source",
]


def make_prompt_source(cfg) -> PromptSource:
    """The source data.source names (null: parquet when data.train_files is set, else task): a TextSource over the
    parquet files (reads and checks every file now), a ReasoningGymSource (generates and tokenizes its problems
    now), or the task's TaskSource."""
    kind, t = cfg.data.kind, cfg.trainer
    if kind == "task":
        return TaskSource.from_config(cfg.task, t.seed, t.eval_prompts)
    source_class = TextSource if kind == "parquet" else ReasoningGymSource
    source = source_class.from_config(cfg.data, cfg.model.path, cfg.custom_reward_function, t.seed, t.train_batch_size)
    if cfg.rollout.agent.enabled:  # the agent returns the rewards: it is what scores a row's responses
        agent = cfg.rollout.agent
        require_extra("openai", "agents", f"rollout.agent.path={agent.path!r}")
        require_extra("aiohttp", "agents", f"rollout.agent.path={agent.path!r}")
        source.agent = FileFunction(agent.path, agent.name, "rollout.agent", AgentFunctionError)
    return source
