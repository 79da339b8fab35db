"""Pure helpers for the dashboard's templates: wording of deadlines, a report's key figures, the lineage drawing.

Nothing here reads the database; the router hands in what the domain services returned.
"""

from __future__ import annotations

from typing import Any

from markupsafe import Markup, escape

ACTIVE_STATUSES = ("received", "queued", "running", "verifying")
ANSWERED_STATUSES = ("certified", "rejected", "cancelled")  # app/requests/tables.py (the dashboard reads no tables)


def time_left(days_left: float | None, overdue: bool, status: str, answered_late: bool = False) -> str:
    """The deadline as a person reads it: time left, OVERDUE while the erasure is still owed (a failed or
    pending-approval request too), answered (late) once it is not."""
    if days_left is None:
        return "—"
    if status in ANSWERED_STATUSES:
        return "answered late" if answered_late else "answered"
    if overdue:
        return f"OVERDUE by {_span(-days_left)}"
    return f"{_span(days_left)} left"


def _span(days: float) -> str:
    if days >= 1:
        return f"{days:.0f} d" if days >= 10 else f"{days:.1f} d"
    hours = days * 24
    return f"{hours:.0f} h" if hours >= 1 else f"{max(hours * 60, 0):.0f} min"


def request_json(out: Any) -> dict[str, Any]:
    """What the polling script needs about one request."""
    return {
        "id": out.id,
        "status": out.status,
        "progress": round(float(out.progress or 0.0), 4),
        "message": out.message or "",
        "active": out.status in ACTIVE_STATUSES,
        "overdue": bool(out.overdue),
        "time_left": time_left(out.days_left, out.overdue, out.status, out.answered_late),
    }


def report_figures(report: dict[str, Any]) -> list[tuple[str, str]]:
    """The handful of figures an officer reads first, as (label, value) rows."""
    rows: list[tuple[str, str]] = []
    attack = report.get("attack") or {}
    if attack:
        name, mode, shadows = attack.get("name", "?"), attack.get("mode", ""), attack.get("n_shadows")
        rows.append(("attack", f"{name} ({mode}), {shadows} shadows"))
    rows.append(("forget rows audited", str(report.get("n_forget", "—"))))
    rows.append(("non-members", str(report.get("n_nonmembers", "—"))))
    models = report.get("models") or {}
    for name in ("original", "unlearned", "retrained"):
        lira = (models.get(name) or {}).get("lira") or {}
        if lira:
            tprs = ", ".join(f"TPR@{k}={v:.3f}" for k, v in (lira.get("tpr_at_fpr") or {}).items())
            auc = lira.get("auc")
            rows.append((f"LiRA on {name}", f"{tprs}; AUC {auc:.3f}" if isinstance(auc, float) else tprs))
    utility = report.get("utility") or {}
    accuracy = utility.get("accuracy") or {}
    if accuracy:
        rows.append(("test accuracy", ", ".join(f"{k} {v:.3f}" for k, v in accuracy.items() if isinstance(v, float))))
    if "informative" in report:
        rows.append(("audit power", ("informative" if report["informative"] else "uninformative")
                     + (f" — {report['informative_detail']}" if report.get("informative_detail") else "")))  # fmt: skip
    return rows


