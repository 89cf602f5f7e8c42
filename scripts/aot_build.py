#!/usr/bin/env python3
"""Prebuild every variant (weight dtype x bias dtype) for the listed archs, and the torch binding
for the running torch, in one parallel ninja run: by default into the installed package's own
aot/ directory, which the loader searches before the JIT cache (for the flashinfer_cake this
Python imports: an editable install's is the checkout's flashinfer_cake/aot).

    python scripts/aot_build.py                       # into <installed flashinfer_cake>/aot
    python scripts/aot_build.py --out DIR --arch 9.0a -j 8   # then FLASHINFER_CAKE_AOT_DIR=DIR

The same as `flashinfer-cake build --aot` (or `--out DIR`). Exits 1 with the compiler's output
when a build fails.
"""

from __future__ import annotations

import sys

from flashinfer_cake.cli import main

if __name__ == "__main__":
    args = sys.argv[1:]
    if "-h" in args or "--help" in args:  # this script's own use first: the options are the build command's
        print(__doc__.strip(), end="\n\n", flush=True)
    out_given = any(a == "--out" or a.startswith("--out=") for a in args)
    sys.exit(main(["build", *([] if out_given else ["--aot"]), *args]))
