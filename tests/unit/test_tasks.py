"""Tasks: rewards with partial credit, the random-policy baseline, held-out prompts, the registry."""

import numpy as np
import pytest

from dppo.tasks import (
    BOS_TOKEN,
    DIGIT_VOCAB_SIZE,
    SEP_TOKEN,
    TASKS,
    PromptSampler,
    Task,
    UnknownTaskError,
    held_out_prompts,
    make_task,
    register_task,
)


def _prompt(digits):
    return np.array([[BOS_TOKEN, *digits, SEP_TOKEN]])


@pytest.mark.parametrize(
    "name, digits, answer",
    [("copy", [3, 1, 2], [3, 1, 2]), ("reverse", [3, 1, 2], [2, 1, 3]), ("sort", [3, 1, 2], [1, 2, 3])],
)
def test_exact_answer_scores_one_and_partial_credit(name, digits, answer):
    task = make_task(name, 3)
    full = np.ones((1, 3), dtype=bool)
    assert task.rewards(_prompt(digits), np.array([answer]), full).tolist() == [1.0]
    one_wrong = list(answer)
    one_wrong[1] = (one_wrong[1] + 1) % 10
    assert task.rewards(_prompt(digits), np.array([one_wrong]), full)[0] == pytest.approx(2 / 3)
    # Tokens outside the response mask never count.
    assert task.rewards(_prompt(digits), np.array([answer]), np.array([[1, 1, 0]], dtype=bool))[0] == pytest.approx(
        2 / 3
    )


def test_uniform_random_policy_scores_about_a_tenth():
    task = make_task("copy", 5)
    rng = np.random.default_rng(0)
    prompts = task.sample_prompts(rng, 20000)
    responses = rng.integers(0, DIGIT_VOCAB_SIZE, size=(20000, 5))
    score = task.rewards(prompts, responses, np.ones_like(responses, dtype=bool)).mean()
    assert score == pytest.approx(1 / DIGIT_VOCAB_SIZE, abs=0.005)


def test_prompts_have_the_documented_layout():
    prompts = make_task("sort", 4).sample_prompts(np.random.default_rng(1), 50)
    assert prompts.shape == (50, 6)
    assert (prompts[:, 0] == BOS_TOKEN).all() and (prompts[:, -1] == SEP_TOKEN).all()
    assert ((prompts[:, 1:-1] >= 0) & (prompts[:, 1:-1] <= 9)).all()


def test_training_prompts_never_include_held_out_ones():
    task = make_task("copy", 2)  # only 100 distinct prompts: collisions would be frequent
    held = held_out_prompts(task, seed=0, num=30)
    assert len({row.tobytes() for row in held}) == 30
    drawn = PromptSampler(task, seed=1, held_out=held).sample(2000)
    held_set = {row.tobytes() for row in held}
    assert not any(row.tobytes() in held_set for row in drawn)
    assert len({row.tobytes() for row in drawn}) == 70  # every other prompt does occur


def test_held_out_is_capped_by_the_number_of_distinct_prompts():
    task = make_task("copy", 1)  # 10 distinct prompts
    assert len(held_out_prompts(task, seed=0, num=50)) == 10


def test_register_a_user_task_and_unknown_names():
    def make(length):
        return Task(
            name="const",
            prompt_fn=lambda rng, n: np.zeros((n, 2), dtype=np.int64),
            reward_fn=lambda p, r, m: (r[:, 0] == 7).astype(np.float32),
            answer_length=1,
            vocab_size=8,
        )

    register_task("const-test", make)
    try:
        task = make_task("const-test", 3)
        assert task.rewards(np.zeros((2, 2)), np.array([[7], [6]]), np.ones((2, 1), bool)).tolist() == [1.0, 0.0]
    finally:
        TASKS.pop("const-test")
    with pytest.raises(UnknownTaskError, match="copy, reverse, sort"):
        make_task("const-test", 3)


def test_module_function_task_spec(tmp_path, monkeypatch):
    (tmp_path / "user_task_mod.py").write_text(
        "from dppo.tasks import digit_task\n"
        "def make(length):\n"
        "    return digit_task('rot', length, lambda d: (d + 1) % 10)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task = make_task("user_task_mod:make", 2)
    assert task.name == "rot"
    assert task.rewards(_prompt([3, 9]), np.array([[4, 0]]), np.ones((1, 2), bool)).tolist() == [1.0]
    with pytest.raises(UnknownTaskError, match="nothing_here"):
        make_task("user_task_mod:nothing_here", 2)
