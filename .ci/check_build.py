"""Fail the build check when CUDA kernels were expected but not compiled in.

PAGED_OPS_BUILD_CUDA=1 (or auto with a visible GPU) with a CUDA build of torch and nvcc present
means the CUDA kernels must be in the extension: every CI run (=1) thereby proves the CUDA code
compiles and links.
"""

import glob
import os
import shutil
import sys

import torch

import paged_ops

mode = os.environ.get("PAGED_OPS_BUILD_CUDA", "auto")
cuda_home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
nvcc = shutil.which("nvcc") or (os.path.join(cuda_home, "bin", "nvcc")
                                if os.path.exists(os.path.join(cuda_home, "bin", "nvcc")) else None)
root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
has_cuda_sources = bool(glob.glob(os.path.join(root, "csrc", "cuda", "*.cu")))
# auto builds them only where a GPU is visible.
expected = ((mode == "1" or (mode == "auto" and torch.cuda.is_available()))
            and torch.version.cuda is not None and nvcc is not None and has_cuda_sources)
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), nvcc: {nvcc}, "
      f"PAGED_OPS_BUILD_CUDA={mode}: CUDA kernels expected={expected}, "
      f"built={paged_ops.built_with_cuda()}, CPU kernel={paged_ops.cpu_kernel_variant()} "
      f"(block size 16: {paged_ops.cpu_kernel_variant(16)})")
if expected and not paged_ops.built_with_cuda():
    sys.exit("CUDA kernels were expected in this build but are missing")
