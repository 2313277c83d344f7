"""dppo.launch.precision: actor.mixed_precision=auto and rollout.dtype=auto decided once from the machine (a fake one
here: its cpuinfo flags, its GPU and its timed bf16 speedup) into concrete values and one line; a tiny run with auto
logs that line first, trains, and writes the decision into its config.yaml; nothing downstream takes the word."""

import math

import pytest
import torch
import yaml

import dppo.launch.precision as precision
import dppo.workers.rollout.worker as worker
from dppo.config import ConfigError, load_config
from dppo.data import make_prompt_source
from dppo.launch.plan import plan_run
from dppo.launch.precision import Machine, cpu_flags, resolve_precision, time_bf16_speedup
from dppo.launch.run import run
from dppo.trainer.ppo import PPOTrainer

AUTO = ["actor.mixed_precision=auto", "rollout.dtype=auto"]
AMX = frozenset({"fpu", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"})
NO_AMX = frozenset({"fpu", "avx512f", "avx512_bf16"})  # the reviewer's Xeon and this project's EPYC alike


class Probe:
    """A fake time_bf16_speedup that records its calls; speedup None: a test that expects no call (it raises)."""

    def __init__(self, speedup: float | None) -> None:
        self.speedup, self.calls = speedup, 0

    def __call__(self) -> float:
        self.calls += 1
        if self.speedup is None:
            raise AssertionError("the CPU was timed where no part computes on it")
        return self.speedup


def machine(flags=NO_AMX, speedup: float | None = None, cuda: bool = False, cuda_bf16: bool = True) -> Machine:
    return Machine(cuda, cuda and cuda_bf16, flags, Probe(speedup))


def resolved(overrides, fake):
    cfg, line = resolve_precision(load_config(overrides), fake)
    return cfg.actor.mixed_precision, cfg.rollout.dtype, line


@pytest.mark.parametrize(
    ("flags", "speedup", "expected"),
    [
        (AMX, 6.5, ("bfloat16", "bfloat16", "CPU with AMX: bf16 matmul 6.50x fp32")),
        (NO_AMX, 0.57, (None, "float32", "CPU without AMX: bf16 matmul 0.57x fp32")),  # the reviewer's Xeon
        (NO_AMX, 2.4, ("bfloat16", "bfloat16", "CPU without AMX: bf16 matmul 2.40x fp32")),  # this EPYC: the flags
        (NO_AMX, 1.3, (None, "float32", "CPU without AMX: bf16 matmul 1.30x fp32, under 1.5x")),  # a near tie
        (AMX, 1.2, (None, "float32", "CPU with AMX: bf16 matmul 1.20x fp32, under 1.5x")),  # the timing decides
        (frozenset(), 3.0, ("bfloat16", "bfloat16", "CPU: bf16 matmul 3.00x fp32")),  # no cpuinfo: no flags to name
    ],
)
def test_on_the_cpu_the_timed_matmul_decides_both_keys_and_the_flags_name_the_cpu(flags, speedup, expected):
    fake = machine(flags, speedup)
    mixed, dtype, reason = expected
    shown = f"actor.mixed_precision=auto -> {mixed or 'null'}, rollout.dtype=auto -> {dtype}"
    assert resolved(AUTO, fake) == (mixed, dtype, f"precision: {shown} ({reason})")
    assert fake.bf16_speedup.calls == 1  # timed once for both parts


def test_on_a_gpu_bf16_without_timing_the_cpu_and_each_part_on_its_own_device():
    gpu = machine(cuda=True)  # the probe raises if asked
    assert resolved(AUTO + ["rollout.name=hf", "rollout.n_gpus_per_node=0"], machine(cuda=True, speedup=0.57)) == (
        "bfloat16",
        "float32",
        "precision: actor.mixed_precision=auto -> bfloat16 (GPU with bf16); rollout.dtype=auto -> float32 "
        "(CPU without AMX: bf16 matmul 0.57x fp32)",  # dppo's sampler of a worker without a GPU: on the CPU
    )
    assert resolved(AUTO + ["ray.enabled=true", "rollout.n_gpus_per_node=1"], gpu)[:2] == ("bfloat16", "bfloat16")
    assert resolved(AUTO + ["rollout.name=vllm"], gpu)[:2] == ("bfloat16", "bfloat16")  # vLLM takes the GPU it sees
    assert resolved(["actor.mixed_precision=auto", "trainer.device=auto"], gpu) == (
        "bfloat16",
        None,
        "precision: actor.mixed_precision=auto -> bfloat16 (GPU with bf16)",
    )
    old_gpu = machine(cuda=True, cuda_bf16=False)
    assert resolved(["actor.mixed_precision=auto"], old_gpu) == (
        None,
        None,
        "precision: actor.mixed_precision=auto -> null (GPU without bf16 (compute capability below 8.0))",
    )
    # trainer.device=cpu on a GPU machine: the actor is on the CPU, timed there
    assert resolved(["actor.mixed_precision=auto", "trainer.device=cpu"], machine(cuda=True, speedup=0.57))[0] is None


def test_set_keys_stand_and_a_bf16_model_takes_no_mixed_precision():
    untouched = load_config(["actor.mixed_precision=bfloat16", "rollout.dtype=float32"])
    assert resolve_precision(untouched, machine()) == (untouched, None)  # nothing auto: not timed, no line
    assert resolved(["actor.mixed_precision=auto", "rollout.dtype=float16"], machine(speedup=3.0))[:2] == (
        "bfloat16",
        "float16",
    )
    assert resolved(AUTO + ["model.dtype=bfloat16"], machine(speedup=0.57)) == (
        None,
        "bfloat16",  # rollout.dtype's fp32 choice is model.dtype
        "precision: actor.mixed_precision=auto -> null (model.dtype=bfloat16: the actor computes in it "
        "throughout); rollout.dtype=auto -> bfloat16 (CPU without AMX: bf16 matmul 0.57x fp32)",
    )


def test_the_config_takes_only_the_word_and_nothing_downstream_takes_it(small_cfg):
    cfg = small_cfg(**{"actor.mixed_precision": "auto", "rollout.dtype": "auto"})
    assert (cfg.actor.mixed_precision, cfg.rollout.dtype) == ("auto", "auto")  # plain data: nothing probed
    with pytest.raises(ConfigError, match=r"^actor.mixed_precision='fast': expected one of 'bfloat16', 'auto'$"):
        load_config(["actor.mixed_precision=fast"])
    with pytest.raises(ConfigError, match=r"^rollout.dtype='fast': expected one of .*'float32'.*'auto'$"):
        load_config(["rollout.dtype=fast"])
    unresolved = r"^actor.mixed_precision='auto': expected a resolved value; auto is decided from this machine"
    with pytest.raises(ConfigError, match=unresolved):
        PPOTrainer(cfg)
    with pytest.raises(ConfigError, match=unresolved):
        plan_run(cfg, make_prompt_source(cfg))
    with pytest.raises(ConfigError, match=r"^rollout.dtype='auto': expected a resolved value"):
        PPOTrainer(small_cfg(**{"rollout.dtype": "auto"}))


def test_cpu_flags_read_cpuinfos_flags_line(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu avx512_bf16 amx_bf16 amx_tile\n\n")
    assert cpu_flags(str(info)) == {"fpu", "avx512_bf16", "amx_bf16", "amx_tile"}
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert cpu_flags(str(arm)) == {"fp", "asimd", "bf16", "i8mm"}
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_the_probe_times_both_dtypes_on_one_thread_and_leaves_the_threads_as_they_were(monkeypatch):
    threads = torch.get_num_threads()
    seen = []
    mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: (seen.append((a.dtype, torch.get_num_threads())), mm(a, b))[1])
    speedup = time_bf16_speedup(repeats=2)
    assert math.isfinite(speedup) and speedup > 0
    assert seen == [(torch.float32, 1), (torch.bfloat16, 1)] * 3  # a warm-up, then 2 timed, alternating
    assert torch.get_num_threads() == threads


def test_a_tiny_run_with_auto_logs_the_line_first_and_runs_what_was_decided(small_cfg, capsys, monkeypatch):
    """On a fake machine whose bf16 is slow (the reviewer's Xeon) and on one whose bf16 is fast (AMX): the line is
    the run's first, its config.yaml holds the decision, the rank computes in it and the engine holds its dtype."""
    trainers, engines = [], []
    setup, make_engine = PPOTrainer.setup, worker.make_engine
    monkeypatch.setattr(PPOTrainer, "setup", lambda self: (trainers.append(self), setup(self))[1])
    monkeypatch.setattr(worker, "make_engine", lambda *a, **k: (engines.append(make_engine(*a, **k)), engines[-1])[1])
    cases = [
        (
            machine(NO_AMX, 0.57),
            None,
            "float32",
            "-> null, rollout.dtype=auto -> float32 (CPU without AMX: bf16 matmul 0.57x",
        ),
        (
            machine(AMX, 6.0),
            "bfloat16",
            "bfloat16",
            "-> bfloat16, rollout.dtype=auto -> bfloat16 (CPU with AMX: bf16 matmul 6.00x",
        ),
    ]
    for fake, mixed, dtype, line in cases:
        monkeypatch.setattr(precision.Machine, "this", classmethod(lambda cls, fake=fake: fake))
        out = small_cfg().trainer.output_dir + f"-{dtype}"
        cfg = small_cfg(**{"trainer.total_steps": 1, "trainer.output_dir": out, **dict(a.split("=") for a in AUTO)})
        result = run(cfg)
        printed = capsys.readouterr().out.splitlines()
        assert printed[0] == f"precision: actor.mixed_precision=auto {line} fp32)"  # the first line
        written = yaml.safe_load((result.output_dir / "config.yaml").read_text())
        assert (written["actor"]["mixed_precision"], written["rollout"]["dtype"]) == (mixed, dtype)
        assert trainers[-1].actor_group.local_rank.precision.compute_dtype == (torch.bfloat16 if mixed else None)
        assert next(engines[-1].model.parameters()).dtype == getattr(torch, dtype)
        assert len(result.records) == 1 and fake.bf16_speedup.calls == 1
