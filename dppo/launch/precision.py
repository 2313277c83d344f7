"""actor.mixed_precision=auto and rollout.dtype=auto: bf16 only where this machine computes it faster, decided once
before a run starts and handed down resolved. The config holds only the word; the ranks, the rollout workers, the
evaluation engine, the memory estimate and the run's config.yaml get bfloat16 or the fp32 choice.

    cfg, line = resolve_precision(cfg)    line: "precision: ... -> ... (why)", one line to print; None: no key was auto

The rule, per part (the actor on trainer.device; the rollout engine on its own device):
    a GPU        bf16 where torch says it has it (compute capability 8.0 and later), else the fp32 choice
    a CPU        bf16 where one bf16 matmul runs at least MIN_SPEEDUP x the same in fp32 (time_bf16_speedup)

Why the CPU is timed rather than read from /proc/cpuinfo: the flags do not say it. On an Intel Xeon with avx512_bf16
but no AMX the (512, 576) x (576, 1536) matmul ran at 0.57x fp32 on one thread (and `make real`'s steps took 31-51 s
in bf16 against 22-25 s in fp32); on the AMD EPYC with avx512_bf16 and no AMX this was written on, at 1.7-3.5x
(issue 42); with AMX at 3-12x (496-825 against 71-154 GFLOP/s). The flags go into the reason only. The probe is the
best of 5 interleaved runs of each dtype on one thread, about 0.3 s: other processes only ever add time, so the best
runs are the least disturbed (the medians of 5 read 1.3-2.7x here under load, the best 1.7-3.5x). bf16 takes at
least MIN_SPEEDUP because the step gains less than the matmuls (the norms, the softmax, autocast's casts of the
weights do not speed up: at about 2x the matmul a SmolLM2-sized layer stack's forward and backward gained 1.38x here)
and costs precision (the rollout/trainer gap the correction weighs): a near tie is not worth it. Near MIN_SPEEDUP
two starts may decide differently; a resumed run then goes on in the other precision (its weights are fp32 either
way). The decision is this machine's: on a cluster whose nodes differ from the one `dppo train` starts on, set the
keys.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from dppo.config import DppoConfig
from dppo.config.choices import PRECISION_AUTO
from dppo.workers.rollout.engines import engine_spec

PROBE_MNK = (512, 576, 1536)  # an MLP matmul of SmolLM2-135M (hidden 576, MLP 1536) over 512 tokens
PROBE_REPEATS = 5
MIN_SPEEDUP = 1.5  # bf16 on the CPU where its matmul runs at least this many times as fast as fp32's


def time_bf16_speedup(repeats: int = PROBE_REPEATS) -> float:
    """fp32's time over bf16's for one PROBE_MNK matmul on one thread of this CPU (above 1: bf16 is faster), each
    the best of `repeats` runs after a warm-up, the two dtypes alternating."""
    m, k, n = PROBE_MNK
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    operands = {torch.float32: (a, b), torch.bfloat16: (a.bfloat16(), b.bfloat16())}
    best = dict.fromkeys(operands, math.inf)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core's speed: the ratio holds at any thread count, and others disturb it less
    try:
        for run in range(repeats + 1):  # run 0 warms up (oneDNN builds its kernels)
            for dtype, (x, y) in operands.items():
                start = time.perf_counter()
                torch.mm(x, y)
                if run:
                    best[dtype] = min(best[dtype], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best[torch.float32] / best[torch.bfloat16]


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (x86's `flags`, Arm's `Features` line of cpuinfo); empty where there is no such file."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@dataclass(frozen=True)
class Machine:
    """What the decision reads of the machine (tests give their own)."""

    cuda: bool  # torch.cuda.is_available()
    cuda_bf16: bool  # torch.cuda.is_bf16_supported() where cuda
    flags: frozenset[str]  # cpu_flags()
    bf16_speedup: Callable[[], float]  # time_bf16_speedup: asked at most once, and only for a part on the CPU

    @classmethod
    def this(cls) -> Machine:
        cuda = torch.cuda.is_available()
        return cls(cuda, cuda and torch.cuda.is_bf16_supported(), cpu_flags(), time_bf16_speedup)


@dataclass(frozen=True)
class Verdict:
    """Whether bf16 is the faster precision for one part of the run, and why, in words."""

    bf16: bool
    reason: str


class _Judge:
    """Verdicts for the GPU and the CPU of a Machine, the CPU's timed once."""

    def __init__(self, machine: Machine) -> None:
        self.machine = machine
        self._cpu: Verdict | None = None

    def gpu(self) -> Verdict:
        if not self.machine.cuda:  # a GPU of another node (a rollout pool on a joined cluster): bf16 is its norm
            return Verdict(True, "GPU")
        if self.machine.cuda_bf16:
            return Verdict(True, "GPU with bf16")
        return Verdict(False, "GPU without bf16 (compute capability below 8.0)")

    def cpu(self) -> Verdict:
        if self._cpu is None:
            speedup = self.machine.bf16_speedup()
            flags = self.machine.flags
            kind = "CPU" if not flags else "CPU with AMX" if "amx_bf16" in flags else "CPU without AMX"
            short = f", under {MIN_SPEEDUP:g}x" if 1.0 <= speedup < MIN_SPEEDUP else ""
            self._cpu = Verdict(speedup >= MIN_SPEEDUP, f"{kind}: bf16 matmul {speedup:.2f}x fp32{short}")
        return self._cpu


