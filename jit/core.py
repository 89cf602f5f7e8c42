"""The one build pipeline of the package's compiled artifacts.

A :class:`JitSpec` describes one shared library: its translation units (a kernel module's
generated ``.cu`` files, or the torch binding's ``.cpp``), its flags, and everything else its
binary depends on. Its published file name carries a digest of all of that plus the compiler's identity,
so a stale build is never loaded (:mod:`.build` has the directory layout).

Contract of :func:`load`: returns the loaded artifact (a :class:`~.module.KernelModule`, or the
imported binding module), trying in order
  1. what this process already loaded (no file access),
  2. the AOT directories (``FLASHINFER_CAKE_AOT_DIR``, then the package's own ``aot/``), any
     compiler's build (a ``FLASHINFER_CAKE_AOT_DIR`` that is not a directory, or that others can
     write to, is a RuntimeError),
  3. the JIT cache (``FLASHINFER_CAKE_CACHE_DIR``): this compiler's build, or any compiler's when
     nothing can be compiled there (``FLASHINFER_CAKE_DISABLE_JIT``, no compiler, or a cache
     this process cannot write),
  (where a directory holds several compilers' builds, this compiler's is taken, else the one
  whose record was written last: :func:`.build.find_published`)
  4. a build into the JIT cache, unless ``FLASHINFER_CAKE_DISABLE_JIT`` is set.
Steps 1-3 start no process. Step 4 holds the artifact's file lock and checks the cache again
under it, so concurrent first calls from many processes compile once. A file is loaded only when
its bytes match the record written after it. :func:`prebuild` builds many specs in one ninja run
(the CLI's ``build``; it compiles even under ``FLASHINFER_CAKE_DISABLE_JIT``: that is its job),
copying into another directory what the JIT cache holds of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from . import env
from .build import (BuildItem, build_once, build_specs, find_published, hold_lock, listing, publish, read_record,
                    remove_stale_temporaries, verified_artifact, verified_module)
from .module import KernelModule

logger = logging.getLogger("flashinfer_cake.jit")


@dataclasses.dataclass(frozen=True)
class JitSpec:
    """One artifact. ``source`` is its main translation unit, ``units`` any further ones
    (compiled in parallel, then linked with it into one library); ``language`` picks the compiler
    ("cuda": nvcc, "c++": the C++ compiler); ``include_dirs`` come after the package's templates,
    ``lib_dirs`` are searched for ``ldflags``'s libraries at the link (paths, not in the digest: what
    they hold belongs in ``identity``, so one build serves every install of the same torch);
    ``identity`` lists whatever else the binary depends on (e.g. the torch and Python a binding is
    built for); ``python_extension``: imported as a Python module, else loaded with ctypes as a
    :class:`KernelModule`."""

    uri: str
    source: str = dataclasses.field(repr=False)
    units: tuple[str, ...] = dataclasses.field(default=(), repr=False, kw_only=True)
    language: str = "cuda"
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    include_dirs: tuple[str, ...] = ()
    lib_dirs: tuple[str, ...] = ()
    identity: tuple[str, ...] = ()
    python_extension: bool = False
    # What each entry of ``identity`` is ("torch", ...), for the messages about a build of the same uri for another
    # identity (not part of the digest or of the spec's equality).
    identity_names: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False)
    # The `flashinfer-cake build` options that prebuild this artifact alone (with the torch binding, which every
    # prebuild makes), for the advice of a call that finds it missing (not part of the digest or of the equality).
    build_options: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False)

    def __post_init__(self):
        if self.language not in ("cuda", "c++"):
            raise ValueError(f"JitSpec {self.uri}: language must be 'cuda' or 'c++', got {self.language!r}")
        if not isinstance(self.units, tuple) or not all(isinstance(u, str) for u in self.units):
            raise TypeError(f"JitSpec {self.uri}: units must be a tuple of source strings, got {type(self.units).__name__}")
        if self.identity_names and len(self.identity_names) != len(self.identity):
            raise ValueError(f"JitSpec {self.uri}: identity_names must name each of the {len(self.identity)} identity "
                             f"entries, got {len(self.identity_names)} names")

    @property
    def suffix(self) -> str:
        return ".cu" if self.language == "cuda" else ".cpp"

    @functools.cached_property
    def digest(self) -> str:
        """Hash of every input of the binary but the compiler: templates, sources, flags, identity."""
        h = hashlib.sha256()
        for part in (templates_digest(), self.language, self.source, "\0units", *self.units, "\0cflags", *self.cflags,
                     "\0ld", *self.ldflags, "\0id", *self.identity):
            h.update(part.encode() + b"\0")
        return h.hexdigest()

    def module_prefix(self) -> str:
        """What every build of this spec starts with, any compiler."""
        return f"{self.uri}_{self.digest[:_SOURCE_DIGEST_CHARS]}_"

    def module_name(self, toolchain_digest: str) -> str:
        """File stem of a build: the uri, the source digest, the compiler's digest."""
        return f"{self.module_prefix()}{toolchain_digest[:_TOOLCHAIN_DIGEST_CHARS]}"


