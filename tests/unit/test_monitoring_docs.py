"""docs/monitoring (issue 23): every metric the alert rules and the Grafana dashboard query is one /metrics exports,
with the labels they select on (a typo'd or removed name would leave an alert that never fires, a panel that stays
empty), and the route labels they name are the app's route templates. The scrape configuration sends the key that
/metrics needs (issue 22), made as its comment says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from app.main import create_app
from app.ops.http import UNMATCHED
from tests.helpers import configure, make_key

DOCS = Path(__file__).resolve().parents[2] / "docs" / "monitoring"
ALERTS, DASHBOARD = DOCS / "alerts.yml", DOCS / "grafana-dashboard.json"
PROMETHEUS = DOCS / "prometheus.yml"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_NAME = re.compile(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*+(?!\s*\()")  # *+: a whole name or none
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS |= {"inf", "nan", "atan2"}
_SELECTOR = re.compile(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^{}]*\})")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: what is left once strings, label matchers, ranges, grouping
    label lists, functions (a name before "("), keywords, numbers and durations and Grafana's $variables are gone."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {name for name in _NAME.findall(text) if name.lower() not in _KEYWORDS}


def grouping_labels(expr: str) -> set[str]:
    labels = set()
    for group in _GROUPING.findall(_STRING.sub('""', expr)):
        labels |= {label.strip() for label in group.split(",") if label.strip()}
    return labels


def selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Each ``name{...}`` with its matchers (label, operator, value)."""
    return [(name, _MATCHER.findall(block)) for name, block in _SELECTOR.findall(expr)]


def test_the_extraction_finds_metric_names_and_nothing_else():
    expr = (
        'histogram_quantile(0.95, sum by (le, route) (rate(a_bucket{route=~"/x|/y", status!="5.."}[5m] offset 1h)))'
        " > 1e3 and on (queue) (b_total == 0) or vector(1) unless c / ignoring(kind) d[$__rate_interval:1m]"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d"}
    assert grouping_labels(expr) == {"le", "route", "queue", "kind"}
    assert selectors(expr) == [("a_bucket", [("route", "=~", "/x|/y"), ("status", "!=", "5..")])]
    assert metric_names("lethe_overdue_requests > 0") == {"lethe_overdue_requests"}


def alert_expressions() -> list[str]:
    rules = [rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]]
    assert len({rule["alert"] for rule in rules}) == len(rules) >= 6
    for rule in rules:
        assert rule["labels"]["severity"] in ("critical", "warning") and rule["annotations"]["summary"], rule
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule
    return [rule["expr"] for rule in rules]


def dashboard_expressions() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    found: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(dashboard)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(set(ids)) == len(ids) and len(found) >= 10
    return found


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Sample name → the label names and the values each takes, scraped in-process after one request (so the
    HTTP metrics have series), and the app's route templates."""
    configure(tmp_path_factory.mktemp("monitoring") / "home")
    app = create_app(run_background=False)
    with TestClient(app, headers={"authorization": f"Bearer {make_key(['metrics:read'])}"}) as client:
        assert client.get("/healthz").status_code == 200
        text = client.get("/metrics").text
    series: dict[str, dict[str, set[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = series.setdefault(sample.name, {})
            for label, value in sample.labels.items():
                labels.setdefault(label, set()).add(value)
    routes = {getattr(route, "path_format", None) for route in _routes(app)} - {None}
    return series, routes


def _routes(app):
    """Every route of the app, through FastAPI's included routers."""
    for route in app.routes:
        inner = getattr(route, "effective_route_contexts", None)
        if inner is not None:
            yield from inner()
        else:
            yield route


@pytest.mark.parametrize("source", ["alerts", "dashboard"])
def test_every_metric_the_monitoring_docs_query_is_exported(source, exported):
    series, routes = exported
    expressions = alert_expressions() if source == "alerts" else dashboard_expressions()
    assert "/v1/deletion-requests" in routes and "/v1/models/{model_id}" in routes  # the route listing works
    missing: dict[str, set[str]] = {}
    for expr in expressions:
        names = metric_names(expr)
        assert names, expr
        missing.update({expr: names - set(series)} if names - set(series) else {})
        if names - set(series):
            continue
        carried = set().union(*(series[name] for name in names))
        assert grouping_labels(expr) <= carried, (expr, grouping_labels(expr) - carried)
        for name, matchers in selectors(expr):
            for label, operator, value in matchers:
                assert label in series[name], (expr, name, label)
                alternatives = value.split("|") if operator in ("=~", "!~") else [value]
                if label == "route":
                    assert all(v in routes or v == UNMATCHED for v in alternatives), (expr, value)
                elif not name.startswith("lethe_http_") and all(re.fullmatch(r"[\w-]+", v) for v in alternatives):
                    # the database's metrics name every value from the start: a value they lack is a typo
                    assert set(alternatives) <= series[name][label], (expr, label, value)
    assert not missing, missing


def test_the_scrape_configuration_sends_a_key_that_may_read_the_metrics(tmp_path):
    """docs/monitoring/prometheus.yml: Prometheus scrapes /metrics with the bearer key from its credentials file, and
    a key made with the command its comment gives (``lethe keys create ... --scope metrics:read``) is let in — the
    scrape, done the way Prometheus does it from this file, answers 200; without the key, 401."""
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert config["rule_files"] == [ALERTS.name]
    (job,) = config["scrape_configs"]
    authorization = job["authorization"]
    assert authorization["type"] == "Bearer" and authorization["credentials_file"]
    command = next(line for line in PROMETHEUS.read_text().splitlines() if "lethe keys create" in line)
    scopes = re.findall(r"--scope (\S+)", command)
    configure(tmp_path / "home")
    credentials = tmp_path / "lethe-metrics.key"
    credentials.write_text(make_key(scopes) + "\n")  # Prometheus strips the file's trailing newline
    with TestClient(create_app(run_background=False)) as client:
        path = job.get("metrics_path", "/metrics")
        header = f"{authorization['type']} {credentials.read_text().strip()}"
        scraped = client.get(path, headers={"authorization": header})
        assert scraped.status_code == 200 and "lethe_deletion_requests" in scraped.text
        assert client.get(path).status_code == 401
