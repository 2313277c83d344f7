"""The replay buffer's Ray process imports what the buffer needs and not the rollout worker's model code."""

from __future__ import annotations

import subprocess
import sys


def test_the_replay_buffer_module_does_not_import_transformers():
    # a fresh interpreter: this one has imported transformers already (conftest, other tests)
    code = ("import sys, dppo.workers.rollout.replay_buffer as b; b.ReplayBufferActor; "
            "print(sorted(m for m in ('transformers', 'dppo.workers.rollout.worker', 'dppo.models') if m in sys.modules))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