_SOURCE_DIGEST_CHARS, _TOOLCHAIN_DIGEST_CHARS = 16, 8
_BUILD_NAME = re.compile(rf"\w+_[0-9a-f]{{{_SOURCE_DIGEST_CHARS}}}_[0-9a-f]{{{_TOOLCHAIN_DIGEST_CHARS}}}")


def is_build_name(stem: str) -> bool:
    """Whether ``stem`` is a build's file stem (JitSpec.module_name's form): what this package writes
    into an output directory, beside build/ and the locks."""
    return _BUILD_NAME.fullmatch(stem) is not None


@functools.cache
def templates_digest() -> str:
    """Digest of every file under include/ (path and bytes); read once per process."""
    root = env.include_dir()
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def compiler_of(spec: JitSpec) -> Path:
    """The compiler that builds ``spec``; raises RuntimeError saying how to get one."""
    return env.require_nvcc() if spec.language == "cuda" else env.cxx_path()


def _compiler_if_any(spec: JitSpec) -> Path | None:
    try:
        return compiler_of(spec)
    except RuntimeError:
        return None


_loaded: dict[JitSpec, object] = {}
_loaded_lock = threading.Lock()


def load(spec: JitSpec):
    """The loaded artifact of ``spec`` (see the module's contract)."""
    artifact = _loaded.get(spec)
    if artifact is None:
        with _loaded_lock:
            artifact = _loaded.get(spec)
            if artifact is None:
                artifact = _find_or_build(spec)
                _loaded[spec] = artifact
    return artifact


def open_artifact(spec: JitSpec, path: Path):
    """Load the file ``path`` built from ``spec``; RuntimeError when it cannot be loaded."""
    if not spec.python_extension:
        return KernelModule(path)
    module_spec = importlib.util.spec_from_file_location(f"flashinfer_cake._{spec.uri}", path)
    try:  # (an extension is opened by module_from_spec: a missing library raises there)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except ImportError as e:
        raise RuntimeError(f"flashinfer_cake: cannot load {path}: {e}") from e
    return module


def _build_name(spec: JitSpec, compiler: Path) -> str:
    """The file stem of ``spec``'s build by ``compiler``."""
    return spec.module_name(env.toolchain_digest(compiler))


def _preferred(spec: JitSpec) -> Callable[[], str | None]:
    """find_published's preference among several builds of ``spec``: this machine's compiler's (None
    without a compiler, or one whose files cannot be read: loading a prebuilt module needs none)."""
    def name() -> str | None:
        try:
            compiler = _compiler_if_any(spec)
            return None if compiler is None else _build_name(spec, compiler)
        except OSError:
            return None
    return name


def _aot_builds(spec: JitSpec, listed: list[tuple[Path, list[str]]] | None = None) -> list[Path]:
    """The verified build of ``spec`` in each AOT directory that holds one, in search order (any
    compiler; find_published's choice among several). ``listed``: (directory, its listing) of each AOT
    directory, when the caller has them."""
    listed = [(directory, None) for directory in env.aot_dirs()] if listed is None else listed
    found = (find_published(directory, spec.module_prefix(), _preferred(spec), names) for directory, names in listed)
    return [path for path in found if path is not None]


@functools.cache
def _warn_once(message: str) -> None:
    """Log ``message`` as a warning the first time this process meets it (each first load asks again)."""
    logger.warning(message)


