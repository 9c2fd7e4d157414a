"""Soak test: as many random programs as time allows, in parallel processes.

    python -m tests.soak --minutes 5 [--workers 2] [--seed 0] [--out soak_failures.txt]
                         [--minimize-minutes 3] [--target triton] [--asan]
    python -m tests.soak --minimize soak_failures.txt.json [--minimize-minutes 3]

Each worker draws programs from `tests/programs.py`'s generator with a seeded
`random.Random` (program k of worker w is reproducible from `--seed`), checks
each with `programs.check` (compile, compare with eager and a float64
reference) and reports the outcome.  A program that runs longer than
`--program-timeout` seconds, or kills its worker (a crash in generated code),
is counted as a crash and the worker replaced.  Every failing program's
description goes to `--out` (and its choice list to `--out`.json, to replay
or shrink it later).  With `--minimize-minutes M`, the first program of each
distinct failure is shrunk for up to M minutes (the same kind of failure must
persist) and the minimal program written to `--out`.min.txt.

Out-of-bounds accesses are caught where they are made: with `--target triton` under
TRITON_INTERPRET=1 every load and store is checked against the kernel's tensors
(tests/triton_bounds.py); with `--asan` the C++ kernels are built with AddressSanitizer
(a worker it stops is a crash, its report on stderr; such a crash is not shrunk, as the
shrinker runs programs in its own process).

Exit status: 1 if any program was wrong, crashed, raised an
EgraphCompilerError or could not be generated; 0 otherwise.
"""
from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import queue as queue_mod
import random
import shutil
import subprocess
import sys
import tempfile
import time

MODE_WEIGHTS = [("default", 7), ("zero", 1), ("int", 1), ("multi", 1), ("long", 1), ("deep", 1)]


def _setup_env(cache_dir: str, omp_threads: int):
    os.environ.setdefault("EGC_CACHE_DIR", cache_dir)
    os.environ.setdefault("EGC_PROFILE", "cpu-default")
    # generated kernels' `omp parallel for` with more than one thread (races show), without
    # spinning on the cores the other workers need
    os.environ.setdefault("OMP_NUM_THREADS", str(omp_threads))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


ASAN_ENV = "EGC_SOAK_ASAN"
AVX512_ENV = "EGC_SOAK_AVX512"  # (--allow-avx512: workers keep AVX-512 in generated C++)


def _preload_asan():
    """The workers (spawned: a fresh Python) start with libasan preloaded, as a program built with
    -fsanitize=address and loaded into a process must, and libstdc++ with it (without it ASan's
    interceptor of C++ throws finds no __cxa_throw, and torch's first C++ error aborts the worker);
    leaks are not reported (Python keeps its objects at exit); an error stops the worker (a crash,
    with ASan's report on stderr)."""
    cxx = os.environ.get("CXX", "g++")
    libs = [subprocess.run([cxx, f"-print-file-name={name}"], capture_output=True, text=True).stdout.strip()
            for name in ("libasan.so", "libstdc++.so.6")]
    if not all(os.path.isabs(lib) for lib in libs):
        raise SystemExit(f"--asan: {cxx} has no libasan.so (install the compiler's AddressSanitizer runtime)")
    os.environ["LD_PRELOAD"] = " ".join(filter(None, [*libs, os.environ.get("LD_PRELOAD")]))
    os.environ.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    os.environ[ASAN_ENV] = "1"


