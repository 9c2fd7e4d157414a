import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--update-golden", action="store_true",
                     help="rewrite tests/golden/ from the current output (review the diff)")

# target="triton" runs on CPU tensors in Triton's interpreter, which reads this when
# triton is first imported (a machine with a GPU runs the kernels on it instead)
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True, scope="session")
def _triton_bounds_checked():
    """Under the interpreter, a kernel's load or store outside its tensors fails the test
    (tests/triton_bounds.py) instead of reading or corrupting the heap."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tests import triton_bounds
        triton_bounds.install()
    yield


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Tests compile into their own C++ cache, so a run never reads a stale one."""
    os.environ["EGC_CACHE_DIR"] = str(tmp_path_factory.mktemp("egc-cache"))
    # plans are checked against a fixed device profile; tests that compare the
    # cost model with this machine's clock ask for the calibrated one ("cpu")
    os.environ["EGC_PROFILE"] = "cpu-default"
    yield


@pytest.fixture(autouse=True)
def _fallbacks_warned_afresh(monkeypatch):
    """An ATen fallback is warned once per process (pipeline._warned); each test starts with
    none warned, so a test that expects the warning does not depend on which test ran first."""
    from egraph_compiler import pipeline
    monkeypatch.setattr(pipeline, "_warned", set())


@pytest.fixture
def as_on_a_gpu(monkeypatch):
    """The Triton renderer writes its source as for a GPU (Triton's interpreter still runs the kernels):
    under the interpreter a row's independent sums stay apart (codegen/triton.py)."""
    from egraph_compiler.codegen import triton as renderer
    monkeypatch.setattr(renderer, "_interpreted", lambda: False)