def _find_or_build(spec: JitSpec):
    for path in _aot_builds(spec):
        try:
            return open_artifact(spec, path)
        except RuntimeError as e:  # e.g. built for another platform: the cache or JIT may do
            logger.warning("flashinfer_cake: skipping prebuilt %s: %s", path, e)
    skipped = env.package_aot_problem()
    if skipped:
        _warn_once(f"flashinfer_cake: {skipped}")
    return open_artifact(spec, _find_or_build_in_cache(spec))


def _disabled_error(spec: JitSpec, cache: Path) -> RuntimeError:
    searched = [str(d) for d in env.aot_dirs()] + [str(cache)]
    skipped = env.package_aot_problem()
    other = lookup(spec).other_builds if cache.is_dir() else []  # (a cache that is not there holds nothing)
    command = " ".join(("flashinfer-cake build", *spec.build_options))
    return RuntimeError(
        f"flashinfer_cake: {spec.uri} is not prebuilt (searched {searched}{f'; {skipped}' if skipped else ''}"
        f"{f'; {other[0]} is {built_for(spec, other[0])}' if other else ''}) "
        f"and FLASHINFER_CAKE_DISABLE_JIT is set. Prebuild it with `{command}` (into the JIT cache) or "
        f"`{command} --aot` (into the installed package), or unset FLASHINFER_CAKE_DISABLE_JIT."
    )


def _can_build_in(directory: Path) -> bool:
    """Whether this process may write ``directory``: where it cannot, nothing is compiled there and any compiler's build
    of the same sources serves (load and prebuild alike); one that must be built there is :func:`_unwritable`."""
    return os.access(directory, os.W_OK)


def _unwritable(directory: Path, uris: list[str]) -> RuntimeError:
    """The error of builds (``uris``) that must be written into ``directory``, which this process cannot write, said
    before anything is compiled, with a fix that fits the directory."""
    st = directory.stat()
    if os.statvfs(directory).f_flag & os.ST_RDONLY:
        why, chmod = "is on a read-only file system", ""
    else:
        why = f"is not writable by this process (mode {stat.filemode(st.st_mode)}, owner uid {st.st_uid})"
        chmod = f"make it writable (`chmod u+w {directory}`), or " if st.st_uid == os.getuid() else ""
    return RuntimeError(f"flashinfer_cake: cannot build {', '.join(uris)} in {directory}: it {why}: "
                        f"{chmod}{env.build_elsewhere(directory)}")


def _in_cache(spec: JitSpec, cache: Path, names: list[str] | None = None) -> tuple[Path | None, Path | None]:
    """(the build of ``spec`` in ``cache`` that load opens, or None; the compiler that builds it
    there, or None when nothing can be compiled: then any compiler's build will do). ``names``: the
    cache's listing, when the caller has it."""
    compiler = None if env.jit_disabled() or not _can_build_in(cache) else _compiler_if_any(spec)
    if compiler is None:
        return find_published(cache, spec.module_prefix(), _preferred(spec), names), None
    return verified_module(cache / f"{_build_name(spec, compiler)}.so"), compiler


def _find_or_build_in_cache(spec: JitSpec) -> Path:
    if env.jit_disabled() and not env.cache_dir_path().exists():
        # only read: a cache that does not exist holds nothing, and is not created (nor is its path's problem,
        # e.g. an unwritable home, the error: the prebuild advice is)
        raise _disabled_error(spec, env.cache_dir_path())
    cache = env.cache_dir()
    path, compiler = _in_cache(spec, cache)
    if path is not None:
        return path
    if compiler is None:
        if env.jit_disabled():
            raise _disabled_error(spec, cache)
        compiler = compiler_of(spec)  # raises, saying how to get one
        if not _can_build_in(cache):
            raise _unwritable(cache, [spec.uri])
    item = BuildItem(spec, _build_name(spec, compiler), compiler)
    try:
        return build_once(cache, item)
    except RuntimeError as e:  # (e.g. an nvcc too old): say so when another compiler's build is at hand
        other = find_published(cache, spec.module_prefix())
        if other is None or other.stem == item.name:
            raise
        version = read_record(other).get("compiler_version")
        by = f", by {version}" if isinstance(version, str) else ""
        raise RuntimeError(f"{e}\nflashinfer_cake: the cache holds another compiler's build of {spec.uri} ({other}{by}); "
                           f"FLASHINFER_CAKE_DISABLE_JIT=1 loads it instead of building (and a process with it set "
                           f"compiles nothing)") from e


