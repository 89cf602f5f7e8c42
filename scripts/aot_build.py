#!/usr/bin/env python3
"""Prebuild every variant (weight dtype x bias dtype) for the listed archs in one parallel ninja
run, and the torch binding for the running torch, into a directory the loader searches before the
JIT cache.

    python scripts/aot_build.py                      # into this checkout's flashinfer_cake/aot
    python scripts/aot_build.py --out DIR --arch 9.0a -j 8   # then FLASHINFER_CAKE_AOT_DIR=DIR

Prints ninja's progress; exits 1 with the compiler's output when a build fails.
"""

from __future__ import annotations

import argparse
import sys
import time

from pathlib import Path

from flashinfer_cake import jit
from flashinfer_cake.jit import env

# The checkout's package directory (this script lives in <checkout>/scripts): an editable install
# loads from it, and a wheel built after this script ships it.
CHECKOUT_AOT_DIR = Path(__file__).resolve().parent.parent / "flashinfer_cake" / "aot"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(CHECKOUT_AOT_DIR), help="output directory (default: %(default)s)")
    parser.add_argument("--arch", action="append",
                        help="arch to build, repeatable (default: FLASHINFER_CAKE_CUDA_ARCH_LIST or 9.0a)")
    parser.add_argument("-j", "--jobs", type=int, help="parallel compile jobs (default: MAX_JOBS or all cores)")
    args = parser.parse_args()
    try:
        archs = [env.normalize_arch(a, "--arch") for a in args.arch] if args.arch else env.arch_list()
        specs = jit.all_variants(archs)
        print(f"aot_build: {len(specs)} variants for {' '.join(archs)} into {args.out}", flush=True)
        start = time.perf_counter()
        built = jit.prebuild(specs, args.out, jobs=args.jobs, verbose=True)
        binding = jit.build_binding(args.out, jobs=args.jobs, verbose=True)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"aot_build: error: {e}", file=sys.stderr)
        return 1
    for spec in specs:
        print(f"  {spec.uri:44s} {built[spec].name}")
    print(f"  {'torch binding (this torch and Python)':44s} {binding.name}")
    print(f"aot_build: done in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
