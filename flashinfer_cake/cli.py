"""The ``flashinfer-cake`` command (also ``python -m flashinfer_cake``).

    flashinfer-cake            build what this machine needs, run the forward once on a typical
                               training shape, check it against the reference, print GB/s
                               (without a GPU: say so, build the variants, exit 0)
    flashinfer-cake env        versions, nvcc, arch list, directories, which variants are built
    flashinfer-cake build      prebuild every variant and the torch binding (into the JIT cache, or --out DIR)
    flashinfer-cake clear-cache
"""

from __future__ import annotations

import argparse
import logging
import platform
import shutil
import sys

import torch

from . import __version__, jit
from .jit import env
from .jit.build import nvcc_version


def _specs(archs: list[str] | None) -> list[jit.VariantSpec]:
    return jit.all_variants([env.normalize_arch(a, "--arch") for a in archs] if archs else env.arch_list())


def cmd_env(args) -> int:
    nvcc = env.nvcc_path()
    version = "not found" if nvcc is None else nvcc_version(nvcc)
    print(f"flashinfer_cake  {__version__}")
    print(f"python           {platform.python_version()}")
    print(f"torch            {torch.__version__} (CUDA {torch.version.cuda})")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            print(f"gpu {i}            {torch.cuda.get_device_name(i)} (compute capability {cap[0]}.{cap[1]})")
    else:
        print("gpu              none visible to torch")
    print(f"nvcc             {nvcc or 'not found'} ({version})")
    print(f"arch list        {' '.join(env.arch_list())}  (FLASHINFER_CAKE_CUDA_ARCH_LIST)")
    print(f"cache dir        {env.cache_dir()}  (FLASHINFER_CAKE_CACHE_DIR)")
    print(f"aot dirs         {' '.join(map(str, env.aot_dirs())) or 'none'}  (FLASHINFER_CAKE_AOT_DIR)")
    print(f"jit              {'disabled' if env.jit_disabled() else 'enabled'}  (FLASHINFER_CAKE_DISABLE_JIT)")
    binding = jit.published_binding()
    print(f"torch binding    {binding or 'not built'}")
    print("variants:")
    for spec in _specs(None):
        where = jit.published_modules(spec)
        print(f"  {spec.uri:44s} {where[0] if where else 'not built'}")
    return 0


def cmd_build(args) -> int:
    specs = _specs(args.arch)
    built = jit.prebuild(specs, args.out, jobs=args.jobs, verbose=True)
    binding = jit.build_binding(args.out, jobs=args.jobs, verbose=True)
    for spec in specs:
        print(f"{spec.uri:44s} {built[spec]}")
    print(f"{'torch binding':44s} {binding}")
    return 0


def cmd_clear_cache(args) -> int:
    root = env.cache_dir()
    # Lock files stay: deleting one a running build holds would let a second build start.
    entries = [e for e in root.iterdir() if e.suffix != ".lock"]
    for entry in entries:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    print(f"removed {len(entries)} entries from {root}")
    return 0


def cmd_check(args) -> int:
    from .cake_causal_conv1d_train import cake_causal_conv1d_train_forward, is_cake_causal_conv1d_train_supported
    from .reference import causal_conv1d_reference

    if not is_cake_causal_conv1d_train_supported():
        why = "no CUDA GPU visible to torch" if not torch.cuda.is_available() else (
            f"GPU {torch.cuda.get_device_name()} is not supported (needs compute capability 9.0)")
        print(f"{why}: building the variants only, no forward run.")
        return cmd_build(argparse.Namespace(arch=None, out=None, jobs=None))
    S, C, docs = 16384, 4096, 16
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(S, C, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(C, 4, device="cuda", generator=g) * 0.5
    b = torch.randn(C, device="cuda", generator=g) * 0.1
    cuts = torch.randperm(S - 1, device="cuda", generator=g)[: docs - 1] + 1
    cu = torch.cat([torch.tensor([0, S], device="cuda"), cuts]).sort().values.to(torch.int32)
    y = cake_causal_conv1d_train_forward(x, w, cu, bias=b)  # builds the module when needed
    ref = causal_conv1d_reference(x, w, cu, b)
    err = ((y.double() - ref).norm() / ref.norm()).item()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(50):
        start.record()
        cake_causal_conv1d_train_forward(x, w, cu, bias=b, out=y)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    ok = err < 1e-2
    print(f"{torch.cuda.get_device_name()}: S={S} C={C} docs={docs} fp32 taps + bias: "
          f"rel. error vs FP64 reference {err:.2e} ({'ok' if ok else 'FAIL'}), "
          f"median {ms * 1e3:.1f} us, {4 * S * C / ms / 1e6:.0f} GB/s (x read + y written)")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flashinfer-cake", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("env", help="versions, nvcc, arch list, directories, built variants")
    build = sub.add_parser("build", help="prebuild every variant")
    build.add_argument("--arch", action="append", help="arch to build, e.g. sm_90a (default: the arch list)")
    build.add_argument("--out", help="output directory (default: the JIT cache)")
    build.add_argument("-j", "--jobs", type=int, help="parallel compile jobs (default: MAX_JOBS or all cores)")
    sub.add_parser("clear-cache", help="delete everything in the JIT cache")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    handler = {"env": cmd_env, "build": cmd_build, "clear-cache": cmd_clear_cache, None: cmd_check}[args.command]
    try:
        return handler(args)
    except (RuntimeError, ValueError) as e:
        print(f"flashinfer-cake: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
