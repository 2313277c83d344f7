"""The preflight's memory estimate (dppo.launch.memory_estimate): its accounting against what a training process
really holds, its one line on every run, and a run that cannot fit refused in one line before Ray starts."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dppo.launch.run
from dppo.cli import main
from dppo.data import make_prompt_source
from dppo.launch import preflight
from dppo.launch.plan import plan_run

from tiny_run import small_overrides  # tests/tiny_run.py (tests/conftest.py puts tests/ on sys.path)

REPO = Path(__file__).resolve().parents[3]
GIB = 2**30

# In a fresh process: save a Qwen2 whose memory is its weights (the real 151936-token vocab, tied, 2 thin layers:
# 39M parameters), note the process's RSS, train it in-process (the rank's weights, grads, AdamW and slot, the
# generator's copy, the driver's policy) and print the peak RSS (VmHWM) beside the estimate.
_CHILD = """
import json, sys
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
from dppo.config import load_config
from dppo.data import make_prompt_source
from dppo.launch.run import run
from dppo.launch import preflight
from dppo.launch.plan import plan_run

def status_kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

model_dir, overrides = sys.argv[1], sys.argv[2:]
config = Qwen2Config(vocab_size=151936, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
Qwen2ForCausalLM(config).save_pretrained(model_dir)
cfg = load_config([f"model.path={model_dir}", *overrides])
memory = preflight.memory_estimate(plan_run(cfg, make_prompt_source(cfg)))
base_kib = status_kib("VmRSS")
run(cfg, out=open("/dev/null", "w"))
print(json.dumps({"peak": status_kib("VmHWM") * 1024, "base": base_kib * 1024, "params": memory.params,
                  "estimate": memory.total_bytes, "parts": memory.roles[0].parts}))
"""


def test_the_estimate_is_within_20_percent_of_what_a_training_process_holds(tmp_path):
    overrides = small_overrides(
        tmp_path, **{"trainer.parameter_sync_step": 2, "rollout.max_new_tokens": 8, "trainer.eval_prompts": 0}
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(tmp_path / "model"), *overrides],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    parts = got["parts"]
    w = got["params"] * 4
    # the parts that are the model's bytes, counted exactly: the rank's 4 W + slot, the generator's W, the policy's W
    assert parts["weights"] == 2 * w and parts["grads"] == w and parts["optimizer"] == 2 * w
    assert parts["snapshot slot"] == w and parts["policy"] == w
    # what the process came to hold for the run (its RSS once imports were done aside) against the estimate's
    held = got["peak"] - got["base"]
    expected = got["estimate"] - parts["process"]
    assert 0.8 * expected <= held <= 1.2 * expected, (held / GIB, expected / GIB, parts)


def test_every_run_prints_its_estimate_in_one_line(small_args, capsys):
    assert main(["train", *small_args()]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("memory estimate:")]
    assert len(lines) == 1
    assert "GiB host" in lines[0] and "B/param" in lines[0] and "driver" in lines[0]


def test_a_run_that_cannot_fit_is_refused_in_one_line_before_ray_starts(small_args, monkeypatch, capsys):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(preflight, "available_host_bytes", lambda: GIB // 4)  # less than Ray and three processes

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a run that cannot fit")

    monkeypatch.setattr(dppo.launch.run, "init_ray", no_ray)
    monkeypatch.setattr(dppo.launch.run, "probe_cluster", no_ray)
    assert main(["train", *small_args(**{"ray.enabled": True, "rollout.num_workers": 2})]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert len(err) == 1 and err[0].startswith("dppo: error: ")
    line = err[0]
    for words in (
        "GiB of host memory",
        "actor_rank",
        "rollout_worker",
        "object_store",
        "ray_runtime",
        "0.2 GiB is available",
        "model.dtype=bfloat16",
        "rollout.num_workers=1",
        "smaller batches",
    ):
        assert words in line, (words, line)


@pytest.mark.parametrize("dtype, per_param", [("float32", 4), ("bfloat16", 2)])
def test_the_actor_rank_shards_its_model_bytes_over_the_world_size(small_cfg, dtype, per_param):
    for ws in (1, 2):
        cfg = small_cfg(
            **{"ray.enabled": True, "trainer.n_gpus_per_node": ws, "model.dtype": dtype, "trainer.device": "cpu"}
        )
        memory = preflight.memory_estimate(plan_run(cfg, make_prompt_source(cfg)))
        rank = next(r for r in memory.roles if r.name == "actor rank")
        assert rank.count == ws
        w = memory.params * per_param
        assert rank.parts["weights"] == w // ws and rank.parts["optimizer"] == 2 * w // ws
        assert ("publish gather" in rank.parts) == (ws > 1)


@pytest.mark.parametrize("sync", ["full", "delta"])
def test_a_vllm_worker_is_counted_with_the_kv_cache_its_engine_sizes(small_cfg, sync):
    from dppo.launch.memory_estimate import PROCESS_BYTES
    from dppo.workers.rollout.engines.vllm import VLLM_IMPORT_BYTES

    keys = {
        "ray.enabled": True,
        "trainer.device": "cpu",
        "model.hidden_size": 256,
        "model.num_hidden_layers": 4,
        "model.num_attention_heads": 4,
        "model.intermediate_size": 512,
        "rollout.n": 8,
        "rollout.groups_per_batch": 64,
        "rollout.weight_sync": sync,
    }
    hf = small_cfg(**keys)
    cfg = small_cfg(**keys, **{"rollout.name": "vllm"})
    source = make_prompt_source(cfg)
    shape = plan_run(cfg, source).shape
    worker = next(r for r in preflight.memory_estimate(plan_run(cfg, source)).roles if r.name == "rollout worker").parts
    hf_worker = next(
        r for r in preflight.memory_estimate(plan_run(hf, source)).roles if r.name == "rollout worker"
    ).parts
    rows = 64 * 8  # rollout.groups_per_batch x n, which is more than a trigger's groups here
    tokens = rows * -(-(shape.prompt_length + shape.response_length + 1) // 32) * 32  # whole blocks of 32
    kv = tokens * 2 * 4 * 256 * 4  # K and V, 4 layers, 256 wide, fp32
    assert kv > 32 * 2**20  # above the engine's minimum, so the count is the rows'
    assert worker["kv cache and logits"] == kv + rows * shape.vocab_size * 4 * 2
    assert worker["process"] == PROCESS_BYTES + VLLM_IMPORT_BYTES and worker["weights"] == hf_worker["weights"]
    assert ("delta copy" in worker) == (sync == "delta")


@pytest.mark.parametrize("threshold, strategy, batch, per_ticket", [
    (1, "wait", 8, 32),  # issue 35's run: the buffer grants 16 groups ahead, fewer than rollout.groups_per_batch
    (0, "drop", 8, 32),  # 8 ahead
    (3, "wait", 16, 32),  # 64 ahead: rollout.groups_per_batch bounds the ticket
])  # fmt: skip
def test_an_hf_workers_batch_is_the_largest_ticket_the_replay_buffer_grants(
    small_cfg, threshold, strategy, batch, per_ticket
):
    """The rows the estimate gives one generate call are those of the largest ticket a worker can get: asked for
    rollout.groups_per_batch groups, the replay buffer grants at most what it lets the rollout run ahead."""
    from dppo.launch.memory_estimate import generation_rows
    from dppo.workers.rollout.replay_buffer import ReplayBufferCore

    cfg = small_cfg(
        **{
            "trainer.mode": "separate_async",
            "replay.max_off_policy_threshold": threshold,
            "replay.max_off_policy_strategy": strategy,
            "trainer.train_batch_size": batch,
            "rollout.groups_per_batch": per_ticket,
            "rollout.n": 8,
        }
    )
    buffer = ReplayBufferCore(threshold, strategy, batch)
    buffer.publish("weights", 0)
    first = buffer.acquire(-1, per_ticket)  # the first ticket is the largest: nothing is generated yet
    assert (
        generation_rows(plan_run(cfg, make_prompt_source(cfg)))
        == first.num_groups * 8
        == min(per_ticket, (threshold + 1) * batch) * 8
    )
    sync = small_cfg(**{"trainer.mode": "sync", "rollout.n": 8})
    assert (
        generation_rows(plan_run(sync, make_prompt_source(sync))) == sync.groups_per_trigger * 8
    )  # in process: a trigger's groups at a time


def test_an_hf_workers_batch_is_its_kv_cache_or_its_scoring_pass_not_both(small_cfg):
    """The KV cache is gone once the responses are sampled, before their behavior log-probs are scored; the scoring
    pass's logits cover the R + 1 last positions only (the LM head runs on those). Issue 35's run: SmolLM2-135M's shape
    (30 layers, vocab 49152), prompts of 46 tokens, 12-token responses, 8 groups of 8 a step, 2 steps a cycle."""
    from dppo.launch.memory_estimate import generation_rows, rollout_worker
    from dppo.launch.plan import RunShape

    cfg = small_cfg(
        **{
            "trainer.mode": "separate_async",
            "trainer.train_batch_size": 8,
            "rollout.n": 8,
            "rollout.groups_per_batch": 32,
            "actor.micro_batch_size": 256,
        }
    )
    shape = RunShape(
        params=134515008,
        vocab_size=49152,
        prompt_length=46,
        response_length=12,
        max_positions=None,
        layers=30,
        hidden=576,
        kv_width=192,
        intermediate=1536,
        embedding_params=28311552,
    )
    plan = dataclasses.replace(plan_run(cfg, make_prompt_source(cfg)), shape=shape)
    batch = rollout_worker(plan)["kv cache and logits"]
    rows, length, v = generation_rows(plan), 46 + 12, 49152
    assert rows == 16 * 8  # the replay buffer grants 2 steps' groups ahead at most
    kv = 2 * 30 * length * 192 * 4 * rows
    logits = rows * (12 + 1) * v * 4  # the scoring pass's micro-batch is all the rows
    assert max(kv, logits) <= batch < kv + logits, (batch, kv, logits)
    # every position's logits (the estimate before 2026-12-03, 11.5 GiB with 4 copies) would be 4.5 times as many
    assert batch < rows * length * v * 4


def test_bf16_compute_is_counted_in_the_actor_ranks_activations(small_cfg):
    """actor.mixed_precision=bfloat16: the weights, gradients and AdamW's moments stay fp32, the logits and the
    matmuls' saved activations are bf16, and autocast's bf16 casts of the weights are held for the backward."""
    from dppo.launch.memory_estimate import actor_rank

    fp32 = small_cfg(**{"ray.enabled": True, "trainer.device": "cpu"})
    bf16 = small_cfg(**{"ray.enabled": True, "trainer.device": "cpu", "actor.mixed_precision": "bfloat16"})
    source = make_prompt_source(fp32)
    shape = plan_run(fp32, source).shape
    a, b = actor_rank(plan_run(fp32, source)), actor_rank(plan_run(bf16, source))
    for key in ("weights", "grads", "optimizer", "snapshot slot"):
        assert a[key] == b[key] == {"optimizer": 2}.get(key, 1) * shape.params * 4, key
    assert b["bf16 weight copies"] == shape.params * 2 and "bf16 weight copies" not in a
    assert b["activations"] < a["activations"]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
@pytest.mark.parametrize("ray", [True, False])
def test_an_eval_engine_is_counted_in_the_driver_as_a_rollout_workers_engine(small_cfg, engine, ray):
    """trainer.eval_engine=rollout: the driver also holds an engine like a rollout worker's (its weights, KV cache and
    logits; vLLM's import), on Ray and without it; policy adds nothing."""
    from dppo.launch.memory_estimate import estimate
    from dppo.workers.rollout.engines.vllm import VLLM_IMPORT_BYTES

    keys = {
        "ray.enabled": ray,
        "trainer.device": "cpu",
        "trainer.mode": "separate_async",
        "rollout.name": engine,
        "rollout.dtype": "bfloat16",
        "model.num_attention_heads": 1,
    }
    plain = small_cfg(**keys)
    cfg = small_cfg(**keys, **{"trainer.eval_engine": "rollout"})

    def roles(c):
        return {r.name: r for r in estimate(plan_run(c, make_prompt_source(c))).roles}

    worker, driver, plain_driver = roles(cfg)["rollout worker"].parts, roles(cfg)["driver"], roles(plain)["driver"]
    added = driver.each_bytes - plain_driver.each_bytes
    expected = worker["weights"] + worker["kv cache and logits"] + (VLLM_IMPORT_BYTES if engine == "vllm" else 0)
    assert added == expected > 0


@pytest.mark.parametrize("targets, engine_dtype", [("all-linear", "float32"), ("[q_proj,v_proj]", "bfloat16")])
def test_lora_counts_the_adapters_gradients_optimizer_and_slot_alone(small_cfg, targets, engine_dtype):
    """model.lora_rank: a rank holds the frozen base and the adapter, the gradients, AdamW's moments and the snapshot
    slot of the adapter alone, and the object store the base once and two adapters; the adapter's size is r x
    (in + out) per target linear, counted by hand for the tiny model (32 wide, an MLP of 64, one layer, key/value as
    wide as the queries); a worker's merge of the targets is in the engine's dtype (rollout.dtype)."""
    from dppo.launch.memory_estimate import estimate

    keys = {"ray.enabled": True, "trainer.device": "cpu", "trainer.mode": "separate_async"}
    keys["rollout.dtype"] = engine_dtype
    full = small_cfg(**keys)
    lora = small_cfg(**keys, **{"model.lora_rank": 4, "model.target_modules": targets})
    source = make_prompt_source(full)
    h, i, r = 32, 64, 4
    per_target = {"q_proj": h + h, "k_proj": h + h, "v_proj": h + h, "o_proj": h + h}
    per_target |= {"gate_proj": h + i, "up_proj": h + i, "down_proj": i + h}
    named = list(per_target) if targets == "all-linear" else ["q_proj", "v_proj"]
    adapter = 4 * r * sum(per_target[name] for name in named)  # fp32 bytes: 2176 params over all seven linears
    plan_full, plan_lora = plan_run(full, source), plan_run(lora, source)
    assert plan_lora.shape.params == plan_full.shape.params and plan_lora.adapter_bytes == adapter
    w = plan_full.weight_bytes
    assert plan_full.pi_old_choice.takes_snapshots  # the slot below is counted

    def roles(memory):
        return {role.name: role.parts for role in memory.roles if role.count}

    without, with_lora = estimate(plan_full), estimate(plan_lora)
    rank = roles(with_lora)["actor rank"]
    assert rank["weights"] == w + adapter
    assert rank["grads"] == rank["snapshot slot"] == adapter and rank["optimizer"] == 2 * adapter
    assert roles(with_lora)["object store"]["published weights"] == w + 2 * adapter
    # merged weights, W, and the merge of the targets at each load in the engine's dtype (the target linears'
    # weights, by hand)
    target_weights = {"q_proj": h * h, "k_proj": h * h, "v_proj": h * h, "o_proj": h * h}
    target_weights |= {"gate_proj": h * i, "up_proj": h * i, "down_proj": i * h}
    merge = {"float32": 4, "bfloat16": 2}[engine_dtype] * sum(target_weights[name] for name in named)
    worker = dict(roles(with_lora)["rollout worker"])
    assert worker.pop("lora merge") == merge and worker == roles(without)["rollout worker"]
    # lower by the gradients', AdamW's and the slot's share of the base (4 (W - A)), less the adapter the rank holds
    # beside the base (A), and by the object store's second base (W - 2 A); higher by each worker's merge
    workers = next(role.count for role in with_lora.roles if role.name == "rollout worker")
    saved = 4 * (w - adapter) - adapter + (w - 2 * adapter) - workers * merge
    assert without.total_bytes - with_lora.total_bytes == saved


def test_a_sync_lora_run_keeps_the_adapter_alone_as_its_last_publish(small_cfg):
    """trainer.mode=sync without Ray: the in-process rollout's copy of the last publish is the adapter (the base is
    the rank's own frozen tensors), where a full run's is the whole weights."""
    from dppo.launch.memory_estimate import estimate

    full, lora = small_cfg(), small_cfg(**{"model.lora_rank": 4})
    source = make_prompt_source(full)
    plan_full, plan_lora = plan_run(full, source), plan_run(lora, source)
    copies = [estimate(p).roles[0].parts["published copy"] for p in (plan_full, plan_lora)]
    assert copies == [plan_full.weight_bytes, plan_lora.adapter_bytes] and 0 < copies[1] < copies[0]


def test_a_lora_target_the_model_lacks_is_one_line_exit_2_before_anything_starts(small_args, monkeypatch, capsys):
    def started(*args, **kwargs):
        raise AssertionError("the trainer was built for a run whose LoRA targets are not in the model")

    monkeypatch.setattr(dppo.launch.run.ppo, "PPOTrainer", started)
    overrides = small_args(**{"model.lora_rank": 4, "model.target_modules": "[q_proj,qkv_proj]"})
    assert main(["train", *overrides]) == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("dppo: error: "), lines
    assert "model.target_modules" in lines[0] and "'qkv_proj'" in lines[0] and "'q_proj'" not in lines[0], lines[0]
