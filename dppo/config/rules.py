"""Rules across config sections, checked once every section has passed its own (cfg is a
dppo.config.schema.DppoConfig): each error names the keys and values involved. Pure checks of the values: nothing
here builds a dataset or a task, imports a user's module or asks the machine (dppo.launch.preflight does, before a
run starts)."""

from __future__ import annotations

from dppo.algo_names import FIXED_AGG_MODES, GREEDY_BASELINE_ESTIMATORS, LOSS_AGG_NORMALIZERS
from dppo.config.checks import ConfigError
from dppo.config.choices import FILTER_REWARD_METRICS, PRECISION_AUTO
from dppo.pi_old_names import InexactUnderShardingError, check_strategy_for_sharding


def require_resolved_precision(cfg) -> None:
    """ConfigError where actor.mixed_precision or rollout.dtype is still auto: the machine decides those before a run
    (dppo.launch.precision.resolve_precision, which `dppo train` and `dppo eval` call), and what runs (the trainer,
    the run's plan, the engines) takes the decision, never the word."""
    for key, value in (("actor.mixed_precision", cfg.actor.mixed_precision), ("rollout.dtype", cfg.rollout.dtype)):
        if value == PRECISION_AUTO:
            raise ConfigError(
                f"{key}={value!r}: expected a resolved value; auto is decided from this machine before a run "
                "(dppo train does it): cfg, line = dppo.launch.precision.resolve_precision(cfg)"
            )


def validate_combinations(cfg) -> None:
    """Cross-field rules; each error names the keys and values involved."""
    t = cfg.trainer
    if t.train_batch_size % t.parameter_sync_step:
        raise ConfigError(
            f"trainer.train_batch_size={t.train_batch_size} must be a multiple of "
            f"trainer.parameter_sync_step={t.parameter_sync_step} (each optimizer step takes an equal share)"
        )
    world_size = t.nnodes * t.n_gpus_per_node
    if world_size > 1 and not cfg.use_ray:
        raise ConfigError(
            f"trainer.nnodes={t.nnodes} x trainer.n_gpus_per_node={t.n_gpus_per_node}: a world size "
            "above 1 runs its ranks as Ray actors; ray.enabled=false runs one rank in this process"
        )
    if cfg.rollout.n_gpus_per_node and not cfg.use_ray:
        raise ConfigError(
            f"rollout.n_gpus_per_node={cfg.rollout.n_gpus_per_node} gives the rollout workers GPUs of "
            "their own as Ray actors; ray.enabled=false generates on this machine's CPU"
        )
    if world_size > 1 or cfg.actor.fsdp == "always":
        try:
            check_strategy_for_sharding(cfg.snapshot.strategy)
        except InexactUnderShardingError as err:
            raise ConfigError(
                f"{err} (the actor is sharded: world size {world_size}, actor.fsdp={cfg.actor.fsdp!r})"
            ) from None
    if cfg.actor.mixed_precision not in (None, PRECISION_AUTO) and cfg.model.dtype != "float32":
        raise ConfigError(
            f"actor.mixed_precision={cfg.actor.mixed_precision} computes in it over fp32 master weights, "
            f"but model.dtype={cfg.model.dtype}: use model.dtype=float32, or actor.mixed_precision=null "
            "to train in model.dtype throughout"
        )
    if t.verify_old_log_prob and cfg.algorithm.rollout_correction.bypass_mode:
        raise ConfigError(
            "trainer.verify_old_log_prob=true checks the recomputed old log-probs, but "
            "algorithm.rollout_correction.bypass_mode=true does not recompute them"
        )
    if cfg.model.lora_rank and cfg.rollout.weight_sync == "delta":
        raise ConfigError(
            f"model.lora_rank={cfg.model.lora_rank} with rollout.weight_sync=delta: LoRA syncs the adapter alone "
            "already (a worker merges its target modules from the base it holds and loads those); use "
            "rollout.weight_sync=full"
        )
    _check_prox_logp_method(cfg.algorithm, cfg.snapshot, t)
    _check_policy_loss(cfg.algorithm, cfg.actor)
    _check_stability_remedies(t, cfg.actor, cfg.algorithm, _prompt_source_in_words(cfg.data, cfg.task))
    _check_data_or_task(cfg.data, cfg.model, cfg.task, cfg.custom_reward_function, t)
    _check_agent(cfg.rollout.agent, cfg.data, cfg.algorithm)


