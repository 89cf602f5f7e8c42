"""Build JitSpecs with ninja and publish them atomically.

Layout of an output directory (the JIT cache or an AOT directory)::

    <name>.so      the artifact, <name> = JitSpec.module_name(compiler digest)
    <name>.json    its record: sha256 of the .so, uri, identity (the JitSpec's), compiler and version, build seconds;
                   written last, so an artifact without a matching record is never loaded
    <name>.lock    the file lock of its build
    build/...      ninja's work directories (sources, build.ninja, objects, build.log: the
                   compilers' whole output, register and spill counts included)
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import filelock

from . import env

if TYPE_CHECKING:
    from .core import JitSpec

logger = logging.getLogger("flashinfer_cake.jit")


def notice(message: str) -> None:
    """A line the user should see once (a build starting, a wait on another process's build):
    logged at INFO where logging shows INFO, else written to stderr (a build takes seconds)."""
    if logger.hasHandlers() and logger.isEnabledFor(logging.INFO):
        logger.info(message)
    else:
        print(message, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class BuildItem:
    """A spec to build, the file stem it is published under, and the compiler that builds it."""
    spec: "JitSpec"
    name: str
    compiler: Path


def _check_lock_file(lock_file: Path) -> None:
    """Raise the OSError of a lock file filelock cannot open, which some of its versions retry for ever (a cache path
    like /proc/self, where no file can be made); a lock file held by another process passes. Creates nothing that
    stays: filelock's mode without flock (some NFS, Lustre, FUSE mounts) reads an empty lock file as held."""
    try:
        os.close(os.open(lock_file, os.O_RDONLY))
    except FileNotFoundError:  # (not there: can its directory hold a file at all?)
        try:
            fd, probe = tempfile.mkstemp(dir=lock_file.parent, prefix=f".{lock_file.name}.")
        except OSError as e:
            raise OSError(e.errno, e.strerror, str(lock_file)) from e
        os.close(fd)
        os.unlink(probe)


@contextlib.contextmanager
def hold_lock(out_dir: Path, name: str, what: str):
    """Hold ``out_dir/<name>.lock``; says so when another process holds it (its build may take a
    minute). An unwritable directory is a RuntimeError that says what to do."""
    try:
        lock = filelock.FileLock(str(out_dir / f"{name}.lock"))
        try:
            lock.acquire(timeout=0.5)
        except filelock.Timeout:
            _check_lock_file(Path(lock.lock_file))
            notice(f"flashinfer_cake: waiting for another process to finish building {what} (lock {lock.lock_file})")
            lock.acquire()
    except OSError as e:
        raise RuntimeError(
            f"flashinfer_cake: cannot build in {out_dir}: {e.strerror or e} ({e.filename or out_dir}). Use a "
            f"writable directory (FLASHINFER_CAKE_CACHE_DIR, or --out for a prebuild)"
        ) from e
    try:
        yield
    finally:
        lock.release()


def write_if_different(path: Path, content: str) -> None:
    """Write ``content`` unless the file already holds it, so ninja sees no new mtime."""
    if path.is_file() and path.read_text() == content:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(content)
    os.replace(tmp, path)


def unit_files(item: BuildItem) -> list[tuple[str, str]]:
    """(file name, source) of each translation unit of ``item``, the main one first."""
    spec = item.spec
    return [(f"{item.name}{spec.suffix}", spec.source),
            *((f"{item.name}.unit{k}{spec.suffix}", u) for k, u in enumerate(spec.units))]


def _ninja_file(items: list[BuildItem]) -> str:
    """One ninja file for any mix of CUDA and C++ specs: each translation unit compiled by its own
    edge (so a module's units, and the modules, compile in parallel), then one link edge per
    artifact (ninja reports each artifact as it is linked)."""
    lines = [
        "ninja_required_version = 1.3",
        "rule compile",
        "  command = $compiler $cflags -c -MD -MF $out.d $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = compile $out",
        "rule link",
        "  command = $compiler $cflags -shared $in -o $out $ldflags",
        "  description = build $out",
    ]
    for item in items:
        spec = item.spec
        includes = [str(env.include_dir()), *spec.include_dirs]
        flags = [f"  compiler = {shlex.quote(str(item.compiler))}",
                 f"  cflags = {' '.join(map(shlex.quote, [*spec.cflags, *(f'-I{d}' for d in includes)]))}"]
        objects = []
        for file, _ in unit_files(item):
            objects.append(f"{file}.o")
            lines += [f"build {file}.o: compile {file}", *flags]
        ldflags = [*(f"-L{d}" for d in spec.lib_dirs), *spec.ldflags,
                   *(env.toolkit_link_flags(item.compiler) if spec.language == "cuda" else ())]
        lines += [f"build {item.name}.so: link {' '.join(objects)}", *flags,
                  f"  ldflags = {' '.join(map(shlex.quote, ldflags))}"]
    return "\n".join(lines) + "\n"


def compiler_version(compiler: Path) -> str:
    """The compiler's version line (runs it: cold path only)."""
    out = subprocess.run([str(compiler), "--version"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        detail = (out.stderr.strip() or out.stdout.strip()).split("\n", 1)[0]
        return f"error: `{compiler.name} --version` exited {out.returncode}" + (f": {detail}" if detail else "")
    lines = out.stdout.strip().splitlines()
    return next((line for line in lines if "release" in line),
                lines[0] if lines else f"error: `{compiler.name} --version` printed nothing")


def check_nvcc_release(nvcc: Path, version: str) -> None:
    """Refuse, by its version line (compiler_version's), an nvcc that does not run, what is not CUDA's nvcc
    (FLASHINFER_CAKE_NVCC=/usr/bin/gcc, which would fail mid-build on nvcc's flags) and an nvcc older than the
    kernels need (a flag it does not know)."""
    if version.startswith("error: "):
        raise RuntimeError(f"flashinfer_cake: {nvcc} does not run as nvcc ({version.removeprefix('error: ')}); nvcc "
                           f"is looked up in this order: {', '.join(env.NVCC_SEARCH_ORDER)}.")
    found = re.search(r"release (\d+)\.(\d+)", version)
    if not found:
        raise RuntimeError(f"flashinfer_cake: {nvcc} is not CUDA's nvcc: `{nvcc.name} --version` says {version!r}, "
                           f"with no 'release X.Y'. nvcc is looked up in this order: {', '.join(env.NVCC_SEARCH_ORDER)}; "
                           f"the first must be CUDA's nvcc {env.MIN_NVCC} or newer.")
    if (int(found[1]), int(found[2])) < env.MIN_NVCC_RELEASE:
        raise RuntimeError(f"flashinfer_cake: {nvcc} is CUDA {found[1]}.{found[2]} ({version}); the kernels need nvcc "
                           f"{env.MIN_NVCC} or newer (their build flags): {env.other_nvcc_hint(nvcc)}.")


def check_python_headers(spec: "JitSpec") -> None:
    """A Python extension (the torch binding) includes Python.h: name the missing development headers
    before the compiler fails on them (a distribution's python3 without its -dev package). The
    compiler's own search path (CPATH, CPLUS_INCLUDE_PATH) counts."""
    dirs = [*spec.include_dirs, *(d for var in ("CPATH", "CPLUS_INCLUDE_PATH")
                                  for d in os.environ.get(var, "").split(os.pathsep) if d)]
    if not any((Path(d) / "Python.h").is_file() for d in dirs):
        raise RuntimeError(
            f"flashinfer_cake: building {spec.uri} needs Python's C headers (Python.h), which are not in "
            f"{' or '.join(dirs)}: install this Python's development package (e.g. `apt install "
            f"python{sys.version_info[0]}.{sys.version_info[1]}-dev`), or use a Python that ships them (a venv of "
            f"one that does, conda, uv, pyenv)."
        )


def publish(built: Path | bytes, out_dir: Path, name: str, record: dict) -> Path:
    """Copy the artifact (a file, or its bytes) into ``out_dir`` under its final name, then write
    its record: each with a temporary name (``.<name>.*``) and ``os.replace``, so readers see the
    old state or the new, never a part."""
    data = built if isinstance(built, bytes) else built.read_bytes()
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


def remove_stale_temporaries(out_dir: Path, name: str) -> None:
    """Delete the temporaries a publish of ``name`` killed midway left. Called under the
    artifact's lock: no live publish of it can own one."""
    for path in out_dir.glob(f".{name}.*"):
        with contextlib.suppress(OSError):
            path.unlink()


def build_specs(items: list[BuildItem], out_dir: Path, build_dir: Path, *, jobs: int | None = None,
                progress: Callable[[str], None] | None = None) -> dict["JitSpec", Path]:
    """Compile ``items`` in one ninja run in ``build_dir`` and publish each into ``out_dir``. The
    caller holds the locks of ``build_dir`` and of every item. Raises RuntimeError with the
    compiler's output when the build fails."""
    for item in items:  # what would fail mid-build is refused before anything is written
        if item.spec.python_extension:
            check_python_headers(item.spec)
    versions = {c: compiler_version(c) for c in {item.compiler for item in items}}
    for compiler in dict.fromkeys(item.compiler for item in items if item.spec.language == "cuda"):
        check_nvcc_release(compiler, versions[compiler])
        (progress or notice)(f"flashinfer_cake: compiling with {compiler} ({versions[compiler]})")
    set_aside(build_dir)
    build_dir.mkdir(parents=True, exist_ok=True)
    for item in items:
        remove_stale_temporaries(out_dir, item.name)
        for file, source in unit_files(item):
            write_if_different(build_dir / file, source)
    write_if_different(build_dir / "build.ninja", _ninja_file(items))
    uris = {item.name: item.spec.uri for item in items}
    seconds = run_ninja(build_dir, ", ".join(uris.values()), jobs=jobs, progress=progress and (
        lambda stem, done, start: progress(f"compiled {uris[stem]} ({done}/{len(items)}, {time.perf_counter() - start:.1f} s)")),
        heartbeat=progress and (lambda step, steps, start: progress(
            f"  compiling: {step} of {steps} steps done ({time.perf_counter() - start:.0f} s)")))
    published = {}
    for item in items:
        record = {"uri": item.spec.uri, "identity": list(item.spec.identity), "compiler": str(item.compiler),
                  "compiler_version": versions[item.compiler], "build_seconds": round(seconds, 2)}
        published[item.spec] = publish(build_dir / f"{item.name}.so", out_dir, item.name, record)
    return published


_BUILT = re.compile(r"^\[\d+/\d+\] build (\S+)\.so$")
_STEP = re.compile(r"^\[(\d+)/(\d+)\] ")  # a ninja step's line: steps done, steps
# ptxas --resource-usage's report (kept in build.log: registers and spills per kernel), hundreds of lines a build
_PTXAS_REPORT = re.compile(r"^(ptxas info\s*:|\s+\d+ bytes stack frame)")
# ninja's status when it is interrupted (SIGINT: Ctrl-C reaches its process group) or killed by a signal
# (ninja exits 130 on SIGINT, SIGTERM and SIGHUP alike; 143 is a step's own status: a compiler killed, a failure)
_INTERRUPTED = (130, -signal.SIGINT, -signal.SIGTERM)
_ERROR = re.compile(r"\berror\b|\bfatal\b", re.IGNORECASE)


def failure_excerpt(log: str, limit: int = 80) -> str:
    """What a failed build's log says about the failure: each FAILED step of ninja with the command and output under
    it, else the log's last 20 lines; ptxas's resource report left out; at most ``limit`` lines."""
    lines = [line for line in log.splitlines() if not _PTXAS_REPORT.match(line)]
    keep = []
    for i, line in enumerate(lines):
        if line.startswith("FAILED: "):
            j = i + 1
            while j < len(lines) and not _STEP.match(lines[j]) and not lines[j].startswith(("FAILED: ", "ninja: ")):
                j += 1
            keep += lines[i:j]
    keep = keep or lines[-20:]
    if len(keep) > limit:  # the FAILED lines and the errors first (warnings can fill the limit before them)
        shown = [line for line in keep if line.startswith("FAILED: ") or _ERROR.search(line)][:limit] or keep[:limit]
        keep = shown + [f"... ({len(keep) - len(shown)} more lines)"]
    return "\n".join(keep)


# How often a long build says how far it is between its artifacts (build_specs' progress): the kernel modules link
# together at the end, after minutes of compiling on a few cores (a prebuild: 278-484 s on 2).
HEARTBEAT_S = 60.0


def run_ninja(build_dir: Path, what: str, *, jobs: int | None = None,
              progress: Callable[[str, int, float], None] | None = None,
              heartbeat: Callable[[int, int, float], None] | None = None) -> float:
    """Run ninja in ``build_dir`` (its build.ninja written); the seconds it took. Keeps the whole
    output in build.log, calls ``progress(stem, artifacts done so far, start time)`` as each
    artifact is linked and ``heartbeat(steps done, steps, start time)`` as a step ends at least
    HEARTBEAT_S after the last call of either, and raises RuntimeError with the compiler's output
    when the build fails."""
    (build_dir / "build.log").unlink(missing_ok=True)  # present again only once ninja has ended
    start = last = time.perf_counter()
    cmd = [env.ninja_path(), "-C", str(build_dir), "-j", str(jobs or env.max_jobs())]
    # (NINJA_STATUS set: the step lines this reads are ninja's default form)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "NINJA_STATUS": "[%f/%t] "})
    lines, done = [], 0
    try:
        for line in proc.stdout:
            lines.append(line)
            match, step = _BUILT.match(line.strip()), _STEP.match(line)
            if match and progress:
                done += 1
                progress(match.group(1), done, start)
                last = time.perf_counter()
            elif step and heartbeat and time.perf_counter() - last >= HEARTBEAT_S:
                heartbeat(int(step[1]), int(step[2]), start)
                last = time.perf_counter()
    except KeyboardInterrupt:  # Ctrl-C reached ninja too: its output so far is the log; the interrupt goes on
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
        lines.append(proc.stdout.read())  # (what the iteration had buffered included)
        (build_dir / "build.log").write_text("".join(lines))
        raise
    returncode = proc.wait()
    log = "".join(lines)
    (build_dir / "build.log").write_text(log)
    if returncode in _INTERRUPTED:
        raise RuntimeError(f"flashinfer_cake: building {what} was interrupted (ninja exit {returncode}); nothing of "
                           f"it was published (its output: {build_dir / 'build.log'})")
    if returncode != 0:
        raise RuntimeError(f"flashinfer_cake: building {what} failed (ninja exit {returncode}; the whole output: "
                           f"{build_dir / 'build.log'}):\n{failure_excerpt(log)}")
    return time.perf_counter() - start


def verified_artifact(path: Path) -> tuple[dict, bytes] | None:
    """The record and bytes of a published artifact, the bytes read once and matching the record;
    None when missing, truncated, corrupt, or interrupted before its record was written."""
    record = read_record(path)
    if not record:
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if record.get("sha256") != hashlib.sha256(data).hexdigest():
        logger.warning("flashinfer_cake: ignoring corrupt module %s (does not match %s)", path, path.with_suffix(".json"))
        return None
    return record, data


def verified_module(path: Path) -> Path | None:
    """``path`` if it is a published artifact whose bytes match its record (verified_artifact), else None."""
    return path if verified_artifact(path) else None


def listing(directory: Path) -> list[str]:
    """The names in ``directory``; [] when it cannot be listed (missing: an unreadable directory is refused where it
    is named, env.aot_dirs and env.cache_dir)."""
    try:
        return os.listdir(directory)
    except OSError:
        return []


def read_record(path: Path) -> dict:
    """The record publish wrote beside the artifact ``path``; {} when it cannot be read."""
    try:
        record = json.loads(path.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def find_published(directory: Path, prefix: str, preferred: Callable[[], str | None] | None = None,
                   names: list[str] | None = None) -> Path | None:
    """A verified artifact in ``directory`` whose name starts with ``prefix`` (any compiler). Of
    several: the one named ``preferred()`` (this machine's compiler's build; asked only then) when it is
    there, else the one whose record was written last (its mtime: copies that keep mtimes, ``cp -a``
    or ``rsync -t``, keep the order), then by name. ``names``: the directory's listing, when the caller
    has it (one listing serves several questions)."""
    names = [n for n in (listing(directory) if names is None else names) if n.startswith(prefix) and n.endswith(".so")]
    if len(names) > 1:
        local = preferred() if preferred is not None else None

        def order(name: str) -> tuple[bool, float, str]:
            try:
                mtime = (directory / name).with_suffix(".json").stat().st_mtime
            except OSError:
                mtime = float("-inf")
            return local is None or name != f"{local}.so", -mtime, name

        names.sort(key=order)
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


def build_once(out_dir: Path, item: BuildItem) -> Path:
    """``out_dir/<name>.so``: a verified one if present, else built under the artifact's file lock,
    checked again under it, so concurrent first calls from many processes compile once."""
    target = out_dir / f"{item.name}.so"
    if verified_module(target):
        return target
    with hold_lock(out_dir, item.name, item.spec.uri):
        if verified_module(target):  # another process built it while we waited
            return target
        notice(f"flashinfer_cake: building {item.name} (first use; later calls and processes load it from {out_dir})")
        start = time.perf_counter()
        build_specs([item], out_dir, out_dir / "build" / item.name)
        logger.info("flashinfer_cake: built %s in %.1f s", item.name, time.perf_counter() - start)
    if not verified_module(target):
        raise RuntimeError(f"flashinfer_cake: built {target} but cannot verify it")
    return target
