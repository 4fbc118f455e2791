"""A LOCAL STAND-IN for the Hugging Face Hub's HTTP endpoints, for the push tests.

It is not the Hub and nothing here contacts it. It serves, on 127.0.0.1, just what
`huggingface_hub`'s `create_repo`, `create_branch`, `upload_folder` and `model_info` call
(as of huggingface_hub 2.4, with Xet disabled: HF_HUB_DISABLE_XET=1):

- POST /api/repos/create                          -> {"url"}; 409 if it exists
- POST /api/models/NS/NAME/branch/BRANCH          -> a branch made from main
- POST /api/validate-yaml                         -> the card's metadata parsed as YAML
- POST /api/models/NS/NAME/preupload/REV          -> "lfs" for binary suffixes, else "regular"
- POST /NS/NAME.git/info/lfs/objects/batch        -> a basic upload action to /lfs/OID
- PUT  /lfs/OID                                   -> the bytes, checked against OID (sha256)
- POST /api/models/NS/NAME/commit/REV             -> the NDJSON commit, recorded
- GET  /api/models/NS/NAME                        -> model info (card data) when set

Every request but the storage PUT (a presigned URL on the Hub) must carry `Authorization:
Bearer TOKEN`; another token gets 401, as the Hub's answer. `HubStandIn.commits` holds each
commit: repo, revision, message, {path: bytes}.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import yaml

LFS_SUFFIXES = (".safetensors", ".gguf", ".png", ".bin")


@dataclass
class Commit:
    repo: str
    revision: str
    message: str
    files: dict[str, bytes]


@dataclass
class HubStandIn:
    token: str = "hf_standin_token"
    user: str = "standin-user"
    repos: dict[str, dict] = field(default_factory=dict)  # id -> {"private", "branches"}
    commits: list[Commit] = field(default_factory=list)
    lfs: dict[str, bytes] = field(default_factory=dict)
    model_info: dict[str, dict] = field(default_factory=dict)  # id -> cardData
    requests: list[str] = field(default_factory=list)

    def __enter__(self) -> HubStandIn:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                standin.handle(self, "GET")

            def do_POST(self) -> None:
                standin.handle(self, "POST")

            def do_PUT(self) -> None:
                standin.handle(self, "PUT")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ---- one request ------------------------------------------------------------------
    def handle(self, h: BaseHTTPRequestHandler, method: str) -> None:
        path = h.path.split("?")[0]
        self.requests.append(f"{method} {path}")
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        presigned = method == "PUT" and path.startswith("/lfs/")  # storage URLs: no token
        if not presigned and h.headers.get("Authorization") != f"Bearer {self.token}":
            return _reply(h, 401, {"error": "Invalid credentials in Authorization header"})
        repo = r"/api/models/([\w.-]+/[\w.-]+)"
        routes = [
            ("POST", r"/api/repos/create", self.create),
            ("POST", r"/api/validate-yaml", self.validate_yaml),
            ("POST", repo + r"/branch/([^/]+)", self.branch),
            ("POST", repo + r"/preupload/([^/]+)", self.preupload),
            ("POST", r"/([\w.-]+/[\w.-]+)\.git/info/lfs/objects/batch", self.lfs_batch),
            ("PUT", r"/lfs/([0-9a-f]{64})", self.lfs_put),
            ("POST", repo + r"/commit/([^/]+)", self.commit),
            ("GET", repo, self.info),
        ]
        for m, pattern, fn in routes:
            match = re.fullmatch(pattern, path)
            if m == method and match:
                return fn(h, body, *match.groups())
        _reply(h, 404, {"error": f"the stand-in does not serve {method} {path}"})

    def create(self, h, body: bytes) -> None:
        payload = json.loads(body)
        repo = f"{payload.get('organization') or self.user}/{payload['name']}"
        if not re.fullmatch(r"[\w.-]{1,96}/[\w.-]{1,96}", repo):
            return _reply(h, 400, {"error": "Invalid repo name"})
        if repo in self.repos:
            # The Hub's 409 carries the url too: create_repo(exist_ok=True) returns it.
            return _reply(h, 409, {"error": "You already created this model repo",
                                   "url": f"{self.url}/{repo}"})  # fmt: skip
        private = payload.get("private") or payload.get("visibility") == "private"
        self.repos[repo] = {"private": bool(private), "branches": {"main"}}
        _reply(h, 200, {"url": f"{self.url}/{repo}"})

    def validate_yaml(self, h, body: bytes) -> None:
        content = json.loads(body)["content"]
        m = re.match(r"---\n(.*?)\n---\n", content, re.S)
        try:
            yaml.safe_load(m.group(1) if m else "")
        except yaml.YAMLError as e:
            return _reply(h, 400, {"errors": [{"message": str(e)}]})
        _reply(h, 200, {"errors": [], "warnings": []})

    def branch(self, h, body: bytes, repo: str, name: str) -> None:
        if repo not in self.repos:
            return _reply(h, 404, {"error": "Repository not found"})
        if name in self.repos[repo]["branches"]:
            return _reply(h, 409, {"error": "Reference already exists"})
        self.repos[repo]["branches"].add(name)
        _reply(h, 200, {})

    def preupload(self, h, body: bytes, repo: str, revision: str) -> None:
        if repo not in self.repos:
            return _reply(h, 404, {"error": "Repository not found"})
        files = [{"path": f["path"], "shouldIgnore": False, "oid": None,
                  "uploadMode": "lfs" if f["path"].endswith(LFS_SUFFIXES) else "regular"}
                 for f in json.loads(body)["files"]]  # fmt: skip
        _reply(h, 200, {"files": files, "commitOid": "0" * 40})

    def lfs_batch(self, h, body: bytes, repo: str) -> None:
        objects = [{"oid": o["oid"], "size": o["size"],
                    "actions": {"upload": {"href": f"{self.url}/lfs/{o['oid']}"}}}
                   for o in json.loads(body)["objects"]]  # fmt: skip
        _reply(h, 200, {"transfer": "basic", "objects": objects})

    def lfs_put(self, h, body: bytes, oid: str) -> None:
        if hashlib.sha256(body).hexdigest() != oid:
            return _reply(h, 400, {"error": "sha256 mismatch"})
        self.lfs[oid] = body
        _reply(h, 200, {})

    def commit(self, h, body: bytes, repo: str, revision: str) -> None:
        if repo not in self.repos or revision not in self.repos[repo]["branches"]:
            return _reply(h, 404, {"error": f"Revision Not Found: {revision}"})
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        files, message = {}, ""
        for line in lines:
            key, value = line["key"], line["value"]
            if key == "header":
                message = value["summary"]
            elif key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                if value["oid"] not in self.lfs:
                    return _reply(h, 422, {"error": f"LFS object {value['oid']} not uploaded"})
                files[value["path"]] = self.lfs[value["oid"]]
        self.commits.append(Commit(repo, revision, message, files))
        oid = hashlib.sha1(body).hexdigest()
        _reply(h, 200, {"commitUrl": f"{self.url}/{repo}/commit/{oid}", "commitOid": oid,
                        "pullRequestUrl": None})  # fmt: skip

    def info(self, h, body: bytes, repo: str) -> None:
        if repo not in self.model_info:
            return _reply(h, 404, {"error": "Repository not found"})
        _reply(h, 200, {"id": repo, "modelId": repo, "sha": "0" * 40, "private": False,
                        "cardData": self.model_info[repo], "siblings": []})  # fmt: skip


def _reply(h: BaseHTTPRequestHandler, status: int, payload: dict) -> None:
    data = json.dumps(payload).encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    if status >= 400 and "error" in payload:
        h.send_header("X-Error-Message", payload["error"])
    h.end_headers()
    h.wfile.write(data)