def _memory_checks():
    """In a worker or the shrinker: an access past a tensor fails where it is made, under the
    Triton interpreter (tests/triton_bounds.py) or, with --asan, in C++ kernels built with
    AddressSanitizer (its runtime preloaded by `_preload_asan`); with --allow-avx512 the
    C++ kernels keep AVX-512."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tests import triton_bounds
        triton_bounds.install()
    if os.environ.get(AVX512_ENV):
        from egraph_compiler import cache
        cache.CXXFLAGS[:] = [f for f in cache.CXXFLAGS if f != "-mno-avx512f"]
    if os.environ.get(ASAN_ENV):
        from egraph_compiler import cache
        if "-fsanitize=address" not in cache.CXXFLAGS:
            cache.CXXFLAGS.append("-fsanitize=address")


def _pick_mode(rng: random.Random) -> str:
    total = sum(w for _, w in MODE_WEIGHTS)
    x = rng.uniform(0, total)
    for mode, w in MODE_WEIGHTS:
        x -= w
        if x <= 0:
            return mode
    return "default"


def _worker(wid: int, seed: int, deadline: float, out_q, first_index: int = 0, check_kwargs=None):
    import faulthandler

    import torch

    from tests import programs as P
    faulthandler.enable()  # a worker killed by a signal prints where it was
    _memory_checks()
    torch.set_num_threads(1)
    i = first_index
    while time.time() < deadline:
        key = f"{seed}:{wid}:{i}"
        rng = random.Random(key)
        mode = _pick_mode(rng)
        drawer = P.ChoiceDrawer(rng=rng)
        try:
            program = P.generate(drawer, mode)
        except Exception as exc:  # noqa: BLE001 - a generator bug
            out_q.put(("done", wid, key, mode, drawer.record, "", "invalid", type(exc).__name__,
                       f"generator raised {P._short_exc(exc)}", f"invalid:{type(exc).__name__}"))
            i += 1
            continue
        description = P.describe(program)
        out_q.put(("start", wid, key, mode, drawer.record, description))
        outcome = P.check(program, **(check_kwargs or {}))
        out_q.put(("done", wid, key, mode, drawer.record, description, outcome.kind, outcome.error_type,
                   outcome.detail, outcome.signature()))
        i += 1
    out_q.put(("exit", wid))


class Soak:
    def __init__(self, args):
        self.args = args
        self.counts = collections.Counter()
        self.errors = collections.Counter()
        self.ill = collections.Counter()
        self.failures: list[dict] = []
        self.ctx = mp.get_context("spawn")
        self.q = self.ctx.Queue()
        self.procs: dict[int, mp.Process] = {}
        self.inflight: dict[int, tuple] = {}  # wid -> (start time, key, mode, choices, description)
        self.next_wid = 0
        self.check_kwargs = {k: v for k, v in (("target", args.target), ("device", args.device)) if v}

    def start_worker(self, deadline):
        wid = self.next_wid
        self.next_wid += 1
        p = self.ctx.Process(target=_worker, args=(wid, self.args.seed, deadline, self.q, 0, self.check_kwargs),
                             daemon=True)
        p.start()
        self.procs[wid] = p

    def record(self, key, mode, choices, description, kind, error_type, detail, signature):
        self.counts["checked"] += 1
        self.counts[kind] += 1
        if kind == "error":
            self.errors[error_type] += 1
        if kind == "ill":
            self.ill[error_type] += 1
        if kind in ("wrong", "crash", "error", "invalid"):
            self.failures.append(dict(key=key, mode=mode, choices=choices, description=description, kind=kind,
                                      error_type=error_type, detail=detail, signature=signature,
                                      check=self.check_kwargs))  # (the target and device, for the shrinker)
            print(f"[{self.counts['checked']}] {kind} {error_type} {key}: {detail.splitlines()[0][:160]}", flush=True)

    def run(self):
        a = self.args
        deadline = time.time() + a.minutes * 60
        for _ in range(a.workers):
            self.start_worker(deadline)
        while self.procs:
            try:
                msg = self.q.get(timeout=1.0)
            except queue_mod.Empty:
                msg = None
            if msg is not None:
                if msg[0] == "start":
                    _, wid, key, mode, choices, description = msg
                    self.inflight[wid] = (time.time(), key, mode, choices, description)
                elif msg[0] == "done":
                    _, wid, key, mode, choices, description, *result = msg
                    self.inflight.pop(wid, None)
                    self.record(key, mode, choices, description, *result)
                elif msg[0] == "exit":
                    p = self.procs.pop(msg[1], None)
                    if p is not None:
                        p.join(timeout=30)
            now = time.time()
            for wid, p in list(self.procs.items()):
                started = self.inflight.get(wid)
                hung = started is not None and now - started[0] > a.program_timeout
                died = not p.is_alive() and p.exitcode not in (0, None)
                if not (hung or died):
                    continue
                if hung:
                    p.kill()
                p.join(timeout=30)
                del self.procs[wid]
                if started is not None:
                    _, key, mode, choices, description = self.inflight.pop(wid)
                    why = (f"no result after {a.program_timeout:.0f} s (killed)" if hung
                           else f"the worker process died (exit code {p.exitcode})")
                    self.record(key, mode, choices, description, "crash", "Hang" if hung else "WorkerDied",
                                why, f"crash:{'Hang' if hung else 'WorkerDied'}")
                if time.time() < deadline:
                    self.start_worker(deadline)

    def report(self, elapsed):
        c = self.counts
        print(f"\nsoak: {c['checked']} programs checked in {elapsed / 60:.1f} min with {self.args.workers} worker(s)")
        print(f"  ok {c['ok']}, wrong {c['wrong']}, crash {c['crash']}, error {c['error']}, "
              f"ill-conditioned {c['ill']}, invalid (generator) {c['invalid']}")
        for t, n in self.errors.most_common():
            print(f"  error {t}: {n}")
        for why, n in self.ill.most_common():
            print(f"  ill-conditioned, {why}: {n}")
        groups = collections.Counter(f["signature"] for f in self.failures)
        if groups:
            print(f"  {len(groups)} distinct failure signature(s):")
            for sig, n in groups.most_common():
                print(f"    {n:4d}  {sig}")
        write_failures(self.args.out, self.failures)
        if self.failures:
            print(f"  failing programs written to {self.args.out} (choices in {self.args.out}.json)")


def write_failures(path, failures):
    with open(path, "w") as f:
        for k, fail in enumerate(failures):
            f.write(f"### failure {k}: {fail['kind']} {fail['error_type']} (program {fail['key']}, "
                    f"mode {fail['mode']})\n# {fail['signature']}\n")
            f.write("# " + fail["detail"].replace("\n", "\n# ") + "\n")
            f.write(fail["description"] + "\n\n")
    with open(path + ".json", "w") as f:
        json.dump(failures, f)


def _same_failure(kind, error_type, signature, check_kwargs=None):
    def still_fails(program):
        from tests import programs as P
        outcome = P.check(program, **(check_kwargs or {}))
        if kind in ("wrong",):
            return outcome.kind == "wrong"
        return outcome.kind == kind and outcome.error_type == error_type and outcome.signature() == signature
    return still_fails


def _minimize_one(fail, budget_s, verbose=False):
    import torch

    from tests import programs as P
    _memory_checks()
    torch.set_num_threads(1)
    start = time.time()
    check = fail.get("check") or {}  # (a failure on the Triton target is shrunk on that target)
    program, choices = P.shrink(fail["choices"], fail["mode"],
                                _same_failure(fail["kind"], fail["error_type"], fail["signature"], check), budget_s,
                                log=lambda m: print(f"[{fail['key']}] {m}", flush=True) if verbose else None)
    outcome = P.check(program, **check)
    return dict(fail, choices=choices, description=P.describe(program), detail=outcome.detail,
                min_kind=outcome.kind, seconds=time.time() - start)


def minimize(failures, out, minutes, workers, max_wrong=8):
    """Shrinks the first failure of each signature, and each of the first
    `max_wrong` wrong results (their signatures say little about the cause)."""
    firsts = {}
    for fail in failures:
        if fail["kind"] == "wrong" and sum(f["kind"] == "wrong" for f in firsts.values()) < max_wrong:
            firsts[fail["signature"] + " #" + fail["key"]] = fail
        firsts.setdefault(fail["signature"], fail)
    if not firsts:
        return
    print(f"\nshrinking {len(firsts)} distinct failure(s), up to {minutes} min each, {workers} at a time")
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        results = pool.starmap(_minimize_one, [(f, minutes * 60) for f in firsts.values()])
    with open(out + ".min.txt", "w") as f:
        for k, r in enumerate(results):
            f.write(f"### minimal failure {k}: {r['kind']} {r['error_type']} (from program {r['key']}, "
                    f"mode {r['mode']}; shrunk in {r['seconds']:.0f} s; now: {r['min_kind']})\n# {r['signature']}\n")
            f.write("# " + r["detail"].replace("\n", "\n# ") + "\n")
            f.write(r["description"] + "\n\n")
    with open(out + ".min.json", "w") as f:
        json.dump(results, f)
    seen = set()
    for r in results:
        if r["description"] in seen:
            continue
        seen.add(r["description"])
        print(f"\n--- {r['signature']} ({r['min_kind']} after shrinking)\n{r['description']}\n# {r['detail'][:600]}")
    print(f"\nminimal programs written to {out}.min.txt")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2)))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="soak_failures.txt")
    ap.add_argument("--program-timeout", type=float, default=180.0)
    ap.add_argument("--target", help="compile for this target (cpu, triton, cuda); default: the inputs' own")
    ap.add_argument("--device", help="run the compiled programs on copies of the inputs on this device (cuda)")
    ap.add_argument("--omp-threads", type=int, default=2, help="OpenMP threads of the generated kernels")
    ap.add_argument("--minimize-minutes", type=float, default=0.0,
                    help="after the run, shrink each distinct failure for up to this long")
    ap.add_argument("--minimize", metavar="JSON", help="shrink the failures saved by an earlier run, then stop")
    ap.add_argument("--allow-avx512", action="store_true",
                    help="build the C++ kernels with AVX-512, which generated code leaves out (egraph_compiler.cache): "
                         "whether this machine's compiler and vector math give right answers with it")
    ap.add_argument("--asan", action="store_true",
                    help="build the C++ kernels with AddressSanitizer and run the workers with its runtime "
                         "preloaded: a read or write past a buffer stops the worker with ASan's report")
    args = ap.parse_args(argv)
    if args.asan:
        _preload_asan()
    if args.allow_avx512:
        os.environ[AVX512_ENV] = "1"
    cache = tempfile.mkdtemp(prefix="egc-soak-cache-")
    try:
        return _main(args, cache)
    finally:  # the run's kernels are of no use after it (they filled a disk over many soaks)
        shutil.rmtree(cache, ignore_errors=True)


def _main(args, cache: str) -> int:
    _setup_env(cache, args.omp_threads)
    if args.minimize:
        with open(args.minimize) as f:
            failures = json.load(f)
        out = args.minimize.removesuffix(".json")
        minimize(failures, out, args.minimize_minutes or 3.0, args.workers)
        return 0
    soak = Soak(args)
    t0 = time.time()
    soak.run()
    soak.report(time.time() - t0)
    if args.minimize_minutes > 0:
        minimize(soak.failures, args.out, args.minimize_minutes, args.workers)
    c = soak.counts
    return 1 if c["wrong"] or c["crash"] or c["error"] or c["invalid"] else 0


if __name__ == "__main__":
    sys.exit(main())
