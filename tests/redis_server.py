"""A real redis-server for tests and benchmarks: Debian's `redis-server`, started
on localhost on a free port with no persistence, stopped afterwards."""
from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def redis_server():
    """Yields the server's URL (redis://127.0.0.1:PORT/0)."""
    program = shutil.which("redis-server")
    if program is None:
        raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="egc-redis-") as workdir:
        proc = subprocess.Popen([program, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no", "--dir", workdir], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            client = redis.Redis.from_url(url, socket_connect_timeout=0.2)
            for _ in range(100):
                with contextlib.suppress(redis.RedisError):
                    if client.ping():
                        break
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with status {proc.returncode}")
                time.sleep(0.05)
            else:
                raise RuntimeError("redis-server did not answer within 5 s")
            client.close()
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
