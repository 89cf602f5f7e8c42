"""The torch binding (``torch_binding.cpp``): the public functions' eager path in C++.

One CPython extension per torch build, beside the framework-free kernel modules: it reads the
tensors' metadata natively and calls a kernel module's C entry, which keeps an eager call within
the host budget (the ctypes path cost 11-14 µs). It includes torch's headers, so unlike a kernel
module it is tied to the torch (and Python) it was built for; its identity carries both. It is
built and loaded by the same pipeline as the kernel modules (:mod:`.core`).
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch

from .core import JitSpec, load

SOURCE = Path(__file__).with_name("torch_binding.cpp")


def _torch_build_settings() -> str:
    """torch's build configuration (its compiler flags, options, commit): two builds of one version that
    differ there are told apart without their install paths. The line only: the rest of
    torch.__config__.show() describes the running CPU, which a prebuilt binding does not depend on."""
    return next((line.strip() for line in torch.__config__.show().splitlines() if "Build settings:" in line), "")


@functools.cache
def binding_spec() -> JitSpec:
    """The binding for the running torch and Python."""
    import torch.distributed  # (its is_available(): whether torch was built with it)

    torch_dir = Path(torch.__file__).resolve().parent
    return JitSpec(
        uri="torch_binding",
        source=SOURCE.read_text(),
        language="c++",
        cflags=(
            "-O2",
            "-DNDEBUG",  # torch's debug-only asserts out of the inlined header code
            "-std=c++20",  # what torch's own extensions use
            "-fPIC",
            "-fvisibility=hidden",  # only PyInit_* is exported
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            "-w",  # torch's headers warn under -std=c++20 with some compilers; nothing of ours
            f"-DCAKE_C10D={int(torch.distributed.is_available())}",  # the CP calls' collectives need it
        ),
        ldflags=("-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"),
        include_dirs=(str(torch_dir / "include"), sysconfig.get_paths()["include"]),
        lib_dirs=(str(torch_dir / "lib"),),
        identity=(torch.__version__, str(torch.version.git_version), str(torch.version.cuda), str(torch.version.hip),
                  _torch_build_settings(), str(sysconfig.get_config_var("EXT_SUFFIX"))),
        identity_names=("torch", "torch git", "torch CUDA", "torch HIP", "torch's build settings",
                        "the Python extension suffix"),
        python_extension=True,
    )


def load_binding():
    """The loaded torch binding module (built on first use when needed)."""
    return load(binding_spec())
