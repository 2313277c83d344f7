"""The config schema's model.*, task.*, data.* and custom_reward_function.*: the policy model and where the prompts,
rewards and held-out problems come from. One dataclass per section, a docstring per field, each section's own rules
in its __post_init__ (dppo.config.schema assembles the whole config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from dppo.config.checks import (
    check_numbers,
    nonnegative,
    one_of,
    positive,
    require,
)
from dppo.config.choices import (
    DTYPES,
    PROMPT_SOURCES,
    prompt_source_kind,
)
from dppo.data.text import TRUNCATIONS
from dppo.tasks import TASKS


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """Local directory of any transformers causal LM; null builds the tiny Qwen2-style model below."""

    hidden_size: int = 64
    """Tiny model: hidden size."""

    num_hidden_layers: int = 2
    """Tiny model: transformer layers."""

    num_attention_heads: int = 4
    """Tiny model: attention heads (also the key/value heads)."""

    intermediate_size: int = 128
    """Tiny model: MLP width."""

    dtype: str = "float32"
    """Parameter dtype of the trainer and the rollout workers."""

    lora_rank: int = 0
    """LoRA's rank r (verl's key; needs the lora extra, peft): the base frozen, low-rank adapters trained, pi_old's
    snapshots, the optimizer state and each weight sync the adapter's alone. 0: LoRA off, the whole model trained."""

    lora_alpha: float = 16
    """LoRA's alpha: the adapter's product is scaled by lora_alpha / lora_rank."""

    target_modules: Any = "all-linear"
    """The modules that get adapters: all-linear (every linear layer but the LM head), or a list of module names
    (e.g. [q_proj, v_proj]); a name that matches no module of the model is an error naming it."""

    lora_dropout: float = 0.0
    """Dropout on the adapter's input; only 0: dppo scores every log-prob in eval mode (dropout off), so that old and
    new log-probs are deterministic functions of the weights."""

    def __post_init__(self) -> None:
        check_numbers(self, "model")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            positive(f"model.{key}", getattr(self, key))
        require(
            self.hidden_size % self.num_attention_heads == 0,
            "model.hidden_size",
            self.hidden_size,
            f"a multiple of model.num_attention_heads={self.num_attention_heads}",
        )
        one_of("model.dtype", self.dtype, DTYPES)
        nonnegative("model.lora_rank", self.lora_rank)
        if self.lora_rank:
            positive("model.lora_alpha", self.lora_alpha)
            require(
                self.target_modules == "all-linear"
                or (
                    isinstance(self.target_modules, (list, tuple))
                    and len(self.target_modules) > 0
                    and all(isinstance(t, str) and t for t in self.target_modules)
                ),
                "model.target_modules",
                self.target_modules,
                "all-linear or a non-empty list of module names",
            )
            require(
                self.lora_dropout == 0,
                "model.lora_dropout",
                self.lora_dropout,
                "0 (dppo scores log-probs in eval mode, dropout off: a nonzero dropout would never be applied)",
            )
        if self.path is not None:
            require(isinstance(self.path, str) and self.path, "model.path", self.path, "a local model directory")


@dataclass
class TaskConfig:
    name: str = "copy"
    """Task: copy, reverse, sort, one added with dppo.tasks.register_task, or module:function returning a Task."""

    length: int = 5
    """Digits per prompt."""

    def __post_init__(self) -> None:
        check_numbers(self, "task")
        # a name of the registry, or the form of a factory's path: the factory is imported before the run starts
        # (dppo.launch.preflight.check_prompt_source), not by the config
        require(
            self.name in TASKS or ":" in self.name,
            "task.name",
            self.name,
            "a registered task (" + ", ".join(TASKS) + ") or an importable module:function",
        )
        positive("task.length", self.length)


def _check_data_files(key: str, files: object) -> None:
    """files: null, one path, or a non-empty list of paths (that they exist is dppo.launch.machine's to check)."""
    if files is None:
        return
    paths = [files] if isinstance(files, str) else files
    require(
        isinstance(paths, (list, tuple)) and len(paths) > 0 and all(isinstance(p, str) and p for p in paths),
        key,
        files,
        "a parquet file path or a non-empty list of them",
    )


