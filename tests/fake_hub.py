"""A local stand-in for the Hugging Face Hub's download API, for tests (the real Hub is not
reachable here): what huggingface_hub's ``snapshot_download`` asks of it (repo info, the file
tree, each file's resolve URL), served from memory, with an optional token the requests must
carry (a gated repo). ``seen`` records (method, path, Authorization) of every request."""
from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

SHA = "0123456789abcdef0123456789abcdef01234567"


class FakeHub:
    def __init__(self, repos: dict[str, dict[str, bytes]], token: str | None = None):
        self.repos, self.token, self.seen = repos, token, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _auth_ok(self) -> bool:
                hub.seen.append((self.command, self.path, self.headers.get("authorization")))
                return hub.token is None or self.headers.get("authorization") == f"Bearer {hub.token}"

            def _send(self, code: int, body: bytes = b"", headers: dict | None = None, head=False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _route(self, head: bool):
                path = unquote(urlparse(self.path).path)
                if not self._auth_ok():
                    return self._send(401, b'{"error": "Access to this model is restricted"}',
                                      {"X-Error-Code": "GatedRepo", "Content-Type": "application/json"}, head)
                if path.startswith("/api/models/"):
                    rest = path[len("/api/models/"):]
                    for repo, files in hub.repos.items():
                        if rest.startswith(repo + "/revision/"):
                            body = json.dumps({"id": repo, "sha": SHA, "siblings": [{"rfilename": f} for f in files]})
                            return self._send(200, body.encode(), {"Content-Type": "application/json"}, head)
                        if rest.startswith(repo + "/tree/"):
                            body = json.dumps([{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                                               for f, b in files.items()])
                            return self._send(200, body.encode(), {"Content-Type": "application/json"}, head)
                    return self._send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, head)
                for repo, files in hub.repos.items():
                    prefix = f"/{repo}/resolve/"
                    if path.startswith(prefix):
                        fname = path[len(prefix):].split("/", 1)[1]
                        if fname not in files:
                            return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, head)
                        b = files[fname]
                        return self._send(200, b, {"X-Repo-Commit": SHA, "ETag": f'"{hashlib.sha1(b).hexdigest()}"'}, head)
                return self._send(404, b"", {"X-Error-Code": "RepoNotFound"}, head)

            def do_GET(self):
                self._route(False)

            def do_HEAD(self):
                self._route(True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
