"""The shared compile cache: built artifacts (the generated C++ shared objects,
and Triton's compiled kernels: codegen/triton.py's SharedCacheManager) stored in
Redis by content hash, with the local disk caches (cache.py, Triton's) in front.  A machine that compiles a program another machine compiled before
fetches the library instead of running the C++ compiler.

Where: `EGC_REMOTE_CACHE=redis://HOST:PORT/DB`, or `compile(..., cache=URL)`
(`cache=False` turns it off for that compile).  This is the one module that
imports redis (redis-py).

Never a failed compile because of the cache:
- Each entry is `MAGIC`, a JSON header line (the key it was stored under, its
  size, sha256, and an HMAC-SHA256 when `EGC_REMOTE_CACHE_SECRET` is set), then
  the bytes.  An entry whose header does not parse, names another key (a
  foreign entry), exceeds MAX_BYTES, fails its checksum, or lacks the right HMAC
  (where a secret is set) is refused with a warning, rebuilt and overwritten.
- An unreachable or slow server (connect timeout CONNECT_TIMEOUT, reply timeout
  REPLY_TIMEOUT) gives one warning and local compilation; the server is not
  asked again for RETRY_AFTER seconds, so a dead server costs one timeout, not
  one per compile.
- Trust: the library is loaded into the process.  Without a secret, anyone who
  can write to that Redis database can run code in every process that reads it
  (as with any shared build cache); set EGC_REMOTE_CACHE_SECRET on the machines
  that share it so that only they can make entries the others accept.

Keys hold everything that changes the artifact: the source, the compiler's
command and `--version`, the flags, the machine (architecture and CPU model:
the flags include -march=native) and this module's FORMAT.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import hmac
import json
import os
import platform
import subprocess
import time
import warnings
from dataclasses import dataclass, field

import redis

from .errors import EgraphCompilerError

URL_ENV = "EGC_REMOTE_CACHE"
SECRET_ENV = "EGC_REMOTE_CACHE_SECRET"
FORMAT = 1
MAGIC = b"EGC-ARTIFACT\n"
MAX_BYTES = 64 << 20  # entries larger than this are neither stored nor accepted
CONNECT_TIMEOUT = 0.5  # seconds
REPLY_TIMEOUT = 2.0
RETRY_AFTER = 60.0  # seconds a server that failed is left alone
PREFIX = "egc:artifact:"

_choice: contextvars.ContextVar = contextvars.ContextVar("egc_remote_cache", default=None)


@dataclass
class Stats:
    """What the shared cache did in this process (tests and benchmarks count these)."""
    hits: int = 0
    misses: int = 0
    stores: int = 0
    refused: list = field(default_factory=list)  # reasons, one per refused entry
    errors: list = field(default_factory=list)  # server faults (unreachable, timeout)


stats = Stats()
_clients: dict[str, redis.Redis] = {}
_down_until: dict[str, float] = {}


@contextlib.contextmanager
def using(choice):
    """Within: the cache `compile(..., cache=choice)` asked for (None: the environment's)."""
    token = _choice.set(choice)
    try:
        yield
    finally:
        _choice.reset(token)


def url() -> str | None:
    choice = _choice.get()
    if choice is False:
        return None
    text = choice if isinstance(choice, str) else os.environ.get(URL_ENV)
    if not text:
        return None
    if not text.startswith(("redis://", "rediss://", "unix://")):
        raise EgraphCompilerError(f"the shared compile cache must be a redis://HOST:PORT/DB URL, not {text!r} "
                                  f"(from {'cache=' if isinstance(choice, str) else URL_ENV})")
    return text


def _client(address: str) -> redis.Redis:
    if address not in _clients:
        try:
            _clients[address] = redis.Redis.from_url(address, socket_connect_timeout=CONNECT_TIMEOUT,
                                                     socket_timeout=REPLY_TIMEOUT, retry_on_timeout=False)
        except ValueError as exc:  # a malformed URL: the user's mistake, said plainly
            raise EgraphCompilerError(f"the shared compile cache URL {address.split('@')[-1]!r} is not valid: "
                                      f"{exc} (expected redis://HOST:PORT/DB)") from None
    return _clients[address]


def artifact_key(kind: str, parts: list[str], machine: bool = True) -> str:
    """The key of an artifact: its kind, then a hash of everything that shapes it
    (with `machine`, this machine's architecture and CPU model too: code built with
    -march=native; a Triton kernel's own key already names its GPU target)."""
    text = "\0".join([f"format={FORMAT}", kind, *parts, *(_machine() if machine else [])])
    return PREFIX + kind + ":" + hashlib.sha256(text.encode()).hexdigest()


_MACHINE: list[str] = []


def _machine() -> list[str]:
    if not _MACHINE:
        model = ""
        with contextlib.suppress(OSError):
            with open("/proc/cpuinfo") as info:
                lines = info.read().splitlines()
            model = next((l.split(":", 1)[1].strip() for l in lines if l.startswith("model name")), "")
            flags = next((l.split(":", 1)[1].strip() for l in lines if l.startswith("flags")), "")
            model += " flags=" + hashlib.sha256(flags.encode()).hexdigest()[:16]
        _MACHINE.extend([platform.system(), platform.machine(), model])
    return _MACHINE


_VERSIONS: dict[str, str] = {}


def compiler_version(cxx: str) -> str:
    """The first line of `CXX --version` (cached per process)."""
    if cxx not in _VERSIONS:
        try:
            out = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=10)
            _VERSIONS[cxx] = (out.stdout or out.stderr).splitlines()[0] if (out.stdout or out.stderr) else "?"
        except (OSError, subprocess.SubprocessError):
            _VERSIONS[cxx] = "?"
    return _VERSIONS[cxx]


