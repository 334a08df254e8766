"""The server against its own OpenAPI document (``/openapi.json``), by schemathesis: bodies
generated from the document, valid and invalid, never get a server error, invalid ones are
refused, and every answer has a documented status, content type and shape."""

import pytest
from hypothesis import HealthCheck, given, settings

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

# Valid bodies may still get a documented 400 (a prompt plus max_tokens past the context, which
# a schema cannot state), so data acceptance is not among the checks.
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_the_server_keeps_to_its_openapi_document(base_url, mode):
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {"/v1/completions", "/v1/chat/completions", "/v1/embeddings"}
    assert {op.path for op in operations} >= paths
    if mode == GenerationMode.NEGATIVE:  # only bodies can be made invalid
        operations = [op for op in operations if op.method.upper() == "POST"]
    for operation in operations:

        @settings(
            max_examples=25,
            deadline=None,
            database=None,
            derandomize=True,  # the same examples on every run: a CI result does not depend on luck
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            case.call_and_validate(checks=CHECKS)

        run()
