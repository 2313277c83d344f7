"""One tiny `dppo train` at world size 2 (FSDP2 ranks on a local Ray cluster) with every tracker and hf_model in its
checkpoints, shared by every assertion: hf_model/ is the trained policy (the ranks' shards) bitwise, the export of
its last checkpoint equals hf_model/, `dppo eval` of hf_model/ reproduces the final evaluation, and TensorBoard,
W&B (offline) and MLflow (file store) hold metrics.jsonl's scalars at its steps."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from fsdp_ranks import token_rows
from tiny_run import tiny_run
from tracker_files import mlflow_run, tensorboard_scalars, wandb_offline_run

from dppo.cli import main
from dppo.trainer.report import read_metrics

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
LAST = "step_00000002"


@pytest.fixture(scope="module")
def ws2_run(tmp_path_factory):
    """`dppo train` (the CLI, in this process) on a new local Ray cluster that sees this tree's dppo."""
    import ray

    saved = {k: os.environ.pop(k, None) for k in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "WANDB_MODE")}
    os.environ["WANDB_MODE"] = "offline"
    out = tmp_path_factory.mktemp("ws2") / "run"
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        logging_level="WARNING",
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}},
    )
    try:
        code = main(
            [
                "train",
                *tiny_run(
                    out,
                    2,
                    "trainer.n_gpus_per_node=2",
                    "trainer.mode=sync",
                    "trainer.checkpoint_every=1",
                    "rollout.num_workers=1",
                    "actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
                    "trainer.logger=[console,jsonl,tensorboard,wandb,mlflow]",
                    "trainer.project_name=dppo-it",
                    "trainer.experiment_name=ws2",
                ),
            ]
        )
        assert code == 0
        yield out
    finally:
        ray.shutdown()
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()


def _logp(model, ids):
    from dppo.models import response_log_probs

    with torch.no_grad():
        return response_log_probs(model, ids, 4, 1.0, 4)


def test_hf_model_at_world_size_2_is_the_trained_policy_bitwise(ws2_run):
    from dppo.models import model_from_config
    from dppo.checkpoint.shards import load_full_weights

    hf = _load(ws2_run / "hf_model")
    shards = load_full_weights(ws2_run / "checkpoints" / LAST / "actor")  # what the two ranks held at the end
    assert sorted((ws2_run / "checkpoints" / LAST / "actor").glob("*.distcp"))[1].name == "__1_0.distcp"
    trained = model_from_config(hf.config, "float32")
    trained.load_state_dict(shards)
    for key, value in trained.state_dict().items():
        assert torch.equal(hf.state_dict()[key], value), key
    ids = token_rows(hf.config.vocab_size)
    assert torch.equal(_logp(hf, ids), _logp(trained, ids))
    assert hf.dtype == torch.float32
    assert sorted(p.name for p in (ws2_run / "hf_model").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]


def test_the_export_of_the_last_checkpoint_and_its_huggingface_dir_equal_hf_model(ws2_run, tmp_path, capsys):
    assert main(["export", str(ws2_run / "checkpoints" / LAST), str(tmp_path / "exported")]) == 0
    assert str(tmp_path / "exported") in capsys.readouterr().out
    expected = (ws2_run / "hf_model" / "model.safetensors").read_bytes()
    assert (tmp_path / "exported" / "model.safetensors").read_bytes() == expected
    in_checkpoint = ws2_run / "checkpoints" / LAST / "actor" / "huggingface"
    assert (in_checkpoint / "model.safetensors").read_bytes() == expected
    for name in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "exported" / name).read_text()) == json.loads(
            (ws2_run / "hf_model" / name).read_text()
        )
    manifest = json.loads((ws2_run / "checkpoints" / LAST / "manifest.json").read_text())
    assert "actor/huggingface/model.safetensors" in manifest["files"]


def test_eval_of_hf_model_reproduces_the_final_evaluation(ws2_run, tmp_path, capsys):
    final = read_metrics(ws2_run / "metrics.jsonl")[-1]
    out = tmp_path / "eval.json"
    assert main(["eval", str(ws2_run / "hf_model"), "--config", str(ws2_run / "config.yaml"), "--out", str(out)]) == 0
    metrics = json.loads(out.read_text())["metrics"]
    assert metrics == {key: final[key] for key in ("eval/reward", "eval/accuracy", "eval/prompts")}
    assert "eval/reward" in capsys.readouterr().out


def test_trackers_hold_the_scalars_of_metrics_jsonl_at_its_steps(ws2_run):
    from dppo.checkpoint.store import load_torch
    from dppo.trainer.trackers import scalars

    records = read_metrics(ws2_run / "metrics.jsonl")
    want = {}
    for record in records:
        for key, value in scalars(record).items():
            want.setdefault(key, {})[record["step"]] = value
    assert "eval/reward" in want and "timing_s/step" in want

    board = tensorboard_scalars(ws2_run / "tensorboard")
    assert set(board) == set(want)
    for key, steps in want.items():
        assert board[key] == pytest.approx(steps, rel=1e-6, abs=1e-30), key  # event files store float32

    state = load_torch(ws2_run / "checkpoints" / LAST / "trainer.pt")["trackers"]
    (wandb_dir,) = (ws2_run / "wandb").glob("offline-run-*")
    run = wandb_offline_run(wandb_dir)
    assert run["run_id"] == state["wandb"]["run_id"] and run["project"] == "dppo-it"
    got = {key: {s: row[key] for s, row in run["history"].items() if key in row} for key in want}
    assert got == want
    assert run["summary"]["eval/reward"] == records[-1]["eval/reward"]

    logged = mlflow_run(ws2_run / "mlruns", state["mlflow"]["run_id"])
    assert logged["metrics"] == want
    assert logged["params"]["trainer.n_gpus_per_node"] == "2" and logged["status"] == "FINISHED"
