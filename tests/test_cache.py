"""The on-disk kernel cache: atomic builds, checksums, permissions, fallback, compiler errors."""
import ctypes
import hashlib
import os
import stat
import tempfile
import warnings
from pathlib import Path

import pytest

from egraph_compiler import cache
from egraph_compiler.errors import CacheError, CodegenError, EgraphCompilerError, ToolchainError

SOURCE = 'extern "C" void k0(float* a) { a[0] = 1.0f; }\n'
OTHER = 'extern "C" void k1(float* a) { a[0] = 2.0f; }\n'


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """A private cache, the real compiler, no fallback yet, temp files under tmp_path."""
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "g++")
    monkeypatch.setattr(cache, "_fallback", None)
    monkeypatch.setattr(cache, "_scalar_warned", False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))


def fake_compiler(tmp_path, body):
    script = tmp_path / "fakecxx"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(0o755)
    return str(script)


def checksum_ok(lib):
    return Path(str(lib) + ".sha256").read_text().strip() == hashlib.sha256(lib.read_bytes()).hexdigest()


def test_builds_inside_cache_dir_and_replaces_atomically(tmp_path, monkeypatch):
    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append((Path(a), Path(b))), real_replace(a, b)))
    lib, compiled_now = cache.build_shared_object(SOURCE)
    root = tmp_path / "cache"
    assert compiled_now and lib.parent == root
    # both the library and its checksum come from a build directory inside the cache (same filesystem)
    assert [dst for _, dst in replaced] == [lib, Path(str(lib) + ".sha256")]
    assert all(src.parent.parent == root and src.parent.name.startswith(".build-") for src, _ in replaced)
    assert sorted(p.name for p in root.iterdir()) == [lib.name, lib.name + ".sha256"]  # build dir removed
    assert cache.build_shared_object(SOURCE) == (lib, False)


def test_checksum_recorded_and_missing_checksum_rebuilds(tmp_path):
    lib, _ = cache.build_shared_object(SOURCE)
    assert checksum_ok(lib)
    Path(str(lib) + ".sha256").unlink()
    with pytest.warns(RuntimeWarning, match=str(lib)) as record:
        assert cache.build_shared_object(SOURCE) == (lib, True)
    assert len(record) == 1 and checksum_ok(lib)


@pytest.mark.parametrize("damage", ["empty", "truncated", "other library"])
def test_damaged_entry_is_rebuilt_and_loads(tmp_path, damage):
    lib, _ = cache.build_shared_object(SOURCE)
    if damage == "empty":
        lib.write_bytes(b"")
    elif damage == "truncated":
        lib.write_bytes(lib.read_bytes()[:100])
    else:  # a different, valid library under this entry's name
        other, _ = cache.build_shared_object(OTHER)
        lib.write_bytes(other.read_bytes())
    assert not checksum_ok(lib)
    with pytest.warns(RuntimeWarning, match="checksum") as record:
        assert cache.build_shared_object(SOURCE) == (lib, True)
    assert len(record) == 1 and checksum_ok(lib)
    buf = (ctypes.c_float * 1)(0.0)
    ctypes.CDLL(str(lib)).k0(buf)  # loaded only now: dlopen would reuse an earlier mapping of this path
    assert buf[0] == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cache.build_shared_object(SOURCE) == (lib, False)


def test_new_cache_dir_is_private(tmp_path):
    assert cache.cache_dir() == tmp_path / "cache"
    assert stat.S_IMODE(os.stat(tmp_path / "cache").st_mode) == 0o700


