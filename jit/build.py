"""Build variants with ninja and publish the modules atomically.

Layout of an output directory (the JIT cache or an AOT directory)::

    <name>.so      the module, <name> = VariantSpec.module_name(toolchain digest)
    <name>.json    its record: sha256 of the .so, variant, nvcc version, build seconds;
                   written last, so a module without a matching record is never loaded
    build/...      ninja's work directory (generated .cu, build.ninja, objects, build.log)
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import filelock

from . import env
from .variant import VariantSpec

logger = logging.getLogger("flashinfer_cake.jit")


def write_if_different(path: Path, content: str) -> None:
    """Write ``content`` unless the file already holds it, so ninja sees no new mtime."""
    if path.is_file() and path.read_text() == content:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(content)
    os.replace(tmp, path)


def _ninja_file(nvcc: Path, stems: dict[str, VariantSpec]) -> str:
    lines = [
        "ninja_required_version = 1.3",
        f"nvcc = {shlex.quote(str(nvcc))}",
        f"include_dir = {shlex.quote(str(env.include_dir()))}",
        "rule compile",
        "  command = $nvcc $flags -I$include_dir -MD -MF $out.d -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compile $out",
        "rule link",
        "  command = $nvcc $flags -shared $in -o $out",
        "  description = link $out",
    ]
    for stem, spec in stems.items():
        flags = " ".join(spec.nvcc_flags())
        lines += [
            f"build {stem}.o: compile {stem}.cu",
            f"  flags = {flags}",
            f"build {stem}.so: link {stem}.o",
            f"  flags = {flags}",
        ]
    return "\n".join(lines) + "\n"


def nvcc_version(nvcc: Path) -> str:
    """nvcc's "Cuda compilation tools, release X.Y, VX.Y.Z" line (runs nvcc: cold path only)."""
    out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=False)
    lines = out.stdout.strip().splitlines() if out.returncode == 0 else []
    return next((line for line in lines if "release" in line), lines[-1] if lines else f"error: {out.stderr.strip()}")


def publish(built: Path, out_dir: Path, name: str, record: dict) -> Path:
    """Copy the module into ``out_dir`` under its final name, then write its record: each with a
    temporary name and ``os.replace``, so readers see the old state or the new, never a part."""
    data = built.read_bytes()
    target = out_dir / f"{name}.so"
    with tempfile.NamedTemporaryFile(dir=out_dir, prefix=f".{name}.", suffix=".so", delete=False) as f:
        f.write(data)
    os.chmod(f.name, 0o755)  # readable like any installed library; the directory guards writes
    os.replace(f.name, target)
    record = {**record, "sha256": hashlib.sha256(data).hexdigest()}
    with tempfile.NamedTemporaryFile("w", dir=out_dir, prefix=f".{name}.", suffix=".json", delete=False) as f:
        json.dump(record, f, indent=1)
    os.chmod(f.name, 0o644)
    os.replace(f.name, out_dir / f"{name}.json")
    return target


def build_variants(specs: list[VariantSpec], out_dir: Path, build_dir: Path, nvcc: Path, *,
                   jobs: int | None = None, verbose: bool = False) -> dict[VariantSpec, Path]:
    """Compile ``specs`` in one ninja run in ``build_dir`` and publish each into ``out_dir``.

    The caller holds whatever lock keeps other processes out of ``build_dir``. Raises
    RuntimeError with the compiler's output when the build fails.
    """
    toolchain = env.toolchain_digest(nvcc)
    names = {spec: spec.module_name(toolchain) for spec in specs}
    build_dir.mkdir(parents=True, exist_ok=True)
    for spec, name in names.items():
        write_if_different(build_dir / f"{name}.cu", spec.source())
    write_if_different(build_dir / "build.ninja", _ninja_file(nvcc, {n: s for s, n in names.items()}))

    seconds = run_ninja(build_dir, ", ".join(s.uri for s in specs), jobs=jobs, verbose=verbose)
    version = nvcc_version(nvcc)
    published = {}
    for spec, name in names.items():
        record = {"variant": spec.uri, "arch": spec.arch, "nvcc": str(nvcc), "nvcc_version": version,
                  "build_seconds": round(seconds, 2)}
        published[spec] = publish(build_dir / f"{name}.so", out_dir, name, record)
    return published


def run_ninja(build_dir: Path, what: str, *, jobs: int | None = None, verbose: bool = False) -> float:
    """Run ninja in ``build_dir`` (its build.ninja written); the seconds it took. Keeps the whole
    log in build.log, streams ninja's "[i/n] ..." lines when ``verbose`` (AOT progress), and
    raises RuntimeError with the compiler's output when the build fails."""
    (build_dir / "build.log").unlink(missing_ok=True)  # present again only once ninja has ended
    start = time.perf_counter()
    cmd = [env.ninja_path(), "-C", str(build_dir), "-j", str(jobs or env.max_jobs())]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if verbose:
            print(line, end="", flush=True)
    returncode = proc.wait()
    log = "".join(lines)
    (build_dir / "build.log").write_text(log)
    if returncode != 0:
        raise RuntimeError(
            f"flashinfer_cake: building {what} failed (ninja exit {returncode}, log {build_dir / 'build.log'}):\n{log}"
        )
    return time.perf_counter() - start


def verified_module(path: Path) -> Path | None:
    """``path`` if it is a published module whose bytes match its record, else None (missing,
    truncated, corrupt, or interrupted before its record was written)."""
    record_path = path.with_suffix(".json")
    try:
        record = json.loads(record_path.read_text())
        data = path.read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("sha256") != hashlib.sha256(data).hexdigest():
        if path.exists():
            logger.warning("flashinfer_cake: ignoring corrupt module %s (does not match %s)", path, record_path)
        return None
    return path


def find_published(directory: Path, prefix: str) -> Path | None:
    """A verified module in ``directory`` whose name starts with ``prefix`` (any compiler)."""
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(".so"))
    except OSError:
        return None
    for n in names:
        if verified_module(directory / n):
            return directory / n
    return None


def set_aside(build_dir: Path) -> None:
    """Move a build directory left by an interrupted build (no build.log: it is written when
    ninja ends) out of the way before reusing its path: compilers orphaned by a killed process
    keep writing into the moved directory (their working directory), never into the new build's.
    A completed build's directory stays, so ninja rebuilds only what changed."""
    if not build_dir.exists() or (build_dir / "build.log").exists():
        return
    stale = build_dir.with_name(f"{build_dir.name}.stale.{os.getpid()}.{time.monotonic_ns()}")
    os.replace(build_dir, stale)
    shutil.rmtree(stale, ignore_errors=True)


def build_once(out_dir: Path, name: str, build: Callable[[Path], None]) -> Path:
    """``out_dir/<name>.so``: a verified one if present, else built by ``build(build_dir)`` (which
    publishes it) under the module's file lock, checked again under the lock, so concurrent first
    calls from many processes compile once. A build directory an interrupted build left is set
    aside first."""
    target = out_dir / f"{name}.so"
    if verified_module(target):
        return target
    with filelock.FileLock(str(out_dir / f"{name}.lock")):
        if verified_module(target):  # another process built it while we waited
            return target
        logger.info("flashinfer_cake: building %s", name)
        start = time.perf_counter()
        build_dir = out_dir / "build" / name
        set_aside(build_dir)
        build(build_dir)
        logger.info("flashinfer_cake: built %s in %.1f s", name, time.perf_counter() - start)
    if not verified_module(target):
        raise RuntimeError(f"flashinfer_cake: built {target} but cannot verify it")
    return target
