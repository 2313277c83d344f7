"""The host memory a run needs, by role, counted from its config and the model's shape without allocating anything.

Every process of a CPU run and what it holds at its peak (W: the model's bytes in model.dtype; ws: the world size):

    actor rank (each)  its 1/ws of the weights, gradients and AdamW's two moments (4 W/ws: 16 B/param in fp32), the
                       snapshot slot (W/ws; the cycle_start strategies only), the KL reference (W/ws, with
                       actor.kl_loss_coef > 0 or algorithm.use_kl_in_reward); under FSDP2 (ws > 1) the largest unit
                       gathered whole (the embeddings and a layer) and, on rank 0, the full weights gathered to publish them (W); one micro-batch's
                       activations (its logits over the vocab, R + 1 positions, and the layers' saved outputs, in the
                       compute dtype: bf16 under actor.mixed_precision, with autocast's bf16 casts of the weights); the
                       process itself
    rollout worker     its copy of the weights (in rollout.dtype), loaded in place, and the larger of its batch's KV
                       cache (while it generates; a batch is the largest ticket the replay buffer grants) and its
                       scoring pass's logits (after); the process itself (forked from the driver without Ray)
    replay buffer      the process itself (the groups are small)
    driver             the process itself (the policy it evaluates and saves at the end is built once the ranks and
                       the workers have gone; in-process, W beside the rank's, and the last publish's copy of the
                       weights); with trainer.eval_engine=rollout the engine that decodes its evaluations, counted as
                       a rollout worker's (eval_engine)
    object store       the published weights: one version, two while a new one is put before the old is let go
    ray runtime        GCS, raylet, dashboard and Ray's other helpers

LoRA (model.lora_rank > 0; A: the adapter's bytes, counted from a meta model by dppo.launch.plan): a rank holds the
frozen base and the adapter (W + A, its 1/ws), the gradients, AdamW's moments and a snapshot slot of the adapter alone
(A/ws each); a publish puts the base once and the adapter every time, so the object store (or the local workers'
shared memory) holds W + 2 A. A rollout worker holds merged weights, W, as without LoRA, and at each load merges its
targets W_t + (alpha / r) B A from the base, rounded to the engine's dtype (its bytes per target weight, for the load
and its check: let go of afterwards); an in-process rollout's last publish is its adapter alone (the base is the
rank's frozen tensors), and its evaluation engine's loads merge the same way, one load at a time.

Calibrated on benchmarks/memory_bench.py's measurements of this machine (summed PSS of every process) and, by process,
on benchmarks/real_run_bench.py's of issue 35's run (SmolLM2-135M: within 12% for the driver and 3% for the rollout
worker, fp32 and bf16; see benchmarks/RESULTS.md); tests/unit/trainer/test_memory_estimate.py checks the per-role accounting against what a
process really holds on a small model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dppo.algo.logprob import DEFAULT_CHUNK_BYTES
from dppo.launch.plan import DTYPE_BYTES, RunPlan, RunShape
from dppo.workers.rollout.engines import WorkerLoad

GIB = 2**30

# What a process holds before any model: the interpreter with torch and transformers imported (shared libraries
# counted by PSS, so shared among the processes), Ray's core worker. Measured by memory_bench on this machine.
PROCESS_BYTES = 400 * 2**20
RAY_RUNTIME_BYTES = 384 * 2**20
# A local rollout worker (a run without Ray) is forked from the driver: the pages of torch and transformers it
# imported stay shared, and its PSS counts half of those it touches. Measured by benchmarks/real_run_bench.py.
LOCAL_WORKER_PROCESS_BYTES = 192 * 2**20
BUFFER_PROCESS_BYTES = (
    128 * 2**20
)  # the replay buffer's process, which imports no torch  # GCS, raylet, dashboard and its agents, log monitor (all of them together)
# A training micro-batch's logits (b, R+1, V) in the compute dtype, as its backward holds them: the LM head's output
# (saved by the log-prob's autograd function), the log-probs' gradient of its (b, R, V) view, and that gradient laid
# into the whole (b, R+1, V) for the LM head's backward. The log-softmax itself is never held: dppo.algo.logprob walks
# the rows in chunks of at most DEFAULT_CHUNK_BYTES of fp32 work.
LOGIT_COPIES = 3


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
        roles = ", ".join(
            f"{r.name} {_gib(r.each_bytes)}" + (f" x {r.count}" if r.count > 1 else "")
            for r in self.roles
            if r.count and r.each_bytes
        )
        return (
            f"memory estimate: {_gib(self.total_bytes)} GiB host for {self.params / 1e6:,.0f}M parameters in "
            f"{self.dtype} ({self.total_bytes / self.params:.1f} B/param): {roles}"
        )


def _gib(n: int) -> str:
    return f"{n / GIB:.1f}"


def actor_rank(plan: RunPlan) -> dict[str, int]:
    """What one actor rank holds in this machine's host memory (rank 0's: it also gathers what it publishes)."""
    shape, ws, w = plan.shape, plan.world_size, plan.weight_bytes
    t = plan.trainable_bytes  # W, or LoRA's adapter: what the gradients, AdamW and a slot hold
    parts = {"process": PROCESS_BYTES}
    if plan.pi_old_choice.takes_snapshots:
        parts["snapshot slot"] = t // ws  # host arenas even when the model trains on a GPU
    if plan.trainer_on_gpu:
        return parts
    parts.update({"weights": (w + plan.adapter_bytes) // ws, "grads": t // ws, "optimizer": 2 * t // ws})
    if plan.kl_reference:  # the KL loss's or the reward's reference (a copy of the model, adapters and all)
        parts["kl reference"] = (w + plan.adapter_bytes) // ws
    c = plan.compute_bytes
    if ws > 1:
        layer = (shape.params - shape.embedding_params) // max(1, shape.layers)
        parts["fsdp gather"] = (shape.embedding_params + layer) * c  # gathered in the compute dtype
        parts["publish gather"] = w
    rows = plan.groups_per_trigger * plan.rollout_n // ws  # the rank's share of a trigger's sequences
    micro = max(1, min(plan.micro_batch_size, rows))
    length = shape.prompt_length + shape.response_length
    logits = micro * (shape.response_length + 1) * shape.vocab_size * c * LOGIT_COPIES
    logits += log_prob_work(micro * shape.response_length, shape.vocab_size)
    saved = micro * length * shape.layers * saved_bytes_per_token_layer(plan)
    # the backward of a tied embedding: the lm_head's gradient and the input embedding's, summed into one (none where
    # LoRA freezes them)
    b = DTYPE_BYTES[plan.model_dtype]
    tied = 2 * shape.embedding_params * b if shape.embedding_params and _tied(shape) and not plan.adapter_bytes else 0
    parts["activations"] = logits + saved + tied
    if plan.mixed_precision and not plan.sharded:
        parts["bf16 weight copies"] = shape.params * c  # autocast's casts of the weights, saved for the backward
    return parts


def saved_bytes_per_token_layer(plan: RunPlan) -> int:
    """What a decoder layer saves for the backward per token (H: hidden, I: the MLP's width): about 10 H-wide tensors
    (the norms' inputs and outputs, q, k, v after the rotary embedding, the attention's output, the residual) and 4
    I-wide ones (the MLP's gate, up, activation and product), each in the compute dtype; under autocast the H-wide
    ones of the residual stream and the norms (4 of them) stay fp32. Checked against torch's saved tensors of a Llama
    layer (2026-12-03): within 7% at H=576, I=1536 (SmolLM2-135M), H=576, I=4608 and H=288, I=1152, fp32, autocast and
    bf16 weights alike."""
    h, i, c = plan.shape.hidden, plan.shape.intermediate, plan.compute_bytes
    if plan.mixed_precision and not plan.sharded:  # autocast over fp32 weights
        return 4 * h * 4 + (6 * h + 4 * i) * c
    return (10 * h + 4 * i) * c


def log_prob_work(rows: int, vocab: int) -> int:
    """The fp32 working set of log-probs over rows positions of a vocab-wide softmax (dppo.algo.logprob): two (n, V)
    fp32 tensors of one chunk at most (the upcast logits or the exponentials, and the softmax of the backward), with
    n <= DEFAULT_CHUNK_BYTES / (12 V) rows a chunk."""
    return 2 * 4 * vocab * min(rows, max(1, DEFAULT_CHUNK_BYTES // (12 * vocab)))


def _tied(shape: RunShape) -> bool:
    """Whether the embeddings are one tensor with the lm_head (counted once in embedding_params)."""
    return shape.embedding_params == shape.vocab_size * shape.hidden


def rollout_worker(plan: RunPlan) -> dict[str, int]:
    """What one rollout worker (on the CPU) holds (engine_parts), and with LoRA its merge of the targets at each load,
    in the engine's dtype."""
    parts = engine_parts(plan)
    if plan.shape.target_params:
        parts["lora merge"] = DTYPE_BYTES[plan.engine_dtype] * plan.shape.target_params
    return parts


def engine_parts(plan: RunPlan) -> dict[str, int]:
    """What a rollout worker's engine holds: its engine spec's count where it has one (worker_bytes: vLLM's counts the
    KV cache the engine sizes), else that of a worker holding a transformers model copy (the hf engine): its weights
    and the larger of its batch's KV cache and its scoring pass's logits."""
    shape, b = plan.shape, DTYPE_BYTES[plan.engine_dtype]
    length = shape.prompt_length + shape.response_length
    if plan.engine.worker_bytes is not None:
        load = WorkerLoad(
            params=shape.params,
            layers=shape.layers,
            kv_width=shape.kv_width,
            vocab_size=shape.vocab_size,
            sequence_len=length,
            dtype_bytes=b,
            rows=plan.engine_rows,
            weight_sync=plan.weight_sync,
            process_bytes=PROCESS_BYTES,
        )
        return plan.engine.worker_bytes(load)
    rows = generation_rows(plan)
    p, r, v = shape.prompt_length, shape.response_length, shape.vocab_size
    # generating: the KV cache of every row at full length, with the larger of the prefill's transients (one layer's
    # MLP over the prompts: gate, up and their product) and a decode step's fp32 logits and probabilities
    kv = 2 * shape.layers * length * shape.kv_width * b * rows
    generating = kv + max(rows * p * 3 * shape.intermediate * b, rows * v * 4 * 2)
    # then scoring the behavior log-probs (the cache is gone): a micro-batch's logits, whose LM head runs on the R + 1
    # last positions only, in the engine's dtype, their log-prob work, and one layer's MLP transients
    micro = max(1, min(plan.micro_batch_size, rows))
    scoring = micro * (r + 1) * v * b + log_prob_work(micro * r, v) + micro * length * 3 * shape.intermediate * b
    process = PROCESS_BYTES if plan.use_ray else LOCAL_WORKER_PROCESS_BYTES
    return {"process": process, "weights": shape.params * b, "kv cache and logits": max(generating, scoring)}


def generation_rows(plan: RunPlan) -> int:
    """Sequences one generate call of an hf rollout worker holds: a ticket's groups x rollout.n. separate_async: at most
    rollout.groups_per_batch groups, and at most what the replay buffer grants ahead of the trainer
    ((replay.max_off_policy_threshold + 1) x trainer.train_batch_size groups); sync: a trigger's groups."""
    if plan.mode == "sync":
        return plan.groups_per_trigger * plan.rollout_n
    ahead = (plan.off_policy_threshold + 1) * plan.train_batch_size
    return min(plan.groups_per_batch, ahead) * plan.rollout_n


def eval_engine(plan: RunPlan) -> dict[str, int]:
    """What trainer.eval_engine=rollout adds to the driver: an engine as a rollout worker holds one (the weights in
    rollout.dtype, its KV cache and logits, and what its package adds to a process: a worker's process beyond
    PROCESS_BYTES, vLLM's import), built at the first evaluation; nothing for policy."""
    if plan.eval_engine != "rollout":
        return {}
    parts = rollout_worker(plan)
    # not its LoRA merge: a transient at each load, as the rollout worker's own (counted there)
    extra = {
        f"eval engine {key}": value
        for key, value in parts.items()
        if key not in ("process", "delta copy", "lora merge")
    }
    if parts["process"] > PROCESS_BYTES:
        extra["eval engine import"] = parts["process"] - PROCESS_BYTES
    return extra


def estimate(plan: RunPlan) -> MemoryEstimate:
    """The host memory of the run on this machine, by role (only the processes that run here)."""
    w, params = plan.weight_bytes, plan.shape.params
    if not plan.use_ray:  # the trainer's process: the rank and the policy it evaluates and saves at the end
        in_process = plan.mode == "sync"  # and the generator; else local worker processes beside it
        merged = {"process": PROCESS_BYTES, "policy": w, **eval_engine(plan)}
        if in_process:  # the in-process rollout keeps the last publish (pi_old for a checkpoint without an anchor)
            merged["published copy"] = plan.adapter_bytes or w  # LoRA: the adapter copied, the base the rank's
        for key, value in [*actor_rank(plan).items(), *(rollout_worker(plan).items() if in_process else ())]:
            if key != "process":
                merged[key] = merged.get(key, 0) + value
        roles = [Role("driver", 1, merged)]
        if not in_process:  # shared memory: a new version is copied in before the old one is let go
            roles += [
                Role("rollout worker", plan.num_workers, rollout_worker(plan)),
                Role("shared weights", 1, {"published weights": published_bytes(plan)}),
            ]
        return MemoryEstimate(tuple(roles), params, plan.model_dtype)
    local = plan.local_cluster
    workers = plan.num_workers if local and not plan.rollout_gpus_per_node else 0
    store = published_bytes(plan) if local else 0
    roles = (
        Role("driver", 1, {"process": PROCESS_BYTES, **eval_engine(plan)}),  # its final policy: once the ranks went
        Role("actor rank", plan.world_size if local else 0, actor_rank(plan)),
        Role("rollout worker", workers, rollout_worker(plan)),
        Role("replay buffer", 1 if local else 0, {"process": BUFFER_PROCESS_BYTES}),  # imports no torch
        Role("object store", 1 if store else 0, {"published weights": store}),
        Role("ray runtime", 1 if local else 0, {"process": RAY_RUNTIME_BYTES}),
    )
    return MemoryEstimate(roles, params, plan.model_dtype)


def published_bytes(plan: RunPlan) -> int:
    """What the published weights take in the object store or the local workers' shared memory: two versions (a new
    one is put before the old is let go), of the whole weights, or with LoRA the base once and two adapters."""
    if plan.adapter_bytes:
        return plan.weight_bytes + 2 * plan.adapter_bytes
    return 2 * plan.weight_bytes


def what_to_change(plan: RunPlan) -> str:
    """The settings that make a run smaller, as the one line of a refusal names them."""
    hints = []
    if plan.model_dtype == "float32":
        hints.append("model.dtype=bfloat16 (half the bytes)")
    if plan.num_workers > 1:
        hints.append(f"rollout.num_workers=1 (each worker holds a copy; now {plan.num_workers})")
    ws = plan.world_size
    hints.append(f"a world size over more machines (trainer.nnodes; now world size {ws}: each rank holds 1/{ws})")
    hints.append("smaller batches (rollout.groups_per_batch, actor.micro_batch_size)")
    return "; ".join(hints)