def _signature(key: str, digest: str) -> str | None:
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        return None
    return hmac.new(secret.encode(), f"{key}\0{digest}".encode(), hashlib.sha256).hexdigest()


def pack(key: str, data: bytes) -> bytes:
    digest = hashlib.sha256(data).hexdigest()
    header = {"key": key, "size": len(data), "sha256": digest, "hmac": _signature(key, digest)}
    return MAGIC + json.dumps(header).encode() + b"\n" + data


def unpack(key: str, entry: bytes) -> tuple[bytes | None, str]:
    """(the artifact, "") or (None, why the entry is refused)."""
    if len(entry) > MAX_BYTES + 4096:
        return None, f"{len(entry)} bytes, over the {MAX_BYTES}-byte limit"
    if not entry.startswith(MAGIC):
        return None, "not an egraph-compiler artifact (no header)"
    line, _, data = entry[len(MAGIC):].partition(b"\n")
    try:
        header = json.loads(line)
        stored_key, size, digest = header["key"], int(header["size"]), str(header["sha256"])
    except (ValueError, KeyError, TypeError):
        return None, "its header does not parse"
    if stored_key != key:
        return None, f"it was stored for another key ({str(stored_key)[:60]})"
    if size != len(data) or size > MAX_BYTES:
        return None, f"it holds {len(data)} bytes where its header says {size} (truncated or padded)"
    if hashlib.sha256(data).hexdigest() != digest:
        return None, "its bytes do not match their sha256 (damaged or replaced)"
    expected = _signature(key, digest)
    if expected is not None and not hmac.compare_digest(str(header.get("hmac")), expected):
        return None, f"it is not signed with this machine's {SECRET_ENV}"
    return data, ""


def fetch(key: str) -> bytes | None:
    """The artifact stored under `key`, or None (absent, refused, or the server failing)."""
    address = url()
    if address is None or not _available(address):
        return None
    try:
        entry = _client(address).get(key)
    except redis.RedisError as exc:
        _failed(address, exc)
        return None
    if entry is None:
        stats.misses += 1
        return None
    data, why = unpack(key, entry)
    if data is None:
        stats.refused.append(why)
        warnings.warn(f"egraph_compiler: shared cache entry {key} refused ({why}); building it here and "
                      f"replacing it", RuntimeWarning, stacklevel=3)
        return None
    stats.hits += 1
    return data


def store(key: str, data: bytes) -> None:
    address = url()
    if address is None or len(data) > MAX_BYTES or not _available(address):
        return
    try:
        _client(address).set(key, pack(key, data))
        stats.stores += 1
    except redis.RedisError as exc:
        _failed(address, exc)


def _available(address: str) -> bool:
    return time.monotonic() >= _down_until.get(address, 0.0)


def _failed(address: str, exc: Exception) -> None:
    """A server fault: one warning, local compilation, the server left alone for a while."""
    _down_until[address] = time.monotonic() + RETRY_AFTER
    stats.errors.append(f"{type(exc).__name__}: {exc}")
    shown = address.split("@")[-1]  # no password in messages
    warnings.warn(f"egraph_compiler: shared compile cache {shown} failed ({type(exc).__name__}: {exc}); "
                  f"compiling locally, and not asking it again for {RETRY_AFTER:.0f} s", RuntimeWarning,
                  stacklevel=3)


def reset() -> None:
    """Forget clients, failed servers and counts (tests)."""
    for client in _clients.values():
        with contextlib.suppress(Exception):
            client.close()
    _clients.clear()
    _down_until.clear()
    stats.__init__()
