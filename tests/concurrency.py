"""Running a test's calls in threads at once (the compiled programs' thread safety)."""
import sys
import threading


def in_threads(fn, arguments: list) -> None:
    """fn(*a) for each a in its own thread, all at once, the interpreter switching threads between
    any two steps (a thread's exception is the caller's to keep: fn should record failures)."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=fn, args=a) for a in arguments]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
