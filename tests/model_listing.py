"""`GET /v1/models` checks shared by the SQLite (unit) and PostgreSQL (integration) tests: model rows are written
straight into the registry's table (no training needed to list them), then listed through the API and the client."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from app.client import LetheClient, LetheProblem
from app.db import session_scope
from app.registry.tables import Model, ModelTag

T0 = datetime(2026, 1, 1, tzinfo=UTC)
TAGS = {"fraud-lr": ["prod", "team:fraud"], "fraud-mlp": ["team:fraud"], "clip-fed": ["prod"]}
SEED = [  # name, kind, status, minutes after T0 (two share a moment: the id breaks the tie)
    ("fraud-lr", "tabular", "ready", 0),
    ("fraud-mlp", "tabular", "failed", 1),
    ("churn_100%", "tabular", "ready", 2),
    ("churnX100Y", "tabular", "registering", 2),
    ("clip-fed", "clip_federated", "ready", 3),
]


def seed_models() -> dict[str, str]:
    ids = {}
    with session_scope() as session:
        for name, kind, status, minutes in SEED:
            model = Model(
                name=name, kind=kind, status=status, spec={}, state={}, created_at=T0 + timedelta(minutes=minutes)
            )
            session.add(model)
            session.flush()
            session.add_all(ModelTag(model_id=model.id, tag=t) for t in TAGS.get(name, []))
            ids[name] = model.id
    return ids


def check_listing(http, ids: dict[str, str]) -> None:
    """``http``: an httpx client on the app with a key that may read models."""
    client = LetheClient(http=http)
    expected = sorted(((T0 + timedelta(minutes=m), ids[n]) for n, _, _, m in SEED), key=lambda pair: pair, reverse=True)
    # keyset paging, newest first, two at a time: every model once, in order
    pages, cursor = [], None
    while True:
        page = client.list_models(limit=2, cursor=cursor)
        pages.append([m.id for m in page.items])
        cursor = page.next_cursor
        if cursor is None:
            break
    assert [len(p) for p in pages] == [2, 2, 1]
    assert [i for p in pages for i in p] == [i for _, i in expected]
    # a model registered while paging does not shift the later pages
    first = client.list_models(limit=2)
    with session_scope() as session:
        session.add(Model(name="late", kind="tabular", status="ready", spec={}, state={}))
    second = client.list_models(limit=2, cursor=first.next_cursor)
    assert [m.id for m in second.items] == [i for _, i in expected][2:4]

    assert [m.id for m in client.list_models(name="fraud-lr").items] == [ids["fraud-lr"]]
    assert client.list_models(name="fraud").items == []  # exact
    assert {m.name for m in client.iter_models(name_contains="FRAUD")} == {"fraud-lr", "fraud-mlp"}
    # the LIKE wildcards are literal: "100%" matches only the name that holds it
    assert [m.name for m in client.list_models(name_contains="_100%").items] == ["churn_100%"]
    assert [m.id for m in client.list_models(kind="clip_federated").items] == [ids["clip-fed"]]
    assert {m.name for m in client.iter_models(status="ready", kind="tabular")} == {"fraud-lr", "churn_100%", "late"}
    model = client.list_models(name="clip-fed").items[0]
    assert model.kind == "clip_federated" and model.links["self"] == f"/v1/models/{ids['clip-fed']}"

    # tags: every given tag must be carried; each model shows its own
    assert {m.name for m in client.iter_models(tags=["team:fraud"])} == {"fraud-lr", "fraud-mlp"}
    assert [m.name for m in client.iter_models(tags=["team:fraud", "prod"])] == ["fraud-lr"]
    assert {m.name for m in client.iter_models(tags=["prod"], kind="clip_federated")} == {"clip-fed"}
    assert client.list_models(tags=["nobody"]).items == []
    assert client.list_models(name="fraud-lr").items[0].tags == ["prod", "team:fraud"]

    for params, slug in (
        ({"cursor": "not-a-cursor"}, "invalid-cursor"),
        ({"tag": "Upper Case"}, "validation-error"),
        ({"kind": "ensemble"}, "validation-error"),
        ({"limit": 0}, "validation-error"),
        ({"tag": "x", "limit": 501}, "validation-error"),
    ):
        response = http.get("/v1/models", params=params)
        assert response.headers["content-type"] == "application/problem+json", params
        assert response.json()["type"].endswith("/" + slug), (params, response.json())
    anonymous = http.get("/v1/models", headers={"authorization": ""})
    assert anonymous.status_code == 401
    try:
        LetheClient(http=http).list_models(cursor="%%%")
    except LetheProblem as problem:
        assert problem.status == 400 and problem.slug == "invalid-cursor" and problem.instance == "/v1/models"
    else:
        raise AssertionError("a bad cursor must raise LetheProblem")
