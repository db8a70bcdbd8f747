"""The C kernels (pfedkit/runtime/kernels.c), built by the package's build, once per CPU capability as PyTorch
builds its own CPU kernels (ATen's DEFAULT / AVX2 / AVX512): each a portable baseline for the CPUs of that class,
never `-march=native`; pfedkit/runtime/native.py loads the one PyTorch's own capability check picks
(`torch.backends.cpu.get_cpu_capability()`). Optional: without a C compiler the install goes on, and the models run
on PyTorch's ops, saying why (pfedkit.runtime.native.why_not). The rest of the package is in pyproject.toml."""
import platform

from setuptools import Extension, setup

COMMON = ["-O3", "-std=gnu11", "-Wno-psabi"]
VARIANTS = {"default": []}
if platform.machine().lower() in ("x86_64", "amd64"):
    VARIANTS["avx2"] = ["-mavx2", "-mfma"]
    VARIANTS["avx512"] = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]

setup(ext_modules=[Extension(f"pfedkit.runtime._kernels_{name}", ["pfedkit/runtime/kernels.c"],
                             extra_compile_args=COMMON + flags, libraries=["m"], optional=True)
                   for name, flags in VARIANTS.items()])