def actor_on_gpu(cfg: DppoConfig, cuda: bool) -> bool:
    """Whether the actor's ranks compute on a GPU: trainer.device cuda, or auto where this machine has one."""
    return cfg.trainer.device != "cpu" and cuda


def rollout_on_gpu(cfg: DppoConfig, cuda: bool) -> bool:
    """Whether the rollout engines compute on a GPU: a pool of their own (rollout.n_gpus_per_node), or an engine
    that takes the GPU its process sees (its spec's uses_visible_gpu: vLLM); the hf engine of a worker without one
    runs on the CPU."""
    return cfg.rollout.n_gpus_per_node > 0 or (cuda and engine_spec(cfg.rollout.name).uses_visible_gpu)


def resolve_precision(cfg: DppoConfig, machine: Machine | None = None) -> tuple[DppoConfig, str | None]:
    """cfg with actor.mixed_precision=auto and rollout.dtype=auto decided (the module docstring's rule), and the one
    line that says what each became and why ("precision: actor.mixed_precision=auto -> null, rollout.dtype=auto ->
    float32 (CPU without AMX: bf16 matmul 0.57x fp32)"); (cfg, None) where neither key is auto. machine: this one
    (Machine.this()) unless given."""
    a, r = cfg.actor, cfg.rollout
    if PRECISION_AUTO not in (a.mixed_precision, r.dtype):
        return cfg, None
    judge = _Judge(machine or Machine.this())
    choices: list[tuple[str, str]] = []  # (key -> value, reason)
    if a.mixed_precision == PRECISION_AUTO:
        if cfg.model.dtype != "float32":  # mixed precision is bf16 compute over fp32 master weights
            verdict = Verdict(False, f"model.dtype={cfg.model.dtype}: the actor computes in it throughout")
        else:
            verdict = judge.gpu() if actor_on_gpu(cfg, judge.machine.cuda) else judge.cpu()
        a = dataclasses.replace(a, mixed_precision="bfloat16" if verdict.bf16 else None)
        choices.append((f"actor.mixed_precision=auto -> {a.mixed_precision or 'null'}", verdict.reason))
    if r.dtype == PRECISION_AUTO:
        verdict = judge.gpu() if rollout_on_gpu(cfg, judge.machine.cuda) else judge.cpu()
        r = dataclasses.replace(r, dtype="bfloat16" if verdict.bf16 else cfg.model.dtype)
        choices.append((f"rollout.dtype=auto -> {r.dtype}", verdict.reason))
    return dataclasses.replace(cfg, actor=a, rollout=r), precision_line(choices)


def precision_line(choices: list[tuple[str, str]]) -> str:
    """ "precision: " and each choice with its reason, the reason said once where the choices share it."""
    if len({reason for _, reason in choices}) == 1:
        return f"precision: {', '.join(choice for choice, _ in choices)} ({choices[0][1]})"
    return "precision: " + "; ".join(f"{choice} ({reason})" for choice, reason in choices)
