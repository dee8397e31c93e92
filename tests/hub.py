"""A stand-in for the Hugging Face Hub on 127.0.0.1, for the download tests (never another address).

It serves what huggingface_hub asks when it downloads a model repo: the model info with each
file's size and hashes (GET /api/models/{repo} and /api/models/{repo}/revision/{rev}, blobs=true),
the file tree (GET /api/models/{repo}/tree/{rev}, used by `hf download --include`), and HEAD and
GET on /{repo}/resolve/{rev}/{file}, GET with a Range header answered 206. Large files (*.safetensors)
are announced as LFS files, by SHA-256, as the Hub does; the rest by git's blob SHA-1.

Faults, per file: `status` (the Hub answers it, e.g. 404 or 500), `corrupt` (served with a
byte changed, announced by the hash of the true bytes), `slow` (name -> seconds: the file is sent
in small pieces spread over that long, to watch it arrive or to interrupt it). Every request is logged in `requests` as (method, path, Range header).
"""
import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def git_blob_sha1(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class StandInHub:
    def __init__(self):
        self.repos, self.status, self.corrupt, self.slow, self.requests = {}, {}, set(), {}, []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add_repo(self, repo, folder, names):
        """Serve the files `names` of a local folder as the repo `repo` (org/name)."""
        self.repos[repo] = {name: (Path(folder) / name).read_bytes() for name in names}

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def info(self, repo):
        siblings = []
        for name, data in self.repos[repo].items():
            sibling = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(data)}
            if name.endswith(".safetensors"):
                sibling["lfs"] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                                  "pointerSize": 134}
            siblings.append(sibling)
        return {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings}

    def handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                self.answer(head=True)

            def do_GET(self):
                self.answer(head=False)

            def send(self, code, body=b"", headers=(), head=False):
                self.send_response(code)
                for key, value in headers:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if head:
                    return
                pieces = [body[i:i + 16384] for i in range(0, len(body), 16384)] if body else []
                for piece in pieces:
                    self.wfile.write(piece)
                    if self.slow:
                        self.wfile.flush()
                        time.sleep(self.slow / len(pieces))

            def answer(self, head):
                path = self.path.split("?")[0]
                hub.requests.append((self.command, path, self.headers.get("Range")))
                self.slow = 0
                parts = path.strip("/").split("/")
                if parts[0] == "api" and parts[1] == "models":
                    repo = "/".join(parts[2:4])
                    if repo not in hub.repos:
                        return self.send(404, b'{"error": "Repository not found"}',
                                         [("X-Error-Code", "RepoNotFound")], head)
                    if len(parts) > 4 and parts[4] == "tree":
                        info = hub.info(repo)["siblings"]
                        tree = [{"type": "file", "path": s["rfilename"], "size": s["size"],
                                 "oid": s["blobId"], **({"lfs": {"oid": s["lfs"]["sha256"],
                                 "size": s["size"], "pointerSize": 134}} if "lfs" in s else {})}
                                for s in info]
                        return self.send(200, json.dumps(tree).encode(),
                                         [("Content-Type", "application/json")], head)
                    return self.send(200, json.dumps(hub.info(repo)).encode(),
                                     [("Content-Type", "application/json")], head)
                if len(parts) >= 5 and parts[2] == "resolve":
                    repo, name = "/".join(parts[:2]), "/".join(parts[4:])
                    data = hub.repos.get(repo, {}).get(name)
                    if data is None:
                        return self.send(404, b"Entry not found", [("X-Error-Code", "EntryNotFound"),
                                         ("X-Repo-Commit", COMMIT)], head)
                    if name in hub.status:
                        return self.send(hub.status[name], b"trouble", [], head)
                    lfs = name.endswith(".safetensors")
                    etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
                    headers = [("X-Repo-Commit", COMMIT), ("Accept-Ranges", "bytes"),
                               ("ETag", f'"{etag}"')]
                    if lfs:
                        headers += [("X-Linked-Etag", f'"{etag}"'), ("X-Linked-Size", str(len(data)))]
                    if name in hub.corrupt:
                        middle = len(data) // 2
                        data = data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:]
                    self.slow = 0 if head else hub.slow.get(name, 0)
                    if self.headers.get("Range") and not head:
                        start = int(self.headers["Range"].split("=")[1].split("-")[0])
                        headers.append(("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}"))
                        return self.send(206, data[start:], headers, head)
                    return self.send(200, data, headers, head)  # a HEAD: the length, no body
                return self.send(404, b"not found", [], head)

        return Handler
