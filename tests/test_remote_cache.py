"""The shared compile cache (remote.py) against a real redis-server started by the
test on a free localhost port: a second process with an empty local cache
compiles with zero C++ builds; every fault of the cache (corrupt, foreign,
oversized or unsigned entry, server down, server that never answers) ends in a
correct result, built locally, without a hang."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import redis as redis_py
import torch

import egraph_compiler as egc
from egraph_compiler import cache, remote

from redis_server import redis_server


@pytest.fixture(scope="module")
def server():
    try:
        with redis_server() as url:
            yield url
    except FileNotFoundError as exc:
        if os.environ.get("EGC_REQUIRE_BROWSER"):
            raise
        pytest.skip(str(exc))


@pytest.fixture
def shared(server, tmp_path, monkeypatch):
    """A fresh local cache, the shared cache switched on, counts reset, the database empty."""
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path / "local"))
    monkeypatch.setenv(remote.URL_ENV, server)
    monkeypatch.delenv(remote.SECRET_ENV, raising=False)
    remote.reset()
    redis_py.Redis.from_url(server).flushdb()
    yield server
    remote.reset()


def _program(scale: float):
    """A program whose generated source differs with `scale` (a fresh cache key per test)."""
    def program(x, w):
        return torch.relu(torch.layer_norm(x, (x.shape[-1],), w, None) * scale + 1.0)
    return program


def _compile_and_check(scale: float, **kwargs):
    x, w = torch.randn(8, 32), torch.randn(32)
    fn = _program(scale)
    compiled = egc.compile(fn, [x, w], **kwargs)
    torch.testing.assert_close(compiled(x, w), fn(x, w))
    return compiled


CHILD = r"""
import json, sys, torch
import egraph_compiler as egc
from egraph_compiler import cache, remote
torch.manual_seed(0)
class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(64), torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)
    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
model, x = MLP().eval(), torch.randn(4, 16, 64)
compiled = egc.compile(model, [x])
with torch.no_grad():
    torch.testing.assert_close(compiled(x), model(x))
print(json.dumps({"builds": cache.builds, "hits": remote.stats.hits, "stores": remote.stats.stores,
                  "compiled_now": compiled.compiled_now}))