def lineage_svg(versions: list[dict[str, Any]]) -> Markup:
    """The version tree as inline SVG, drawn here (no script, no external library): one box per version, an arrow
    from each parent; retired versions are struck grey."""
    if not versions:
        return Markup("")
    by_id = {v["id"]: v for v in versions}
    depth: dict[str, int] = {}
    for v in versions:  # versions come in number order: a parent precedes its children
        depth[v["id"]] = depth.get(v["parent_id"], -1) + 1 if v["parent_id"] in by_id else 0
    rows: dict[int, int] = {}
    place: dict[str, tuple[int, int]] = {}
    for v in versions:
        d = depth[v["id"]]
        place[v["id"]] = (d, rows.get(d, 0))
        rows[d] = rows.get(d, 0) + 1
    box_w, box_h, gap_x, gap_y = 150, 46, 40, 14
    width = (max(depth.values()) + 1) * (box_w + gap_x)
    height = max(rows.values()) * (box_h + gap_y) + gap_y
    parts = [
        f'<svg class="lineage" role="img" aria-label="version lineage" xmlns="http://www.w3.org/2000/svg" '
        f'width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
        '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="7" refY="4" orient="auto">'
        '<path d="M0,0 L8,4 L0,8 z" fill="#667"/></marker></defs>',
    ]

    def corner(version_id: str) -> tuple[int, int]:
        col, row = place[version_id]
        return col * (box_w + gap_x) + 4, row * (box_h + gap_y) + gap_y

    for v in versions:
        if v["parent_id"] in place:
            px, py = corner(v["parent_id"])
            x, y = corner(v["id"])
            parts.append(
                f'<line x1="{px + box_w}" y1="{py + box_h / 2}" x2="{x - 2}" y2="{y + box_h / 2}" '
                'stroke="#667" stroke-width="1.5" marker-end="url(#arrow)"/>'
            )
    for v in versions:
        x, y = corner(v["id"])
        retired = v.get("retired_at") is not None
        fill, stroke = ("#eee", "#aaa") if retired else ("#e8f1fb", "#3b6ea5")
        if v.get("current"):
            fill, stroke = "#e6f6ea", "#2e8540"
        label = f"v{v['number']} · {v['method']}"
        sub = "retired" if retired else ("current" if v.get("current") else v["digest"][:12])
        strike = ' text-decoration="line-through"' if retired else ""
        parts.append(
            f'<g class="version{" retired" if retired else ""}"><rect x="{x}" y="{y}" width="{box_w}" '
            f'height="{box_h}" rx="6" fill="{fill}" stroke="{stroke}"/>'
            f'<text x="{x + 8}" y="{y + 19}" font-size="13" font-weight="600"'
            f"{strike}>{escape(label)}</text>"
            f'<text x="{x + 8}" y="{y + 36}" font-size="11" fill="#555">{escape(sub)}</text></g>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))


def served_by(version: dict[str, Any]) -> list[str]:
    """The deletion requests a version was made for: a batch's every request (its metrics), or its one request."""
    served = (version.get("metrics") or {}).get("requests")
    return list(served) if served else ([version["request_id"]] if version.get("request_id") else [])


def carried_deletions(versions: list[dict[str, Any]]) -> dict[str, list[str]]:
    """For each version, the deletion requests it embodies: its own and every ancestor's (a version made without
    rows keeps them out of all its descendants)."""
    by_id = {v["id"]: v for v in versions}
    out: dict[str, list[str]] = {}
    for v in versions:
        chain, seen, cur = [], set(), v
        while cur is not None and cur["id"] not in seen:
            seen.add(cur["id"])
            chain += list(reversed(served_by(cur)))
            cur = by_id.get(cur.get("parent_id"))
        out[v["id"]] = list(reversed(chain))
    return out


def flat_info(info: dict[str, Any] | None) -> list[tuple[str, str]]:
    """A method's preparation record as (key, value) rows, nested figures one level deep (``validation.median``)."""
    rows: list[tuple[str, str]] = []

    def text(value: Any) -> str:
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    for key, value in (info or {}).items():
        if isinstance(value, dict):
            rows.extend((f"{key}.{k}", text(v)) for k, v in value.items() if not isinstance(v, dict | list))
        elif isinstance(value, list):
            if len(value) <= 6 and all(not isinstance(v, dict | list) for v in value):
                rows.append((key, ", ".join(text(v) for v in value)))
        else:
            rows.append((key, text(value)))
    return rows


def actor_names(keys: list[Any]) -> dict[str, str]:
    """``api-key:<id>`` → the key's name, as an officer knows it (its public prefix added where two keys share a
    name). ``keys``: the auth service's key records (id, name, prefix); revoked keys keep their names."""
    keys = list(keys)
    counts: dict[str, int] = {}
    for key in keys:
        counts[key.name] = counts.get(key.name, 0) + 1
    return {
        f"api-key:{key.id}": key.name if counts[key.name] == 1 else f"{key.name} (lethe_{key.prefix}_…)" for key in keys
    }


def actor_label(actor: str | None, names: dict[str, str]) -> str:
    """An audit actor as a person reads it: an API key by its name, anything else (``dispatcher``, ``lethe``, a
    worker, the CLI) as recorded; a key the service no longer knows keeps its id."""
    if not actor:
        return "—"
    return names.get(actor, actor) if isinstance(names, dict) else actor


def version_accuracy(metrics: dict[str, Any] | None) -> dict[str, float | None]:
    """A tabular version's accuracy on the held-out rows and on the rows it was trained on (the retained rows once a
    deletion made it); None where the version measured none (a federated CLIP model reports retrieval instead)."""
    metrics = metrics or {}
    after = metrics.get("after") if isinstance(metrics.get("after"), dict) else {}

    def number(value: Any) -> float | None:
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None

    return {
        "holdout": number(after.get("accuracy_holdout", metrics.get("accuracy_holdout"))),
        "trained": number(after.get("accuracy_retain", metrics.get("accuracy_train"))),
    }


def _seconds(value: float) -> str:
    if value >= 1:
        return f"{value:.2f} s"
    if value >= 1e-3:
        return f"{value * 1e3:.1f} ms"
    return f"{value * 1e6:.0f} µs"


def method_quality(info: dict[str, Any] | None, max_param_ratio: float) -> dict[str, str] | None:
    """A prepared method's validated quality in the few figures ``auto`` decides on (measured at preparation on real
    deletions against exact retrains), and whether its param_ratio lies within ``auto``'s bound (the setting
    ``auto_max_param_ratio``); None when it was prepared without a validation."""
    validation = (info or {}).get("validation")
    if not isinstance(validation, dict) or not validation:
        return None
    ratio, gap = validation.get("param_ratio_median"), validation.get("acc_gap_pts_median")
    step, retrain = validation.get("method_seconds_median"), validation.get("retrain_seconds_median")
    deletions = validation.get("deletions")
    out = {
        "deletions": f"{deletions}" if deletions is not None else "—",
        "param_ratio": f"{ratio:.3g}" if isinstance(ratio, int | float) else "—",
        "acc_gap": f"{gap:+.2f} pts" if isinstance(gap, int | float) else "—",
        "time": _seconds(step) if isinstance(step, int | float) else "—",
        "retrain": _seconds(retrain) if isinstance(retrain, int | float) else "—",
    }
    if validation.get("equals_do_nothing"):
        out["bound"], out["within"] = "no: validated equal to doing nothing", "no"
    elif not isinstance(ratio, int | float) or not isinstance(step, int | float):
        out["bound"], out["within"] = "no: validation measured nothing", "no"
    elif ratio > max_param_ratio:
        out["bound"], out["within"] = f"no: {ratio:.3g} > {max_param_ratio:g}", "no"
    else:
        out["bound"], out["within"] = f"yes: {ratio:.3g} ≤ {max_param_ratio:g}", "yes"
    return out
