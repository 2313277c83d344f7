"""dppo: Decoupled PPO for asynchronous RL on language models."""

__version__ = "0.1.0"

import os
import sys

# A venv may hold its own build of dppo._C (`make vllm` builds one against vLLM's torch into
# <venv>/dppo-ext/dppo): it comes first, so two venvs with different torch ABIs share one checkout.
_venv_extension_dir = os.path.join(sys.prefix, "dppo-ext", "dppo")
if os.path.isdir(_venv_extension_dir):
    __path__.insert(0, _venv_extension_dir)
