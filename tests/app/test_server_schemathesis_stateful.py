"""Schemathesis' full run against a real server, as in CI (``make test-slow``): every phase --
examples, coverage, fuzzing and the stateful one -- with fixed seeds; any server error fails it
(the rule of test_server_schemathesis.py: a 5xx, or TEI's 424 under /tei).

The stateful phase is a state machine over the schema's links: the ones schemathesis infers (a
created or listed collection's name opens its documents, search and deletion) and the ones the
collection routes declare (an upsert's first document and a search's first hit open that
document). It is what found issue 50's bug: a value an upsert acknowledged broke every later
search of the collection. A Hypothesis state machine against a live server ends a suite early
when the server's state makes a replay draw differently, so the stateful phase runs as
``SUITES`` suites, each on a seed of its own; the first run also holds the other phases.

The server is this module's own (a fresh data directory): the stateful phase deletes the
collections it finds, which would be other tests' on the shared ``server``. Bounded for a 2-core
machine: ~2-3 minutes with the server's start."""

from __future__ import annotations

import collections
import time
from typing import Any

import pytest
import schemathesis
from schemathesis import engine
from schemathesis.checks import CHECKS
from schemathesis.engine import Status, events
from schemathesis.engine.run import PhaseName

from test_server_schemathesis import server_error

pytestmark = pytest.mark.slow

SEED = 50
MAX_EXAMPLES = 25  # per operation and phase (examples, coverage and fuzzing)
SUITES = 24  # stateful suites, seeds SEED .. SEED + SUITES - 1
SCENARIOS = 100  # per suite (a suite may end earlier, see above)
STEPS = 20  # per scenario

PHASES = {PhaseName.EXAMPLES: "examples", PhaseName.COVERAGE: "coverage", PhaseName.FUZZING: "fuzzing",
          PhaseName.STATEFUL_TESTING: "stateful"}
DOCUMENTS = "/collections/{name}/documents"
DOCUMENT = "/collections/{name}/documents/{doc_id}"
SEARCH = "/collections/{name}/search"


def _config(seed: int, *, all_phases: bool) -> schemathesis.Config:
    return schemathesis.Config.from_dict({
        "seed": seed,
        "suppress-health-check": ["all"],
        "request-timeout": 120,
        "generation": {"max-examples": MAX_EXAMPLES, "deterministic": True, "database": "none",
                       "no-shrink": True},
        # only the server-error rule: the schema's conformance is not what this run is for
        "checks": {"enabled": False, "embedpool_server_error": {"enabled": True}},
        "phases": {"examples": {"enabled": all_phases}, "coverage": {"enabled": all_phases},
                   "fuzzing": {"enabled": all_phases},
                   "stateful": {"max-steps": STEPS, "generation": {"max-examples": SCENARIOS}}},
    })


class Tally:
    """Every response the run got, by phase, and the stateful phase's calls on the collections it
    had created (named in a 2xx answer to ``POST /collections`` earlier in that phase)."""

    def __init__(self) -> None:
        self.phases: collections.Counter[str] = collections.Counter()
        self.created: set[str] = set()
        self.chained: collections.Counter[tuple[str, str, int]] = collections.Counter()
        self.errors: list[str] = []

    def check(self, ctx: Any, response: Any, case: Any) -> None:
        """Count the response; a server error fails the check (and the test)."""
        phase = case.meta.phase.name.value if case.meta is not None else "?"
        route, status = case.operation.path, response.status_code
        self.phases[phase] += 1
        if phase == "stateful":
            if case.method == "POST" and route == "/collections" and status in (200, 201):
                self.created.add(response.json()["name"])
            elif route.startswith("/collections/{name}/") and (case.path_parameters or {}).get("name") in self.created:
                self.chained[(case.method, route, status)] += 1
        if server_error(case.formatted_path, status):
            self.errors.append(f"{phase}: {case.method} {case.formatted_path} -> {status}: {response.text[:300]}")
            raise AssertionError(f"server error {status}: {response.text[:300]}")

    def calls(self, method: str, route: str, ok: bool = False) -> int:
        return sum(n for (m, r, s), n in self.chained.items() if m == method and r == route and (s == 200 or not ok))


def test_schemathesis_all_phases_and_stateful_no_server_errors(start_server, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("schemathesis-stateful"), {}).wait_ready()
    tally = Tally()

    def embedpool_server_error(ctx, response, case):  # the check's name is how the config enables it
        tally.check(ctx, response, case)

    schemathesis.check(embedpool_server_error)
    finished: set[str] = set()
    problems: list[str] = []  # engine errors, and each failure's steps to reproduce it
    scenarios, started = 0, time.monotonic()
    try:
        for i in range(SUITES):
            schema = schemathesis.openapi.from_url(f"{srv.url}/openapi.json", config=_config(SEED + i, all_phases=i == 0))
            for event in engine.from_schema(schema).execute():
                if isinstance(event, events.PhaseFinished) and event.phase.name in PHASES \
                        and event.status != Status.SKIP:
                    finished.add(PHASES[event.phase.name])
                elif isinstance(event, events.ScenarioStarted) and event.phase == PhaseName.STATEFUL_TESTING:
                    scenarios += 1
                elif isinstance(event, events.ScenarioFinished) and event.status == Status.FAILURE:
                    for nodes in event.recorder.checks.values():
                        for node in nodes:
                            if node.failure_info is not None:
                                steps = [s.curl for s in node.failure_info.steps] or [node.failure_info.code_sample]
                                problems.append(f"seed {SEED + i}: {node.failure_info.failure.message}\n"
                                                + "\n".join(steps))
                elif isinstance(event, (events.NonFatalError, events.FatalError, events.Interrupted)):
                    problems.append(f"seed {SEED + i}: {event!r}"[:2000])
    finally:
        CHECKS.unregister("embedpool_server_error")
    elapsed = time.monotonic() - started
    print(f"schemathesis: {sum(tally.phases.values())} requests in {elapsed:.0f} s, {dict(tally.phases)}; "
          f"stateful: {scenarios} scenarios, {len(tally.created)} collections created, on them "
          f"{dict(sorted(tally.chained.items()))}")

    assert not tally.errors, "\n\n".join(["\n".join(dict.fromkeys(tally.errors))] + problems)
    assert not problems, "\n\n".join(problems)
    assert finished == set(PHASES.values()), finished
    assert all(tally.phases[p] > 0 for p in PHASES.values()), tally.phases
    # not vacuous: the state machine chained create -> upsert -> search / read back on its collections
    assert scenarios >= SUITES and len(tally.created) >= 10, (scenarios, tally.created)
    assert tally.calls("POST", DOCUMENTS, ok=True) >= 20, tally.chained
    assert tally.calls("POST", SEARCH) >= 20 and tally.calls("POST", SEARCH, ok=True) >= 2, tally.chained
    assert tally.calls("GET", DOCUMENT) >= 20 and tally.calls("GET", DOCUMENT, ok=True) >= 5, tally.chained
    srv.alive()
