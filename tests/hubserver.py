"""A tiny Hugging Face Hub look-alike on 127.0.0.1 for tests: just the endpoints our push and download use.

Implements (model repos only): whoami-v2, repos/create, branch and tag create, refs, revision info, preupload,
LFS batch + basic PUT upload, ndjson commit, tree listing and resolve (HEAD/GET); a revision is a branch, a tag
or a commit sha. Files live on disk under `root/blobs`. Faults can be injected per endpoint: a status code, or a
dropped connection. tests/broken_server.py is a server that answers every request with HTTP 500.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".png", ".pt")
GITATTRIBUTES = b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"


def git_oid(data: bytes) -> str:
    """The git blob sha1 of `data` (what the Hub reports as a regular file's oid)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _pointer_oid(e: "Entry") -> str:
    return git_oid(f"version https://git-lfs.github.com/spec/v1\noid sha256:{e.sha256}\nsize {e.size}\n".encode())


@dataclass
class Entry:
    size: int
    oid: str  # git blob sha1 (regular) or sha256 (LFS), as the Hub reports
    sha256: str
    lfs: bool


@dataclass
class Repo:
    owner: str
    private: bool
    branches: dict[str, str] = field(default_factory=dict)  # branch -> commit oid
    tags: dict[str, str] = field(default_factory=dict)  # tag -> commit oid
    trees: dict[str, dict[str, Entry]] = field(default_factory=dict)  # commit oid -> path -> entry


@dataclass
class Fault:
    """Answer the `nth` matching request (1-based) and the `times - 1` after it with `status`, or drop it."""

    endpoint: str  # one of: create, branch, tag, preupload, batch, lfs, commit, tree, info, resolve
    nth: int = 1
    times: int = 1
    status: int = 503
    drop: bool = False  # close the connection without an answer
    after: bool = False  # with drop: do the work first, then drop (the client never hears it succeeded)
    seen: int = 0

    def fires(self) -> bool:
        self.seen += 1
        return self.nth <= self.seen < self.nth + self.times


class HubServer:
    """Run with `with HubServer(root, tokens={"tok": "alice"}) as hub:`; `hub.url` is the endpoint."""

    def __init__(self, root: Path, tokens: dict[str, str] | None = None):
        self.root = Path(root)
        (self.root / "blobs").mkdir(parents=True, exist_ok=True)
        self.tokens = dict(tokens or {})
        self.repos: dict[str, Repo] = {}
        self.faults: list[Fault] = []
        self.log: list[tuple[str, str, int]] = []  # (method, path, status)
        self.commit_log: list[tuple[str, str, list[str]]] = []  # (repo, branch, paths) per POST /commit
        self.lock = threading.RLock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=5)

    # ---- helpers for tests ----
    def commits(self, repo: str, branch: str | None = None) -> int:
        return sum(1 for r, b, _ in self.commit_log if r == repo and (branch is None or b == branch))

    def files(self, repo: str, branch: str) -> dict[str, bytes]:
        r = self.repos[repo]
        return {p: self._blob(e.sha256).read_bytes() for p, e in r.trees[r.branches[branch]].items()}

    def requests(self, endpoint_path_part: str) -> int:
        return sum(1 for _, p, _ in self.log if endpoint_path_part in p)

    def _blob(self, sha256: str) -> Path:
        return self.root / "blobs" / sha256

    def _store(self, data: bytes) -> str:
        sha = hashlib.sha256(data).hexdigest()
        self._blob(sha).write_bytes(data)
        return sha

    def _new_commit(self, repo: Repo, tree: dict[str, Entry]) -> str:
        oid = hashlib.sha1(uuid.uuid4().bytes).hexdigest()
        repo.trees[oid] = tree
        return oid

    def _fault(self, endpoint: str) -> Fault | None:
        with self.lock:
            for f in self.faults:
                if f.endpoint == endpoint and f.fires():
                    return f
        return None


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, **extra):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra


