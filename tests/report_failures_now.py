"""A pytest plugin for runs that may not reach their end (a device call's time limit, a fatal error in a
CUDA driver): each failure's traceback is written as soon as its test fails, not in the final summary.
    python -m pytest -p tests.report_failures_now ...
"""

from __future__ import annotations

import pytest


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    if report.failed:
        terminal = report_config.pluginmanager.get_plugin("terminalreporter")
        terminal.write_line(f"\n==== {report.nodeid} ({report.when}) failed\n{report.longreprtext}\n==== end")


def pytest_configure(config):
    global report_config
    report_config = config
