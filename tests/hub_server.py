"""A real HTTP server on an ephemeral port that answers like the Hugging Face hub's file API for
what huggingface_hub calls when sizing a model: model info with siblings
(/api/models/ORG/NAME[/revision/REV]), HEAD and GET of /ORG/NAME/resolve/REV/FILE with Range
requests, gated repos (401 + X-Error-Code: GatedRepo without the token) and missing ones (404 +
RepoNotFound). Every request is recorded, so tests can check that weights were only ranged.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_INFO = re.compile(r"^/api/models/([^/]+/[^/]+?)(?:/revision/([^/?]+))?(?:\?.*)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class Repo:
    files: dict[str, bytes]
    token: str | None = None  # gated: this bearer token is required for files


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    authorization: str | None


@dataclass
class HubServer:
    repos: dict[str, Repo] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    def add_folder(self, repo_id: str, folder: Path, token: str | None = None) -> None:
        """Serve every file of a saved model folder as a hub repo."""
        files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
        self.repos[repo_id] = Repo(files, token)

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> HubServer:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
                hub._answer(self, body=False)

            def do_GET(self) -> None:  # noqa: N802
                hub._answer(self, body=True)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    # ---- answers --------------------------------------------------------------------------
    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        self.requests.append(Request(h.command, h.path, h.headers.get("Range"),
                                     h.headers.get("Authorization")))
        if (m := _INFO.match(h.path)) is not None:
            return self._info(h, m.group(1), body)
        if (m := _RESOLVE.match(h.path)) is not None:
            return self._file(h, m.group(1), m.group(3), body)
        self._error(h, 404, "EntryNotFound")

    def _info(self, h: BaseHTTPRequestHandler, repo_id: str, body: bool) -> None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(h, 404, "RepoNotFound")
        info = {"id": repo_id, "modelId": repo_id, "sha": _sha(repo_id), "private": False,
                "gated": "manual" if repo.token else False,
                "siblings": [{"rfilename": name} for name in sorted(repo.files)]}
        self._send(h, 200, json.dumps(info).encode(), body, {"Content-Type": "application/json"})

    def _file(self, h: BaseHTTPRequestHandler, repo_id: str, name: str, body: bool) -> None:
        repo = self.repos.get(repo_id)
        if repo is None:
            return self._error(h, 404, "RepoNotFound")
        if repo.token and h.headers.get("Authorization") != f"Bearer {repo.token}":
            return self._error(h, 401, "GatedRepo")
        data = repo.files.get(name)
        if data is None:
            return self._error(h, 404, "EntryNotFound")
        headers = {"ETag": f'"{hashlib.sha1(data).hexdigest()}"', "X-Repo-Commit": _sha(repo_id),
                   "Accept-Ranges": "bytes"}
        match = _RANGE.match(h.headers.get("Range") or "")
        if match:
            start = int(match.group(1))
            end = min(int(match.group(2) or len(data) - 1), len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            return self._send(h, 206, data[start:end + 1], body, headers)
        self._send(h, 200, data, body, headers)

    @staticmethod
    def _error(h: BaseHTTPRequestHandler, status: int, code: str) -> None:
        HubServer._send(h, status, json.dumps({"error": code}).encode(), True,
                        {"X-Error-Code": code, "Content-Type": "application/json"})

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, body: bool,
              headers: dict[str, str]) -> None:
        h.send_response(status)
        for key, value in headers.items():
            h.send_header(key, value)
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if body:
            h.wfile.write(data)


def _sha(repo_id: str) -> str:
    return hashlib.sha1(repo_id.encode()).hexdigest()
