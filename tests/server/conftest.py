"""One tiny compiled server for the whole directory (compiling its programs is most of the
cost; every test shares it), stopped as soon as a worker's next test lies outside it."""

from pathlib import Path

import pytest
from server_support import running, served_model, tiny_model

HERE = Path(__file__).parent


@pytest.fixture(scope="session")
def loaded(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def served(loaded):
    return served_model(loaded)


@pytest.fixture(scope="session")
def base_url(served):
    with running(served) as url:
        yield url


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    # A session fixture lives until the worker ends, and the worker goes on to other
    # directories' tests: the server's threads (scheduler, uvicorn) and the model would stay
    # up beside them. Finishing `loaded` finishes what depends on it (`served`, `base_url`)
    # first; a later test here builds them again.
    result = yield
    if nextitem is None or HERE not in nextitem.path.parents:
        for fixturedef in item.session._fixturemanager.getfixturedefs("loaded", item) or ():
            if fixturedef.cached_result is not None:
                fixturedef.finish(item._request)
    return result
