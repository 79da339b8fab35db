"""Checks of a caption-file federation at registration (issue 11 item 6): every bad input is a 422 problem naming the
field and, for rows of the files, the entry or line — never the files' contents (they are server-side files the
caller may not otherwise read).

Torch-free on purpose (the API never loads ML code): the worker reads the same files again with
app.ml.data.captions (``federation_from_spec``) and decodes the images with the backbone's own transform. The files'
sha256 are kept in the model's spec so that the job, and every later deletion, refuses files changed since they were
checked here.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any

from app.config import get_settings
from app.problems import Problem
from app.registry.schemas import CaptionFilesFederationIn

CLIENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
"""What a client id may be (also the form of ``scope.client_id`` in a deletion request and of a round key's
client)."""


def _invalid(kind: str, title: str, field: str, detail: str, **extra: Any) -> Problem:
    return Problem(422, kind, title, detail, field=field, **extra)


def _allowed(path: str, field: str, want: str) -> Path:
    """``path`` resolved under one of the data roots (LETHE_DATA_ROOTS), existing as a file or a folder."""
    from app.registry.service import is_service_file

    settings = get_settings()
    resolved = Path(path).expanduser().resolve()
    roots = [Path(r).expanduser().resolve() for r in settings.data_roots]
    if not roots:
        raise _invalid(
            "dataset-path-not-allowed",
            "Data cannot be read from server paths here",
            field,
            "No data roots are configured (LETHE_DATA_ROOTS).",
        )
    if not any(resolved.is_relative_to(root) for root in roots) or is_service_file(resolved):
        raise _invalid(
            "dataset-path-not-allowed",
            "The path is outside the allowed roots",
            field,
            f"{field} must lie under one of {[str(r) for r in roots]} (LETHE_DATA_ROOTS).",
        )
    if want == "file" and not resolved.is_file():
        raise _invalid("dataset-not-found", "The path is not a readable file", field, f"{field}: {path}")
    if want == "dir" and not resolved.is_dir():
        raise _invalid("dataset-not-found", "The path is not a folder", field, f"{field}: {path}")
    return resolved


def _read(path: Path, field: str) -> bytes:
    limit = get_settings().max_upload_bytes
    if path.stat().st_size > limit:
        raise Problem(413, "payload-too-large", "The file is larger than the limit", f"{field}: limit {limit} bytes")
    return path.read_bytes()


def _entries(raw: bytes) -> list[dict[str, Any]]:
    """The Karpathy file's image entries, each checked for the fields the loader reads."""
    bad = "invalid-captions", "The caption file is not in the Karpathy layout", "captions_path"
    try:
        payload = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _invalid(*bad, "the file is not JSON (nothing of it is shown)") from None
    images = payload.get("images") if isinstance(payload, dict) else None
    if not isinstance(images, list) or not images:
        raise _invalid(*bad, 'expected an object with a non-empty "images" list')
    for i, entry in enumerate(images):
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("filename"), str)
            and entry["filename"]
            and isinstance(entry.get("split"), str)
            and isinstance(entry.get("filepath", ""), str)
            and isinstance(entry.get("imgid", 0), int | str)
            and isinstance(entry.get("sentences"), list)
            and entry["sentences"]
            and all(
                isinstance(s, dict)
                and (
                    (isinstance(s.get("raw"), str) and s["raw"].strip())
                    or (isinstance(s.get("tokens"), list) and all(isinstance(t, str) for t in s["tokens"]))
                )
                for s in entry["sentences"]
            )
        )
        if not ok:
            raise _invalid(
                *bad,
                f'images[{i}]: each entry needs "filename", "split" and non-empty "sentences" with "raw" text',
                entry=i,
            )
    return images


def _assignment(raw: bytes, path: Path) -> list[tuple[int, str, str]]:
    """(line or position, image key, client) rows of the assignment file."""
    bad = "invalid-assignment", "The client assignment cannot be read", "assignment_path"
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise _invalid(*bad, "the file is not UTF-8") from None
    if path.suffix.lower() == ".json":
        try:
            payload = json.loads(text)
        except json.JSONDecodeError:
            raise _invalid(*bad, "the file is not JSON (nothing of it is shown)") from None
        if not isinstance(payload, dict) or not all(isinstance(v, str | int) for v in payload.values()):
            raise _invalid(*bad, 'expected a JSON object {"<image>": "<client>"}')
        return [(i + 1, str(k).strip(), str(v).strip()) for i, (k, v) in enumerate(payload.items())]
    reader = csv.DictReader(io.StringIO(text))
    if not reader.fieldnames or not {"image", "client"} <= {f.strip() for f in reader.fieldnames}:
        raise _invalid(*bad, "a CSV assignment needs the header image,client")
    rows = []
    for row in reader:
        row = {(k or "").strip(): v for k, v in row.items()}
        image, client = row.get("image"), row.get("client")
        if not isinstance(image, str) or not isinstance(client, str):
            raise _invalid(*bad, f"line {reader.line_num}: a row needs an image and a client", line=reader.line_num)
        rows.append((reader.line_num, image.strip(), client.strip()))
    if not rows:
        raise _invalid(*bad, "the assignment has no rows")
    return rows


