"""``--require-all`` (CI: the README's test command carries it): every skip whose reason does not start
with ``by design: `` (:data:`tests.environments.BY_DESIGN`) fails instead, whether it came from
:func:`tests.environments.require`, ``pytest.skip``, a ``skipif`` mark, an empty parametrization or a
module-level skip (a collection error then). Without the flag such skips stay skips, with their reasons.

The suite runs as one refit job: refit refuses to set up without a secret (``RefitOptions.insecure`` opts
out), and most tests start senders and receivers themselves, in threads or in processes that inherit the
environment. So ``REFIT_SECRET`` holds :data:`SUITE_SECRET` unless it was set before (set it empty to run
as a user without one: ``REFIT_SECRET= pytest tests/docs`` checks that the docs' snippets need no help).
Tests of the secret-less paths remove it (``monkeypatch.delenv``)."""

from __future__ import annotations

import os
from collections.abc import Generator

import pytest

from tests.environments import BY_DESIGN

pytest_plugins = ["pytester"]

OPTION = "--require-all"
SUITE_SECRET = "refit-test-suite"
os.environ.setdefault("REFIT_SECRET", SUITE_SECRET)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(OPTION, action="store_true", default=False,
                     help="fail every skip not declared legitimate (reason starting 'by design: '), such as a "
                          "package tests/environments.py declares for this environment that is missing (CI)")


def _undeclared_skip(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    """The reason of ``report``'s skip when it is not a skip by design (None: no such skip)."""
    if not report.skipped or hasattr(report, "wasxfail") or not isinstance(report.longrepr, tuple):
        return None
    reason = report.longrepr[2].removeprefix("Skipped: ")
    return None if reason.startswith(BY_DESIGN) else reason


def _fail(report: pytest.TestReport | pytest.CollectReport, reason: str) -> None:
    report.outcome = "failed"
    report.longrepr = (f"skipped in a {OPTION} run, where only skips by design may skip: {reason}\n"
                       f"(a skip that is legitimate here, such as no CUDA, says so with a reason starting "
                       f"{BY_DESIGN!r}: see tests/environments.py)")


def _enforce(report: pytest.TestReport | pytest.CollectReport, config: pytest.Config) -> None:
    """Under ``--require-all``, turn ``report``'s undeclared skip into a failure."""
    reason = _undeclared_skip(report)
    if reason is not None and config.getoption(OPTION):
        _fail(report, reason)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, object, object]:
    report = yield
    assert isinstance(report, pytest.TestReport)
    _enforce(report, item.config)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, object, object]:
    report = yield
    assert isinstance(report, pytest.CollectReport)
    _enforce(report, collector.config)
    return report