@dataclass
class ReasoningGymSection:
    """data.reasoning_gym: problems of a reasoning-gym dataset (data.source=reasoning_gym; the extra dppo[tasks])."""

    dataset: Optional[str] = None
    """The dataset's name in reasoning-gym (106 in 0.1.25): e.g. basic_arithmetic, chain_sum, gsm_symbolic,
    countdown. Its verifier (score_answer) is the reward."""

    config: Dict[str, Any] = field(default_factory=dict)
    """Settings of the dataset's config, passed to reasoning_gym.create_dataset (e.g. basic_arithmetic's min_terms,
    max_digits, operators): a mapping in a --config file, or data.reasoning_gym.config.KEY=VALUE each. seed and
    size are this section's own keys."""

    val_config: Optional[Dict[str, Any]] = None
    """Settings of the held-out problems that differ from config's (config's, these on top); null: config's. For
    a curriculum, training on another mix of the task than the one evaluated: basic_arithmetic with config's
    operators ["+", "-", "-"] (reasoning-gym draws an operator from the list: two subtractions in three) and
    val_config's operators ["+", "-"]. A held-out row's score_answer comes from a dataset of its own settings."""

    size: int = 1000
    """Training problems: items 0..size-1 of the dataset at seed, generated and tokenized once on the driver before
    anything starts (about 0.1 ms each for basic_arithmetic, 14 ms for countdown on a 2-core CPU); a run takes
    them epoch after epoch (data.shuffle). One that is also a held-out problem is left out."""

    seed: Optional[int] = None
    """Seed of the training problems (reasoning-gym draws item i from seed + i); null: trainer.seed."""

    val_size: int = 100
    """Held-out problems of the greedy evaluation (val/score/<dataset>, at the end and every trainer.test_freq
    steps); 0: none."""

    val_seed: Optional[int] = None
    """Seed of the held-out problems; null: seed + size (the seeds right after the training ones). Its items
    val_seed..val_seed + val_size - 1 must not overlap the training ones' seed..seed + size - 1."""

    prompt_suffix: str = ""
    """Text put after each question (after a space) in the user message, e.g. "Give only the final answer.";
    empty: the question as the dataset writes it. Empty by default because many datasets' questions already say
    how to answer (countdown, gsm_symbolic) and what a model needs to hear is the model's own, so a run sets it."""

    def resolved_seeds(self, trainer_seed: int) -> tuple[int, int]:
        """(seed, val_seed) with their nulls resolved."""
        seed = trainer_seed if self.seed is None else self.seed
        return seed, seed + self.size if self.val_seed is None else self.val_seed

    @property
    def held_out_config(self) -> Dict[str, Any]:
        """The settings of the held-out problems: config's with val_config's on top."""
        return {**self.config, **(self.val_config or {})}

    def __post_init__(self) -> None:
        check_numbers(self, "data.reasoning_gym")
        if self.dataset is not None:
            require(
                isinstance(self.dataset, str) and bool(self.dataset),
                "data.reasoning_gym.dataset",
                self.dataset,
                "a reasoning-gym dataset name",
            )
        require(isinstance(self.config, dict), "data.reasoning_gym.config", self.config, "a mapping of settings")
        if self.val_config is not None:
            require(
                isinstance(self.val_config, dict), "data.reasoning_gym.val_config", self.val_config, "a mapping or null"
            )
        positive("data.reasoning_gym.size", self.size)
        nonnegative("data.reasoning_gym.val_size", self.val_size)
        for key in ("seed", "val_seed"):
            value = getattr(self, key)
            if value is not None:
                require(0 <= value < 2**63, f"data.reasoning_gym.{key}", value, "an integer >= 0, or null")


@dataclass
class DataConfig:
    source: Optional[str] = None
    """Where the prompts come from: task (task.name, the integer tasks), parquet (data.train_files: verl-format
    text data), or reasoning_gym (data.reasoning_gym: generated problems and their verifier). null: parquet when
    data.train_files is set, else task, so that setting data.train_files alone switches to text as in verl."""

    reasoning_gym: ReasoningGymSection = field(default_factory=ReasoningGymSection)

    train_files: Any = None
    """Parquet file(s) of training prompts in verl's format (columns prompt, data_source,
    reward_model.ground_truth, optional extra_info): one path or a list. Set: train on text with the tokenizer
    and chat template of model.path; null: train on task.name."""

    val_files: Any = None
    """Parquet file(s) of the greedy evaluation (val/score/<data_source>) at the end and every trainer.test_freq
    steps; null: no evaluation."""

    prompt_key: str = "prompt"
    """Column holding each row's chat messages, a list of {role, content}."""

    max_prompt_length: int = 512
    """Longest prompt in tokens, counted after the chat template (see data.truncation)."""

    max_response_length: int = 512
    """Response tokens to generate at most (rollout.max_new_tokens overrides it when set); a response also ends
    at the tokenizer's EOS token."""

    truncation: str = "error"
    """A prompt longer than max_prompt_length: error (stop before training, naming the row and its length), left
    (keep its last tokens) or right (keep its first tokens)."""

    shuffle: bool = True
    """Shuffle the training rows anew every epoch (false: file order)."""

    seed: Optional[int] = None
    """Seed of the shuffling; null: trainer.seed."""

    @property
    def kind(self) -> str:
        """data.source with its null resolved: task, parquet or reasoning_gym."""
        return prompt_source_kind(self.source, self.train_files)

    def __post_init__(self) -> None:
        if self.source is not None:
            one_of("data.source", self.source, PROMPT_SOURCES)
        _check_data_files("data.train_files", self.train_files)
        _check_data_files("data.val_files", self.val_files)
        require(bool(self.prompt_key), "data.prompt_key", self.prompt_key, "a column name")
        positive("data.max_prompt_length", self.max_prompt_length)
        positive("data.max_response_length", self.max_response_length)
        one_of("data.truncation", self.truncation, TRUNCATIONS)
        if self.seed is not None:
            require(0 <= self.seed < 2**64, "data.seed", self.seed, "an integer in [0, 2**64) or null")


@dataclass
class CustomRewardFunctionConfig:
    path: Optional[str] = None
    """Python file defining the reward function of text data, verl's signature: compute_score(data_source,
    solution_str, ground_truth, extra_info=None) -> a float, or a dict with "score" (its other numeric entries
    are logged as reward/extra/<key> means); null: the built-in GSM8K-style reward (the last number of the
    response against the answer after '####' in ground_truth)."""

    name: str = "compute_score"
    """The function's name in path."""

    timeout_s: Optional[float] = 60.0
    """How long one call may take; past it the run stops as if the function had raised (one line naming the
    function, the data source and the row; on a Ray worker, after a checkpoint). null: no limit."""

    def __post_init__(self) -> None:
        require(self.name.isidentifier(), "custom_reward_function.name", self.name, "a Python function name")
        if self.timeout_s is not None:
            require(
                0 < self.timeout_s < float("inf"),
                "custom_reward_function.timeout_s",
                self.timeout_s,
                "a finite number of seconds > 0, or null (no limit)",
            )
