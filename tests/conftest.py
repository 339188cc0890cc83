"""Shared by every test directory: ``tests/`` on ``sys.path``, whatever pytest's import mode, so that test
modules can ``from pinned import pinned, PINNED_OVERRIDES`` (the pinned cost profile, ``tests/pinned.py``);
``once``, an expensive run (a torchrun, a sweep) made once per test session however many xdist workers
run the tests that read it; and Hypothesis without its per-example deadline."""
import fcntl
import os
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import settings

pytest_plugins = ["cpu_report"]

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

# Hypothesis's per-example deadline (200 ms) is a timing assertion: on the 2-core CI, with the xdist workers
# sharing the cores, one example of a partition test took 307 ms and failed a correct run. Properties are
# checked here, speed in the benchmarks.
settings.register_profile("no_deadline", deadline=None)
settings.load_profile("no_deadline")


@pytest.fixture(scope="session")
def once(tmp_path_factory):
    """``once(name, make)``: the directory ``<shared>/<name>`` after ``make(path)`` filled it (``path`` exists,
    empty, when ``make`` starts), made once per test session. Under xdist the tests of one module-scoped run
    are spread over the workers, and each worker would launch the run itself; here the first worker to ask
    makes it while the others wait on a file lock, then every worker reads the same files. A ``make`` that
    fails leaves no directory behind, so the next worker that asks runs it again (and fails as loudly).
    Tests treat the directory as read-only, apart from files that one test alone writes."""
    base = tmp_path_factory.getbasetemp()
    # xdist gives each worker <session basetemp>/<worker id>: the parent is this session's, shared by all of them
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "once"
    shared.mkdir(exist_ok=True)

    def make_once(name: str, make) -> Path:
        path, done = shared / name, shared / f"{name}.done"
        with open(shared / f"{name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not done.exists():
                shutil.rmtree(path, ignore_errors=True)
                path.mkdir()
                try:
                    make(path)
                except BaseException:
                    shutil.rmtree(path, ignore_errors=True)
                    raise
                done.touch()
        return path

    return make_once
