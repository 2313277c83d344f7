"""The preflight's memory estimate (dppo.trainer.memory_estimate): its accounting against what a training process
really holds, its one line on every run, and a run that cannot fit refused in one line before Ray starts."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dppo.train
from dppo.cli import main
from dppo.data import make_prompt_source
from dppo.trainer import preflight

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
from dppo.train import run
from dppo.trainer import preflight

def status_kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

model_dir, overrides = sys.argv[1], sys.argv[2:]
config = Qwen2Config(vocab_size=151936, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
Qwen2ForCausalLM(config).save_pretrained(model_dir)
cfg = load_config([f"model.path={model_dir}", *overrides])
memory = preflight.memory_estimate(cfg, preflight.run_shape(cfg, make_prompt_source(cfg)))
base_kib = status_kib("VmRSS")
run(cfg, out=open("/dev/null", "w"))
print(json.dumps({"peak": status_kib("VmHWM") * 1024, "base": base_kib * 1024, "params": memory.params,
                  "estimate": memory.total_bytes, "parts": memory.roles[0].parts}))
"""


def test_the_estimate_is_within_20_percent_of_what_a_training_process_holds(tmp_path):
    overrides = small_overrides(tmp_path, **{"trainer.parameter_sync_step": 2, "rollout.max_new_tokens": 8,
                                             "trainer.eval_prompts": 0})  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "model"), *overrides], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
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

    monkeypatch.setattr(dppo.train, "init_ray", no_ray)
    monkeypatch.setattr(dppo.train, "probe_cluster", no_ray)
    assert main(["train", *small_args(**{"ray.enabled": True, "rollout.num_workers": 2})]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert len(err) == 1 and err[0].startswith("dppo: error: ")
    line = err[0]
    for words in ("GiB of host memory", "actor_rank", "rollout_worker", "object_store", "ray_runtime",
                  "0.2 GiB is available", "model.dtype=bfloat16", "rollout.num_workers=1", "smaller batches"):  # fmt: skip
        assert words in line, (words, line)


@pytest.mark.parametrize("dtype, per_param", [("float32", 4), ("bfloat16", 2)])
def test_the_actor_rank_shards_its_model_bytes_over_the_world_size(small_cfg, dtype, per_param):
    for ws in (1, 2):
        cfg = small_cfg(**{"ray.enabled": True, "trainer.n_gpus_per_node": ws, "model.dtype": dtype,
                           "trainer.device": "cpu"})  # fmt: skip
        memory = preflight.memory_estimate(cfg, preflight.run_shape(cfg, make_prompt_source(cfg)))
        rank = next(r for r in memory.roles if r.name == "actor rank")
        assert rank.count == ws
        w = memory.params * per_param
        assert rank.parts["weights"] == w // ws and rank.parts["optimizer"] == 2 * w // ws
        assert ("publish gather" in rank.parts) == (ws > 1)


@pytest.mark.parametrize("sync", ["full", "delta"])
def test_a_vllm_worker_is_counted_with_the_kv_cache_its_engine_sizes(small_cfg, sync):
    from dppo.trainer.memory_estimate import PROCESS_BYTES, VLLM_IMPORT_BYTES

    keys = {"ray.enabled": True, "trainer.device": "cpu", "model.hidden_size": 256, "model.num_hidden_layers": 4,
            "model.num_attention_heads": 4, "model.intermediate_size": 512, "rollout.n": 8,
            "rollout.groups_per_batch": 64, "rollout.weight_sync": sync}  # fmt: skip
    hf = small_cfg(**keys)
    cfg = small_cfg(**keys, **{"rollout.name": "vllm"})
    shape = preflight.run_shape(cfg, make_prompt_source(cfg))
    worker = next(r for r in preflight.memory_estimate(cfg, shape).roles if r.name == "rollout worker").parts
    hf_worker = next(r for r in preflight.memory_estimate(hf, shape).roles if r.name == "rollout worker").parts
    rows = 64 * 8  # rollout.groups_per_batch x n, which is more than a trigger's groups here
    tokens = rows * -(-(shape.prompt_length + shape.response_length + 1) // 32) * 32  # whole blocks of 32
    kv = tokens * 2 * 4 * 256 * 4  # K and V, 4 layers, 256 wide, fp32
    assert kv > 32 * 2**20  # above the engine's minimum, so the count is the rows'
    assert worker["kv cache and logits"] == kv + rows * shape.vocab_size * 4 * 2
    assert worker["process"] == PROCESS_BYTES + VLLM_IMPORT_BYTES and worker["weights"] == hf_worker["weights"]
    assert ("delta copy" in worker) == (sync == "delta")


@pytest.mark.parametrize("engine", ["hf", "vllm"])
@pytest.mark.parametrize("ray", [True, False])
def test_an_eval_engine_is_counted_in_the_driver_as_a_rollout_workers_engine(small_cfg, engine, ray):
    """trainer.eval_engine=rollout: the driver also holds an engine like a rollout worker's (its weights, KV cache and
    logits; vLLM's import), on Ray and without it; policy adds nothing."""
    from dppo.trainer.memory_estimate import VLLM_IMPORT_BYTES

    keys = {"ray.enabled": ray, "trainer.device": "cpu", "trainer.mode": "separate_async", "rollout.name": engine,
            "rollout.dtype": "bfloat16", "model.num_attention_heads": 1}  # fmt: skip
    plain = small_cfg(**keys)
    cfg = small_cfg(**keys, **{"trainer.eval_engine": "rollout"})
    shape = preflight.run_shape(cfg, make_prompt_source(cfg))

    def roles(c):
        return {r.name: r for r in preflight.memory_estimate(c, shape).roles}

    worker, driver, plain_driver = roles(cfg)["rollout worker"].parts, roles(cfg)["driver"], roles(plain)["driver"]
    added = driver.each_bytes - plain_driver.each_bytes
    expected = worker["weights"] + worker["kv cache and logits"] + (VLLM_IMPORT_BYTES if engine == "vllm" else 0)
    assert added == expected > 0
