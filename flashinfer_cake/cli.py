"""The ``flashinfer-cake`` command (also ``python -m flashinfer_cake``): check this machine, prebuild the kernel
modules, list them, clear the JIT cache. ``flashinfer-cake --help`` and ``flashinfer-cake <command> --help`` say
what each does (the texts below)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import select
import shutil
import sys
import time

import torch

from . import __version__, jit
from ._checks import no_cuda_reason
from .jit import env
from .jit.build import check_nvcc_release, compiler_version, hold_lock
from .jit.core import is_build_name
from .jit.variant import BIAS_DTYPES, WEIGHT_DTYPES


DESCRIPTION = """\
Without a command: build what this machine needs, run the forward once on a
typical training shape, check it against the FP64 reference and print GB/s.
Without a GPU: say so, build the modules that are not built yet, exit 0.

Under FLASHINFER_CAKE_DISABLE_JIT=1 the default action compiles nothing (it
runs on prebuilt modules, or says which are missing); `build` still compiles:
prebuilding is what it is for. Errors are one line on stderr and exit status 1;
a usage error (an unknown command, a bad option value) is argparse's usage line
and status 2; Ctrl-C is status 130.
"""

ENV_DESCRIPTION = """\
Print the versions (flashinfer_cake with the directory it runs from, python,
torch), the GPUs, the nvcc, C++ compiler and ninja a build would use, NVIDIA's
CUDA wheels, the arch list, the compile jobs, the cache and prebuilt
directories, and for every module the build a first call opens. Always
finishes: a problem is reported on its line, then exit status 1 with the first
one on stderr.
"""

BUILD_DESCRIPTION = """\
Prebuild the kernel modules (one per weight dtype, bias dtype and arch) and the
torch binding in one parallel ninja run: into the JIT cache
(FLASHINFER_CAKE_CACHE_DIR), --out DIR (then export
FLASHINFER_CAKE_AOT_DIR=DIR), or --aot (the installed package's own aot/, found
with no variable). A call whose weight is W (fp32 or bf16) and whose bias is B
(fp32, bf16, or none without a bias) loads causal_conv1d_w_W_b_B_<arch>:
--weight W --bias B prebuilds only that one. Into --out or --aot, a module the
JIT cache holds (the same sources, flags and compiler) is copied, not compiled.
One line per module as it links or is copied, and how far the build is each
minute between them; a failed build prints the compiler's errors (the whole log
is in build.log).
"""

CLEAR_CACHE_DESCRIPTION = """\
Delete the JIT cache's builds, after any running build: the lock files stay (a
build may be waiting on one), and so does anything in the directory that is not
flashinfer_cake's (FLASHINFER_CAKE_CACHE_DIR may be a shared directory).
"""


def _specs(archs: list[str] | None, weights: list[str] | None = None, biases: list[str] | None = None) -> list[jit.JitSpec]:
    """The variants of ``archs`` (default: the arch list), ``weights`` and ``biases`` (default: all), then the torch
    binding. Each value once: a repeated arch, e.g. "--arch sm_90a --arch 9.0a", would take its lock twice."""
    archs = list(dict.fromkeys(archs)) if archs else env.arch_list()
    weights = tuple(dict.fromkeys(weights)) if weights else WEIGHT_DTYPES
    biases = tuple(dict.fromkeys(biases)) if biases else BIAS_DTYPES
    return [*jit.all_variants(archs, weights, biases), jit.binding_spec()]


def _line(label: str, value, problems: list[str], width: int = 16) -> None:
    """One line of `env`: the value, or the error that computing it raised (kept in ``problems``)."""
    try:
        text = value() if callable(value) else value
    except (RuntimeError, ValueError, OSError) as e:
        problems.append(_message(e))
        text = f"ERROR: {problems[-1]}"
    print(f"{label:{width}s} {text}")


def _cuda_devices() -> str:
    if not torch.cuda.is_available():
        return "none visible to torch"
    return "; ".join(f"{i}: {torch.cuda.get_device_name(i)} (compute capability "
                     f"{'.'.join(map(str, torch.cuda.get_device_capability(i)))})"
                     for i in range(torch.cuda.device_count()))


def _nvcc_line(nvcc) -> str:
    """The nvcc and its version; one too old to build is this line's error (the build's own check)."""
    version = compiler_version(nvcc)
    check_nvcc_release(nvcc, version)
    return f"{nvcc} ({version})"


def _ninja_line() -> str:
    """ninja, or that builds would miss it: not a problem by itself (prebuilt modules need none), as no nvcc is not."""
    try:
        return env.ninja_path()
    except RuntimeError:
        return "not found (a build needs it: `pip install ninja`)"


def _no_nvcc_line() -> str:
    """No nvcc: not a problem by itself (prebuilt modules need none), unless FLASHINFER_CAKE_NVCC names
    something that is not one, which every call that compiles would refuse (require_nvcc's error); with
    the JIT disabled only `build` compiles: then a note."""
    explicit = os.environ.get("FLASHINFER_CAKE_NVCC")
    if explicit and env.jit_disabled():
        return f"not found (FLASHINFER_CAKE_NVCC={explicit!r} is not an executable file; calls compile nothing: " \
               f"FLASHINFER_CAKE_DISABLE_JIT, but `build` would fail)"
    if explicit:
        env.require_nvcc()
    return "not found"


def _cache_line() -> str:
    """The JIT cache root, refused as load refuses it; one that does not exist yet is not created (env only reads)."""
    path = env.cache_dir(create=False)
    state = "" if path.exists() else "; not created yet: the first call or build makes it"
    return f"{path}  (FLASHINFER_CAKE_CACHE_DIR{state})"


def _aot_line() -> str:
    """The prebuilt directories calls search; a package aot/ that they skip (a broken install: calls use the JIT, as
    a missing one does) is a note on the line, not an error."""
    skipped = env.package_aot_problem()
    note = f"; {skipped}: calls build with the JIT instead" if skipped else ""
    return f"{' '.join(map(str, env.aot_dirs())) or 'none'}  (FLASHINFER_CAKE_AOT_DIR, the package's aot/{note})"


def _wheel_trees(nvcc) -> str:
    """NVIDIA's CUDA wheel trees in this environment (jit/env.py), each with whether it is the nvcc taken, why
    not, or why it cannot build: a tree passed over is not an error."""
    states = []
    for top, unusable in env.pip_toolkits():
        if unusable:
            state = f"cannot build: {'; '.join(unusable)}; {env.PIP_TOOLKIT_COMMAND} installs one release of every part"
        elif nvcc == top / "bin" / "nvcc":
            state = "the nvcc above"
        else:
            first = "FLASHINFER_CAKE_NVCC" if os.environ.get("FLASHINFER_CAKE_NVCC") else nvcc
            state = f"can build; not taken: {first} comes first in the search order"
        states.append(f"{top} ({state})")
    return " | ".join(states) or "none"


def _cxx_line() -> str:
    """The binding's compiler and its version; through a launcher's masquerade link, the compiler it runs (what names
    the build) and the link."""
    cxx = env.cxx_path()
    behind = env.compiler_behind(cxx)
    via = "" if behind == cxx else f", through {cxx} ({env.target_name(cxx)})"
    return f"{behind} ({compiler_version(cxx)}){via}  (CXX)"


def _module_state(spec) -> str:
    """The build a first call opens, else whether another toolchain's is all there is (it compiles), else whether a
    build of its uri for another identity or other sources is (e.g. a binding prebuilt for another torch)."""
    path, others, other_builds = jit.lookup(spec)
    if path is not None:
        return str(path)
    if others:
        return f"not built by this toolchain (a first call builds it; {others[0]} is another's)"
    if other_builds:
        return f"not built ({other_builds[0]} is {jit.built_for(spec, other_builds[0])})"
    return "not built"


def cmd_env(args) -> int:
    """Every line, whatever fails; exit status 1 (and the first problem on stderr) if any did."""
    nvcc, problems = env.nvcc_path(), []
    _line("flashinfer_cake", f"{__version__} ({env.PACKAGE_DIR})", problems)  # which copy runs (a checkout, an install)
    _line("python", platform.python_version(), problems)
    _line("torch", f"{torch.__version__} (CUDA {torch.version.cuda})", problems)
    _line("gpus", _cuda_devices, problems)
    _line("nvcc", lambda: _no_nvcc_line() if nvcc is None else _nvcc_line(nvcc), problems)
    _line("cuda wheels", lambda: _wheel_trees(nvcc), problems)
    _line("c++", _cxx_line, problems)
    _line("ninja", _ninja_line, problems)
    _line("arch list", lambda: f"{' '.join(env.arch_list())}  (FLASHINFER_CAKE_CUDA_ARCH_LIST)", problems)
    _line("compile jobs", lambda: f"{env.max_jobs()}  (MAX_JOBS)", problems)
    _line("cache dir", _cache_line, problems)
    _line("aot dirs", _aot_line, problems)
    _line("jit", lambda: f"{'disabled' if env.jit_disabled() else 'enabled'}  (FLASHINFER_CAKE_DISABLE_JIT)", problems)
    if problems:
        print("modules          not listed (see the errors above)")
    else:
        print("modules:")
        for spec in _specs(None):
            _line(f"  {spec.uri}", lambda spec=spec: _module_state(spec), problems, 46)
    if problems:
        print(f"flashinfer-cake: error: {problems[0]}", file=sys.stderr)
    return 1 if problems else 0


def cmd_build(args) -> int:
    out = env.PACKAGE_AOT_DIR if args.aot else args.out
    start = time.perf_counter()
    built = jit.prebuild(_specs(args.arch, args.weight, args.bias), out, jobs=args.jobs, progress=lambda line: print(line, flush=True))
    for spec, path in built.items():
        print(f"{spec.uri:44s} {path}")
    where = next(iter(built.values())).parent
    print(f"the {len(built)} modules are in {where} ({time.perf_counter() - start:.1f} s)")  # (built, found or copied)
    searched = [env.PACKAGE_AOT_DIR]
    try:
        searched += env.aot_dirs()
    except RuntimeError as e:  # the build is done; the variable is the caller's to fix
        print(f"note: {_message(e)}; calls fail until it is fixed")
    with contextlib.suppress(RuntimeError):
        searched.append(env.cache_dir())
    installed = env.installed_package_dir()
    if where not in searched:
        print(f"this installation does not search {where}: export FLASHINFER_CAKE_AOT_DIR={where}")
    elif where == env.PACKAGE_AOT_DIR and installed not in (None, env.PACKAGE_DIR):
        print(f"note: this ran the flashinfer_cake of {env.PACKAGE_DIR}, not the installed one ({installed}), which "
              f"does not search {where}: run it from another directory, or export FLASHINFER_CAKE_AOT_DIR={where}")
    return 0


def _remove(entry) -> bool:
    """Remove a cache entry (a link is unlinked, not followed); False if it went meanwhile (a build moved it)."""
    try:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    except FileNotFoundError:
        return False
    return True


def _is_lock(path) -> bool:
    return path.suffix == ".lock" and path.is_file() and not path.is_symlink()


def cmd_clear_cache(args) -> int:
    if not env.cache_dir_path().exists():  # (a mistyped FLASHINFER_CAKE_CACHE_DIR is not created)
        print(f"nothing to remove: {env.cache_dir_path()} does not exist")
        return 0
    root = env.cache_dir()
    # Each artifact's files go under its lock, every lock taken first in prebuild()'s order ("prebuild", then by name;
    # load() holds one at a time): a running build ends before its files go. Lock files stay (a build may be waiting
    # on one), and so do the files of a build that started after the locks were taken (a lock not held here).
    names = sorted(p.stem for p in root.iterdir() if _is_lock(p) and p.stem != "prebuild")
    with contextlib.ExitStack() as held:
        try:
            if not (root / "prebuild.lock").exists() or _is_lock(root / "prebuild.lock"):
                held.enter_context(hold_lock(root, "prebuild", "another prebuild"))
            for name in names:
                held.enter_context(hold_lock(root, name, name))
        except RuntimeError as e:
            raise RuntimeError(f"cannot clear {root}: {e.__cause__ or e}") from e
        mine = {"prebuild", *names}

        def free(entry) -> bool:  # <name>.so / .json, .<name>.* temporaries, build/<name>[.stale.*]
            base = entry.name.lstrip(".")
            owners = [p.stem for p in root.iterdir() if _is_lock(p)]  # (now: a build may have started)
            owner = next((n for n in owners if base == n or base.startswith(n + ".")), None)
            return owner is None or owner in mine

        def ours(entry, names=()) -> bool:  # a build's files (by their name's form), or one of `names`
            stem = entry.name.lstrip(".").split(".", 1)[0]
            return is_build_name(stem) or stem in names

        # Only this package's files: a FLASHINFER_CAKE_CACHE_DIR set to a shared directory (~/.cache) keeps the rest.
        removed = kept = foreign = 0
        for entry in [e for e in root.iterdir() if not _is_lock(e)]:
            if entry.name == "build" and entry.is_dir() and not entry.is_symlink():
                for sub in list(entry.iterdir()):
                    if not ours(sub, ("prebuild",)):
                        foreign += 1
                    elif free(sub):
                        removed += _remove(sub)
                    else:
                        kept += 1
                with contextlib.suppress(OSError):  # (not empty: a build that started meanwhile, or not ours)
                    entry.rmdir()
            elif not ours(entry):
                foreign += 1
            elif free(entry):
                removed += _remove(entry)
            else:
                kept += 1
    print(f"removed {removed} entries from {root}" + (f"; kept {kept} of builds that started meanwhile" if kept else "")
          + (f"; left {foreign} that are not flashinfer_cake's" if foreign else ""))
    return 0


def cmd_check(args) -> int:
    from .cake_causal_conv1d_train import cake_causal_conv1d_train_forward, is_cake_causal_conv1d_train_supported
    from .reference import causal_conv1d_reference

    if not is_cake_causal_conv1d_train_supported():
        why = no_cuda_reason() if not torch.cuda.is_available() else (
            f"GPU {torch.cuda.get_device_name()} is not supported (needs compute capability "
            f"{', '.join(f'{a}.{b}' for a, b in env.ARCH_OF_CAPABILITY)})")
        if env.jit_disabled():
            print(f"{why}, and FLASHINFER_CAKE_DISABLE_JIT is set: nothing to run, nothing built.")
            return cmd_env(args)
        print(f"{why}: building the modules that are not built yet, no forward run (all of them take minutes on a "
              f"few cores: a line per module, and how far it is each minute between them; "
              f"FLASHINFER_CAKE_DISABLE_JIT=1 builds nothing).", flush=True)
        return cmd_build(argparse.Namespace(arch=None, weight=None, bias=None, out=None, aot=False, jobs=None))
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


def _message(e: BaseException) -> str:
    return str(e).removeprefix("flashinfer_cake: ")


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return int(text)


def _arch(text: str) -> str:
    try:
        return env.normalize_arch(text, "--arch")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--arch: ")) from None


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll's POLLERR on its write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a captured stdout), no poll
        return False


def main(argv: list[str] | None = None) -> int:
    text = dict(formatter_class=argparse.RawDescriptionHelpFormatter)
    parser = argparse.ArgumentParser(prog="flashinfer-cake", description=DESCRIPTION, **text)
    parser.add_argument("--version", action="version", version=f"flashinfer_cake {__version__}")
    sub = parser.add_subparsers(dest="command", title="commands")
    sub.add_parser("env", help="versions, compilers, arch list, directories, built modules", description=ENV_DESCRIPTION,
                   **text)
    build = sub.add_parser("build", help="prebuild the variants and the torch binding", description=BUILD_DESCRIPTION,
                           **text)
    build.add_argument("--arch", action="append", type=_arch,
                       help=f"arch to build: {', '.join(sorted(set(env.ARCH_OF_CAPABILITY.values())))}, the kernels' "
                            f"(in any spelling FLASHINFER_CAKE_CUDA_ARCH_LIST takes, e.g. 9.0a; repeatable; default: "
                            f"the arch list)")
    build.add_argument("--weight", action="append", choices=WEIGHT_DTYPES,
                       help="only the variants of this weight dtype (repeatable; default: all)")
    build.add_argument("--bias", action="append", choices=BIAS_DTYPES,
                       help="only the variants of this bias dtype, none for no bias (repeatable; default: all)")
    where = build.add_mutually_exclusive_group()
    where.add_argument("--out", metavar="DIR", help="output directory (default: the JIT cache)")
    where.add_argument("--aot", action="store_true", help=f"into the installed package's aot/ ({env.PACKAGE_AOT_DIR})")
    build.add_argument("-j", "--jobs", type=_positive_int,
                       help="parallel compile jobs (default: MAX_JOBS, else all cores)")
    sub.add_parser("clear-cache", help="delete the JIT cache's builds, after any running build",
                   description=CLEAR_CACHE_DESCRIPTION, **text)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    handler = {"env": cmd_env, "build": cmd_build, "clear-cache": cmd_clear_cache, None: cmd_check}[args.command]
    try:
        status = handler(args)
        sys.stdout.flush()  # here, so that a reader gone before the last lines is the BrokenPipeError below
        return status
    except BrokenPipeError as e:
        if not _stdout_closed():  # another pipe's: an error like any other
            print(f"flashinfer-cake: error: {_message(e)}", file=sys.stderr)
            return 1
        # the reader of stdout went away (`flashinfer-cake env | head -1`), which a command stopped by SIGPIPE
        # would not report either. Python's own recipe: stdout to /dev/null, so the interpreter's flush at exit
        # does not report the pipe again; exit status 1.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (RuntimeError, ValueError, OSError) as e:
        print(f"flashinfer-cake: error: {_message(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # (a build's output so far is in its build.log)
        print("flashinfer-cake: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
