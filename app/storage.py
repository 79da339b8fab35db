"""Artifact store: content-addressed blobs (sha256) on any fsspec URL (a local folder, file://, s3://, memory://).

Writing the same bytes twice is a no-op, so a job that runs again after a crash reuses what it already stored.
Model parameters are stored as safetensors; the digest of that file is the model version's identity.

A worker's attempt names each blob before writing it (``recording``: a write-ahead intent, app/jobs/blobs.py), so
whoever ends the attempt without publishing shreds exactly what it wrote; ``sweep`` removes what nothing references.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from functools import lru_cache
from typing import Any

import fsspec

from app.config import get_settings


def _is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


class ArtifactNotFoundError(KeyError):
    pass


TEMP_MARK = ".tmp-"
"""Part of a temp file's name (``<digest>.tmp-<random>``): renamed to the digest once written, or removed."""

_BEFORE_WRITE: ContextVar[Callable[[str], None] | None] = ContextVar("lethe_before_write", default=None)


@contextmanager
def recording(before_write: Callable[[str], None]) -> Iterator[None]:
    """Within the block (this thread), every ``put_bytes`` first calls ``before_write(digest)``, before any byte
    reaches the store: a worker's attempt records its write-ahead intent there (app/jobs/blobs.py)."""
    token = _BEFORE_WRITE.set(before_write)
    try:
        yield
    finally:
        _BEFORE_WRITE.reset(token)


class ArtifactStore:
    def __init__(self, url: str):
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.url = url
        if _is_local(self.fs) and not os.path.exists(self.root):
            # the store holds every data set and model: owner only (files below inherit the folder's protection)
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            os.chmod(self.root, 0o700)

    def _path(self, digest: str) -> str:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"not a sha256 digest: {digest!r}")
        return f"{self.root}/sha256/{digest[:2]}/{digest}"

    def put_bytes(self, data: bytes) -> str:
        """Store ``data`` under its sha256 and return the hex digest (atomic: write to a temp name, then rename; a
        write that fails, a full disk say, removes its temp file). An attempt's intent is recorded first, even for
        bytes already stored: another attempt ending meanwhile must not shred what this one is about to publish."""
        digest = hashlib.sha256(data).hexdigest()
        before_write = _BEFORE_WRITE.get()
        if before_write is not None:
            before_write(digest)
        path = self._path(digest)
        if not self.fs.exists(path):
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            tmp = f"{path}{TEMP_MARK}{uuid.uuid4().hex[:12]}"
            try:
                with self.fs.open(tmp, "wb") as handle:
                    handle.write(data)
                self.fs.mv(tmp, path)
            except FileExistsError:
                self._remove(tmp)
            except BaseException:
                self._remove(tmp)
                raise
        return digest

    def _remove(self, path: str) -> None:
        with suppress(FileNotFoundError):
            self.fs.rm(path)

    def put_file(self, local_path: str) -> str:
        with open(local_path, "rb") as handle:
            return self.put_bytes(handle.read())

    def get_bytes(self, digest: str) -> bytes:
        path = self._path(digest)
        try:
            with self.fs.open(path, "rb") as handle:
                data = handle.read()
        except FileNotFoundError:
            raise ArtifactNotFoundError(digest) from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"artifact {digest} is corrupt (content does not match its digest)")
        return data

    def exists(self, digest: str) -> bool:
        return self.fs.exists(self._path(digest))

    def delete(self, digest: str) -> None:
        path = self._path(digest)
        if self.fs.exists(path):
            self.fs.rm(path)

    def listing(self) -> Iterator[tuple[str, float | None]]:
        """Every file under the store's blob folder (blobs and temp files) with its last change (epoch seconds;
        None where the file system does not say)."""
        base = f"{self.root}/sha256"
        if not self.fs.exists(base):
            return
        for path in self.fs.find(base):
            try:
                modified = self.fs.modified(path).timestamp()
            except (NotImplementedError, FileNotFoundError, AttributeError):
                modified = None
            yield path, modified

    def sweep(
        self, referenced: set[str], grace_seconds: float, listing: list[tuple[str, float | None]] | None = None
    ) -> dict[str, int]:
        """Delete every blob not in ``referenced`` and every temp file, each only once it is older than
        ``grace_seconds`` (a write in progress, or a blob whose row is about to commit, is younger); ``listing``: one
        taken before ``referenced`` was read. Returns counts."""
        cutoff, counts = time.time() - grace_seconds, {"blobs": 0, "temp_files": 0}
        for path, modified in listing if listing is not None else list(self.listing()):
            if modified is None or modified > cutoff:
                continue
            name = path.rsplit("/", 1)[-1]
            if TEMP_MARK in name:
                self._remove(path)
                counts["temp_files"] += 1
            elif name not in referenced and len(name) == 64 and all(c in "0123456789abcdef" for c in name):
                self.delete(name)  # the shredding an erasure uses
                counts["blobs"] += 1
        return counts

    def put_json(self, obj: Any) -> str:
        return self.put_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())

    def get_json(self, digest: str) -> Any:
        return json.loads(self.get_bytes(digest))


@lru_cache
def get_store() -> ArtifactStore:
    return ArtifactStore(get_settings().resolved_artifact_url)