def _check_agent(agent, data, a) -> None:
    """rollout.agent runs on chat rows (text data or reasoning-gym problems: their messages are what an agent gets)
    and returns the reward itself."""
    if not agent.enabled:
        return
    if data.kind == "task":
        raise ConfigError(
            f"rollout.agent.path={agent.path!r} runs an agent on chat rows, but the run's prompts are the integer "
            "task's (data.train_files is null); set data.train_files or data.source=reasoning_gym"
        )
    if a.adv_estimator in GREEDY_BASELINE_ESTIMATORS:
        raise ConfigError(
            f"algorithm.adv_estimator={a.adv_estimator!r} scores a greedy response to each prompt as its baseline, "
            f"which an agent (rollout.agent.path={agent.path!r}) does not make; use grpo, rloo or another estimator"
        )


def _check_prox_logp_method(a, snapshot, trainer) -> None:
    """algorithm.prox_logp_method=loglinear|metrics only where there is a cycle-start pi_prox to approximate, and
    loglinear only where pi_prox may come micro-batch by micro-batch and nobody expects it exact."""
    method, rc = a.prox_logp_method, a.rollout_correction
    if method == "recompute":
        return
    key = f"algorithm.prox_logp_method={method}"
    if rc.bypass_mode:
        raise ConfigError(
            f"{key} approximates pi_prox, but algorithm.rollout_correction.bypass_mode=true has none "
            "(pi_prox := pi_behav); drop one of them"
        )
    if a.prox_anchor == "current":
        raise ConfigError(
            f"{key} approximates the cycle-start pi_prox, but algorithm.prox_anchor=current makes "
            "pi_prox the live weights, whose log-probs the training forward pass gives exactly and "
            "for free; use prox_logp_method=recompute or prox_anchor=cycle_start"
        )
    if method == "auto" and snapshot.strategy == "reference":
        raise ConfigError(
            f"{key} reads slot 0 on its check cycles through a slot reader, but snapshot.strategy="
            "'reference' is verl v1's save-and-restore scheme, kept for comparison only; use "
            "snapshot.strategy=auto (or view, swap, stream), or prox_logp_method=recompute with it"
        )
    if method not in ("loglinear", "auto"):
        return
    if rc.rollout_is is not None and rc.rollout_is_batch_normalize:
        raise ConfigError(
            f"{key} derives pi_prox from each micro-batch's training forward pass, but "
            "algorithm.rollout_correction.rollout_is_batch_normalize=true needs the whole mini-batch's "
            "IS weights before the first one; use prox_logp_method=recompute or drop the normalization"
        )
    if trainer.verify_old_log_prob:
        raise ConfigError(
            f"trainer.verify_old_log_prob=true checks exact old log-probs, but {key} approximates "
            "them; use prox_logp_method=metrics to measure the approximation's error"
        )


def _check_policy_loss(a, actor) -> None:
    """Bypass mode picks its loss by rollout_correction.loss_type (verl's rule); the losses with an aggregation of
    their own (sapo, geo_mean) must divide by the same count as the entropy / KL terms where rejection sampling
    finds the loss mask per micro-batch (the update then divides all the accumulated gradients by one count)."""
    loss_mode = actor.policy_loss.loss_mode
    if a.rollout_correction.bypass_mode and loss_mode != "vanilla":
        raise ConfigError(
            f"actor.policy_loss.loss_mode={loss_mode!r} with algorithm.rollout_correction.bypass_mode=true: bypass mode "
            "takes its loss from algorithm.rollout_correction.loss_type (ppo_clip or reinforce), as verl's does; "
            "leave loss_mode=vanilla there"
        )
    pg_mode = FIXED_AGG_MODES.get(loss_mode, actor.loss_agg_mode)  # dppo.algo.loss_mode_agg_mode's rule
    other_terms = actor.entropy_coeff > 0 or actor.kl_loss_coef > 0
    if (
        a.rollout_correction.rollout_rs is not None
        and other_terms
        and LOSS_AGG_NORMALIZERS[pg_mode] != LOSS_AGG_NORMALIZERS[actor.loss_agg_mode]
    ):
        raise ConfigError(
            f"actor.policy_loss.loss_mode={loss_mode!r} aggregates with {pg_mode}, the entropy and KL terms with "
            f"actor.loss_agg_mode={actor.loss_agg_mode!r}: with rejection sampling (algorithm.rollout_correction."
            "rollout_rs) they must divide by the same count; use a seq-mean-* loss_agg_mode"
        )


