"""One tiny compiled server for the whole directory (compiling its programs is most of the
cost; every test shares it)."""

import pytest
from server_support import running, served_model, tiny_model


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
