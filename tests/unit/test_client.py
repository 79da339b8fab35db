"""app/client.py's parts that need no server: the problem document of an answer, and one made up for an answer
that is not problem+json (a proxy's 502 page). The client against a real service: tests/unit/test_cli.py,
tests/model_listing.py (SQLite and PostgreSQL), tests/integration/test_ease_service.py (the federation)."""

from __future__ import annotations

import httpx

from app.client import DeletionRequest, LetheProblem


def test_a_problem_document_keeps_its_fields_and_extensions():
    response = httpx.Response(
        422,
        json={
            "type": "https://lethe.dev/problems/unknown-sample-ids",
            "title": "Some sample ids are not in the data set",
            "status": 422,
            "detail": "1 unknown",
            "instance": "/v1/deletion-requests",
            "unknown_sample_ids": ["P9999"],
        },
        headers={"content-type": "application/problem+json"},
    )
    problem = LetheProblem.from_response(response)
    assert (problem.status, problem.slug, problem.detail) == (422, "unknown-sample-ids", "1 unknown")
    assert problem.instance == "/v1/deletion-requests" and problem.extensions == {"unknown_sample_ids": ["P9999"]}
    assert str(problem) == "422 unknown-sample-ids: 1 unknown"


def test_an_answer_that_is_not_a_problem_still_raises_a_typed_problem():
    problem = LetheProblem.from_response(httpx.Response(502, text="<html>Bad gateway</html>"))
    assert problem.status == 502 and problem.type == "about:blank" and "Bad gateway" in problem.detail


def test_models_accept_fields_a_newer_server_adds():
    body = {
        "id": "r", "model_id": "m", "subject_hash": "h", "scope": {}, "method": "retrain", "status": "certified",
        "created_at": "2026-01-01T00:00:00Z", "updated_at": "2026-01-01T00:00:00Z", "something_new": 1,
    }  # fmt: skip
    request = DeletionRequest.model_validate(body)
    assert request.done and request.model_extra == {"something_new": 1}