def _existing_cache() -> Path | None:
    """The JIT cache root, checked as load checks it, when it exists; None when it does not yet (a
    report creates no directory: there is nothing built in it)."""
    cache = env.cache_dir(create=False)
    return cache if cache.exists() else None


class Lookup(NamedTuple):
    """Where the builds of a spec are (what ``flashinfer-cake env`` reports)."""
    located: Path | None  # the build load tries first without compiling; None: it would compile
    published: list[Path]  # the verified build in each AOT directory and in the JIT cache that holds one
    # where none is published: the latest verified build of its uri from other sources or for another identity (e.g.
    # a binding prebuilt for another torch) in each directory that holds one, which no process like this one loads
    # (:func:`built_for` says why)
    other_builds: list[Path]


def _other_build(spec: JitSpec, directory: Path, names: list[str]) -> Path | None:
    """The latest verified build of ``spec.uri`` among ``names`` (``directory``'s listing) that is not ``spec``'s (the
    order find_published takes among several), or None."""
    form = re.compile(rf"{re.escape(spec.uri)}_[0-9a-f]{{{_SOURCE_DIGEST_CHARS}}}_[0-9a-f]{{{_TOOLCHAIN_DIGEST_CHARS}}}\.so")
    others = [n for n in names if form.fullmatch(n) and not n.startswith(spec.module_prefix())]
    return find_published(directory, "", names=others)


def lookup(spec: JitSpec) -> Lookup:
    """Where ``spec``'s builds are, each directory listed once: :func:`located` and :func:`published`
    in one pass (load still skips a prebuilt file it cannot open), and where there are none, the other builds of its
    uri (:attr:`Lookup.other_builds`)."""
    listed = [(directory, listing(directory)) for directory in env.aot_dirs()]
    aot = _aot_builds(spec, listed)
    cache = _existing_cache()
    here = cached = None
    if cache is not None:
        listed.append((cache, listing(cache)))
        here, compiler = _in_cache(spec, cache, listed[-1][1])
        # (where nothing compiles, load's choice is already any compiler's: find_published's, as below)
        cached = here if compiler is None else find_published(cache, spec.module_prefix(), _preferred(spec), listed[-1][1])
    published = [*aot, *([cached] if cached is not None else [])]
    others = [] if published else [p for directory, names in listed if (p := _other_build(spec, directory, names))]
    return Lookup(aot[0] if aot else here, published, others)


def built_for(spec: JitSpec, other: Path) -> str:
    """What ``other``, a build of ``spec.uri`` that is not ``spec``'s (:attr:`Lookup.other_builds`), was built for:
    the identity entries its record names that differ from this process's, else other sources."""
    recorded = read_record(other).get("identity")
    what = "another torch or other sources" if spec.identity else "other sources"
    if not isinstance(recorded, list):
        return f"built for {what} (its record, from an older flashinfer_cake, does not say which)"
    if len(recorded) != len(spec.identity):
        return f"built for {what} (its record's identity has {len(recorded)} entries, this one {len(spec.identity)})"
    names = spec.identity_names or tuple(f"identity[{i}]" for i in range(len(spec.identity)))
    # (a long value, e.g. torch's build settings, is named, not quoted)
    differ = [f"{name} {theirs} (this process: {ours})" if len(f"{theirs}{ours}") <= 80 else f"other {name}"
              for name, theirs, ours in zip(names, recorded, spec.identity) if theirs != ours]
    return f"built for {', '.join(differ)}" if differ else "built from other sources (another flashinfer_cake's)"


def located(spec: JitSpec) -> Path | None:
    """The build of ``spec`` that :func:`load` tries first without compiling, or None when it
    would compile."""
    return lookup(spec).located


def published(spec: JitSpec) -> list[Path]:
    """The verified build of ``spec`` in each AOT directory and in the JIT cache that holds one (any
    compiler; find_published's choice among several, as load makes it)."""
    return lookup(spec).published


