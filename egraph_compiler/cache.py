"""Kernel cache: turn the C++ source that codegen renders into a shared object
on disk, compiled once per source and compiler flags.  It sits between code
generation (which produces the source) and the runtime (which dlopens the
library this module returns), so a second compile of the same program does no
C++ compile.  Because whatever it returns is loaded into the process, it only
trusts a private directory, builds beside the final entry and renames it into
place atomically, and checks each entry against a recorded sha256 before
handing it out: a damaged entry is rebuilt, a shared or foreign-owned one is
refused, and an unusable directory falls back to a private temporary one.
"""
from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

from . import remote
from .errors import CacheError, CodegenError, ScalarMathWarning, ToolchainError



def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as info:
            return any(line.startswith("flags") and flag in line.split() for line in info)
    except OSError:
        return False


# -ffp-contract=off: every op rounded, as in torch; a contracted `x*x - max(x*x)` is the
# rounding error of x*x, not 0, and softmax's exp of it overflows (tests/test_regressions.py)
# -fno-trapping-math changes no result (no FP exception is ever read): it lets g++ turn a relu's or
# a where's select into a blend in a vector loop, where it left a branch per element (30x slower on
# random signs without AVX-512)
CXXFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off",
            "-shared", "-fPIC", "-std=c++17"]
# On an AVX-512 machine (a Sapphire Rapids, g++ 13.3, glibc 2.39) row kernels calling glibc's
# vector math gave wrong sums and norms (errors of 0.02-2.0, found by the random-program soak);
# the same code built without AVX-512 was right, so AVX-512 is left out of generated code.
if _cpu_has("avx512f"):
    CXXFLAGS.append("-mno-avx512f")
VECTOR_MATH = (["-DEGC_VECTOR_MATH"], ["-lmvec"])  # glibc's SIMD exp/log/tanh/erf; dropped where absent
OUTPUT_TAIL = 3000  # characters of compiler output kept in an error

builds = 0  # C++ compiles run by this process (tests and benchmarks count them)
_fallback: Path | None = None  # the private temporary cache, made at most once per process
_warned: set[str] = set()  # unusable cache paths already reported
_scalar_warned = False  # a build without vector math reported (once per process)


def compiler() -> str:
    """The C++ compiler, read at call time so a changed CXX takes effect."""
    return os.environ.get("CXX", "g++")


def cache_dir() -> Path:
    """The cache directory (EGC_CACHE_DIR or ~/.cache/egraph_compiler), created private.

    Raises CacheError where it is writable by others or owned by another user;
    falls back to a private temporary directory where it cannot be created or
    written."""
    path = Path(os.environ.get("EGC_CACHE_DIR") or Path.home() / ".cache" / "egraph_compiler")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:  # read-only filesystem, a file in the way, no permission
        return _fallback_dir(path, exc)
    _check_private(path, "cache directory")
    if not os.access(path, os.W_OK | os.X_OK):
        return _fallback_dir(path, PermissionError("not writable"))
    return path


def build_shared_object(source: str) -> tuple[Path, bool]:
    """Returns the library path and whether it was compiled now (False: from the
    local cache, or fetched from the shared one: remote.py)."""
    global builds
    cxx = compiler()
    key = hashlib.sha256((source + "\0" + " ".join([cxx] + CXXFLAGS)).encode()).hexdigest()[:24]
    first_root = cache_dir()
    lib = first_root / f"egc_{key}.so"
    if _verified(lib):
        return lib, False
    root, tmp = _scratch(first_root)
    try:
        lib = root / f"egc_{key}.so"
        if root != first_root and _verified(lib):  # fell back: the fallback may already hold it
            return lib, False
        shared = remote.artifact_key("cpp", [source, cxx, remote.compiler_version(cxx), *CXXFLAGS]) \
            if remote.url() else None
        fetched = remote.fetch(shared) if shared else None
        if fetched is not None:
            built = tmp / "fetched.so"
            built.write_bytes(fetched)
            _install(built, lib)
            return lib, False
        built = _compile(cxx, source, tmp, root / f"failed_{key}.cpp")
        builds += 1
        data = built.read_bytes() if shared else b""
        _install(built, lib)
        if shared:
            remote.store(shared, data)
        return lib, True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _check_private(path: Path, what: str) -> None:
    # Anything that can write here can make this process load its code.
    st = os.stat(path)
    fix = f"run `chmod go-w {shlex.quote(str(path))}` or set EGC_CACHE_DIR to a private directory"
    if st.st_mode & 0o022:
        raise CacheError(f"refusing {what} {path}: it is writable by group or others "
                         f"(mode {st.st_mode & 0o777:o}), so another user could plant code; {fix}")
    if hasattr(os, "getuid") and st.st_uid != os.getuid():
        raise CacheError(f"refusing {what} {path}: it is owned by uid {st.st_uid}, not by this user "
                         f"(uid {os.getuid()}); set EGC_CACHE_DIR to a directory you own")


def _fallback_dir(original: Path, exc: BaseException) -> Path:
    # Kept for the whole process (not removed at exit) so libraries and saved
    # failing sources stay where messages point; the OS cleans its temp dir.
    global _fallback
    if _fallback is None:
        _fallback = Path(tempfile.mkdtemp(prefix="egc-cache-"))  # mode 0700
    if str(original) not in _warned:
        _warned.add(str(original))
        warnings.warn(f"egraph_compiler: cache directory {original} is not usable ({exc}); "
                      f"compiling into the private temporary cache {_fallback} for this process",
                      RuntimeWarning, stacklevel=3)
    return _fallback


