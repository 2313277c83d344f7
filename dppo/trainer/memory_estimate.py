"""The host memory a run needs, by role, counted from its config and the model's shape without allocating anything.

Every process of a CPU run and what it holds at its peak (W: the model's bytes in model.dtype; ws: the world size):

    actor rank (each)  its 1/ws of the weights, gradients and AdamW's two moments (4 W/ws: 16 B/param in fp32), the
                       snapshot slot (W/ws; the cycle_start strategies only), the KL reference (W/ws, with
                       actor.kl_loss_coef > 0 or algorithm.use_kl_in_reward); under FSDP2 (ws > 1) the largest unit
                       gathered whole (the embeddings and a layer) and, on rank 0, the full weights gathered to publish them (W); one micro-batch's
                       activations (logits over the vocab and the layers' saved outputs); the process itself
    rollout worker     its copy of the weights (in rollout.dtype), loaded in place, and its batch's KV cache and
                       logits; the process itself
    replay buffer      the process itself (the groups are small)
    driver             the process itself (the policy it evaluates and saves at the end is built once the ranks and
                       the workers have gone; in-process, W beside the rank's); with trainer.eval_engine=rollout the
                       engine that decodes its evaluations, counted as a rollout worker's (eval_engine)
    object store       the published weights: one version, two while a new one is put before the old is let go
    ray runtime        GCS, raylet, dashboard and Ray's other helpers

Calibrated on benchmarks/memory_bench.py's measurements of this machine (summed PSS of every process; see
benchmarks/RESULTS.md); tests/unit/trainer/test_memory_estimate.py checks the per-role accounting against what a
process really holds on a small model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from dppo.config import DppoConfig
from dppo.config.choices import select_strategy_name
from dppo.workers.rollout.engines import vllm_rows
from dppo.workers.rollout.engines.vllm import kv_bytes_of

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# What a process holds before any model: the interpreter with torch and transformers imported (shared libraries
# counted by PSS, so shared among the processes), Ray's core worker. Measured by memory_bench on this machine.
PROCESS_BYTES = 400 * 2**20
RAY_RUNTIME_BYTES = 384 * 2**20
BUFFER_PROCESS_BYTES = 128 * 2**20  # the replay buffer's process, which imports no torch  # GCS, raylet, dashboard and its agents, log monitor (all of them together)
# vLLM imported and started in a rollout worker, beyond what an hf worker holds: a forked local worker of the tiny
# demo model held 531 MB PSS with vllm (32 MiB of it KV cache) against 171 MB with hf (2026-12-02).
VLLM_IMPORT_BYTES = 330 * 2**20
LOGIT_COPIES = 4  # a micro-batch's logits (B, R+1, V) as the loss holds them: fp32 logits, log-softmax, their grads


@dataclass(frozen=True)
class Role:
    """count processes of one role, each holding the sum of parts (bytes by what they are)."""

    name: str
    count: int
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def each_bytes(self) -> int:
        return sum(self.parts.values())

    @property
    def total_bytes(self) -> int:
        return self.count * self.each_bytes


@dataclass(frozen=True)
class MemoryEstimate:
    roles: tuple[Role, ...]
    params: int
    dtype: str

    @property
    def total_bytes(self) -> int:
        return sum(r.total_bytes for r in self.roles)

    def by_role(self) -> dict[str, int]:
        return {r.name.replace(" ", "_"): r.total_bytes for r in self.roles if r.count}

    def line(self) -> str:
        """One line: the total and each role's bytes (x count)."""
        roles = ", ".join(f"{r.name} {_gib(r.each_bytes)}" + (f" x {r.count}" if r.count > 1 else "")
                          for r in self.roles if r.count and r.each_bytes)  # fmt: skip
        return (f"memory estimate: {_gib(self.total_bytes)} GiB host for {self.params / 1e6:,.0f}M parameters in "
                f"{self.dtype} ({self.total_bytes / self.params:.1f} B/param): {roles}")  # fmt: skip


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of the model: its parameters (a tied tensor once) and widths."""

    params: int
    vocab_size: int
    prompt_length: int
    response_length: int
    layers: int
    hidden: int
    kv_width: int
    intermediate: int
    embedding_params: int  # the input embeddings and an untied lm_head (the root unit FSDP2 gathers whole)


def local_cluster(cfg: DppoConfig) -> bool:
    """Whether every Ray process runs on this machine (a cluster this run starts)."""
    return not (cfg.ray.address or os.environ.get("RAY_ADDRESS"))


def actor_rank(cfg: DppoConfig, shape: Shape, on_gpu: bool) -> dict[str, int]:
    """What one actor rank holds in this machine's host memory (rank 0's: it also gathers what it publishes)."""
    ws = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    w = shape.params * DTYPE_BYTES[cfg.model.dtype]
    strategy = select_strategy_name(cfg)
    parts = {"process": PROCESS_BYTES}
    if strategy.startswith("cycle_start") or strategy == "auto":
        parts["snapshot slot"] = w // ws  # host arenas even when the model trains on a GPU
    if on_gpu:
        return parts
    parts.update({"weights": w // ws, "grads": w // ws, "optimizer": 2 * w // ws})
    if cfg.actor.kl_loss_coef > 0 or cfg.algorithm.use_kl_in_reward:  # the KL loss's or the reward's reference
        parts["kl reference"] = w // ws
    b = DTYPE_BYTES[cfg.model.dtype]
    if ws > 1:
        layer = (shape.params - shape.embedding_params) // max(1, shape.layers)
        parts["fsdp gather"] = (shape.embedding_params + layer) * b
        parts["publish gather"] = w
    rows = cfg.groups_per_trigger * cfg.rollout.n // ws  # the rank's share of a trigger's sequences
    micro = max(1, min(cfg.actor.micro_batch_size, rows))
    length = shape.prompt_length + shape.response_length
    logits = micro * (shape.response_length + 1) * shape.vocab_size * 4 * LOGIT_COPIES
    saved = micro * length * shape.layers * (10 * shape.hidden + 4 * shape.intermediate) * b
    # the backward of a tied embedding: the lm_head's gradient and the input embedding's, summed into one
    tied = 2 * shape.embedding_params * b if shape.embedding_params and _tied(shape) else 0
    parts["activations"] = logits + saved + tied
    return parts


def _tied(shape: Shape) -> bool:
    """Whether the embeddings are one tensor with the lm_head (counted once in embedding_params)."""
    return shape.embedding_params == shape.vocab_size * shape.hidden


def rollout_worker(cfg: DppoConfig, shape: Shape) -> dict[str, int]:
    """What one rollout worker (on the CPU) holds: its weights, its batch's KV cache and logits; a vllm engine's
    KV cache is the one the engine sizes (every row of a ticket), and with delta sync it keeps one more copy of the
    weights in its dtype (the last publish, to compare with)."""
    b = DTYPE_BYTES[cfg.rollout.dtype or cfg.model.dtype]
    seqs = cfg.rollout.groups_per_batch * cfg.rollout.n
    length = shape.prompt_length + shape.response_length
    if cfg.rollout.name == "vllm":
        rows = vllm_rows(cfg)
        parts = {"process": PROCESS_BYTES + VLLM_IMPORT_BYTES, "weights": shape.params * b,
                 "kv cache and logits": kv_bytes_of(shape.layers, shape.kv_width, b, rows, length)
                 + rows * shape.vocab_size * 4 * 2}  # fmt: skip
        if cfg.rollout.weight_sync == "delta":
            parts["delta copy"] = shape.params * b
        return parts
    kv = 2 * shape.layers * length * shape.kv_width * b * seqs
    micro = max(1, min(cfg.actor.micro_batch_size, seqs))  # the behavior log-probs' scoring pass, every position
    logits = max(seqs * shape.vocab_size * 4 * 2, micro * length * shape.vocab_size * 4 * LOGIT_COPIES)
    return {"process": PROCESS_BYTES, "weights": shape.params * b, "kv cache and logits": kv + logits}


def eval_engine(cfg: DppoConfig, shape: Shape) -> dict[str, int]:
    """What trainer.eval_engine=rollout adds to the driver: an engine as a rollout worker holds one (vLLM imported,
    the weights in rollout.dtype, its KV cache and logits), built at the first evaluation; nothing for policy."""
    if cfg.trainer.eval_engine != "rollout":
        return {}
    parts = rollout_worker(cfg, shape)
    extra = {f"eval engine {key}": value for key, value in parts.items() if key not in ("process", "delta copy")}
    if cfg.rollout.name == "vllm":
        extra["eval engine vllm import"] = VLLM_IMPORT_BYTES
    return extra


def estimate(cfg: DppoConfig, shape: Shape, on_gpu: bool = False) -> MemoryEstimate:
    """The host memory of cfg's run on this machine, by role (only the processes that run here)."""
    w = shape.params * DTYPE_BYTES[cfg.model.dtype]
    ws = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    if not cfg.use_ray:  # the trainer's process: the rank and the policy it evaluates and saves at the end
        in_process = cfg.trainer.mode == "sync"  # and the generator; else local worker processes beside it
        merged = {"process": PROCESS_BYTES, "policy": w, **eval_engine(cfg, shape)}
        parts = [*actor_rank(cfg, shape, on_gpu).items(), *(rollout_worker(cfg, shape).items() if in_process else ())]
        for key, value in parts:
            if key != "process":
                merged[key] = merged.get(key, 0) + value
        roles = [Role("driver", 1, merged)]
        if not in_process:  # shared memory: a new version is copied in before the old one is let go
            roles += [Role("rollout worker", cfg.rollout.num_workers, rollout_worker(cfg, shape)),
                      Role("shared weights", 1, {"published weights": 2 * w})]  # fmt: skip
        return MemoryEstimate(tuple(roles), shape.params, cfg.model.dtype)
    local = local_cluster(cfg)
    ranks = ws if local else 0
    workers = cfg.rollout.num_workers if local and not cfg.rollout.n_gpus_per_node else 0
    store = 2 * w if local else 0  # a new version is put before the old one is let go
    roles = (
        Role("driver", 1, {"process": PROCESS_BYTES, **eval_engine(cfg, shape)}),  # its final policy: once the ranks went
        Role("actor rank", ranks, actor_rank(cfg, shape, on_gpu)),
        Role("rollout worker", workers, rollout_worker(cfg, shape)),
        Role("replay buffer", 1 if local else 0, {"process": BUFFER_PROCESS_BYTES}),  # imports no torch
        Role("object store", 1 if store else 0, {"published weights": store}),
        Role("ray runtime", 1 if local else 0, {"process": RAY_RUNTIME_BYTES}),
    )
    return MemoryEstimate(roles, shape.params, cfg.model.dtype)


def what_to_change(cfg: DppoConfig) -> str:
    """The settings that make a run smaller, as the one line of a refusal names them."""
    hints = []
    if cfg.model.dtype == "float32":
        hints.append("model.dtype=bfloat16 (half the bytes)")
    if cfg.rollout.num_workers > 1:
        hints.append(f"rollout.num_workers=1 (each worker holds a copy; now {cfg.rollout.num_workers})")
    ws = cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node
    hints.append(f"a world size over more machines (trainer.nnodes; now world size {ws}: each rank holds 1/{ws})")
    hints.append("smaller batches (rollout.groups_per_batch, actor.micro_batch_size)")
    return "; ".join(hints)