def _check_stability_remedies(t, actor, a, source: tuple[str, str]) -> None:
    """The lr warmup must end within the run; the ppo_kl guard needs a ppo_kl that can be non-zero; a task's reward
    has no extra outputs for algorithm.filter_groups.metric to name."""
    optim = actor.optim
    if optim.lr_warmup_steps > t.total_steps:  # the ratio's warmup is a fraction of the run
        raise ConfigError(
            f"actor.optim.lr_warmup_steps={optim.lr_warmup_steps}: longer than the run's {t.total_steps} global "
            f"steps (trainer.total_steps; verl's unit: a global step is trainer.parameter_sync_step="
            f"{t.parameter_sync_step} optimizer steps); the lr would never reach actor.lr"
        )
    if actor.max_ppo_kl is not None and not a.rollout_correction.bypass_mode:
        why = (
            "algorithm.prox_anchor=current"
            if a.prox_anchor == "current"
            else "trainer.parameter_sync_step=1"
            if t.parameter_sync_step == 1
            else None
        )
        if why is not None:
            raise ConfigError(
                f"actor.max_ppo_kl={actor.max_ppo_kl} guards on actor/ppo_kl_k3, which {why} makes 0 "
                "at every trigger (pi_old is the live weights); the guard would never act: drop it"
            )
    fg = a.filter_groups
    kind, where = source
    if fg.enable and fg.metric not in FILTER_REWARD_METRICS and kind != "parquet":
        raise ConfigError(
            f"algorithm.filter_groups.metric={fg.metric!r}: the run trains on {where}, whose reward has no "
            f"extra outputs (only a custom_reward_function does); use {' or '.join(FILTER_REWARD_METRICS)}"
        )


def _prompt_source_in_words(data, task) -> tuple[str, str]:
    """(data.kind, the run's prompts in words) for the messages of the other checks."""
    kind = data.kind
    return kind, f"task.name={task.name!r}" if kind == "task" else f"data.source={kind}"


def _check_data_or_task(data, model, task, reward, trainer) -> None:
    """Each prompt source's own keys, and only its: text data (parquet) needs a model directory (its tokenizer);
    reasoning-gym problems a model directory, a dataset name and held-out seeds apart from the training ones. The keys
    of the other sources must stay unset. (That the dataset exists and takes its config, and that a task leaves
    prompts to train on, is dppo.launch.preflight.check_prompt_source's to find out: it builds them.)"""
    kind = data.kind
    if kind != "reasoning_gym" and data.reasoning_gym.dataset is not None:
        raise ConfigError(
            f"data.reasoning_gym.dataset={data.reasoning_gym.dataset!r} is for data.source=reasoning_gym, "
            f"but the run's prompts come from data.source={kind}; set data.source=reasoning_gym or drop it"
        )
    if kind == "parquet":
        if data.train_files is None:
            raise ConfigError("data.source=parquet needs data.train_files: verl-format parquet file(s) of prompts")
        _require_model_path(model, f"data.train_files={data.train_files!r}")
        return
    if data.train_files is not None:
        raise ConfigError(
            f"data.train_files={data.train_files!r} is for data.source=parquet, but data.source={kind}; "
            "drop one of them"
        )
    for key, value in (("data.val_files", data.val_files), ("custom_reward_function.path", reward.path)):
        if value is None:
            continue
        if kind == "task":
            raise ConfigError(
                f"{key}={value!r} is for text data, but data.train_files is null (the run trains on "
                f"task.name={task.name!r}); set data.train_files or drop {key}"
            )
        raise ConfigError(
            f"{key}={value!r} is for text data, but the run trains on data.source=reasoning_gym, whose "
            "held-out problems come from data.reasoning_gym.val_seed and whose reward is the dataset's "
            f"own verifier; drop {key}"
        )
    if kind == "reasoning_gym":
        _check_reasoning_gym(data.reasoning_gym, model, trainer.seed)


def _require_model_path(model, what: str) -> None:
    if model.path is None:
        raise ConfigError(
            f"{what} needs model.path: a local model directory holding the tokenizer (and its chat "
            "template) that turns the prompts into tokens"
        )


def _check_reasoning_gym(rg, model, trainer_seed: int) -> None:
    """A dataset name, a model directory, and held-out problems whose seeds are not the training ones'
    (reasoning-gym draws item i from seed + i)."""
    if rg.dataset is None:
        raise ConfigError(
            "data.source=reasoning_gym needs data.reasoning_gym.dataset: a reasoning-gym dataset name, "
            "e.g. basic_arithmetic, chain_sum, gsm_symbolic, countdown"
        )
    _require_model_path(model, f"data.source=reasoning_gym (dataset {rg.dataset!r})")
    seed, val_seed = rg.resolved_seeds(trainer_seed)
    if rg.val_size and val_seed < seed + rg.size and seed < val_seed + rg.val_size:
        raise ConfigError(
            f"data.reasoning_gym.val_seed={val_seed}: the held-out problems' seeds {val_seed}.."
            f"{val_seed + rg.val_size - 1} overlap the training problems' {seed}..{seed + rg.size - 1} "
            f"(data.reasoning_gym.seed={seed}, size={rg.size}; reasoning-gym draws item i from seed + i); "
            f"use a val_seed >= {seed + rg.size} or null"
        )