def check_caption_files(data: CaptionFilesFederationIn) -> dict[str, Any]:
    """Every check a caption-file federation needs before its version-1 job may run; returns what the model's spec
    keeps: the clients, the counts and the sha256 of the caption and assignment files."""
    if data.train_split == data.test_split:
        raise _invalid(
            "invalid-splits", "The training and test splits must differ", "test_split", "the test split is held out"
        )
    captions_path = _allowed(data.captions_path, "captions_path", "file")
    root = _allowed(data.image_root, "image_root", "dir")
    assignment_path = _allowed(data.assignment_path, "assignment_path", "file")
    captions_raw, assignment_raw = _read(captions_path, "captions_path"), _read(assignment_path, "assignment_path")
    entries = _entries(captions_raw)

    def split_of(entry: dict[str, Any]) -> str:
        return "train" if entry["split"] == "restval" else entry["split"]

    train_keys: dict[str, int] = {}
    n_train = n_test = 0
    for i, entry in enumerate(entries):
        split = split_of(entry)
        if split not in (data.train_split, data.test_split):
            continue
        image = (root / entry.get("filepath", "") / entry["filename"]).resolve()
        if not image.is_relative_to(root):
            raise _invalid(
                "image-outside-root",
                "An image of the caption file lies outside the image folder",
                "captions_path",
                f"images[{i}]: its path leaves image_root",
                entry=i,
            )
        if not image.is_file():
            raise _invalid(
                "image-not-found", "An image of the caption file is missing", "captions_path", f"images[{i}]", entry=i
            )
        if split == data.train_split:
            n_train += 1
            for key in (str(entry.get("imgid", "")), entry["filename"]):
                if key:
                    train_keys.setdefault(key, i)
        elif data.max_test_images is None or n_test < data.max_test_images:
            n_test += 1
    if n_test == 0:
        raise _invalid(
            "no-test-images",
            "The caption file has no test images",
            "captions_path",
            f"the {data.test_split!r} split is the shared held-out set every deletion is measured on",
        )

    declared = set(data.clients) if data.clients is not None else None
    seen_images: dict[int, str] = {}
    for line, key, client in _assignment(assignment_raw, assignment_path):
        if key not in train_keys:
            raise _invalid(
                "unknown-image",
                "The assignment names an image that is not a training image of the caption file",
                "assignment_path",
                f"line {line}: no {data.train_split!r} entry has that imgid or filename",
                line=line,
            )
        if not CLIENT_ID.match(client):
            raise _invalid(
                "invalid-client-id",
                "A client id is not valid",
                "assignment_path",
                f"line {line}: client ids are 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit",
                line=line,
            )
        if declared is not None and client not in declared:
            raise _invalid(
                "unknown-client",
                "The assignment names a client that is not in `data.clients`",
                "assignment_path",
                f"line {line}: the client is not one of the declared clients",
                line=line,
            )
        entry = train_keys[key]
        if seen_images.setdefault(entry, client) != client:
            raise _invalid(
                "conflicting-assignment",
                "An image is assigned to two clients",
                "assignment_path",
                f"line {line}: images[{entry}] already belongs to another client",
                line=line,
            )
    per_client: dict[str, int] = {}
    for client in seen_images.values():
        per_client[client] = per_client.get(client, 0) + 1
    if declared is not None and (empty := sorted(declared - set(per_client))):
        raise _invalid(
            "client-without-data",
            "A declared client holds no training image",
            "data.clients",
            f"no image is assigned to {empty}",
            clients=empty,
        )
    if len(per_client) < 2:
        raise _invalid(
            "too-few-clients",
            "A federation needs at least two clients holding data",
            "assignment_path",
            f"{len(per_client)} client(s) hold training images",
        )
    return {
        "clients": sorted(per_client),
        "train_images": n_train,
        "assigned_images": len(seen_images),
        "test_images": n_test,
        "images_per_client": dict(sorted(per_client.items())),
        "captions_sha256": hashlib.sha256(captions_raw).hexdigest(),
        "assignment_sha256": hashlib.sha256(assignment_raw).hexdigest(),
    }
