"""Everything the JIT reads from the environment: directories, tools, arch list.

Each function reads the environment when called (never at import), so a test or a user can set a
variable before the first build. Nothing here starts processes; :func:`cache_dir` creates the
cache root the first time a module is looked up, :func:`output_dir` a prebuild's output.

Environment variables:
    FLASHINFER_CAKE_CACHE_DIR      JIT cache root (default ``~/.cache/flashinfer_cake/<version>``).
    FLASHINFER_CAKE_AOT_DIR        a directory of prebuilt modules, searched before the package's aot/
                                   (one that is not a directory, that others can write to, or that this
                                   process cannot read, is an error).
    FLASHINFER_CAKE_CUDA_ARCH_LIST archs that ``flashinfer-cake build`` prebuilds (default ``9.0a``, unset or empty).
    FLASHINFER_CAKE_NVCC           the nvcc to build with (else $CUDA_HOME/bin/nvcc, $CUDA_PATH/bin/nvcc,
                                   NVIDIA's CUDA wheels in this Python environment, PATH, /usr/local/cuda).
    CXX                            the C++ compiler of the torch binding, one executable (else c++ / g++ on PATH).
    FLASHINFER_CAKE_DISABLE_JIT    ``1`` (``true``, ``yes``, ``on``): calls never compile; a module that is
                                   not prebuilt is an error (``0``, ``false``, ``no``, ``off`` or empty: the
                                   JIT builds it; any other value is an error). Explicit prebuilds (``flashinfer-cake build``) still
                                   compile: that is what they are for.
    MAX_JOBS                       parallel compile jobs for ninja.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import re
import shutil
import stat
import sys
from pathlib import Path

from .. import _version
from .._version import __version__

logger = logging.getLogger("flashinfer_cake.jit")

# Device compute capability -> the arch a variant is compiled for. Data, not code: a new arch is a
# new row once its kernels are tested on it.
ARCH_OF_CAPABILITY = {(9, 0): "sm_90a"}
# Spellings accepted in FLASHINFER_CAKE_CUDA_ARCH_LIST and --arch: 9.0, 9.0a, 90, 90a, sm_90 and the arch itself.
_ARCH_TOKENS = {token: arch for (major, minor), arch in ARCH_OF_CAPABILITY.items()
                for token in (f"{major}.{minor}", f"{major}.{minor}a", f"{major}{minor}", f"{major}{minor}a",
                              f"sm_{major}{minor}", arch)}

PACKAGE_DIR = Path(_version.__file__).resolve().parent  # the flashinfer_cake package
PACKAGE_AOT_DIR = PACKAGE_DIR / "aot"  # where `flashinfer-cake build --aot` prebuilds


@functools.cache
def include_dir() -> Path:
    """The templates: flashinfer_cake/include in a wheel, <checkout>/include in a checkout."""
    for d in (PACKAGE_DIR / "include", PACKAGE_DIR.parent / "include"):
        if (d / "flashinfer_cake").is_dir():
            return d
    raise RuntimeError(f"flashinfer_cake's CUDA templates are missing (looked in {PACKAGE_DIR}/include "
                       f"and {PACKAGE_DIR.parent}/include): reinstall the package")


def env_flag(name: str, on: str, off: str) -> bool:
    """A boolean environment variable: 1, true, yes or on set it; unset, empty, 0, false, no or off do not (any case,
    spaces around ignored); any other value is a RuntimeError naming the variable, the value and what each word
    means (``on`` / ``off``), not a guess."""
    value = os.environ.get(name, "")
    word = value.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("", "0", "false", "no", "off"):
        return False
    raise RuntimeError(f"{name} must be 1, true, yes or on ({on}) or 0, false, no, off or empty ({off}), got {value!r}")


def jit_disabled() -> bool:
    """FLASHINFER_CAKE_DISABLE_JIT (env_flag; `false` disabled the JIT until 2026-12-06)."""
    return env_flag("FLASHINFER_CAKE_DISABLE_JIT", "calls never compile", "they build what is missing")


def max_jobs() -> int:
    """Parallel compile jobs: MAX_JOBS, else every core. A bad value is a RuntimeError (as a bad
    FLASHINFER_CAKE_DISABLE_JIT: the calls' error for a module that cannot be loaded)."""
    value = os.environ.get("MAX_JOBS", "")
    if not value:
        return max(1, os.cpu_count() or 1)
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise RuntimeError(f"MAX_JOBS must be a positive integer (or unset: every core), got {value!r}")
    return int(value)


def normalize_arch(token: str, source: str = "arch") -> str:
    """``9.0``, ``9.0a``, ``90a`` or ``sm_90a`` -> the variant arch ``sm_90a``."""
    if token not in _ARCH_TOKENS:
        raise ValueError(f"{source}: unsupported arch {token!r}; supported: {sorted(_ARCH_TOKENS)}")
    return _ARCH_TOKENS[token]


def arch_list() -> list[str]:
    """Archs named by FLASHINFER_CAKE_CUDA_ARCH_LIST (space, comma or semicolon separated)."""
    value = os.environ.get("FLASHINFER_CAKE_CUDA_ARCH_LIST") or "9.0a"  # empty is unset, as for every variable
    archs = []
    for token in value.replace(",", " ").replace(";", " ").split():
        arch = normalize_arch(token, "FLASHINFER_CAKE_CUDA_ARCH_LIST")
        if arch not in archs:
            archs.append(arch)
    if not archs:
        raise ValueError(f"FLASHINFER_CAKE_CUDA_ARCH_LIST names no arch: {value!r}")
    return archs


def _owners(package: bool) -> set[int]:
    """Who may own a directory code is loaded from: you or root (the package's aot/: also the package's owner)."""
    return {os.getuid(), 0, PACKAGE_DIR.stat().st_uid} if package else {os.getuid(), 0}


def _unsafe_reason(path: Path, *, package: bool = False) -> str | None:
    """Why another user could have written code into this directory, or None. The package's own
    directory is as trusted as the Python files beside it: owned like the package, and
    group-writable is fine (pip creates it so under a umask of 002); only world-writable is not."""
    st = path.stat()
    if st.st_uid not in _owners(package):
        return f"owned by uid {st.st_uid}, not by you (uid {os.getuid()}) or root"
    unsafe = stat.S_IWOTH if package else stat.S_IWGRP | stat.S_IWOTH
    if st.st_mode & unsafe:
        who = "other users" if st.st_mode & stat.S_IWOTH else "its group"
        return f"writable by {who} (mode {stat.filemode(st.st_mode)})"
    return None


def _check_private_dir(path: Path, what: str) -> None:
    """Refuse a directory we would load code from if another user could have written to it,
    saying which check failed and a fix that is safe for that directory."""
    reason = _unsafe_reason(path)
    if reason is None:
        return
    st = path.stat()
    if st.st_uid == os.getuid() and not st.st_mode & stat.S_ISVTX:
        fix = f"make it private with `chmod go-w {path}` (or `chmod 700 {path}`)"
    elif what == "FLASHINFER_CAKE_AOT_DIR":  # prebuilt modules shared by another user: a copy, or the install's aot/
        fix = (f"copy its modules into a directory of your own (`cp -a`, which keeps their records' order) and point "
               f"{what} there, or have the package's owner install them into its own aot/ (`flashinfer-cake build "
               f"--aot`), which every user of the install loads")
    else:  # another user's, or a shared directory (sticky, e.g. /tmp): no chmod can make it safe
        fix = f"point {what} at a directory of your own, e.g. {Path.home() / '.cache' / 'flashinfer_cake'}"
    raise RuntimeError(f"flashinfer_cake: {what} {path} is {reason}; refusing to load code from it: {fix}")


def _unreadable(path: Path, mode: str = "u+rx") -> str | None:
    """Why this process cannot search the directory ``path`` for builds (list it, open what it holds), with the fix
    (``mode``: the chmod its owner runs; the JIT cache's is 700, as it is created, the package's aot/ a+rx, every
    user's); None when it can. (Listed, not only os.access: an ACL or a mount's rules refuse root too.)"""
    try:
        with os.scandir(path):
            pass
        if os.access(path, os.R_OK | os.X_OK):
            return None
        error = "Permission denied"
    except OSError as e:
        error = e.strerror or str(e)
    st = path.stat()
    fix = (f"`chmod {mode} {path}`" if st.st_uid == os.getuid() else
           f"its owner (uid {st.st_uid}) can make it readable: `chmod a+rx {path}`")
    return f"not readable by this process ({error}; mode {stat.filemode(st.st_mode)}): {fix}"


def _check_readable(path: Path, what: str, otherwise: str, mode: str = "u+rx") -> None:
    """Refuse a directory we search for builds that this process cannot read: it would look empty."""
    problem = _unreadable(path, mode)
    if problem:
        raise RuntimeError(f"flashinfer_cake: {what} {path} is {problem}, or {otherwise}")


def _make_dir(path: Path, what: str, mode: int, create: bool = True) -> Path:
    """``path`` as an existing directory (created with ``mode`` when missing), or a RuntimeError
    that says what is in the way. ``create=False``: a missing one is left missing when nothing
    that mkdir would meet is in its way (its nearest existing ancestor is a directory we may write)."""
    if path.is_symlink() and not path.exists():
        raise RuntimeError(f"flashinfer_cake: {what} {path} is a symbolic link to {os.readlink(path)}, "
                           f"which does not exist: create the target or choose another directory")
    if path.exists() and not path.is_dir():
        raise RuntimeError(f"flashinfer_cake: {what} {path} exists and is not a directory: remove it or choose "
                           f"another directory")
    if not path.exists() and not create:
        ancestor = next(a for a in path.parents if a.exists() or a.is_symlink())
        problem = ("Not a directory" if not ancestor.is_dir() else
                   "Permission denied" if not os.access(ancestor, os.W_OK | os.X_OK) else None)
        if problem:
            raise RuntimeError(f"flashinfer_cake: cannot create {what} {path}: {problem} ({ancestor}): "
                               f"{build_elsewhere(path)}")
    elif not path.exists():
        try:
            path.mkdir(mode=mode, parents=True, exist_ok=True)
            os.chmod(path, mode)  # mkdir's mode is filtered by the umask
        except OSError as e:
            where = f" ({e.filename})" if e.filename and str(e.filename) != str(path) else ""
            raise RuntimeError(f"flashinfer_cake: cannot create {what} {path}: {e.strerror or e}{where}: "
                               f"{build_elsewhere(path)}") from e
    return path


def build_elsewhere(directory: Path) -> str:
    """Where to build instead of ``directory``, which this process cannot create or write: the fix
    that fits it (the package's aot/, the JIT cache, or a prebuild's --out)."""
    if directory == PACKAGE_AOT_DIR:
        return ("run `flashinfer-cake build --aot` as the install's owner, or build into your JIT cache "
                "(`flashinfer-cake build`)")
    if directory == cache_dir_path():
        return "point FLASHINFER_CAKE_CACHE_DIR at a directory you can write"
    return ("build into a directory you can write (`flashinfer-cake build --out DIR`, then "
            "`export FLASHINFER_CAKE_AOT_DIR=DIR`)")


def cache_dir_path() -> Path:
    """Where the JIT cache root is (FLASHINFER_CAKE_CACHE_DIR, else ~/.cache/flashinfer_cake/<version>),
    whether or not it exists."""
    value = os.environ.get("FLASHINFER_CAKE_CACHE_DIR")
    root = Path(value) if value else Path.home() / ".cache" / "flashinfer_cake" / __version__
    return root.expanduser().absolute()


def cache_dir(create: bool = True) -> Path:
    """The JIT cache root, created 0700 if missing and refused if others can write to it.
    ``create=False`` (a report): one that does not exist is returned as it is, when it could be created."""
    root = _make_dir(cache_dir_path(), "the JIT cache directory (FLASHINFER_CAKE_CACHE_DIR)", 0o700, create)
    if root.exists():
        _check_private_dir(root, "FLASHINFER_CAKE_CACHE_DIR")
        _check_readable(root, "FLASHINFER_CAKE_CACHE_DIR", "point FLASHINFER_CAKE_CACHE_DIR at another directory",
                        mode="700")
    return root


def output_dir(path: Path) -> Path:
    """A prebuild's output directory (an AOT directory), created 0755 when missing: readable by
    every user of an install, writable by its owner only. One the loader would refuse is refused
    now (the package's own aot/ by the package's rule)."""
    path = _make_dir(path.expanduser().absolute(), "the output directory", 0o755)
    if path != PACKAGE_AOT_DIR:
        _check_private_dir(path, "the output directory")
    elif reason := _unsafe_reason(path, package=True):
        raise RuntimeError(f"flashinfer_cake: {path} is {reason}; the loader would skip it")
    return path


def installed_package_dir() -> Path | None:
    """Where pip installed flashinfer_cake (not editable), or None: a process running a checkout's
    sources (python -m from the checkout root) may be another copy than the installed one. A
    checkout's own metadata (the egg-info `pip install .` leaves there, found first from its root)
    names no installer: it is not an install."""
    for dist in importlib.metadata.distributions(name="flashinfer_cake"):
        if dist.read_text("INSTALLER") is None:
            continue
        init = Path(dist.locate_file("flashinfer_cake/__init__.py"))
        if init.is_file():
            return init.parent.resolve()
    return None


def aot_dirs() -> list[Path]:
    """Directories of prebuilt modules, searched in order before the JIT cache."""
    dirs = []
    value = os.environ.get("FLASHINFER_CAKE_AOT_DIR")
    if value:  # named by the user: a missing or unsafe one is an error, not a silent JIT build
        path = Path(value).expanduser().absolute()
        if not path.is_dir():
            state = "is not a directory" if path.exists() else "does not exist"
            shown = value if str(path) == value else f"{value} ({path})"
            raise RuntimeError(f"flashinfer_cake: FLASHINFER_CAKE_AOT_DIR={shown} {state}: point it at a prebuild's "
                               f"output (`flashinfer-cake build --out DIR`) or unset it")
        _check_private_dir(path, "FLASHINFER_CAKE_AOT_DIR")
        _check_readable(path, "FLASHINFER_CAKE_AOT_DIR", "point it at another prebuild's output or unset it")
        dirs.append(path)
    if PACKAGE_AOT_DIR.is_dir() and package_aot_problem() is None:
        dirs.append(PACKAGE_AOT_DIR)
    return dirs


def package_aot_problem() -> str | None:
    """Why the package's own aot/ is skipped, or None (used, or absent): a broken install, which is not an error
    (calls build their modules with the JIT instead); the loader warns once, `flashinfer-cake env` reports it."""
    if not PACKAGE_AOT_DIR.is_dir():
        return None
    unsafe = _unsafe_reason(PACKAGE_AOT_DIR, package=True)
    if unsafe:  # (the unreadable reason below says its own fix)
        fix = ("reinstall the package, so that its aot/ is owned as the package is"
               if PACKAGE_AOT_DIR.stat().st_uid not in _owners(package=True)
               else f"its owner can run `chmod o-w {PACKAGE_AOT_DIR}`")
        return f"ignoring {PACKAGE_AOT_DIR}: it is {unsafe}: {fix}"
    unreadable = _unreadable(PACKAGE_AOT_DIR, mode="a+rx")
    return unreadable and f"ignoring {PACKAGE_AOT_DIR}: it is {unreadable}"


# NVIDIA's CUDA wheels install one toolkit tree per CUDA major version into the `nvidia` namespace package
# (site-packages/nvidia/cu13/{bin,nvvm,include,lib}); nvcc reads every part from its own tree. What a build reads,
# and the wheel that ships it:
PIP_TOOLKIT_TREES = ("cu13",)
PIP_TOOLKIT_PARTS = (
    ("bin/nvcc", "nvidia-cuda-nvcc"),
    ("nvvm/bin/cicc", "nvidia-nvvm"),
    ("include/crt/host_config.h", "nvidia-cuda-crt"),
    ("include/cuda_runtime.h", "nvidia-cuda-runtime"),
    ("lib/libcudart_static.a", "nvidia-cuda-runtime"),
    ("include/cccl/nv/target", "nvidia-cuda-cccl"),
)
# ptxas reads only the PTX of a cicc of its own release, and the crt headers are nvcc's own: these three wheels come
# from one release. Pinning nvidia-cuda-nvcc alone (==13.0.88) lets pip take nvvm and crt 13.5.37, and every build
# then fails in ptxas ("Unsupported .version 9.5; current version is '9.0'").
PIP_TOOLKIT_ONE_RELEASE = ("nvidia-cuda-nvcc", "nvidia-nvvm", "nvidia-cuda-crt")
# pyproject.toml's cu13 extra (tests/test_jit.py keeps the two and the README equal): NVIDIA's meta-package, one
# release of every part.
PIP_TOOLKIT_REQUIREMENT = "cuda-toolkit[nvcc,nvvm,crt,cudart,cccl]>=13.0,<14"
PIP_TOOLKIT_COMMAND = f'`pip install "{PIP_TOOLKIT_REQUIREMENT}"`'
INSTALL_PIP_TOOLKIT = f"NVIDIA's CUDA 13 compiler wheels ({PIP_TOOLKIT_COMMAND}, or the cu13 extra)"
SYSTEM_NVCC = "/usr/local/cuda/bin/nvcc"
NVCC_SEARCH_ORDER = ("FLASHINFER_CAKE_NVCC", "$CUDA_HOME/bin/nvcc", "$CUDA_PATH/bin/nvcc",
                     "NVIDIA's CUDA wheels in this Python environment", "PATH", SYSTEM_NVCC)
MIN_NVCC_RELEASE = (12, 8)  # the oldest nvcc the kernels build with (jit/build.py checks it before a build)
MIN_NVCC = ".".join(map(str, MIN_NVCC_RELEASE))


def _is_pip_tree(top: Path) -> bool:
    return top.parent.name == "nvidia" and top.name in PIP_TOOLKIT_TREES


def _pip_toolkit_trees():
    """(site directory, tree) of each NVIDIA toolkit tree holding an nvcc in this Python environment's
    import path: absolute str entries only (the working directory is no place to run a compiler
    from), each tree once however its path is spelled."""
    seen = set()
    for entry in sys.path:
        if not isinstance(entry, str) or not os.path.isabs(entry):
            continue
        for tree in PIP_TOOLKIT_TREES:
            top = Path(entry) / "nvidia" / tree
            if os.path.isfile(top / "bin" / "nvcc") and os.path.realpath(top) not in seen:
                seen.add(os.path.realpath(top))
                yield Path(entry), top


def _pip_toolkit_problems(site: Path, top: Path) -> list[str]:
    """What keeps the tree ``top`` from building (empty: nothing): a wheel whose files are not in it
    (not installed, or installed into another site directory, e.g. the system's under a venv: nvcc
    reads every part from its own tree), and nvcc, nvvm and crt of different releases (read from
    ``site``'s wheel metadata, where it has any). Stats and metadata look-ups: no process. The
    callers add the one-release fix (PIP_TOOLKIT_COMMAND) once."""
    problems = []
    for wheel in dict.fromkeys(wheel for _, wheel in PIP_TOOLKIT_PARTS):
        lacking = [part for part, w in PIP_TOOLKIT_PARTS if w == wheel and not os.path.exists(top / part)]
        if not lacking:
            continue
        installed = [Path(d.locate_file("")) for d in importlib.metadata.distributions(name=wheel)]
        if site in installed:
            why = f"{wheel} is installed into {site} without its files (`pip install --force-reinstall {wheel}`)"
        elif installed:
            why = (f"{wheel} is installed into {installed[0]}, not beside nvcc in {site} (`pip install "
                   f"--ignore-installed {wheel}` puts it there)")
        else:
            why = f"{wheel} is not installed"
        problems.append(f"no {top / lacking[0]}: {why}")
    versions = {}
    for name in PIP_TOOLKIT_ONE_RELEASE:
        for dist in importlib.metadata.distributions(name=name, path=[str(site)]):
            versions[name] = dist.version
            break
    if len(set(versions.values())) > 1:
        problems.append(", ".join(f"{n} {v}" for n, v in versions.items()) + " are of different releases (ptxas "
                        "reads only the PTX of its own release's nvvm)")
    return problems


def pip_toolkit_troubles() -> str:
    """The wheel trees here that cannot build, and the fix, as sentences for an error; "" when none."""
    unusable = [f"NVIDIA's CUDA wheels at {top} cannot build: {'; '.join(problems)}."
                for top, problems in pip_toolkits() if problems]
    return " ".join(unusable + [f"{PIP_TOOLKIT_COMMAND} installs one release of every part."]) if unusable else ""


def pip_toolkits() -> list[tuple[Path, list[str]]]:
    """Each NVIDIA toolkit tree in this Python environment, with what keeps it from building (empty: it
    can build)."""
    return [(top, _pip_toolkit_problems(site, top)) for site, top in _pip_toolkit_trees()]


def _nvcc_candidates():
    """The places an nvcc may be (NVCC_SEARCH_ORDER), in order; each looked at only once the ones
    before it are not there."""
    explicit = os.environ.get("FLASHINFER_CAKE_NVCC")
    if explicit:  # an explicit choice is never silently replaced
        yield explicit
        return
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            yield os.path.join(os.environ[var], "bin", "nvcc")
    for site, top in _pip_toolkit_trees():
        if not _pip_toolkit_problems(site, top):
            yield str(top / "bin" / "nvcc")
    yield shutil.which("nvcc")
    yield SYSTEM_NVCC


def nvcc_path() -> Path | None:
    """The nvcc to build with, or None when there is none."""
    for c in _nvcc_candidates():
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return Path(c).absolute()
    return None


def require_nvcc() -> Path:
    nvcc = nvcc_path()
    if nvcc is None:
        explicit = os.environ.get("FLASHINFER_CAKE_NVCC")
        if explicit:
            raise RuntimeError(f"FLASHINFER_CAKE_NVCC={explicit!r} is not an executable file: point it at an nvcc, or "
                               "unset it to search the usual places.")
        troubles = pip_toolkit_troubles()
        raise RuntimeError(
            f"No nvcc found (looked at {', '.join(NVCC_SEARCH_ORDER)}). "
            + (troubles or f"Install {INSTALL_PIP_TOOLKIT} or the CUDA toolkit ({MIN_NVCC} or newer; set "
                           "FLASHINFER_CAKE_NVCC or CUDA_HOME).")
            + " Or use modules prebuilt elsewhere (`flashinfer-cake build --out DIR` there, then "
            "FLASHINFER_CAKE_AOT_DIR=DIR)."
        )
    return nvcc


def other_nvcc_hint(nvcc: Path) -> str:
    """How to build with another nvcc than ``nvcc`` (nvcc_path's choice): a usable wheel tree by name
    when there is one (CUDA_HOME, e.g. a cluster's module, comes before it), what keeps the wheel
    trees here from building when none can, else the ways to get an nvcc."""
    usable = [top / "bin" / "nvcc" for top, problems in pip_toolkits() if not problems and top / "bin" / "nvcc" != nvcc]
    if usable:
        return (f"NVIDIA's CUDA wheels here can build: set FLASHINFER_CAKE_NVCC={usable[0]}, or unset CUDA_HOME / "
                f"CUDA_PATH, which come before them")
    return pip_toolkit_troubles() or (f"point FLASHINFER_CAKE_NVCC or CUDA_HOME at a newer toolkit, or install "
                                      f"{INSTALL_PIP_TOOLKIT}, taken after CUDA_HOME and CUDA_PATH and before PATH")


def toolkit_link_flags(nvcc: Path) -> tuple[str, ...]:
    """Link flags an NVIDIA wheel tree's own nvcc.profile leaves out: it links from <tree>/lib64, the
    wheels put the static CUDA runtime in <tree>/lib ("cannot find -lcudart_static"). For ``nvcc`` or
    the nvcc a wrapper script of it runs; other toolkits need none."""
    for binary in _nvcc_binaries(nvcc.resolve()):
        top = binary.parent.parent
        if _is_pip_tree(top) and not (top / "lib64").exists():
            return (f"-L{top / 'lib'}",)
    return ()


def cxx_path() -> Path:
    """The C++ compiler of the torch binding: $CXX, else c++ / g++ on PATH. CXX is one executable (a name on PATH or
    a path), as torch.utils.cpp_extension takes it (2.13 quotes it whole into its ninja file and adds ccache / sccache
    itself): a launcher or flags in it would run a compiler the build's identity (toolchain_digest) does not name. A
    launcher's masquerade link (/usr/lib/ccache/c++) builds through the launcher, and the build's identity is the
    compiler it runs (compiler_behind)."""
    explicit = os.environ.get("CXX", "").strip()
    if explicit:
        found = shutil.which(explicit)
        words = explicit.split()
        if not found and len(words) > 1:
            compiler = next((w for w in reversed(words) if not w.startswith("-")), "g++")
            raise RuntimeError(
                f"CXX={explicit!r} is a command of {len(words)} words, not one C++ compiler executable, which is what "
                f"CXX takes (a name on PATH or a path, as torch.utils.cpp_extension takes it; a compiler launcher such "
                f"as ccache, or flags, cannot go in it: the build's identity is the compiler's): set CXX={compiler}, or "
                f"unset it (c++ or g++ on PATH)."
            )
        if not found:
            raise RuntimeError(f"CXX={explicit!r} is not an executable (a name on PATH or a path): set it to the C++ "
                               f"compiler of the torch binding, or unset it (c++ or g++ on PATH).")
        if compiler_behind(path := Path(found).absolute()) is None:
            raise _no_compiler_behind(path, f"CXX={explicit!r}")
        return path
    links = [Path(found).absolute() for found in (shutil.which("c++"), shutil.which("g++")) if found]
    for path in links:
        if compiler_behind(path) is not None:
            return path
    if links:
        raise _no_compiler_behind(links[0], f"{links[0].name} on PATH")
    raise RuntimeError("No C++ compiler found (c++ or g++ on PATH). The torch binding needs one (and nvcc a host "
                       "compiler, which it finds on PATH): install g++, or set CXX to a C++ compiler.")


# Compiler launchers whose masquerade directories (/usr/lib/ccache: c++ -> ccache) put them first on PATH.
_LAUNCHERS = ("ccache", "sccache", "distcc", "icecc")


def target_name(path: Path | str) -> str:
    """The name of the file ``path`` leads to through its links (realpath: never raises, a link loop included)."""
    return os.path.basename(os.path.realpath(path))


def compiler_behind(path: Path) -> Path | None:
    """The compiler ``path`` runs: itself, or for a launcher's masquerade link (/usr/lib/ccache/c++ -> ccache, which
    runs the next c++ on PATH that is not a launcher) that compiler, whose files are the build's identity
    (toolchain_digest: a compiler upgrade rebuilds); None for a launcher with no compiler behind it, or the launcher
    itself."""
    if target_name(path) not in _LAUNCHERS:
        return path
    if path.name in _LAUNCHERS:
        return None
    for d in os.environ.get("PATH", "").split(os.pathsep):
        candidate = os.path.join(os.path.abspath(d or "."), path.name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK) and target_name(candidate) not in _LAUNCHERS:
            return Path(candidate)
    return None


def _no_compiler_behind(found: Path, shown: str) -> RuntimeError:
    launcher = target_name(found)
    if found.name in _LAUNCHERS:
        what = f"the compiler launcher {launcher} itself, not a compiler"
    else:
        what = (f"a link to the compiler launcher {launcher} (its masquerade directory), and no {found.name} on PATH "
                f"behind it is a compiler")
    return RuntimeError(f"{shown} is {found}, {what}: set CXX to the compiler itself (e.g. CXX=/usr/bin/g++).")


def _fingerprint(path: Path) -> str:
    st = path.stat()
    return f"{path}\0{st.st_size}\0{st.st_mtime_ns}"


def _nvcc_binaries(nvcc: Path) -> list[Path]:
    """``nvcc`` and, when it is a wrapper script (under 64 KiB), the nvcc binaries it names."""
    files = [nvcc]
    if nvcc.stat().st_size < 65536:
        for target in re.findall(rb"(/[^\s'\"]*/nvcc)\b", nvcc.read_bytes()):
            target = Path(target.decode(errors="replace")).resolve()
            if target.is_file() and target not in files:
                files.append(target)
    return files


@functools.lru_cache(maxsize=8)
def _toolchain_digest(fingerprint: str) -> str:
    nvcc = Path(fingerprint.split("\0")[0])
    h = hashlib.sha256(fingerprint.encode())
    if nvcc.stat().st_size < 65536:  # a wrapper script: its text, and the nvcc it runs
        h.update(nvcc.read_bytes())
    files = _nvcc_binaries(nvcc)
    for target in files[1:]:
        h.update(_fingerprint(target).encode())
    # The toolkit's own identity files, when present: a system toolkit's version.json, and a file of each part
    # NVIDIA's wheels update apart from nvcc (nvvm, crt, the runtime, CCCL).
    for f in files:
        for ident in ("version.json", *(part for part, wheel in PIP_TOOLKIT_PARTS[1:] if not part.startswith("lib/"))):
            p = f.parent.parent / ident
            if p.is_file():
                h.update(_fingerprint(p).encode())
    return h.hexdigest()


# Environment variables the compilers read as more flags or search paths (nvcc's, then gcc's): set,
# they change what a build makes, so they are part of the compiler's identity (a module built under
# NVCC_APPEND_FLAGS=-G is not loaded once it is unset). Unset, the identity is the compiler's alone.
COMPILER_ENV = ("NVCC_APPEND_FLAGS", "NVCC_PREPEND_FLAGS", "NVCC_CCBIN", "CPATH", "C_INCLUDE_PATH",
                "CPLUS_INCLUDE_PATH", "LIBRARY_PATH")


def toolchain_digest(nvcc: Path) -> str:
    """Identity of an nvcc (or of the C++ compiler, alike) without running it (the warm path starts no process):
    path, size and mtime of the nvcc binary (through a wrapper script to the nvcc it runs; through a launcher's
    masquerade link to the compiler it runs, compiler_behind) and of the toolkit's version.json and a file of each
    part NVIDIA's wheels update apart (PIP_TOOLKIT_PARTS), and the COMPILER_ENV variables that are set. A new or
    updated toolkit changes it."""
    flags = "".join(f"\0{name}={os.environ[name]}" for name in COMPILER_ENV if os.environ.get(name))
    return _toolchain_digest(_fingerprint((compiler_behind(nvcc) or nvcc).resolve()) + flags)


def ninja_path() -> str:
    """ninja on PATH, else the binary of the PyPI package: where its module says (ninja.BIN_DIR, which is empty in a
    venv made with --system-site-packages over the install), else where its distribution's record puts it."""
    found = shutil.which("ninja")
    if found:
        return found
    try:
        import ninja  # the PyPI package ships the binary
    except ImportError:  # (e.g. installed with --no-deps)
        ninja = None
    candidates = [Path(ninja.__file__).parent / "data" / "bin" / "ninja"] if getattr(ninja, "__file__", None) else []
    if ninja is not None and getattr(ninja, "BIN_DIR", ""):
        candidates.insert(0, Path(ninja.BIN_DIR) / "ninja")
    try:
        candidates += [Path(f.locate()) for f in importlib.metadata.files("ninja") or () if f.name == "ninja"]
    except importlib.metadata.PackageNotFoundError:
        pass
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    raise RuntimeError("ninja not found: `pip install ninja` (a dependency of flashinfer_cake)")
