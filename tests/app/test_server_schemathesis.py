"""Property-based: schemathesis generates requests from /openapi.json; no answer may be a 5xx
(nor, on the TEI surface under /tei, a 424: TEI's status for what embedpool answers 500).

Bounded for a 2-core machine: a few examples per operation (valid and invalid data), no
shrinking, no example database. Runs against the live default server."""

from __future__ import annotations

import hypothesis
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, settings

MAX_EXAMPLES = 6


def server_error(path: str, status: int) -> bool:
    return status >= 500 or (status == 424 and (path == "/tei" or path.startswith("/tei/")))


def test_no_server_errors_on_generated_requests(server):
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    session = requests.Session()
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        op = result.ok()
        operations += 1
        strategy = op.as_strategy()

        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @hypothesis.given(case=strategy)
        def run(case):
            response = case.call(base_url=server.url, session=session, timeout=120)
            if server_error(case.formatted_path, response.status_code):
                failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}: "
                                f"{response.text[:300]} (body {str(case.body)[:200]})")
            elif response.content:  # TEI's health answers 200 with no body (and no content type)
                ctype = (response.headers.get("content-type") or [""])[0]
                assert ctype.startswith(("application/json", "text/plain", "text/html")), response.headers

        run()
    assert operations >= 24  # embedpool's own routes, TEI's under /tei, /v1/rerank, /v1/models
    assert not failures, "\n".join(failures)
    server.alive()


@pytest.mark.parametrize("mode", ["negative"])
def test_no_server_errors_on_invalid_requests(server, mode):
    """Requests that break the schema on purpose: every one must be a 4xx."""
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    session = requests.Session()
    failures: list[str] = []
    checked = 0
    for result in schema.get_all_operations():
        op = result.ok()
        try:
            strategy = op.as_strategy(generation_mode=GenerationMode.NEGATIVE)
        except Exception:  # an operation without anything to break
            continue

        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @hypothesis.given(case=strategy)
        def run(case):
            response = case.call(base_url=server.url, session=session, timeout=120)
            if server_error(case.formatted_path, response.status_code):
                failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}: "
                                f"{response.text[:300]}")

        try:
            run()
        except hypothesis.errors.Unsatisfiable:  # nothing to break (no parameters, no body)
            continue
        checked += 1
    assert checked >= 8
    assert not failures, "\n".join(failures)
    server.alive()
