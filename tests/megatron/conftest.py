"""The megatron tests' shared start-up: one spawn of ``engine_ranks`` for every model that refits into
the kit's reference engine (each test module used to start its own: megatron's import and start-up
is most of such a spawn's time)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.environments import require


@pytest.fixture(scope="session")
def engine_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
                   ) -> Callable[[str], tuple[list[Any], list[Any]]]:
    """Every ``(ENGINE_MODEL, layout)`` the collected tests that use this fixture ask for (their module's
    ``ENGINE_MODEL``, their ``layout`` parameter; ``-k`` narrows it), in one
    :func:`engine_ranks.run_engine_ranks`; returns a function giving one model's ``(train results, gen
    results)``, each rank's by layout."""
    require("megatron.core")
    from engine_ranks import run_engine_ranks

    cases = list(dict.fromkeys((item.module.ENGINE_MODEL, item.callspec.params["layout"])
                               for item in request.session.items if "engine_results" in item.fixturenames))
    train, gen = run_engine_ranks(str(tmp_path_factory.mktemp("engine")), cases)

    def of(model: str) -> tuple[list[Any], list[Any]]:
        return [rank[model] for rank in train], [rank[model] for rank in gen]

    return of