ROUTES = [
    ("POST", "create", re.compile(r"^/api/repos/create$")),
    ("GET", "whoami", re.compile(r"^/api/whoami-v2$")),
    ("POST", "branch", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/branch/(?P<rev>[^/]+)$")),
    ("POST", "tag", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tag/(?P<rev>[^/]+)$")),
    ("GET", "refs", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/refs$")),
    ("GET", "info", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")),
    ("POST", "preupload", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/preupload/(?P<rev>[^/]+)$")),
    ("POST", "commit", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/commit/(?P<rev>[^/]+)$")),
    ("GET", "tree", re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.*))?$")),
    ("POST", "validate", re.compile(r"^/api/validate-yaml$")),
    ("POST", "batch", re.compile(r"^/(?P<repo>[^/]+/[^/]+)\.git/info/lfs/objects/batch$")),
    ("PUT", "lfs", re.compile(r"^/lfs-upload/(?P<oid>[0-9a-f]{64})$")),
    ("GET", "resolve", re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
    ("HEAD", "resolve", re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")),
]


def _make_handler(hub: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"

        def log_message(self, *args) -> None:  # keep test output quiet
            pass

        def do_GET(self):
            self._dispatch("GET")

        def do_HEAD(self):
            self._dispatch("HEAD")

        def do_POST(self):
            self._dispatch("POST")

        def do_PUT(self):
            self._dispatch("PUT")

        def _dispatch(self, method: str) -> None:
            url = urlsplit(self.path)
            self.body = self._read_body()
            self.query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            for m, name, rx in ROUTES:
                match = rx.match(url.path)
                if m == method and match:
                    break
            else:
                return self._send(404, {"error": f"no route {method} {url.path}"}, url.path)
            args = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
            fault = hub._fault(name)
            if fault and fault.drop and not fault.after:
                return self._drop(method, url.path)
            if fault and not fault.drop:
                return self._send(fault.status, {"error": "injected fault"}, url.path)
            try:
                status, payload, headers = getattr(self, "h_" + name)(**args)
            except HubError as e:
                code = {"X-Error-Code": e.code} if e.code else {}
                return self._send(e.status, {"error": e.message, **e.extra}, url.path, {**code, "X-Error-Message": e.message})
            if fault and fault.drop:
                return self._drop(method, url.path)
            self._send(status, payload, url.path, headers)

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))
            parts = []
            while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline().strip():  # trailers
                pass
            return b"".join(parts)

        def _drop(self, method: str, path: str) -> None:
            hub.log.append((method, path, 0))
            self.close_connection = True

        def _send(self, status: int, payload, path: str, headers: dict | None = None) -> None:
            hub.log.append((self.command, path, status))
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            headers = {"Content-Type": "application/json", **(headers or {})}
            length = headers.pop("_length", len(data))
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(length))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        # ---- auth and lookups ----
        def _user(self) -> str | None:
            auth = self.headers.get("Authorization", "")
            if not auth.startswith("Bearer "):
                return None
            user = hub.tokens.get(auth[7:])
            if user is None:
                raise HubError(401, "Invalid credentials in Authorization header")
            return user

        def _repo(self, repo_id: str, write: bool = False) -> Repo:
            user = self._user()
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and user != repo.owner):
                raise HubError(404, f"Repository not found: {repo_id}", "RepoNotFound")
            if write and user is None:
                raise HubError(401, "You must be authenticated to write")
            if write and user != repo.owner:
                raise HubError(403, f"You don't have the rights to write to {repo_id}")
            return repo

        def _commit(self, repo: Repo, rev: str) -> str:
            if rev in repo.branches:
                return repo.branches[rev]
            if rev in repo.tags:
                return repo.tags[rev]
            if rev in repo.trees:
                return rev
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")

        # ---- endpoints ----
        def h_whoami(self):
            user = self._user()
            if user is None:
                raise HubError(401, "Invalid credentials in Authorization header")
            return 200, {"type": "user", "name": user, "orgs": [], "auth": {"type": "access_token"}}, None

        def h_create(self):
            user = self._user()
            body = json.loads(self.body)
            namespace = body.get("organization") or user
            repo_id = f"{namespace}/{body['name']}"
            if user is None or namespace != user:
                raise HubError(403 if user else 401, f"You don't have the rights to create a model under {namespace}")
            with hub.lock:
                if repo_id in hub.repos:
                    raise HubError(409, "You already created this model repo", url=f"{hub.url}/{repo_id}")
                repo = Repo(owner=user, private=body.get("visibility") == "private" or bool(body.get("private")))
                sha = hub._store(GITATTRIBUTES)
                tree = {".gitattributes": Entry(len(GITATTRIBUTES), git_oid(GITATTRIBUTES), sha, False)}
                repo.branches["main"] = hub._new_commit(repo, tree)
                hub.repos[repo_id] = repo
            return 200, {"url": f"{hub.url}/{repo_id}", "name": repo_id}, None

        def h_branch(self, repo: str, rev: str):
            r = self._repo(repo, write=True)
            start = json.loads(self.body or b"{}").get("startingPoint") or "main"
            with hub.lock:
                if rev in r.branches:
                    raise HubError(409, f"Reference already exists: refs/heads/{rev}")
                r.branches[rev] = self._commit(r, start)
            return 200, {}, None

        def h_tag(self, repo: str, rev: str):
            r = self._repo(repo, write=True)
            tag = json.loads(self.body or b"{}")["tag"]
            with hub.lock:
                if tag in r.tags:
                    raise HubError(409, f"Tag already exists: {tag}")
                r.tags[tag] = self._commit(r, rev)
            return 200, {}, None

        def h_refs(self, repo: str):
            r = self._repo(repo)
            branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": c} for b, c in r.branches.items()]
            tags = [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": c} for t, c in r.tags.items()]
            return 200, {"branches": branches, "tags": tags, "converts": []}, None

        def h_info(self, repo: str, rev: str = "main"):
            r = self._repo(repo)
            sha = self._commit(r, rev)
            files = [{"rfilename": p} for p in sorted(r.trees[sha])]
            return 200, {"id": repo, "sha": sha, "private": r.private, "siblings": files, "tags": []}, None

        def h_validate(self):
            return 200, {"errors": [], "warnings": []}, None

        def h_preupload(self, repo: str, rev: str):
            r = self._repo(repo, write=True)
            tree = r.trees[self._commit(r, rev)] if rev in r.branches or rev in r.trees else {}
            out = []
            for f in json.loads(self.body)["files"]:
                lfs = f["path"].endswith(LFS_SUFFIXES) or f["size"] > 1_000_000
                old = tree.get(f["path"])
                out.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular",
                            "shouldIgnore": False, "oid": old.oid if old else None})
            return 200, {"files": out, "commitOid": rev}, None

        def h_batch(self, repo: str):
            self._repo(repo, write=True)
            objects = []
            for o in json.loads(self.body)["objects"]:
                obj = {"oid": o["oid"], "size": o["size"], "authenticated": True}
                if not hub._blob(o["oid"]).exists():
                    obj["actions"] = {"upload": {"href": f"{hub.url}/lfs-upload/{o['oid']}"}}
                objects.append(obj)
            return 200, {"transfer": "basic", "objects": objects}, None

        def h_lfs(self, oid: str):
            if hashlib.sha256(self.body).hexdigest() != oid:
                raise HubError(400, "sha256 mismatch")
            hub._store(self.body)
            return 200, b"", None

        def h_commit(self, repo: str, rev: str):
            r = self._repo(repo, write=True)
            lines = [json.loads(x) for x in self.body.splitlines() if x.strip()]
            with hub.lock:
                tree = dict(r.trees[self._commit(r, rev)])
                for item in lines:
                    v = item["value"]
                    if item["key"] == "file":
                        data = base64.b64decode(v["content"])
                        tree[v["path"]] = Entry(len(data), git_oid(data), hub._store(data), False)
                    elif item["key"] == "lfsFile":
                        if not hub._blob(v["oid"]).exists():
                            raise HubError(422, f"LFS object {v['oid']} was not uploaded")
                        tree[v["path"]] = Entry(hub._blob(v["oid"]).stat().st_size, v["oid"], v["oid"], True)
                    elif item["key"] == "deletedFile":
                        tree.pop(v["path"], None)
                    elif item["key"] == "deletedFolder":
                        tree = {p: e for p, e in tree.items() if not p.startswith(v["path"].rstrip("/") + "/")}
                oid = hub._new_commit(r, tree)
                r.branches[rev] = oid
                hub.commit_log.append((repo, rev, [x["value"]["path"] for x in lines if x["key"] != "header"]))
            return 200, {"commitUrl": f"{hub.url}/{repo}/commit/{oid}", "commitOid": oid, "success": True}, None

        def h_tree(self, repo: str, rev: str, path: str = ""):
            r = self._repo(repo)
            tree = r.trees[self._commit(r, rev)]
            prefix = path.strip("/") + "/" if path.strip("/") else ""
            recursive = self.query.get("recursive", "").lower() in ("1", "true")
            files, dirs = [], set()
            for p, e in sorted(tree.items()):
                if not p.startswith(prefix):
                    continue
                parts = p[len(prefix):].split("/")
                for i in range(1, len(parts) if recursive else min(2, len(parts))):
                    dirs.add(prefix + "/".join(parts[:i]))
                if recursive or len(parts) == 1:
                    item = {"type": "file", "path": p, "size": e.size, "oid": e.oid if not e.lfs else _pointer_oid(e)}
                    if e.lfs:
                        item["lfs"] = {"oid": e.sha256, "size": e.size, "pointerSize": 134}
                    files.append(item)
            out = [{"type": "directory", "path": d, "oid": git_oid(d.encode())} for d in sorted(dirs)] + files
            return 200, out, None

        def h_resolve(self, repo: str, rev: str, path: str):
            r = self._repo(repo)
            sha = self._commit(r, rev)
            entry = r.trees[sha].get(path)
            if entry is None:
                raise HubError(404, f"Entry not found: {path}", "EntryNotFound")
            headers = {"Content-Type": "application/octet-stream", "X-Repo-Commit": sha, "ETag": f'"{entry.oid}"'}
            if self.command == "HEAD":
                return 200, b"", {**headers, "_length": entry.size}
            return 200, hub._blob(entry.sha256).read_bytes(), headers

    return Handler
