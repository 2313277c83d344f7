"""Checkpoints of a LoRA run (model.lora_rank > 0): the adapter, its optimizer state and the base's hash, never the
frozen base; a resume on the same base is bitwise the run that never stopped, one on another base is refused in one
line (exit code 2)."""

import json

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from dppo.checkpoint import store as ckpt
from dppo.checkpoint.failure import checkpoint_bytes_estimate
from dppo.checkpoint.layout import ACTOR_DIR, PI_OLD_FILE, TRAINER_FILE
from dppo.checkpoint.shards import safe_reader_classes
from dppo.cli import main
from dppo.lora import is_adapter
from dppo.trainer.ppo import PPOTrainer
from dppo.trainer.report import read_metrics
from dppo.trainer.rollout import RolloutFailedError

LORA = {"model.lora_rank": 4, "model.lora_alpha": 8, "actor.lr": 0.05}


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def without_timing(records: list[dict]) -> list[dict]:
    """The records less their timings and the rollout engines' weight loads (rollout/weight_sync_*): the resumed run's
    new engine loads the base next to the adapter at its first load (the run that never stopped did at its first
    publish), and where the checkpoint held the cycle's groups scored ahead, it loads nothing in that step."""
    return [{k: v for k, v in r.items() if not k.startswith(("timing_s/", "rollout/weight_sync_"))} for r in records]


def recording_publishes(monkeypatch) -> list[tuple[int, dict]]:
    """From now on every publish to an in-process rollout appends (version, a copy of its adapter) to the list."""
    from dppo.trainer.rollout import InProcessRollout

    published, publish = [], InProcessRollout.publish

    def recording(self, weights, version):
        published.append((version, {k: v.clone() for k, v in weights.adapter.items()}))
        return publish(self, weights, version)

    monkeypatch.setattr(InProcessRollout, "publish", recording)
    return published


def newest_checkpoint(out) -> tuple:
    """(path, trainer state) of the newest trusted checkpoint of the run in out."""
    return ckpt.CheckpointDir(f"{out}/checkpoints").newest(lambda p, m: ckpt.load_torch(p / TRAINER_FILE))


def saved_tensors(checkpoint) -> dict[str, int]:
    """{name: bytes} of every tensor the checkpoint's actor shards hold (DCP's metadata: nothing is loaded)."""
    reader_cls, _ = safe_reader_classes()
    metadata = reader_cls(str(checkpoint / ACTOR_DIR)).read_metadata().state_dict_metadata
    return {
        fqn: md.size.numel() * md.properties.dtype.itemsize
        for fqn, md in metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }


# (where the run fails, trainer.checkpoint_every, snapshot.score_ahead, where the checkpoint keeps pi_old's weights):
# mid-cycle at step 2's second trigger (the checkpoint written after the failure holds pi_old: the ranks' slot of the
# adapter, or, of a cycle scored wholly ahead, what the rollout was given), or at step 3's start (step 2's checkpoint)
STOPS = {
    "mid_cycle_anchor": ((1, 1), 10, False, "anchor"),
    "mid_cycle_file": ((1, 1), 10, True, "file"),
    "step_boundary": ((2, 0), 1, True, "live"),
}


