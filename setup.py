"""Builds dppo._C, the snapshot engine, from csrc/ (the package itself is described in pyproject.toml).

The CUDA engine is compiled when a CUDA toolkit (nvcc under CUDA_HOME) and a CUDA build of torch are both
present. DPPO_FORCE_CUDA=1 makes that a requirement (the build fails loudly without it); DPPO_SKIP_CUDA=1
builds the CPU engine only. DPPO_NO_EXTENSION=1 installs the package without building the extension at all
(`make vllm` does that, then builds the extension into its own venv, apart from the source tree). No .cu files: the CUDA engine is host code that calls the CUDA runtime, so the
host compiler builds everything and the build stays quick on small machines.
"""

import os
import shutil
from pathlib import Path



def _locate_cuda_home() -> None:
    """Point CUDA_HOME at a real toolkit when it is not set.

    torch takes dirname(dirname(which nvcc)) as the toolkit, which is wrong when nvcc is a symlink or a
    wrapper script such as /usr/local/bin/nvcc (it would look for headers in /usr/local/include).
    """
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    candidates.append(Path("/usr/local/cuda"))
    for home in candidates:
        if (home / "include" / "cuda_runtime_api.h").exists() and (home / "bin" / "nvcc").exists():
            os.environ["CUDA_HOME"] = str(home)
            return


_locate_cuda_home()

import torch  # noqa: E402
from setuptools import setup  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402
from torch.utils.cpp_extension import include_paths  # noqa: E402

ROOT = Path(__file__).parent
CPU_SOURCES = [
    "bindings.cpp", "pool.cpp", "pool_memory.cpp", "pool_stream.cpp", "streamer.cpp", "layout.cpp", "host_arena.cpp",
    "backend.cpp", "cpu_engine.cpp", "worker_pool.cpp",
]
CUDA_SOURCES = ["cuda_engine.cpp"]


def _flag(name: str) -> bool:
    return os.environ.get(name, "") == "1"


def _cuda_toolkit_problem() -> str | None:
    """Why the CUDA engine cannot be built here, or None if it can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is not a CUDA build"
    if CUDA_HOME is None:
        return "no CUDA toolkit found (set CUDA_HOME or put nvcc on PATH)"
    if not (Path(CUDA_HOME) / "include" / "cuda_runtime_api.h").exists():
        return f"no CUDA headers under CUDA_HOME={CUDA_HOME}"
    return None


def _want_cuda() -> bool:
    if _flag("DPPO_FORCE_CUDA") and _flag("DPPO_SKIP_CUDA"):
        raise RuntimeError("DPPO_FORCE_CUDA=1 and DPPO_SKIP_CUDA=1 contradict each other; set one of them")
    if _flag("DPPO_SKIP_CUDA"):
        return False
    problem = _cuda_toolkit_problem()
    if problem is not None and _flag("DPPO_FORCE_CUDA"):
        raise RuntimeError(f"DPPO_FORCE_CUDA=1 but the CUDA engine cannot be built: {problem}")
    if problem is not None:
        print(f"dppo: building the CPU-only engine ({problem})")
    return problem is None


def _runtime_library_dirs(cuda: bool) -> list[str]:
    """Where the extension finds torch's libraries (and torch's own CUDA runtime) at import time.

    With these baked in, `import dppo._C` works even before `import torch`, and it loads the same
    libcudart as torch rather than whichever one the system linker would find first.
    """
    torch_lib = Path(torch.__file__).parent / "lib"
    dirs = [torch_lib]
    if cuda:
        dirs += sorted(p.parent for p in torch_lib.parent.parent.glob("nvidia/*/lib/libcudart.so*"))
    return [str(d) for d in dict.fromkeys(dirs)]


def _warning_flags() -> list[str]:
    """-Wall -Wextra for csrc/, with torch's headers read as system headers: their unused parameters would
    otherwise bury ours (a directory given with both -isystem and -I is a system one)."""
    system = [flag for d in include_paths("cpu") for flag in ("-isystem", d)]
    return ["-Wall", "-Wextra", *system]


def _extension():
    cxx_flags = ["-O3", *_warning_flags()]
    if _want_cuda():
        # Respected by torch's build helpers for any device code; sm_80 and sm_90 by default.
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        print(f"dppo: building the CUDA engine (CUDA_HOME={CUDA_HOME}, torch CUDA {torch.version.cuda})")
        return CUDAExtension(
            "dppo._C",
            [f"csrc/{s}" for s in CPU_SOURCES + CUDA_SOURCES],
            define_macros=[("DPPO_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3"]},
            extra_link_args=[f"-Wl,-rpath,{d}" for d in _runtime_library_dirs(cuda=True)],
        )
    return CppExtension(
        "dppo._C",
        [f"csrc/{s}" for s in CPU_SOURCES],
        extra_compile_args={"cxx": cxx_flags},
        extra_link_args=[f"-Wl,-rpath,{d}" for d in _runtime_library_dirs(cuda=False)],
    )


setup(
    ext_modules=[] if _flag("DPPO_NO_EXTENSION") else [_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
