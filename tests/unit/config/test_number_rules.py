"""One rule for numbers: '_' never separates digits (YAML would read 1_000 as 1000 and 0.5_2 as 0.52), on the
command line and in a config file alike."""

import pytest

from dppo.config import ConfigError, load_config

RC = "algorithm.rollout_correction"


def from_file(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return load_config([], config_file=path)


@pytest.mark.parametrize(
    "key, value",
    [
        ("actor.lr", "1_000"),
        ("trainer.total_steps", "1_0"),
        ("actor.grad_clip", "0.5_2"),
        ("rollout.temperature", "1_0e-1"),
    ],
)
def test_a_number_written_with_underscores_is_refused_everywhere(tmp_path, key, value):
    expected = f"{key}={value}: write numbers without '_' separators (e.g. {value.replace('_', '')})"
    with pytest.raises(ConfigError, match=rf"^{expected.replace('.', '[.]').replace('(', '[(]').replace(')', '[)]')}"):
        load_config([f"{key}={value}"])
    section, name = key.split(".")
    with pytest.raises(ConfigError, match="write numbers without '_' separators"):
        from_file(tmp_path, f"{section}:\n  {name}: {value}\n")


def test_in_a_threshold_underscore_separates_lo_and_hi_from_the_command_line_and_a_file(tmp_path):
    for cfg in (
        load_config([f"{RC}.rollout_is_threshold=0.5_2"]),
        from_file(tmp_path, "algorithm:\n  rollout_correction:\n    rollout_is_threshold: 0.5_2\n"),
    ):
        rc = cfg.algorithm.rollout_correction
        assert rc.rollout_is_threshold == "0.5_2"  # not YAML's 0.52
        assert rc.to_algo().is_bounds == (0.5, 2.0)
    with pytest.raises(ConfigError, match="upper bound"):  # 2_000 is lo=2, hi=000, not two thousand
        load_config([f"{RC}.rollout_is_threshold=2_000"])


def test_a_text_value_that_looks_like_an_underscored_number_stays_as_written(tmp_path):
    assert load_config(["trainer.output_dir=2024_01"]).trainer.output_dir == "2024_01"  # YAML: 202401
    assert from_file(tmp_path, "trainer:\n  output_dir: 2024_01\n").trainer.output_dir == "2024_01"
