"""Artifact store: content-addressed blobs (sha256) on any fsspec URL (a local folder, file://, s3://, memory://).

Writing the same bytes twice is a no-op, so a job that runs again after a crash reuses what it already stored.
Model parameters are stored as safetensors; the digest of that file is the model version's identity.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from typing import Any

import fsspec

from app.config import get_settings


def _is_local(fs) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


class ArtifactNotFoundError(KeyError):
    pass


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
        """Store ``data`` under its sha256 and return the hex digest (atomic: write to a temp name, then rename)."""
        digest = hashlib.sha256(data).hexdigest()
        path = self._path(digest)
        if not self.fs.exists(path):
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
            tmp = f"{path}.tmp-{hashlib.sha256(str(id(data)).encode()).hexdigest()[:8]}"
            with self.fs.open(tmp, "wb") as handle:
                handle.write(data)
            try:
                self.fs.mv(tmp, path)
            except FileExistsError:
                self.fs.rm(tmp)
        return digest

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

    def put_json(self, obj: Any) -> str:
        return self.put_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())

    def get_json(self, digest: str) -> Any:
        return json.loads(self.get_bytes(digest))


@lru_cache
def get_store() -> ArtifactStore:
    return ArtifactStore(get_settings().resolved_artifact_url)
