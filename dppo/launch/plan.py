"""A run resolved once before it starts: plan_run(cfg, source) reads the config and the model's shape into a frozen
RunPlan (where the processes run, what each holds, which pi_old, the batches), and the pre-flight checks and the
memory estimate read the plan, never the config; the trainer takes the plan's pi_old choice to its ranks."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dppo.config import DppoConfig
from dppo.config.pi_old import PiOldChoice, choose_pi_old
from dppo.config.rules import require_resolved_precision
from dppo.lora import LoraSpec, apply_lora
from dppo.models import tiny_model_config
from dppo.workers.rollout.engines import EngineSpec, batch_rows, engine_spec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RunShape:
    """The model and the sequences, known without allocating anything."""

    params: int  # model parameters (a tied tensor once)
    vocab_size: int
    prompt_length: int  # P
    response_length: int  # R
    max_positions: int | None  # the model's max_position_embeddings, if it has one
    layers: int = 0  # transformer layers, hidden size, key/value width (0 where the config does not say)
    hidden: int = 0
    kv_width: int = 0
    intermediate: int = 0  # the MLP's width
    embedding_params: int = 0  # the input embeddings, and the lm_head where it is not tied to them
    adapter_params: int = 0  # LoRA's adapters (model.lora_rank > 0), beside params; 0 without LoRA
    target_params: int = 0  # the weights LoRA's adapters sit on (their base layers'), merged at each rollout load

    @property
    def trainable_params(self) -> int:
        """The parameters the optimizer steps and a pi_old snapshot holds: the adapter's with LoRA, else all."""
        return self.adapter_params or self.params


@dataclass(frozen=True)
class RunPlan:
    """Everything the checks before a run need to know of it (see the module docstring)."""

    shape: RunShape
    # where the processes run
    use_ray: bool
    local_cluster: bool  # every process on this machine: no ray.address and no RAY_ADDRESS
    mode: str  # trainer.mode
    world_size: int  # the actor's ranks
    sharded: bool  # FSDP2 (world size above 1, or actor.fsdp=always)
    trainer_on_gpu: bool
    # the model
    model_dtype: str
    mixed_precision: bool  # actor.mixed_precision set: bf16 compute over fp32 master weights
    model_keys: str  # how the config names the model, for messages
    prompt_keys: str  # how the config sets the prompts' length, for messages
    # what an actor rank holds besides the weights
    pi_old_choice: PiOldChoice  # which pi_old (its takes_snapshots: a snapshot slot); the trainer hands it to the ranks
    kl_reference: bool  # actor.kl_loss_coef > 0 or algorithm.use_kl_in_reward
    reference_in_checkpoints: bool  # actor.kl_loss_coef > 0
    # the batches
    rollout_n: int
    groups_per_batch: int
    groups_per_trigger: int
    train_batch_size: int
    micro_batch_size: int
    off_policy_threshold: int
    # the rollout workers
    num_workers: int
    num_threads: int
    rollout_gpus_per_node: int
    engine: EngineSpec  # rollout.name's
    engine_dtype: str  # rollout.dtype, else model.dtype
    weight_sync: str
    engine_rows: int  # the rows an engine batches at once (EngineSettings.rows; vLLM's KV cache holds them)
    eval_engine: str  # trainer.eval_engine: policy, or rollout (an engine like a worker's decodes in the driver)
    # checkpoints
    checkpoint_every: int
    output_dir: str

    @property
    def weight_bytes(self) -> int:
        """W: the model's bytes in model.dtype."""
        return self.shape.params * DTYPE_BYTES[self.model_dtype]

    @property
    def trainable_bytes(self) -> int:
        """The trainable parameters' bytes in model.dtype (peft builds the adapters in their base layer's dtype): what
        the gradients, each of AdamW's moments and a snapshot slot hold; W without LoRA."""
        return self.shape.trainable_params * DTYPE_BYTES[self.model_dtype]

    @property
    def adapter_bytes(self) -> int:
        """LoRA's adapter in model.dtype (0 without LoRA): what the trainer's model holds beside W, and each publish
        carries after the first."""
        return self.shape.adapter_params * DTYPE_BYTES[self.model_dtype]

    @property
    def compute_bytes(self) -> int:
        """Bytes of an element the actor's matmuls give: bf16 under mixed precision, else model.dtype's."""
        return 2 if self.mixed_precision else DTYPE_BYTES[self.model_dtype]