def test_refuses_group_or_world_writable_cache_dir(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    root.chmod(0o777)
    with pytest.raises(CacheError, match="chmod go-w") as err:
        cache.build_shared_object(SOURCE)
    assert str(root) in str(err.value) and "EGC_CACHE_DIR" in str(err.value)
    assert isinstance(err.value, EgraphCompilerError)


def test_refuses_cache_dir_owned_by_another_user(tmp_path, monkeypatch):
    cache.cache_dir()
    monkeypatch.setattr(os, "getuid", lambda: os.stat(tmp_path / "cache").st_uid + 1)
    with pytest.raises(CacheError, match="owned by uid") as err:
        cache.cache_dir()
    assert str(tmp_path / "cache") in str(err.value) and "EGC_CACHE_DIR" in str(err.value)


def test_refuses_writable_entry(tmp_path):
    lib, _ = cache.build_shared_object(SOURCE)
    lib.chmod(0o775)
    with pytest.raises(CacheError, match="chmod go-w") as err:
        cache.build_shared_object(SOURCE)
    assert str(lib) in str(err.value)


def test_uncreatable_cache_dir_falls_back_once(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("EGC_CACHE_DIR", str(blocker / "cache"))  # mkdir fails: a file is in the way
    with pytest.warns(RuntimeWarning, match=str(blocker / "cache")) as record:
        first = cache.cache_dir()
        lib, compiled_now = cache.build_shared_object(SOURCE)
        assert cache.cache_dir() == first
    assert len(record) == 1
    assert first.name.startswith("egc-cache-") and first.parent == tmp_path / "tmp"
    assert stat.S_IMODE(os.stat(first).st_mode) == 0o700
    assert compiled_now and lib.parent == first and checksum_ok(lib)


def test_unwritable_cache_dir_falls_back(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args, dir=None, **kwargs):  # a read-only cache, even for root
        if dir is not None and Path(dir) == root:
            raise PermissionError(13, "Permission denied", str(root))
        return real_mkdtemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    with pytest.warns(RuntimeWarning, match=str(root)) as record:
        lib, compiled_now = cache.build_shared_object(SOURCE)
        assert cache.build_shared_object(SOURCE) == (lib, False)  # found again in the fallback
    assert len(record) == 1 and compiled_now
    assert lib.parent.name.startswith("egc-cache-") and checksum_ok(lib)


def test_missing_compiler_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(ToolchainError, match="not found") as err:
        cache.build_shared_object(SOURCE)
    message = str(err.value)
    assert isinstance(err.value, CodegenError)
    assert "/nonexistent/c++" in message and "-fopenmp" in message and "CXX" in message
    assert not list((tmp_path / "cache").glob(".build-*"))


def test_failing_compiler_reports_command_output_and_saved_source(tmp_path, monkeypatch):
    log = tmp_path / "calls"
    cxx = fake_compiler(tmp_path, f'echo "$@" >> {log}\necho boom\nexit 1')
    monkeypatch.setenv("CXX", cxx)
    with pytest.raises(CodegenError, match="boom") as err:
        cache.build_shared_object(SOURCE)
    message = str(err.value)
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and "-DEGC_VECTOR_MATH" in calls[0] and "-DEGC_VECTOR_MATH" not in calls[1]
    assert cxx in message and "-fopenmp" in message and "first attempt" in message
    saved = [p for p in (tmp_path / "cache").glob("failed_*.cpp")]
    assert len(saved) == 1 and str(saved[0]) in message and saved[0].read_text() == SOURCE
    assert not list((tmp_path / "cache").glob(".build-*")) and not list((tmp_path / "cache").glob("egc_*"))


def test_retries_without_vector_math(tmp_path, monkeypatch):
    """A compiler that cannot link glibc's vector math builds scalar calls, and says so once per
    process (ScalarMathWarning, with the compiler's complaint): never a silent 10-20x slower cos."""
    from egraph_compiler import ScalarMathWarning
    cxx = fake_compiler(tmp_path, 'case "$*" in *EGC_VECTOR_MATH*) echo "no mvec"; exit 1;; esac\nexec g++ "$@"')
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setattr(cache, "_scalar_warned", False)
    with pytest.warns(ScalarMathWarning, match="no mvec"):
        lib, compiled_now = cache.build_shared_object(SOURCE)
    assert compiled_now and checksum_ok(lib)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.build_shared_object(SOURCE + "\n// another source")  # (said once)


def test_cos_and_sin_of_one_angle_stay_vector_calls():
    """A rotary embedding's cos and sin of one angle: g++ merged cosf and sinf into a scalar
    sincosf, which has no SIMD variant (9.3 ns an element against 1.1); the prelude's
    egc_cosf/egc_sinf keep libmvec's vector variants where the build links it."""
    import subprocess

    import torch

    import egraph_compiler as egc
    x = torch.rand(1000) * 6
    compiled = egc.compile(lambda x: torch.cos(x) * torch.sin(x), [x])
    torch.testing.assert_close(compiled(x), torch.cos(x) * torch.sin(x))
    lib, _ = cache.build_shared_object(compiled.source)
    symbols = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True).stdout
    assert "sincosf" not in symbols, symbols
    if "mvec" in subprocess.run(["ldd", str(lib)], capture_output=True, text=True).stdout:
        assert "_ZGV" in symbols and "cosf" in symbols and "sinf" in symbols, symbols