def _scratch(root: Path) -> tuple[Path, Path]:
    """(cache directory, fresh build directory inside it).

    Building inside the cache keeps the final os.replace on one filesystem,
    hence atomic, wherever EGC_CACHE_DIR lives."""
    try:
        return root, Path(tempfile.mkdtemp(prefix=".build-", dir=root))
    except OSError as exc:  # e.g. a directory that refuses writes though os.access said yes (root)
        root = _fallback_dir(root, exc)
        return root, Path(tempfile.mkdtemp(prefix=".build-", dir=root))


def _checksum_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _verified(lib: Path) -> bool:
    """Whether lib is a cache entry whose bytes match its recorded sha256."""
    if not lib.exists():
        return False
    _check_private(lib, "cache entry")
    try:
        expected = _checksum_path(lib).read_text().strip()
        actual = hashlib.sha256(lib.read_bytes()).hexdigest()
    except OSError:
        expected, actual = "", "unreadable"
    if expected == actual:
        return True
    warnings.warn(f"egraph_compiler: cache entry {lib} does not match its checksum "
                  f"(damaged, truncated or replaced); rebuilding it", RuntimeWarning, stacklevel=3)
    return False


def _install(built: Path, lib: Path) -> None:
    """Moves a fresh library into place, then records its checksum, each atomically."""
    os.chmod(built, 0o755)  # a umask of 002 would leave it group-writable, which _verified refuses
    digest = built.with_name(built.name + ".sha256")
    digest.write_text(hashlib.sha256(built.read_bytes()).hexdigest() + "\n")
    os.chmod(digest, 0o644)
    try:
        os.replace(built, lib)
        os.replace(digest, _checksum_path(lib))  # after the library: a reader in between rebuilds
    except OSError as exc:
        raise CacheError(f"cannot write cache entry {lib}: {exc}; free space or set EGC_CACHE_DIR") from exc


def _compile(cxx: str, source: str, tmp: Path, failed: Path) -> Path:
    """Compiles source in tmp; on failure saves it to `failed` (or a temp file) and raises."""
    src, out = tmp / "kernels.cpp", tmp / "kernels.so"
    src.write_text(source)
    defines, libs = VECTOR_MATH
    first = _run([cxx, *CXXFLAGS, *defines, str(src), "-o", str(out), *libs])
    if first.returncode == 0:
        return out
    # No vector math library here: plain scalar calls, said once (a rotary kernel's cos and sin
    # took ~6 ns a call on a 16-core box where exp took ~0.3: a silent build without it is a cliff)
    global _scalar_warned
    second = _run([cxx, *CXXFLAGS, str(src), "-o", str(out)])
    if second.returncode == 0:
        if not _scalar_warned:
            _scalar_warned = True
            warnings.warn(f"generated C++ is built without glibc's vector math ({' '.join(defines + libs)} failed: "
                          f"{(first.stdout + first.stderr).strip()[-400:]}); exp, log, tanh, erf, cos and sin run as "
                          f"scalar calls", ScalarMathWarning, stacklevel=2)
        return out
    saved = _save(source, failed)
    output = (second.stdout + second.stderr)[-OUTPUT_TAIL:]
    raise CodegenError(
        f"C++ compile failed (a bug in egraph_compiler's code generation; please report it).\n"
        f"compiler: {cxx} (exit status {second.returncode})\n"
        f"command (its build directory is removed since): {shlex.join(second.args)}\n"
        f"source saved to: {saved}\n"
        f"(a first attempt with vector math, `{' '.join(defines + libs)}`, also failed "
        f"with exit status {first.returncode})\n"
        f"compiler output (last {OUTPUT_TAIL} characters):\n{output}")


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True)
    except OSError as exc:  # FileNotFoundError, PermissionError, exec format error
        reason = "was not found" if isinstance(exc, FileNotFoundError) else f"could not be run ({exc})"
        raise ToolchainError(
            f"the C++ compiler {cmd[0]!r} {reason}.\ncommand: {shlex.join(cmd)}\n"
            f"Set CXX to an installed C++ compiler with OpenMP support (e.g. CXX=g++).") from exc


def _save(source: str, path: Path) -> Path:
    """Keeps a failing source for the bug report; a temp file where the cache refuses it."""
    try:
        path.write_text(source)
        return path
    except OSError:
        fd, name = tempfile.mkstemp(prefix=path.stem + "-", suffix=".cpp")
        with os.fdopen(fd, "w") as f:
            f.write(source)
        return Path(name)


def read_record(kind: str, key: str) -> dict | None:
    """A small decision kept on disk under `kind` (a tuned kernel's configuration, a linear's
    routine), or None where there is none or it is unreadable."""
    try:
        data = json.loads((cache_dir() / kind / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def write_record(kind: str, key: str, data: dict) -> None:
    """Keep `data` as `read_record(kind, key)`, written whole (a temporary file renamed into
    place); a cache that cannot be written keeps the decision for this process only."""
    path = cache_dir() / kind / f"{key}.json"
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass
