"""The config is plain data: importing it loads no torch, transformers or reasoning-gym (a --help, a bad key, a
config read by a process that never trains wait for none of them), and the names it accepts without torch are
those the torch side implements."""

import subprocess
import sys

from dppo.config import choices

HEAVY = ("torch", "transformers", "reasoning_gym", "ray")


def test_importing_the_config_loads_no_torch_transformers_or_reasoning_gym():
    code = (
        "import sys, dppo.config, dppo.config.pi_old, dppo.config.rules; "
        "dppo.config.load_config(['data.source=reasoning_gym', 'data.reasoning_gym.dataset=chain_sum', "
        "'model.path=/nowhere']); "  # a reasoning-gym config built: its dataset is not
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"import dppo.config loaded {out.stdout.strip()}"


def test_the_dtype_names_the_config_accepts_are_those_dppo_models_maps_to_torch():
    from dppo.models import DTYPES

    assert tuple(DTYPES) == choices.DTYPES
