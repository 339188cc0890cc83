"""A pytest plugin: the CPU seconds each test costs, and the slowest tests of the fast lane listed after the run.

CPU time (this process's threads plus the child processes it waited for) rather than wall time, because other
work on a shared machine stretches wall time and not CPU time. It is a report and never a failure: a budget
asserted on it would still depend on the machine. ``--cpu-report=N`` lists the N costliest tests not marked
``slow`` (default 10; 0 turns the section off); a fast-lane test costing over about 2 s belongs under ``slow``.
``--cpu-log=PATH`` appends one line per test as it finishes (CPU seconds, wall seconds, slow or fast, node id), so
a long run can be read while it goes.
Under xdist the workers measure and the controller lists: the figure travels in the report's user_properties.
"""
from __future__ import annotations

import resource
import time

import pytest

KEY = "cpu_s"
SLOW_S = 2.0


def cpu_seconds() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def pytest_addoption(parser):
    parser.addoption("--cpu-report", type=int, default=10, metavar="N",
                     help="list the N tests not marked slow that cost the most CPU seconds (0: none)")
    parser.addoption("--cpu-log", metavar="PATH", help="append each test's CPU and wall seconds to PATH as it ends")


COSTS = pytest.StashKey[list]()
START = pytest.StashKey[float]()


def pytest_configure(config):
    config.stash[COSTS] = []
    if hasattr(config, "workerinput"):  # an xdist worker: its reports reach the controller, which gathers them
        return
    config.pluginmanager.register(Collector(config.stash[COSTS], config.getoption("--cpu-log")),
                                  "cpu_report_collector")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[START] = cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Setup, call and teardown together: a fixture's cost is the test's that first needs it.
    if call.when == "teardown" and START in item.stash:
        item.user_properties.append((KEY, cpu_seconds() - item.stash[START]))
    yield


class Collector:
    """Gathers the figures from the reports, which under xdist arrive from the workers."""

    def __init__(self, costs: list, log: str | None):
        self.costs, self.log, self.wall = costs, log, {}

    def pytest_runtest_logreport(self, report):
        self.wall[report.nodeid] = self.wall.get(report.nodeid, 0.0) + report.duration
        cost = dict(report.user_properties).get(KEY) if report.when == "teardown" else None
        if cost is None:
            return
        slow = "slow" in report.keywords
        if not slow:
            self.costs.append((cost, report.nodeid))
        if self.log:
            with open(self.log, "a") as log:
                lane = "slow" if slow else "fast"
                log.write(f"{cost:.2f}\t{self.wall.pop(report.nodeid):.2f}\t{lane}\t{report.nodeid}\n")


def pytest_terminal_summary(terminalreporter, config):
    count = config.getoption("--cpu-report")
    costs = sorted(config.stash[COSTS], reverse=True)
    if count <= 0 or not costs:
        return
    over = sum(1 for cost, _ in costs if cost > SLOW_S)
    terminalreporter.section(f"CPU seconds, costliest tests not marked slow ({over} over {SLOW_S:g} s)")
    for cost, nodeid in costs[:count]:
        terminalreporter.write_line(f"{cost:7.2f}  {nodeid}")
