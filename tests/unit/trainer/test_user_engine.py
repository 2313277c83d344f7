"""A rollout engine of the user's own, plugged in by class path (rollout.name=package.module:Class), trains: in the
trainer's process and in a local worker process; one that does not import is one line, exit code 2; what its spec
declares is what the run's start-up and the trainer go by; the builtin names resolve to their modules' specs."""

from __future__ import annotations

import math
import os
import textwrap

import pytest

from dppo.cli import main
from dppo.config import load_config
from dppo.launch.run import run
from tests.tiny_run import small_overrides

# The user's module. WrappedEngine has the documented constructor, (settings, model_config, device), and wraps the
# hf engine; CountingEngine subclasses HFEngine (whose from_settings builds the subclass). Each notes every sample()
# call in a class attribute (this process) and as a line "pid rows" in a file beside the module (any process).
# DeclaredEngine declares a spec of its own: every field away from its default, its memory count noting what it was
# asked for.
USER_ENGINES = """
import os
from pathlib import Path

from dppo.workers.rollout.engines import EngineSpec, RolloutEngine
from dppo.workers.rollout.engines.hf import HFEngine

CALLS = Path(__file__).with_suffix(".calls")


def note(prompts, n):
    with CALLS.open("a") as f:
        f.write(f"{os.getpid()} {len(prompts) * n}\\n")


class WrappedEngine(RolloutEngine):
    calls = 0

    def __init__(self, settings, model_config, device):
        self.inner = HFEngine.from_settings(settings, model_config, device)
        self.reports_sync = self.inner.reports_sync

    def load_weights(self, state_dict):
        return self.inner.load_weights(state_dict)

    def held_prints(self, expected):
        return self.inner.held_prints(expected)

    def seed(self, seed):
        self.inner.seed(seed)

    def sample(self, prompts, n, version=0, refresh=None):
        type(self).calls += 1
        note(prompts, n)
        return self.inner.sample(prompts, n, version, refresh)

    def greedy(self, prompts):
        return self.inner.greedy(prompts)


class CountingEngine(HFEngine):
    def sample(self, prompts, n, version=0, refresh=None):
        note(prompts, n)
        return super().sample(prompts, n, version, refresh)


LOADS = []


class DeclaredEngine(HFEngine):
    spec = EngineSpec(
        name="declared",
        build=lambda settings, model_config, device: DeclaredEngine.from_settings(settings, model_config, device),
        check_installed=lambda: "rollout.name=declared needs the declared package: run `pip install declared`",
        worker_bytes=lambda load: (LOADS.append(load), {"process": 7, "weights": 11})[1],
        accepts_delta=True,
        uses_visible_gpu=True,
    )
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """The user's module, importable under a name of this test's own (the registry caches a name's spec): (its
    name, the file its engines note their calls in)."""
    name = "user_engines_" + "".join(c if c.isalnum() else "_" for c in tmp_path.name)
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_ENGINES))
    monkeypatch.syspath_prepend(str(tmp_path))  # a forked local worker inherits it
    return name, tmp_path / f"{name}.calls"


def _calls(path) -> list[tuple[int, int]]:
    """(process id, rows) of each sample() call noted."""
    return [tuple(map(int, line.split())) for line in path.read_text().splitlines()] if path.exists() else []


def _check_records(result, steps: int) -> None:
    assert [r["step"] for r in result.records] == list(range(1, steps + 1))
    for record in result.records:
        for key, value in record.items():
            assert math.isfinite(value), (key, value)
        assert 0.0 <= record["critic/score/mean"] <= 1.0
    assert 0.0 <= result.evaluation["eval/reward"] <= 1.0


def test_a_users_engine_by_class_path_trains_3_steps_in_the_trainers_process(tmp_path, user_module):
    """trainer.mode=sync, no Ray: the engine is built in this process by its constructor (settings, model_config,
    device) and samples every group trained on: 3 steps of trainer.train_batch_size groups of rollout.n rows."""
    import importlib

    name, calls = user_module
    cfg = load_config(small_overrides(tmp_path, **{"rollout.name": f"{name}:WrappedEngine", "trainer.total_steps": 3}))
    result = run(cfg, out=open(os.devnull, "w"))
    _check_records(result, 3)
    engine_class = importlib.import_module(name).WrappedEngine
    noted = _calls(calls)
    assert engine_class.calls == len(noted) >= 3
    assert {pid for pid, _ in noted} == {os.getpid()}
    assert sum(rows for _, rows in noted) == 3 * cfg.trainer.train_batch_size * cfg.rollout.n


def test_a_users_engine_by_class_path_trains_in_a_local_worker_process(tmp_path, user_module):
    """separate_async without Ray: the worker process, forked from the trainer's, imports the user's module and
    samples with its engine (an HFEngine subclass, built by HFEngine.from_settings as the subclass)."""
    name, calls = user_module
    keys = {
        "rollout.name": f"{name}:CountingEngine",
        "trainer.total_steps": 3,
        "trainer.mode": "separate_async",
        "ray.enabled": False,
    }
    result = run(load_config(small_overrides(tmp_path, **keys)), out=open(os.devnull, "w"))
    _check_records(result, 3)
    noted = _calls(calls)
    assert noted and all(pid != os.getpid() for pid, _ in noted)  # every sample() in the worker's process


@pytest.mark.parametrize("attribute, fragments", [
    ("NoSuchEngine", ["has no 'NoSuchEngine'"]),
    ("note", ["is a function", "RolloutEngine"]),  # a function of the module, not an engine class
])  # fmt: skip
def test_a_class_path_that_names_no_engine_is_one_line_with_exit_code_2(
    small_args, capsys, user_module, attribute, fragments
):
    name, calls = user_module
    value = f"{name}:{attribute}"
    code = main(["train", *small_args(**{"rollout.name": value})])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dppo: error: "), lines
    assert f"rollout.name={value!r}" in lines[0] and all(f in lines[0] for f in fragments), lines[0]
    assert not calls.exists()


@pytest.mark.parametrize("value, fragments", [
    ("no_such_package.engines:Engine", ["module 'no_such_package.engines' does not import", "No module named"]),
    ("hf:Engine", ["module 'hf' does not import"]),
    ("vllm-like", ["expected one of 'hf', 'vllm', or the class path package.module:Class"]),
])  # fmt: skip
def test_a_name_that_does_not_resolve_is_one_line_with_exit_code_2(small_args, capsys, value, fragments):
    code = main(["train", *small_args(**{"rollout.name": value})])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("dppo: error: "), lines
    assert f"rollout.name={value!r}" in lines[0] and all(f in lines[0] for f in fragments), lines[0]


def test_what_a_users_spec_declares_is_what_the_start_up_and_the_trainer_go_by(tmp_path, user_module):
    """A spec away from every default: the memory estimate counts its worker_bytes (asked with the run's numbers),
    the trainer publishes deltas for it, rollout.dtype=auto judges the GPU it sees, the pre-flight check refuses the
    run with its check_installed line; the builtin hf spec, the same keys otherwise, gets none of these."""
    import importlib

    from dppo.config import ConfigError
    from dppo.data import make_prompt_source
    from dppo.launch.memory_estimate import rollout_worker
    from dppo.launch.plan import plan_run
    from dppo.launch.precision import rollout_on_gpu
    from dppo.launch.preflight import check_rollout_engine
    from dppo.trainer.rollout.settings import engine_settings
    from dppo.workers.rollout.engine_config import publishes_deltas

    name, _ = user_module
    declared = f"{name}:DeclaredEngine"

    def cfg(engine, **keys):
        return load_config(small_overrides(tmp_path, **{"rollout.name": engine, **keys}))

    mine, hf = cfg(declared, **{"rollout.weight_sync": "delta"}), cfg("hf", **{"rollout.weight_sync": "delta"})
    source = make_prompt_source(mine)
    assert rollout_worker(plan_run(mine, source)) == {"process": 7, "weights": 11}
    (load,) = importlib.import_module(name).LOADS
    plan = plan_run(hf, source)
    assert (load.params, load.rows, load.weight_sync) == (plan.shape.params, engine_settings(hf, source).rows, "delta")
    assert load.sequence_len == source.prompt_length + source.response_length
    assert set(rollout_worker(plan)) == {"process", "weights", "kv cache and logits"}  # the hf count
    assert publishes_deltas(mine.rollout) and not publishes_deltas(hf.rollout)
    assert not publishes_deltas(cfg(declared).rollout)  # rollout.weight_sync=full
    assert rollout_on_gpu(mine, cuda=True) and not rollout_on_gpu(hf, cuda=True)
    assert not rollout_on_gpu(mine, cuda=False)
    with pytest.raises(ConfigError, match=r"^rollout.name=declared needs the declared package: run `pip install"):
        check_rollout_engine(mine.rollout, mine.model)
    check_rollout_engine(hf.rollout, hf.model)


def test_each_builtin_name_is_its_modules_spec():
    """dppo.config.choices.ROLLOUT_ENGINES, the registry the config checks names against, against the specs: each
    line names a spec of its own name (vllm's module imports without vLLM installed: vLLM only inside functions)."""
    from dppo.config.choices import ROLLOUT_ENGINES
    from dppo.workers.rollout.engines import engine_spec
    from dppo.workers.rollout.engines.hf import SPEC as HF
    from dppo.workers.rollout.engines.vllm import SPEC as VLLM

    assert {name: engine_spec(name) for name in ROLLOUT_ENGINES} == {"hf": HF, "vllm": VLLM}
    assert all(engine_spec(name).name == name for name in ROLLOUT_ENGINES)
    assert (HF.accepts_delta, HF.uses_visible_gpu, HF.worker_bytes) == (False, False, None)
    assert (VLLM.accepts_delta, VLLM.uses_visible_gpu) == (True, True)
