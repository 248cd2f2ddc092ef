"""A loopback HTTP server that answers the requests huggingface_hub makes for dataset files, so the real
download path (``HF_ENDPOINT=http://127.0.0.1:PORT``) is tested without the network.

Served, for each repository ``owner/name`` with files {path: bytes} at one commit sha:
* ``GET /api/datasets/<repo>[/revision/<rev>]``: ``{"id", "sha", "siblings": [{"rfilename"}]}``
  (``HfApi.dataset_info``: commit and file list);
* ``HEAD|GET /datasets/<repo>/resolve/<rev>/<path>``: the file, with the headers ``hf_hub_download`` reads
  (``X-Repo-Commit``, ``ETag``, ``Content-Length``).
``rev`` is ``main`` or the commit sha; anything else answers 404 with the hub's ``X-Error-Code``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

INFO = re.compile(r"^/api/datasets/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
RESOLVE = re.compile(r"^/datasets/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


class FakeHub:
    """``with FakeHub(repos) as hub:`` serves ``repos`` ({repo: {path: bytes}}) at ``hub.endpoint``;
    ``hub.sha[repo]`` is each repository's commit and ``hub.requests`` the (method, path) pairs it answered."""

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.sha = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.requests: list[tuple[str, str]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> "FakeHub":
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output clean
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, body: bool) -> None:
                path = unquote(urlsplit(self.path).path)
                hub.requests.append((self.command, path))
                info, resolve = INFO.match(path), RESOLVE.match(path)
                match = info or resolve
                repo = match["repo"] if match else None
                if repo not in hub.repos:
                    return self._error(404, "RepoNotFound")
                sha = hub.sha[repo]
                if (match["rev"] or "main") not in ("main", sha):
                    return self._error(404, "RevisionNotFound")
                if info:
                    files = [{"rfilename": name} for name in sorted(hub.repos[repo])]
                    return self._send(json.dumps({"id": repo, "sha": sha, "siblings": files}).encode(), body,
                                      {"Content-Type": "application/json"})
                data = hub.repos[repo].get(resolve["path"])
                if data is None:
                    return self._error(404, "EntryNotFound")
                etag = hashlib.sha256(data).hexdigest()
                self._send(data, body, {"X-Repo-Commit": sha, "ETag": f'"{etag}"'})

            def _error(self, status: int, code: str) -> None:
                self._send(b"{}", True, {"X-Error-Code": code, "Content-Type": "application/json"}, status)

            def _send(self, data: bytes, body: bool, headers: dict, status: int = 200) -> None:
                self.send_response(status)
                for key, value in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(key, value)
                self.end_headers()
                if body:
                    self.wfile.write(data)

        return Handler
