"""dppo.checkpoint.export and hf_model: a checkpoint written at world size 1 or 2 (FSDP2 over gloo) as a transformers
directory whose model gives bitwise the trained policy's log-probs on the CPU in fp32; untrusted ones refused."""

from __future__ import annotations

import json
import re
import socket

import pytest
import torch
import torch.multiprocessing as mp
from fsdp_ranks import token_rows, train_and_save_shards

from dppo.models import build_model, response_log_probs
from dppo.checkpoint import store as ckpt
from dppo.checkpoint.layout import ACTOR_DIR, TRAINER_FILE
from dppo.config import to_dict, to_yaml
from dppo.checkpoint.export import export_checkpoint, load_checkpoint_policy
from dppo.checkpoint.hf_model import save_hf_model
from dppo.trainer.ppo import PPOTrainer


def logp(model, ids, response_length: int = 4) -> torch.Tensor:
    with torch.no_grad():
        return response_log_probs(model.eval(), ids, response_length, 1.0, 3)


def load_exported(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert sa[key].dtype == sb[key].dtype and torch.equal(sa[key], sb[key]), key


@pytest.fixture(scope="module")
def ws1_run(tmp_path_factory):
    """A 2-step in-process run (world size 1) with a checkpoint after each step; the trained rank."""
    from dppo.config import load_config

    out = tmp_path_factory.mktemp("ws1") / "run"
    cfg = load_config(
        [
            f"trainer.output_dir={out}",
            "trainer.total_steps=2",
            "trainer.parameter_sync_step=2",
            "trainer.train_batch_size=4",
            "trainer.eval_prompts=8",
            "trainer.progress_bar=false",
            "trainer.mode=sync",
            "trainer.checkpoint_every=1",
            "ray.enabled=false",
            "rollout.n=4",
            "rollout.groups_per_batch=2",
            "task.length=3",
            "model.hidden_size=32",
            "model.num_hidden_layers=1",
            "model.num_attention_heads=2",
            "model.intermediate_size=64",
        ]
    )
    trainer = PPOTrainer(cfg)
    (trainer.output_dir / "config.yaml").write_text(to_yaml(cfg))  # as dppo.launch.run.run writes it
    trainer.fit()
    return trainer


def test_export_of_a_world_size_1_checkpoint_is_the_trained_policy(ws1_run, tmp_path):
    rank = ws1_run.actor_group.local_rank
    last = ws1_run.output_dir / "checkpoints" / "step_00000002"
    out = export_checkpoint(last, tmp_path / "exported")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "generation_config.json", "model.safetensors"]
    exported = load_exported(out)
    assert_same_weights(exported, rank.model)
    ids = token_rows(exported.config.vocab_size)
    assert torch.equal(logp(exported, ids), logp(rank.model, ids))  # bitwise, fp32 on the CPU
    assert exported.config.use_cache is True and rank.model.config.use_cache is False
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation.get("eos_token_id") == ws1_run.source.eos_token and generation["pad_token_id"] == 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_export_replaces_an_old_directory_whole(ws1_run, tmp_path):
    out = tmp_path / "exported"
    out.mkdir()
    (out / "stale.bin").write_bytes(b"old")
    export_checkpoint(ws1_run.output_dir / "checkpoints" / "step_00000001", out)
    assert not (out / "stale.bin").exists() and (out / "model.safetensors").is_file()