def _cache_to_copy_from(out_dir: Path, progress: Callable[[str], None] | None) -> Path | None:
    """The JIT cache, whose verified modules a prebuild into another directory (--out, --aot)
    copies instead of compiling them again; None where it is ``out_dir`` or cannot be used (the
    loader's own checks: code is taken from it; said through ``progress``)."""
    try:
        cache = env.cache_dir(create=False)
    except RuntimeError as e:
        if progress:
            progress(f"note: nothing is copied from the JIT cache: {e}")
        return None
    return None if cache.resolve() == out_dir.resolve() else cache


def _copied_from_cache(item: BuildItem, cache: Path, out_dir: Path, progress: Callable[[str], None] | None) -> bool:
    """Publish into ``out_dir`` the cache's module of the item's name (so of the same sources,
    flags and compiler) when its bytes, read once, match its record; False (compile it) otherwise,
    a file a concurrent clear-cache removes included. The caller holds out_dir's locks; the cache's
    are not taken (two prebuilds, each into the other's cache, must not wait on each other), so
    the bytes checked are the bytes written."""
    cached = cache / f"{item.name}.so"
    artifact = verified_artifact(cached)
    if artifact is None:
        return False
    record, data = artifact
    remove_stale_temporaries(out_dir, item.name)
    record = {k: v for k, v in record.items() if k != "sha256"}
    publish(data, out_dir, item.name, {**record, "copied_from": str(cached)})
    if progress:
        progress(f"copied {item.spec.uri} from the JIT cache ({cached})")
    return True


def prebuild(specs: list[JitSpec], out_dir: Path | str | None = None, *, jobs: int | None = None,
             progress: Callable[[str], None] | None = None) -> dict[JitSpec, Path]:
    """Build every spec of ``specs`` not yet published in ``out_dir`` (default: the JIT cache) in
    one parallel ninja run, and return where each is. Into another directory than the JIT cache,
    the cache's verified build of a spec under the same name (same sources, flags and compiler) is
    copied instead of compiled. ``progress`` gets one line per artifact
    built. A directory that already holds everything is only read (it may be read-only); where
    nothing can be compiled (no compiler, a directory this process cannot write), any compiler's
    build serves, as load takes it, and one that none has built is an error before any compiling."""
    out_dir = env.cache_dir() if out_dir is None else env.output_dir(Path(out_dir))
    specs = list(dict.fromkeys(specs))  # each once: a repeated spec would take its lock twice
    try:
        compilers, no_compiler = [compiler_of(s) for s in specs], None
    except RuntimeError as e:
        compilers, no_compiler = [], e
    if no_compiler or not _can_build_in(out_dir):
        found = {s: find_published(out_dir, s.module_prefix(), _preferred(s)) for s in specs}
        if all(found.values()):
            if progress and any(found[s].stem != _build_name(s, c) for s, c in zip(specs, compilers)):
                progress(f"note: {out_dir} is not writable by this process, so nothing was compiled: calls load the "
                         f"builds it holds (of the same sources, some by another compiler)")
            return found
        raise no_compiler or _unwritable(out_dir, [s.uri for s, path in found.items() if path is None])
    items = [BuildItem(s, _build_name(s, c), c) for s, c in zip(specs, compilers)]
    done = {item.spec: out_dir / f"{item.name}.so" for item in items}
    if all(verified_module(path) for path in done.values()):
        return done
    with contextlib.ExitStack() as locks:
        # One prebuild at a time in this directory (they share build/prebuild), holding the same
        # per-artifact locks as load(), in a fixed order: a concurrent first call waits for this
        # build instead of compiling the artifact again.
        locks.enter_context(hold_lock(out_dir, "prebuild", "another prebuild"))
        for item in sorted(items, key=lambda i: i.name):
            locks.enter_context(hold_lock(out_dir, item.name, item.spec.uri))
        todo = [item for item in items if not verified_module(done[item.spec])]
        cache = _cache_to_copy_from(out_dir, progress) if todo else None
        todo = [item for item in todo if cache is None or not _copied_from_cache(item, cache, out_dir, progress)]
        if todo:
            start = time.perf_counter()
            build_specs(todo, out_dir, out_dir / "build" / "prebuild", jobs=jobs, progress=progress)
            if progress:
                progress(f"built {len(todo)} module(s) into {out_dir} in {time.perf_counter() - start:.1f} s")
    return done
