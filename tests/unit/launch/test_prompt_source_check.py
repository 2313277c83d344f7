"""dppo.launch.preflight.check_prompt_source: what the config's rules cannot say without building it (a task's factory
imported, its held-out prompts drawn; a reasoning-gym dataset built, tests/unit/data/test_reasoning_gym.py), asked
before a run starts, each a one-line ConfigError naming the key and the value. The config itself builds none of it
(test_a_config_builds_no_task_and_imports_no_factory)."""

import pytest

from dppo.config import ConfigError, load_config
from dppo.launch import preflight
from dppo.launch.preflight import check_prompt_source


def check(cfg) -> None:
    check_prompt_source(cfg.data, cfg.model, cfg.task, cfg.trainer)


@pytest.mark.parametrize(
    "override, fragments",
    [
        # Too few distinct prompts for the held-out set: all would be held out, none left to train on.
        (["task.length=2"], ["trainer.eval_prompts=256", "task.length=2", "only 100 distinct prompts"]),
        (["task.length=1"], ["trainer.eval_prompts=256", "task.length=1", "only 10 distinct prompts"]),
        (["task.length=2", "trainer.eval_prompts=100"], ["trainer.eval_prompts=100", "task.length=2"]),
        (["task.name=no_such_module_here:make"], ["task.name='no_such_module_here:make'", "importable module"]),
    ],
)
def test_a_task_without_prompts_to_train_on_or_a_factory_that_does_not_import_is_a_config_error(override, fragments):
    cfg = load_config(override)  # plain data: the config takes it
    with pytest.raises(ConfigError) as info:
        check(cfg)
    assert isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_a_task_factory_that_returns_no_task_is_a_config_error(tmp_path, monkeypatch):
    (tmp_path / "not_a_task_mod.py").write_text("def make(length):\n    return 'copy'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"task.name='not_a_task_mod:make': .*returned str; expected a dppo.tasks.Task"
    ):
        check(load_config(["task.name=not_a_task_mod:make", "trainer.eval_prompts=0"]))


def test_the_held_out_set_may_leave_few_training_prompts_but_not_none():
    check(load_config(["task.length=2", "trainer.eval_prompts=99"]))
    check(load_config(["task.length=1", "trainer.eval_prompts=0"]))
    with pytest.raises(ConfigError, match="trainer.eval_prompts=100"):
        check(load_config(["task.length=2", "trainer.eval_prompts=100"]))


def test_a_config_builds_no_task_and_imports_no_factory(monkeypatch):
    """Building the config checks task.name's form only: the factory is imported here, not by load_config."""
    import dppo.tasks

    monkeypatch.setattr(dppo.tasks, "make_task", lambda *a: pytest.fail("the config built a task"))
    cfg = load_config(["task.name=no_such_module_here:make", "task.length=1"])
    assert cfg.task.name == "no_such_module_here:make"
    with pytest.raises(ConfigError, match="expected a registered task"):
        load_config(["task.name=nosuchtask"])  # not a registered name, nor a module:function: a pure check


def test_eval_prompts_past_what_the_task_can_make_are_refused_by_counting(monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the held-out set was drawn")

    monkeypatch.setattr(preflight, "held_out_prompts", never)
    with pytest.raises(
        ConfigError,
        match=r"trainer.eval_prompts=1000000: task 'copy' with task.length=3 has only "
        r"1000 distinct prompts",
    ):
        check(load_config(["trainer.eval_prompts=1000000", "task.length=3"]))