@pytest.mark.parametrize("stop", list(STOPS))
def test_a_lora_run_resumed_from_its_checkpoint_is_bitwise_the_run_that_never_stopped(small_cfg, monkeypatch, stop):
    fail_at, every, score_ahead, pi_old = STOPS[stop]
    common = {
        **LORA,
        "trainer.total_steps": 3,
        "trainer.checkpoint_every": every,
        "snapshot.score_ahead": score_ahead,
        "actor.kl_loss_coef": 0.1,
        "trainer.verify_old_log_prob": pi_old == "file",  # the verifier's pi_old: pi_old.pt's adapter on the base
    }
    out = small_cfg().trainer.output_dir
    published = recording_publishes(monkeypatch)
    clean = PPOTrainer(small_cfg(**{**common, "trainer.output_dir": f"{out}-clean"}))
    clean.fit()
    cycle_start = dict(published)[1]  # version 1's adapter: pi_old of the cycle the mid-cycle stops are in
    expected_weights = weights(clean.actor_group.local_rank.model)
    expected_records = without_timing(read_metrics(f"{out}-clean/metrics.jsonl"))

    train_trigger = PPOTrainer.train_trigger

    def failing(self, batch, prox_logp=None):
        if (self.global_step, self.local_trigger_step) == fail_at:
            raise RolloutFailedError("the replay buffer died")
        return train_trigger(self, batch, prox_logp)

    monkeypatch.setattr(PPOTrainer, "train_trigger", failing)
    with pytest.raises(RolloutFailedError, match="the replay buffer died"):
        PPOTrainer(small_cfg(**{**common, "trainer.output_dir": out})).fit()
    monkeypatch.setattr(PPOTrainer, "train_trigger", train_trigger)
    path, state = newest_checkpoint(out)
    assert state["pi_old"]["weights"] == pi_old and state["anchor"] is (pi_old == "anchor")
    assert all(is_adapter(name.split(".", 1)[1]) for name in saved_tensors(path) if name.startswith("anchor."))
    if pi_old == "file":  # what the rollout was given, of the adapter alone
        assert state["pi_old"]["adapter_only"] is True
        assert all(is_adapter(name) for name in ckpt.load_torch(path / PI_OLD_FILE))

    published.clear()
    resumed = PPOTrainer(small_cfg(**{**common, "trainer.output_dir": out, "trainer.resume": True}))
    assert resumed.resumed_from == path
    resumed.fit()
    if pi_old != "live":  # the cycle's pi_old published again as its version, never the live adapter
        version, first = published[0]
        assert version == 1 and first.keys() == cycle_start.keys()
        assert [name for name in first if not torch.equal(first[name], cycle_start[name])] == []
    got = weights(resumed.actor_group.local_rank.model)
    assert got.keys() == expected_weights.keys()
    assert [name for name in got if not torch.equal(got[name], expected_weights[name])] == []
    got_records = without_timing(read_metrics(f"{out}/metrics.jsonl"))
    diff = [
        {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        for a, b in zip(got_records, expected_records)
    ]
    assert diff == [{}] * len(expected_records)
    assert got_records == expected_records


def test_a_lora_checkpoint_holds_the_adapter_and_its_optimizer_state_and_no_base(small_cfg, tmp_path):
    one_step = {"trainer.total_steps": 1, "trainer.checkpoint_every": 1}
    lora = PPOTrainer(small_cfg(**{**LORA, **one_step, "trainer.output_dir": tmp_path / "lora"}))
    lora.fit()
    model = lora.actor_group.local_rank.model
    adapter = {n: p.numel() * p.element_size() for n, p in model.named_parameters() if p.requires_grad}
    assert adapter and all(is_adapter(n) for n in adapter)
    path, state = newest_checkpoint(lora.output_dir)
    saved = saved_tensors(path)
    # the adapter, and AdamW's two moments of each of its tensors: nothing of the frozen base
    expected = {f"model.{n}": b for n, b in adapter.items()}
    expected |= {f"optimizer.state.{n}.{m}": b for n, b in adapter.items() for m in ("exp_avg", "exp_avg_sq")}
    assert {n: b for n, b in saved.items() if not n.endswith(".step")} == expected
    assert set(state["lora"]) == {"base_hash", "vocab_size"}
    # the free-disk message's estimate of a checkpoint before any is on disk: these bytes too
    estimate = checkpoint_bytes_estimate(sum(lora.actor_group.trainable_bytes()), 1, with_reference=False)
    assert estimate == sum(b for n, b in saved.items() if not n.endswith(".step"))

    full = PPOTrainer(small_cfg(**{**one_step, "actor.lr": 0.05, "trainer.output_dir": tmp_path / "full"}))
    full.fit()
    full_bytes = sum(saved_tensors(newest_checkpoint(full.output_dir)[0]).values())
    model_bytes = sum(t.numel() * t.element_size() for t in full.actor_group.local_rank.model.parameters())
    assert full_bytes >= 3 * model_bytes  # a full run's checkpoint keeps everything, as it did
    assert "lora" not in newest_checkpoint(full.output_dir)[1]
    assert sum(saved.values()) * 4 < full_bytes  # the tiny model's adapter of rank 4 is a fifth of its weights


def test_a_lora_checkpoint_resumed_on_another_base_is_one_line_and_exit_code_2(small_args, capsys):
    args = small_args(**{**LORA, "trainer.total_steps": 1, "trainer.checkpoint_every": 1})
    assert main(["train", *args]) == 0
    capsys.readouterr()
    # another trainer.seed builds the tiny model with other weights: the adapter is not for them
    code = main(["train", *args, "trainer.total_steps=2", "trainer.resume=true", "trainer.seed=1"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2, lines
    assert not any("Traceback" in line for line in lines), lines
    assert len([line for line in lines if line.startswith("dppo: error:")]) == 1 and lines[-1].startswith(
        "dppo: error:"
    )
    out = json.loads(json.dumps(args))  # the run's own output directory names the checkpoint
    run_dir = next(a.split("=", 1)[1] for a in out if a.startswith("trainer.output_dir="))
    path, state = newest_checkpoint(run_dir)
    assert f"checkpoint {path} holds a LoRA adapter" in lines[-1]
    assert (
        f"hash to {state['lora']['base_hash']}; the base here (the tiny model of trainer.seed=1) hashes to" in lines[-1]
    )
    assert lines[-1].split("hashes to ")[1].split(":")[0] != state["lora"]["base_hash"]


def logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


def test_a_lora_runs_adapter_loads_in_peft_on_its_base_and_computes_hf_model_and_the_export_of_its_checkpoint(
    small_cfg, tmp_path
):
    """The run's adapter/ on a base built as the run built it is, in PEFT, the run's hf_model/ (the merged model) to
    fp32 rounding (PEFT adds x A^T B^T s to x W^T where hf_model/ holds W + s B A); `dppo export` of its last
    checkpoint writes the same two."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dppo.checkpoint.export import export_checkpoint
    from dppo.checkpoint.hf_model import ADAPTER_DIR, HF_MODEL_DIR
    from dppo.models import build_model

    cfg = small_cfg(**{**LORA, "trainer.total_steps": 2, "trainer.checkpoint_every": 2})
    trainer = PPOTrainer(cfg)
    result = trainer.fit()
    out = trainer.output_dir
    assert result.adapter_path == out / ADAPTER_DIR and result.hf_model_path == out / HF_MODEL_DIR
    merged = AutoModelForCausalLM.from_pretrained(out / HF_MODEL_DIR, local_files_only=True).eval()
    vocab_size = merged.config.vocab_size
    input_ids = torch.randint(0, vocab_size, (3, 9), generator=torch.Generator().manual_seed(0))
    expected = logits(merged, input_ids)
    base_logits = logits(build_model(cfg.model, vocab_size, seed=cfg.trainer.seed), input_ids)
    assert (expected - base_logits).abs().max() > 1e-3  # the adapter has learned something: a test that can fail

    exported = export_checkpoint(newest_checkpoint(out)[0], tmp_path / "export")
    for hf_dir, adapter_dir in ((out / HF_MODEL_DIR, out / ADAPTER_DIR), (exported, exported / ADAPTER_DIR)):
        peft_model = PeftModel.from_pretrained(build_model(cfg.model, vocab_size, seed=cfg.trainer.seed), adapter_dir)
        got = logits(peft_model.eval(), input_ids)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        again = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
        assert torch.equal(logits(again, input_ids), expected)  # the export's merge is the run's, bitwise
