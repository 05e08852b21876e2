"""``require()`` (tests/environments.py) and ``--require-all`` (tests/conftest.py) in a pytest run of
their own: a declared package that is missing skips without the flag and fails with it, with the
same reason; skips by design skip either way; every other skip fails under the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.environments import ENVIRONMENTS

TESTS = Path(__file__).parents[1]

NEED = """
import pytest

from tests.environments import Environment, require

HERE = Environment(venv=".venv-here", setup="scripts/setup-here.sh", runs="pytest here",
                   modules=frozenset({"a_package_that_does_not_exist", "json"}))
THERE = Environment(venv=".venv-there", setup="scripts/setup-there.sh", runs="pytest there",
                    modules=frozenset({"a_package_of_the_other_environment"}))


def need(module):
    __tracebackhide__ = True
    return require(module, here=HERE, environments=(HERE, THERE))
"""

CASES = """
from need import need
import pytest


def test_missing_here():
    need("a_package_that_does_not_exist")


def test_missing_by_design():
    need("a_package_of_the_other_environment")


def test_present():
    assert need("json").dumps([1]) == "[1]"


def test_undeclared():
    need("numpy")


def test_plain_skip():
    pytest.skip("a reason that is not by design")


@pytest.mark.skipif(True, reason="by design: a machine that is not this one")
def test_skip_by_design():
    pass
"""

MISSING = "a_package_that_does_not_exist is missing from .venv-here"


def run(suite: pytest.Pytester, *args: str) -> pytest.RunResult:
    # hypothesis's end-of-run summary imports the whole of hypothesis (a second in a fresh process)
    return suite.runpytest_inprocess("-p", "no:hypothesispytest", *args)


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(need=NEED, test_cases=CASES)
    return pytester


def test_without_the_flag_a_missing_package_skips_naming_its_setup_script(suite: pytest.Pytester) -> None:
    result = run(suite, "-rs")
    result.assert_outcomes(passed=1, skipped=4, failed=1)  # the undeclared package fails either way
    result.stdout.re_match_lines([rf".*SKIPPED .*test_cases.py:\d+: {MISSING} .*`bash scripts/setup-here.sh`.*",
                                  r".*SKIPPED .*: by design: a_package_of_the_other_environment is installed in "
                                  r"\.venv-there only \(`bash scripts/setup-there.sh`\).*",
                                  r".*SKIPPED .*: a reason that is not by design"], consecutive=False)
    result.stdout.fnmatch_lines(["*no environment in tests/environments.py declares 'numpy'*"])


def test_with_the_flag_only_skips_by_design_skip(suite: pytest.Pytester) -> None:
    result = run(suite, "-rs", "--require-all")
    result.assert_outcomes(passed=1, skipped=2, failed=3)
    result.stdout.fnmatch_lines([f"*skipped in a --require-all run*: {MISSING} *`bash scripts/setup-here.sh`*"])
    result.stdout.fnmatch_lines(["*skipped in a --require-all run*: a reason that is not by design*"])
    result.stdout.fnmatch_lines(["*SKIPPED *: by design: a machine that is not this one*"])


def test_with_the_flag_a_module_level_require_is_a_collection_error(suite: pytest.Pytester) -> None:
    suite.makepyfile(test_module="from need import need\n\nneed('a_package_that_does_not_exist')\n\n\n"
                                 "def test_never_collected():\n    pass\n")
    run(suite, "test_module.py").assert_outcomes(skipped=1)
    result = run(suite, "test_module.py", "--require-all")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    result.stdout.fnmatch_lines(["*ERROR collecting test_module.py*", f"*{MISSING}*"])


def test_the_readme_command_and_ci_run_every_environment_with_the_flag() -> None:
    readme, ci = (TESTS.parent / "README.md").read_text(), (TESTS.parent / ".ci" / "run").read_text()
    for env in ENVIRONMENTS:
        assert env.runs in readme and env.runs in ci and f"bash {env.setup}" in readme, env