"""


def _child(tmp_path, name: str, url: str) -> dict:
    env = dict(os.environ, EGC_CACHE_DIR=str(tmp_path / name), **{remote.URL_ENV: url})
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_machine_fetches_instead_of_building(shared, tmp_path):
    first = _child(tmp_path, "machine-a", shared)
    assert first["builds"] >= 1 and first["stores"] == first["builds"] and first["hits"] == 0
    second = _child(tmp_path, "machine-b", shared)  # an empty local cache
    assert second == {"builds": 0, "hits": first["stores"], "stores": 0, "compiled_now": False}


def test_compile_option_overrides_the_environment(shared, monkeypatch):
    monkeypatch.delenv(remote.URL_ENV)
    _compile_and_check(1.5, cache=shared)
    assert remote.stats.stores == 1
    _compile_and_check(1.75, cache=False)
    assert remote.stats.stores == 1 and remote.stats.misses == 1
    with pytest.raises(egc.EgraphCompilerError, match="redis://HOST:PORT/DB"):
        _compile_and_check(2.0, cache="localhost:6379")
    with pytest.raises(egc.EgraphCompilerError, match="not valid: Port could not be cast"):
        _compile_and_check(2.0, cache="redis://localhost:notaport/0")


def _only_key(url: str) -> str:
    keys = redis_py.Redis.from_url(url).keys(remote.PREFIX + "*")
    assert len(keys) == 1, keys
    return keys[0].decode()


def _rebuild_with(url, tmp_path, monkeypatch, scale, damage, why):
    """Store an entry, damage it, compile again from an empty local cache: the entry
    is refused with `why`, the library built here, the entry replaced by a good one."""
    _compile_and_check(scale)
    key = _only_key(url)
    client = redis_py.Redis.from_url(url)
    client.set(key, damage(client.get(key), key))
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path / "other"))
    builds = cache.builds
    with pytest.warns(RuntimeWarning, match="refused"):
        _compile_and_check(scale)
    assert cache.builds == builds + 1 and why in remote.stats.refused[-1]
    assert remote.unpack(key, client.get(key))[0] is not None  # replaced by a good entry


def test_corrupt_entry_is_refused_and_rebuilt(shared, tmp_path, monkeypatch):
    def flip(entry, key):
        return entry[:-100] + bytes(b ^ 0xFF for b in entry[-100:])
    _rebuild_with(shared, tmp_path, monkeypatch, 2.25, flip, "sha256")


def test_truncated_entry_is_refused_and_rebuilt(shared, tmp_path, monkeypatch):
    _rebuild_with(shared, tmp_path, monkeypatch, 2.5, lambda entry, key: entry[: len(entry) // 2], "truncated")


def test_foreign_and_garbage_entries_are_refused(shared, tmp_path, monkeypatch):
    def foreign(entry, key):  # a valid entry made for another key
        return remote.pack(key + "0", remote.unpack(key, entry)[0])
    _rebuild_with(shared, tmp_path, monkeypatch, 2.75, foreign, "another key")
    remote.reset()
    redis_py.Redis.from_url(shared).flushdb()
    _rebuild_with(shared, tmp_path / "g", monkeypatch, 3.0, lambda entry, key: b"\x7fELF not ours", "no header")


def test_oversized_entry_is_refused(shared, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "MAX_BYTES", 4096)  # smaller than any library
    _compile_and_check(3.25)
    assert remote.stats.stores == 0  # too big to store
    key = remote.PREFIX + "cpp:manual"
    client = redis_py.Redis.from_url(shared)
    client.set(key, remote.MAGIC + json.dumps({"key": key, "size": 9000, "sha256": ""}).encode() + b"\n" +
               b"x" * 9000)
    with pytest.warns(RuntimeWarning, match="over the 4096-byte limit"):
        assert remote.fetch(key) is None


def test_with_a_secret_unsigned_entries_are_refused(shared, tmp_path, monkeypatch):
    _compile_and_check(3.5)  # stored unsigned
    monkeypatch.setenv(remote.SECRET_ENV, "fleet-secret")
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path / "b"))
    with pytest.warns(RuntimeWarning, match="not signed"):
        _compile_and_check(3.5)  # refused, rebuilt, stored signed
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path / "c"))
    builds = cache.builds
    _compile_and_check(3.5)
    assert cache.builds == builds and remote.stats.hits == 1
    monkeypatch.setenv(remote.SECRET_ENV, "another-secret")
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path / "d"))
    with pytest.warns(RuntimeWarning, match="not signed"):
        _compile_and_check(3.5)


def test_server_down_means_local_compilation(tmp_path, monkeypatch):
    from redis_server import free_port
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(remote.URL_ENV, f"redis://127.0.0.1:{free_port()}/0")  # nothing listens
    remote.reset()
    builds = cache.builds
    start = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="compiling locally"):
        _compile_and_check(3.75)
    _compile_and_check(4.0)  # the dead server is not asked again: no second warning, no wait
    assert cache.builds == builds + 2 and len(remote.stats.errors) == 1
    assert time.perf_counter() - start < 60
    remote.reset()


def test_server_that_never_answers_times_out(tmp_path, monkeypatch):
    """A listener that accepts connections and never replies: one reply timeout, then local builds."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    held = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue
    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    monkeypatch.setenv("EGC_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(remote.URL_ENV, f"redis://127.0.0.1:{listener.getsockname()[1]}/0")
    remote.reset()
    try:
        start = time.perf_counter()
        with pytest.warns(RuntimeWarning, match="Timeout"):
            _compile_and_check(4.25)
        assert time.perf_counter() - start < remote.REPLY_TIMEOUT + 30
        assert len(remote.stats.errors) == 1 and "Timeout" in remote.stats.errors[0]
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()
        remote.reset()


def test_triton_kernels_compiled_on_one_machine_are_fetched_on_another(shared, tmp_path, monkeypatch):
    """Triton's compiled kernels (for an H200, compiled here without a GPU) go through
    the shared cache: a second "machine" with an empty Triton cache fetches every file
    and compiles nothing (Redis receives no SET from it)."""
    from egraph_compiler.codegen.triton_build import compile_for_gpu
    from egraph_compiler import workloads
    modules = []
    for name in ("softmax", "ln_relu"):
        fn, inputs = workloads.make(name, size="test")
        compiled = egc.compile(fn, inputs, target="triton", cache=False)
        modules.append((compiled.source, compiled.loop_kernels))
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "")  # unset: share_triton_cache fills it in
    client = redis_py.Redis.from_url(shared)

    def sets() -> int:
        return int(client.info("commandstats").get("cmdstat_set", {}).get("calls", 0))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-a"))
    compile_for_gpu(modules)
    assert os.environ["TRITON_CACHE_MANAGER"].endswith("triton_cache:SharedCacheManager")
    stored = client.keys(remote.PREFIX + "triton:*")
    assert len(stored) >= 2 * len(modules) and sets() >= len(stored)
    before = sets()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-b"))  # machine B: nothing compiled here
    compile_for_gpu(modules)
    assert sets() == before, "machine B compiled (and stored) kernels instead of fetching them"
    cubins = sorted(p.name for p in (tmp_path / "triton-a").rglob("*.cubin"))
    assert len(cubins) >= len(modules) and sorted(p.name for p in (tmp_path / "triton-b").rglob("*.cubin")) == cubins
    # a damaged entry is refused in B's place: C rebuilds that file and stores it again
    victim = next(k for k in stored if k.decode())
    client.set(victim, b"garbage")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-c"))
    compile_for_gpu(modules)
    assert remote.unpack(victim.decode(), client.get(victim))[0] is not None