def plan_run(cfg: DppoConfig, source) -> RunPlan:
    """The RunPlan of cfg with source (its dppo.data PromptSource: prompt and answer lengths, vocab); cfg's precision
    keys resolved (dppo.launch.precision: the plan's bytes depend on them)."""
    require_resolved_precision(cfg)
    t, a, r, m = cfg.trainer, cfg.actor, cfg.rollout, cfg.model
    world_size = t.nnodes * t.n_gpus_per_node
    return RunPlan(
        shape=run_shape(m, r.max_new_tokens, source, r.agent),
        use_ray=cfg.use_ray,
        local_cluster=not (cfg.ray.address or os.environ.get("RAY_ADDRESS")),
        mode=t.mode,
        world_size=world_size,
        sharded=world_size > 1 or a.fsdp == "always",
        trainer_on_gpu=t.device != "cpu" and torch.cuda.is_available(),
        model_dtype=m.dtype,
        mixed_precision=a.mixed_precision is not None,
        model_keys=f"model.path={m.path!r}"
        if m.path is not None
        else (
            f"model.hidden_size={m.hidden_size}, model.num_hidden_layers={m.num_hidden_layers}, "
            f"model.intermediate_size={m.intermediate_size}"
        ),
        prompt_keys=f"task.length={cfg.task.length}"
        if cfg.data.kind == "task"
        else ("rollout.agent.max_prompt_length" if r.agent.enabled else "data.max_prompt_length"),
        pi_old_choice=choose_pi_old(cfg),
        kl_reference=a.kl_loss_coef > 0 or cfg.algorithm.use_kl_in_reward,
        reference_in_checkpoints=a.kl_loss_coef > 0,
        rollout_n=r.n,
        groups_per_batch=r.groups_per_batch,
        groups_per_trigger=cfg.groups_per_trigger,
        train_batch_size=t.train_batch_size,
        micro_batch_size=a.micro_batch_size,
        off_policy_threshold=cfg.replay.max_off_policy_threshold,
        num_workers=r.num_workers,
        num_threads=r.num_threads,
        rollout_gpus_per_node=r.n_gpus_per_node,
        engine=engine_spec(r.name),
        engine_dtype=r.dtype or m.dtype,
        weight_sync=r.weight_sync,
        engine_rows=batch_rows(r.n, r.groups_per_batch, cfg.groups_per_trigger)
        if not r.agent.enabled
        else min(batch_rows(r.n, r.groups_per_batch, cfg.groups_per_trigger), r.agent.max_concurrency),
        eval_engine=t.eval_engine,
        checkpoint_every=t.checkpoint_every,
        output_dir=t.output_dir,
    )


def tiny_model_parameters(vocab_size: int, hidden: int, layers: int, intermediate: int) -> int:
    """Parameters of dppo.models' tiny Qwen2 (untied embeddings, q/k/v biases, as many key/value heads as heads)."""
    per_layer = 4 * hidden * hidden + 3 * hidden + 3 * hidden * intermediate + 2 * hidden  # attention, MLP, 2 norms
    return 2 * vocab_size * hidden + layers * per_layer + hidden  # embeddings, lm_head, layers, final norm


def run_shape(m, max_new_tokens: int | None, source, agent=None) -> RunShape:
    """The RunShape of the model m (the config's model section) with source, its responses max_new_tokens long (else
    the source's answer length): model.path's model is built on the meta device, the tiny one counted. agent: the
    config's rollout.agent; where it is on, a sequence is an agent run's first prompt (rollout.agent.max_prompt_length)
    and its whole trajectory (the source's response length, data.max_response_length). With model.lora_rank > 0 the
    adapters are injected into a meta model (LoraError, one line naming it, for a target module the model lacks)."""
    prompt_length = source.prompt_length
    response_length = max_new_tokens or source.response_length
    if agent is not None and agent.enabled:
        prompt_length, response_length = agent.max_prompt_length, source.response_length
    lora = LoraSpec.of(m)
    adapter_params = target_params = 0
    if m.path is None:
        config = tiny_model_config(source.vocab_size, 8, 1, 1, 8)  # any sizes: for its max_position_embeddings
        if lora is not None:
            tiny = tiny_model_config(
                source.vocab_size, m.hidden_size, m.num_hidden_layers, m.num_attention_heads, m.intermediate_size
            )
            with torch.device("meta"):
                adapter_params, target_params = adapter_parameters(AutoModelForCausalLM.from_config(tiny), lora)
        params = tiny_model_parameters(source.vocab_size, m.hidden_size, m.num_hidden_layers, m.intermediate_size)
        vocab_size = source.vocab_size
        layers, hidden, kv_width, intermediate = m.num_hidden_layers, m.hidden_size, m.hidden_size, m.intermediate_size
        embedding_params = 2 * vocab_size * hidden  # untied
    else:
        config = AutoConfig.from_pretrained(m.path, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
        vocab_size = config.vocab_size
        layers, hidden, kv_width = _widths(config)
        intermediate = getattr(config, "intermediate_size", 0) or 0
        embeddings = (model.get_input_embeddings().weight, model.get_output_embeddings().weight)
        embedding_params = sum(p.numel() for p in {id(p): p for p in embeddings}.values())
        if lora is not None:
            adapter_params, target_params = adapter_parameters(model, lora)
    return RunShape(
        params,
        vocab_size,
        prompt_length,
        response_length,
        getattr(config, "max_position_embeddings", None),
        layers,
        hidden,
        kv_width,
        intermediate,
        embedding_params,
        adapter_params,
        target_params,
    )


def adapter_parameters(model: torch.nn.Module, spec: LoraSpec) -> tuple[int, int]:
    """The parameters of spec's adapters in model (a meta model: nothing allocated), r x (in + out) per target linear,
    and those of the target linears' own weights; LoraError naming a target module the model lacks. peft's
    initialisation draws from torch's global generator even on the meta device: forked, so the run's seeded weights
    are what they would be without this count."""
    with torch.random.fork_rng(devices=[]):
        model = apply_lora(model, spec)
    targets = [
        m.base_layer.weight for m in model.modules() if isinstance(getattr(m, "base_layer", None), torch.nn.Linear)
    ]
    return sum(p.numel() for p in model.parameters() if p.requires_grad), sum(w.numel() for w in targets)


def _widths(config) -> tuple[int, int, int]:
    """(layers, hidden size, key/value width) of a transformers config; 0 for what it does not name."""
    layers, hidden = getattr(config, "num_hidden_layers", 0) or 0, getattr(config, "hidden_size", 0) or 0
    heads = getattr(config, "num_attention_heads", 0) or 0
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
    return layers, hidden, kv_heads * head_dim
