"""Print which build of the extension is installed; fail if a CUDA build was required and is missing."""

import os
import sys


def main() -> int:
    from dppo import _C  # inside main: a build that fails to load is reported, not an ImportError at start

    cuda = bool(_C.cuda_compiled())
    print(f"dppo._C: {'CUDA' if cuda else 'CPU-only'} build ({_C.__file__})")
    if os.environ.get("DPPO_REQUIRE_CUDA_BUILD") == "1" and not cuda:
        print("error: DPPO_REQUIRE_CUDA_BUILD=1 but the CUDA path of dppo._C did not compile", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
