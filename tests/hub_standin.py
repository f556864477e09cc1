"""The Hub routes a checkpoint uploader and downloader use, on top of :mod:`tests.hf_standin`.

``huggingface_hub`` (2.x, as installed) calls, for what ``relay_server.observers.hub_checkpoints`` does:

=========================================================  ==========================================
``POST /api/repos/create``                                 ``HfApi.create_repo`` (409 = exists)
``GET  /api/models/{repo}[/revision/{rev}]``               ``HfApi.repo_info`` / ``model_info``
``POST /api/validate-yaml``                                ``create_commit`` when README.md is in it
``POST /api/models/{repo}/preupload/{rev}``                ``create_commit``: regular, LFS or Xet?
``POST /api/models/{repo}/commit/{rev}`` (NDJSON)          ``create_commit``: the commit itself
``HEAD|GET /{repo}/resolve/{rev}/{path}``                  ``hf_hub_download``
=========================================================  ==========================================

The real Hub answers ``preupload`` with ``"lfs"`` for binary files such as ``.safetensors``; the
client then uploads the bytes through Xet (``hf_xet``) or the LFS batch API before committing
pointers. This stand-in answers ``"regular"`` for every file, so the client inlines the content
base64-encoded in the NDJSON commit and no Xet/LFS storage has to be faked. Everything else the
client does -- create, preupload, commit, resolve with its commit and ETag headers, the cache --
is the real code path. A commit with an ``lfsFile`` line is refused (400), so a test notices if
that assumption ever breaks.

Write routes need the token of a user with ``role="write"`` who owns the namespace (or is in the
organization); private repos are readable by those same users only.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from relay_server.harness.hf_standin import HfStandin, HfUser, StandinRequest, StandinResponse
from tests.hf_standin import scope_hf_env

_REPO = r"(?P<repo>[\w.-]+/[\w.-]+)"
_REV = r"(?P<rev>[^/]+)"


@dataclass(frozen=True)
class Commit:
    oid: str
    message: str
    files: dict[str, bytes]  # the whole tree after this commit


@dataclass
class Repo:
    repo_id: str
    private: bool
    commits: list[Commit] = field(default_factory=list)

    def resolve(self, revision: str) -> Commit | None:
        """``main`` is the newest commit; a commit id (or a prefix of 7+ characters) names one."""
        if revision == "main":
            return self.commits[-1]
        if len(revision) >= 7:
            return next((c for c in reversed(self.commits) if c.oid.startswith(revision)), None)
        return None


class HubStandin(HfStandin):
    """An :class:`HfStandin` that also hosts model repos in memory."""

    def __init__(self) -> None:
        super().__init__()
        self.repos: dict[str, Repo] = {}
        self._repo_lock = threading.Lock()
        self.add_route("POST", r"/api/repos/create", self._create_repo)
        self.add_route("GET", rf"/api/models/{_REPO}(?:/revision/{_REV})?", self._repo_info)
        self.add_route("POST", r"/api/validate-yaml", lambda _: StandinResponse(200, {"errors": [], "warnings": []}))
        self.add_route("POST", rf"/api/models/{_REPO}/preupload/{_REV}", self._preupload)
        self.add_route("POST", rf"/api/models/{_REPO}/commit/{_REV}", self._commit)
        for method in ("GET", "HEAD"):
            self.add_route(method, rf"/{_REPO}/resolve/{_REV}/(?P<path>.+)", self._resolve)

    # --- helpers for tests -----------------------------------------------------------------------
    def file(self, repo_id: str, path: str, revision: str = "main") -> bytes:
        commit = self.repos[repo_id].resolve(revision)
        assert commit is not None, f"{repo_id} has no revision {revision}"
        return commit.files[path]

    def commits(self, repo_id: str) -> list[Commit]:
        """Commits after the repo's creation, oldest first."""
        return list(self.repos[repo_id].commits[1:]) if repo_id in self.repos else []

    # --- access ----------------------------------------------------------------------------------
    def _user(self, request: StandinRequest) -> HfUser | None:
        return self.users.get(request.token or "")

    @staticmethod
    def _owns(user: HfUser | None, repo_id: str) -> bool:
        namespace = repo_id.split("/", 1)[0]
        return user is not None and (namespace == user.name or namespace in user.orgs)

    def _readable(self, request: StandinRequest, repo_id: str) -> Repo | None:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.private and not self._owns(self._user(request), repo_id)):
            return None  # the Hub hides private repos behind the same 404 as missing ones
        return repo

    def _lookup(
        self, request: StandinRequest, repo_id: str, revision: str
    ) -> tuple[Commit | None, StandinResponse | None]:
        repo = self._readable(request, repo_id)
        if repo is None:
            return None, _not_found(f"Repository {repo_id} not found")
        commit = repo.resolve(revision)
        if commit is None:
            return None, _not_found(f"Invalid rev id: {revision}", "RevisionNotFound")
        return commit, None

    def _writable(self, request: StandinRequest, repo_id: str) -> tuple[Repo | None, StandinResponse | None]:
        user = self._user(request)
        if user is None:
            return None, StandinResponse(401, {"error": "Invalid credentials in Authorization header"})
        if user.role != "write" or not self._owns(user, repo_id):
            return None, StandinResponse(403, {"error": f"You don't have the rights to write to {repo_id}"})
        repo = self.repos.get(repo_id)
        if repo is None:
            return None, _not_found(f"Repository {repo_id} not found")
        return repo, None

    # --- routes ----------------------------------------------------------------------------------
    def _create_repo(self, request: StandinRequest) -> StandinResponse:
        body = json.loads(request.body)
        user = self._user(request)
        if user is None:
            return StandinResponse(401, {"error": "Invalid credentials in Authorization header"})
        repo_id = f"{body.get('organization') or user.name}/{body['name']}"
        if body.get("type", "model") != "model":
            return StandinResponse(400, {"error": "this stand-in hosts model repos only"})
        if user.role != "write" or not self._owns(user, repo_id):
            return StandinResponse(403, {"error": f"You don't have the rights to create a repo in {repo_id}"})
        with self._repo_lock:
            if repo_id in self.repos:
                return StandinResponse(
                    409, {"error": "You already created this model repo", "url": self._url(repo_id)}
                )
            repo = Repo(repo_id, private=body.get("visibility", "public") != "public" or bool(body.get("private")))
            repo.commits.append(
                Commit(
                    _oid(b"initial", repo_id.encode()),
                    "initial commit",
                    {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"},
                )
            )
            self.repos[repo_id] = repo
        return StandinResponse(200, {"url": self._url(repo_id), "name": repo_id, "id": f"id-{repo_id}"})

    def _repo_info(self, request: StandinRequest) -> StandinResponse:
        repo_id, revision = request.match["repo"], request.match["rev"] or "main"
        commit, error = self._lookup(request, repo_id, revision)
        if error:
            return error
        repo = self.repos[repo_id]
        return StandinResponse(
            200,
            {
                "id": repo_id,
                "modelId": repo_id,
                "sha": commit.oid,
                "private": repo.private,
                "siblings": [{"rfilename": p} for p in sorted(commit.files)],
                "tags": [],
                "downloads": 0,
                "likes": 0,
            },
        )

    def _preupload(self, request: StandinRequest) -> StandinResponse:
        repo, error = self._writable(request, request.match["repo"])
        if error:
            return error
        files = json.loads(request.body)["files"]
        head = repo.commits[-1]
        return StandinResponse(
            200,
            {
                "files": [
                    {
                        "path": f["path"],
                        "uploadMode": "regular",
                        "shouldIgnore": False,
                        "oid": _blob_oid(head.files[f["path"]]) if f["path"] in head.files else None,
                    }
                    for f in files
                ]
            },
        )

    def _commit(self, request: StandinRequest) -> StandinResponse:
        repo_id = request.match["repo"]
        repo, error = self._writable(request, repo_id)
        if error:
            return error
        if request.match["rev"] != "main":
            return StandinResponse(400, {"error": "this stand-in commits to main only"})
        lines = [json.loads(line) for line in request.body.splitlines() if line.strip()]
        header = next(line["value"] for line in lines if line["key"] == "header")
        with self._repo_lock:
            files = dict(repo.commits[-1].files)
            for line in lines:
                if line["key"] == "file":
                    if line["value"].get("encoding") != "base64":
                        return StandinResponse(400, {"error": "expected base64 file content"})
                    files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                elif line["key"] == "deletedFile":
                    files.pop(line["value"]["path"], None)
                elif line["key"] != "header":
                    return StandinResponse(
                        400,
                        {
                            "error": f"this stand-in does not take {line['key']!r} operations "
                            "(preupload answers 'regular' for every file)"
                        },
                    )
            commit = Commit(
                _oid(
                    repo.commits[-1].oid.encode(),
                    json.dumps(header).encode(),
                    *(p.encode() + c for p, c in sorted(files.items())),
                ),
                header["summary"],
                files,
            )
            repo.commits.append(commit)
        return StandinResponse(
            200, {"success": True, "commitOid": commit.oid, "commitUrl": f"{self._url(repo_id)}/commit/{commit.oid}"}
        )

    def _resolve(self, request: StandinRequest) -> StandinResponse:
        repo_id, revision, path = request.match["repo"], request.match["rev"], request.match["path"]
        commit, error = self._lookup(request, repo_id, revision)
        if error:
            return error
        if path not in commit.files:
            return _not_found(f"{path} does not exist at {revision}", "EntryNotFound")
        content = commit.files[path]
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{_blob_oid(content)}"'}
        if request.method == "HEAD":  # no body: the size travels in X-Linked-Size, as for LFS files
            return StandinResponse(200, b"", {**headers, "X-Linked-Size": str(len(content))})
        return StandinResponse(200, content, {**headers, "Content-Type": "application/octet-stream"})

    def _url(self, repo_id: str) -> str:
        return f"{self.url}/{repo_id}"


def _oid(*parts: bytes) -> str:
    digest = hashlib.sha1()
    for part in parts:
        digest.update(part)
    return digest.hexdigest()


def _blob_oid(content: bytes) -> str:
    """The git blob id, as the Hub reports for regular files."""
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def _not_found(message: str, code: str = "RepoNotFound") -> StandinResponse:
    return StandinResponse(404, {"error": message}, {"X-Error-Code": code, "X-Error-Message": message})


@pytest.fixture
def hub_standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[HubStandin]:
    """A running :class:`HubStandin`, with ``huggingface_hub`` scoped to it for this test."""
    import huggingface_hub.constants as constants

    with HubStandin() as hub:
        scope_hf_env(monkeypatch, hub.url)
        # hf_hub_url swaps an explicit endpoint in only where the URL template (built at import time)
        # starts with constants.ENDPOINT; keep the two in step, as they are when HF_ENDPOINT is set
        # before the import
        monkeypatch.setattr(
            constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}"
        )
        yield hub