@pytest.mark.parametrize("tamper", ["shard", "trainer", "manifest", "ledger", "extra_file", "not_a_checkpoint"])
def test_an_untrusted_checkpoint_is_refused_in_one_line(ws1_run, tmp_path, tamper):
    import shutil

    run = tmp_path / "checkpoints"
    shutil.copytree(ws1_run.output_dir / "checkpoints", run)
    path = run / "step_00000002"
    if tamper == "shard":
        shard = next((path / ACTOR_DIR).glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))
    elif tamper == "trainer":
        (path / TRAINER_FILE).write_bytes(b"\x80\x04cos\nsystem\n.")
    elif tamper == "manifest":
        manifest = json.loads((path / ckpt.MANIFEST).read_text())
        manifest["version"] += 1
        (path / ckpt.MANIFEST).write_text(json.dumps(manifest))
    elif tamper == "ledger":
        (run / ckpt.LEDGER).unlink()
    elif tamper == "extra_file":
        (path / ACTOR_DIR / "planted.py").write_text("print('hi')")
    else:
        path = tmp_path / "somewhere"
        path.mkdir()
    with pytest.raises(ckpt.CheckpointError, match="refusing checkpoint") as err:
        export_checkpoint(path, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


# ---- world size 2: FSDP2 shards written by two gloo processes ---------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_export_of_a_world_size_2_checkpoint_is_the_gathered_policy(small_cfg, tmp_path):
    cfg = small_cfg(**{"trainer.n_gpus_per_node": 2, "ray.enabled": True, "trainer.mode": "separate_async"})
    vocab_size = 13
    full_path = tmp_path / "full.pt"

    def write(staging):
        mp.start_processes(
            train_and_save_shards,
            args=(cfg, vocab_size, _free_port(), str(staging / ACTOR_DIR), str(full_path)),
            nprocs=2,
            start_method="spawn",
        )
        torch.save({"global_step": 1, "version": 1, "trigger": 0, "config": to_dict(cfg)}, staging / TRAINER_FILE)

    path = ckpt.CheckpointDir(tmp_path / "checkpoints").save(1, 1, write)
    assert sorted(p.name for p in (path / ACTOR_DIR).glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    out = export_checkpoint(path, tmp_path / "exported")
    exported = load_exported(out)
    gathered = build_model(cfg.model, vocab_size, seed=0)
    gathered.load_state_dict(torch.load(full_path, weights_only=True))
    assert_same_weights(exported, gathered)
    assert not torch.equal(
        gathered.model.embed_tokens.weight, build_model(cfg.model, vocab_size, 0).model.embed_tokens.weight
    )
    ids = token_rows(vocab_size)
    assert torch.equal(logp(exported, ids), logp(gathered, ids))
    policy = load_checkpoint_policy(path)
    assert policy.global_step == 1 and policy.tokenizer_dir is None


def test_tied_weights_are_saved_once_and_come_back_tied(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    out = save_hf_model(model, tmp_path / "tied")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert ("lm_head.weight" in keys) != ("model.embed_tokens.weight" in keys)  # one copy
    loaded = load_exported(out)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_the_model_dtype_and_the_tokenizer_of_model_path_go_with_it(text_example, tmp_path):
    from transformers import AutoTokenizer

    model = build_model(type("M", (), {"path": str(text_example["model"]), "dtype": "bfloat16"})(), 1, seed=0)
    out = save_hf_model(model, tmp_path / "hf", tokenizer_dir=text_example["model"])
    loaded = load_exported(out)
    assert loaded.dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    original = AutoTokenizer.from_pretrained(text_example["model"], local_files_only=True)
    assert tokenizer("reverse 407")["input_ids"] == original("reverse 407")["input_ids"]
    assert tokenizer.chat_template == original.chat_template and tokenizer.eos_token_id == original.eos_token_id


# ---- dppo eval ---------------------------------------------------------------------------------------


def test_eval_of_the_checkpoint_and_of_its_export_reproduces_the_runs_final_evaluation(ws1_run, tmp_path):
    from dppo.commands.evaluate import run_eval, write_eval

    final = ws1_run.metrics.records[-1]
    expected = {key: final[key] for key in ("eval/reward", "eval/accuracy", "eval/prompts")}
    last = ws1_run.output_dir / "checkpoints" / "step_00000002"
    from_checkpoint = run_eval(last)
    assert from_checkpoint.metrics == expected and from_checkpoint.n == 1 and from_checkpoint.temperature == 0.0
    exported = export_checkpoint(last, tmp_path / "exported")
    from_dir = run_eval(exported, config_file=str(ws1_run.output_dir / "config.yaml"))
    assert from_dir.metrics == expected and from_dir.prompts == 8
    written = json.loads(write_eval(from_dir, tmp_path / "eval.json").read_text())
    assert written["metrics"] == expected and written["model"] == str(exported)
    assert "eval/reward" in from_dir.table() and "greedy" in from_dir.table()


def test_eval_samples_rollout_n_per_prompt_when_asked(ws1_run):
    from dppo.config import ConfigError
    from dppo.commands.evaluate import run_eval

    last = ws1_run.output_dir / "checkpoints" / "step_00000002"
    sampled = run_eval(last, ["rollout.n=3", "rollout.temperature=1.0"])
    again = run_eval(last, ["rollout.n=3", "rollout.temperature=1.0"])
    assert sampled.n == 3 and sampled.metrics["eval/prompts"] == 24.0 and sampled.metrics == again.metrics
    other_seed = run_eval(last, ["rollout.n=3", "rollout.temperature=1.0", "trainer.seed=1"])
    assert other_seed.metrics["eval/prompts"] == 24.0
    with pytest.raises(ConfigError, match="rollout.temperature"):
        run_eval(last, ["rollout.n=3", "rollout.temperature=0"])


def test_eval_through_the_rollouts_engine_reproduces_the_runs_final_evaluation_and_samples(ws1_run):
    """trainer.eval_engine=rollout: the checkpoint's weights in an engine as rollout.name (hf here) builds it; greedy,
    it decodes what the run's own evaluation decoded; with rollout.n it samples n per prompt, a batch of prompts at a
    time sized by the rollout's rows."""
    from dppo.commands.evaluate import run_eval

    final = ws1_run.metrics.records[-1]
    expected = {key: final[key] for key in ("eval/reward", "eval/accuracy", "eval/prompts")}
    last = ws1_run.output_dir / "checkpoints" / "step_00000002"
    greedy = run_eval(last, ["trainer.eval_engine=rollout"])
    assert greedy.metrics == expected
    sampled = run_eval(last, ["trainer.eval_engine=rollout", "rollout.n=3", "rollout.temperature=1.0"])
    assert sampled.n == 3 and sampled.metrics["eval/prompts"] == 24.0


def test_eval_decides_rollout_dtype_auto_from_the_machine_and_says_so(ws1_run, monkeypatch):
    """rollout.dtype=auto on a fake machine whose bf16 is slow: the engine decodes in model.dtype, exactly as the run's
    own evaluation did, and the table says why."""
    from dppo.commands.evaluate import run_eval
    from dppo.launch import precision

    slow = precision.Machine(False, False, frozenset({"avx512_bf16"}), lambda: 0.57)
    monkeypatch.setattr(precision.Machine, "this", classmethod(lambda cls: slow))
    final = ws1_run.metrics.records[-1]
    last = ws1_run.output_dir / "checkpoints" / "step_00000002"
    result = run_eval(last, ["trainer.eval_engine=rollout", "rollout.dtype=auto"])
    assert result.metrics == {key: final[key] for key in ("eval/reward", "eval/accuracy", "eval/prompts")}
    assert result.config["rollout"]["dtype"] == "float32"
    assert result.precision == "precision: rollout.dtype=auto -> float32 (CPU without AMX: bf16 matmul 0.57x fp32)"
    assert re.search(r"^  precision +rollout.dtype=auto -> float32 \(CPU without AMX", result.table(), re.M)


def test_eval_refuses_what_is_neither_a_model_nor_a_checkpoint(tmp_path):
    from dppo.config import ConfigError
    from dppo.commands.evaluate import run_eval

    with pytest.raises(ConfigError, match="neither a transformers model directory"):
        run_eval(tmp_path)


def test_text_eval_of_a_checkpoint_and_its_export_reproduces_val_score(text_example, tmp_path):
    """Text data: the export carries the tokenizer (AutoTokenizer loads it), and `dppo eval` with data.val_files
    alone gives the run's final val/score/<data_source> from the checkpoint and from the exported directory."""
    from transformers import AutoTokenizer

    from dppo.config import load_config
    from dppo.commands.evaluate import run_eval

    keys = {
        "data.val_files": text_example["val"],
        "custom_reward_function.path": text_example["reward"],
        "data.max_prompt_length": 32,
        "data.max_response_length": 6,
    }
    cfg = load_config(
        [
            f"model.path={text_example['model']}",
            f"data.train_files={text_example['train']}",
            *(f"{k}={v}" for k, v in keys.items()),
            f"trainer.output_dir={tmp_path / 'run'}",
            "trainer.total_steps=1",
            "trainer.parameter_sync_step=2",
            "trainer.train_batch_size=4",
            "trainer.progress_bar=false",
            "trainer.mode=sync",
            "trainer.checkpoint_every=1",
            "ray.enabled=false",
            "rollout.n=4",
            "rollout.groups_per_batch=2",
        ]
    )
    trainer = PPOTrainer(cfg)
    trainer.fit()
    final = {k: v for k, v in trainer.metrics.records[-1].items() if k.startswith("val/")}
    assert sorted(final) == [
        f"val/{key}/{source}"
        for key in ("exact_match", "response_chars", "score")
        for source in ("reverse_long", "reverse_short")
    ]
    last = tmp_path / "run" / "checkpoints" / "step_00000001"
    assert run_eval(last).metrics == final
    exported = export_checkpoint(last, tmp_path / "exported")
    tokenizer = AutoTokenizer.from_pretrained(exported, local_files_only=True)
    assert tokenizer.eos_token_id == trainer.source.eos_token and tokenizer.chat_template
    assert run_eval(exported, [f"{k}={v}" for k, v in keys.items()]).metrics == final


def test_cli_export_and_eval_print_where_they_wrote_and_refuse_in_one_line(ws1_run, tmp_path, capsys):
    import shutil

    from dppo.cli import main

    last = ws1_run.output_dir / "checkpoints" / "step_00000002"
    assert main(["export", str(last), str(tmp_path / "hf")]) == 0
    assert f"exported {last} to {tmp_path / 'hf'}" in capsys.readouterr().out
    assert (
        main(
            [
                "eval",
                str(tmp_path / "hf"),
                "--config",
                str(ws1_run.output_dir / "config.yaml"),
                "--out",
                str(tmp_path / "e.json"),
                "trainer.eval_prompts=4",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "eval/reward" in printed and f"written: {tmp_path / 'e.json'}" in printed
    assert json.loads((tmp_path / "e.json").read_text())["prompts"] == 4

    copy = tmp_path / "checkpoints"
    shutil.copytree(ws1_run.output_dir / "checkpoints", copy)
    (copy / "step_00000002" / TRAINER_FILE).write_bytes(b"tampered")
    assert main(["export", str(copy / "step_00000002"), str(tmp_path / "out")]) == 4
    assert main(["eval", str(copy / "step_00000002")]) == 4
    assert main(["eval", str(last), "--config", str(ws1_run.output_dir / "config.yaml")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith("dppo: error: ") for line in lines)
    assert "refusing checkpoint" in lines[0] and "trainer.pt: content does not match its manifest" in lines[0]


def test_a_resumed_run_continues_its_tracker_runs(tmp_path, monkeypatch):
    """In-process (world size 1): a run with every tracker, then trainer.resume=true for one more step: the same W&B
    run id (a second offline run directory), the same MLflow run, TensorBoard and both trackers equal to the final
    metrics.jsonl; trainer.pt keeps the ids."""
    from tracker_files import mlflow_run, tensorboard_scalars, wandb_offline_run

    from dppo.config import load_config
    from dppo.trainer.report import read_metrics
    from dppo.trainer.trackers import scalars

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    out = tmp_path / "run"
    common = [
        f"trainer.output_dir={out}",
        "trainer.parameter_sync_step=2",
        "trainer.train_batch_size=4",
        "trainer.eval_prompts=8",
        "trainer.progress_bar=false",
        "trainer.mode=sync",
        "trainer.checkpoint_every=1",
        "ray.enabled=false",
        "rollout.n=4",
        "rollout.groups_per_batch=2",
        "task.length=3",
        "model.hidden_size=32",
        "model.num_hidden_layers=1",
        "model.num_attention_heads=2",
        "model.intermediate_size=64",
        "trainer.logger=[console,tensorboard,wandb,mlflow]",
        "trainer.experiment_name=resumed",
    ]
    PPOTrainer(load_config([*common, "trainer.total_steps=2"])).fit()
    first = ckpt.load_torch(out / "checkpoints" / "step_00000002" / TRAINER_FILE)["trackers"]
    resumed = PPOTrainer(load_config([*common, "trainer.total_steps=3", "trainer.resume=true"]))
    assert resumed.global_step == 2
    resumed.fit()
    after = ckpt.load_torch(out / "checkpoints" / "step_00000003" / TRAINER_FILE)["trackers"]
    assert after == first and set(first) == {"wandb", "mlflow"}

    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    want = {}
    for record in records:
        for key, value in scalars(record).items():
            want.setdefault(key, {})[record["step"]] = value
    board = tensorboard_scalars(out / "tensorboard")
    assert set(board) == set(want) and board["critic/score/mean"] == pytest.approx(want["critic/score/mean"])
    runs = [wandb_offline_run(d) for d in sorted((out / "wandb").glob("offline-run-*"))]
    assert len(runs) == 2 and {r["run_id"] for r in runs} == {first["wandb"]["run_id"]}
    assert 3 in runs[1]["history"] and runs[1]["summary"]["eval/reward"] == records[-1]["eval/reward"]
    # the eval of step 2 (the first run's last) was logged, then step 3's by the resumed run, in one MLflow run
    logged = mlflow_run(out / "mlruns", first["mlflow"]["run_id"])
    assert logged["metrics"]["critic/score/mean"] == want["critic/score/mean"]
    assert logged["metrics"]["eval/reward"][3] == records[-1]["eval/reward"]


def test_hf_model_at_world_size_1_is_the_trained_policy(ws1_run):
    rank = ws1_run.actor_group.local_rank
    hf = load_exported(ws1_run.output_dir / "hf_model")
    assert_same_weights(hf, rank.model)
    ids = token_rows(hf.config.vocab_size)
    assert torch.equal(logp(hf, ids), logp(rank.model, ids))
    assert not (ws1_run.output_dir / "checkpoints" / "step_00000002" / ACTOR_DIR / "huggingface").exists()


def test_a_mid_cycle_checkpoint_holds_the_live_weights_as_hf_model(small_cfg, monkeypatch):
    """save_contents with hf_model: a rollout failure at step 1's second trigger checkpoints mid-cycle; its
    actor/huggingface/ holds the live weights (after trigger 0's step), not the cycle start's published ones."""
    from dppo.trainer.rollout import InProcessRollout, RolloutFailedError

    fetch, calls = InProcessRollout.fetch, []

    def failing_fetch(self, num_groups, trainer_version):
        calls.append(trainer_version)
        if len(calls) == 2:  # step 1, trigger 1
            raise RolloutFailedError("the replay buffer died")
        return fetch(self, num_groups, trainer_version)

    monkeypatch.setattr(InProcessRollout, "fetch", failing_fetch)
    trainer = PPOTrainer(
        small_cfg(
            **{
                "trainer.total_steps": 2,
                "trainer.checkpoint_every": 10,
                "snapshot.score_ahead": False,
                "actor.checkpoint.save_contents": "[model,optimizer,extra,hf_model]",
            }
        )
    )
    cycle_start = {k: v.clone() for k, v in trainer.actor_group.local_rank.model.state_dict().items()}  # pi_old
    with pytest.raises(RolloutFailedError, match="step_00000000_trigger_1"):
        trainer.fit()
    path = trainer.output_dir / "checkpoints" / "step_00000000_trigger_1"
    hf = load_exported(path / ACTOR_DIR / "huggingface")
    assert_same_weights(hf, trainer.actor_group.local_rank.model)  # the live weights, one step in
    assert any(not torch.equal(hf.state_dict()[k], v) for k, v in cycle_start.items())
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    assert f"{ACTOR_DIR}/huggingface/model.safetensors" in manifest["files"]
