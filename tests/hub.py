"""A stand-in for the Hugging Face Hub on 127.0.0.1, for the download tests (never another address).

It serves what huggingface_hub asks when it downloads a model repo: the model info with each
file's size and hashes (GET /api/models/{repo} and /api/models/{repo}/revision/{rev}, blobs=true),
the file tree (GET /api/models/{repo}/tree/{rev}, used by `hf download --include`), and HEAD and
GET on /{repo}/resolve/{rev}/{file}, GET with a Range header answered 206. Large files (*.safetensors,
*.gguf) are announced as LFS files, by SHA-256, as the Hub does; the rest by git's blob SHA-1.

Faults, per file: `status` (the Hub answers it, e.g. 404 or 500), `corrupt` (served with a
byte changed, announced by the hash of the true bytes), `slow` (name -> seconds: the file is sent
in small pieces spread over that long, to watch it arrive or to interrupt it). `reset` (name ->
(byte offset, times)): a GET sends the file up to that byte (counted from the file's start, a
Range included; none if the Range starts past it), then aborts the connection with a TCP RST, for
the first `times` GETs only, counted in `resets_done`. `close_early` (name -> byte offset): every
GET sends up to that byte, then closes the connection cleanly (FIN), the rest unsent. `stall`
(name -> byte offset): up to that byte, then nothing more and no close, until the Hub is closed
(at most 120 s). `lie` (a set): the model info and the tree announce a wrong hash for the file
(that of its bytes with one changed), while the true bytes are served.
Every request is logged in `requests` as (method, path, Range header), except those to an
unknown /api/ path (e.g. /api/agent-harnesses, which huggingface_hub asks once a process),
answered 404 unlogged.
"""
import fcntl
import hashlib
import json
import os
import socket
import struct
import termios
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS = (".safetensors", ".gguf")  # announced by SHA-256, as LFS files


def git_blob_sha1(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def flip(data):
    """The bytes with the middle one changed."""
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:]


class StandInHub:
    def __init__(self):
        self.repos, self.status, self.corrupt, self.slow, self.requests = {}, {}, set(), {}, []
        self.reset, self.resets_done, self.close_early, self.stall, self.lie = {}, {}, {}, {}, set()
        self.closed, self.lock = threading.Event(), threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add_repo(self, repo, folder, names):
        """Serve the files `names` of a local folder as the repo `repo` (org/name)."""
        self.repos[repo] = {name: (Path(folder) / name).read_bytes() for name in names}

    def close(self):
        self.closed.set()  # stalled answers end
        self.server.shutdown()
        self.server.server_close()

    def info(self, repo):
        siblings = []
        for name, data in self.repos[repo].items():
            hashed = data if name not in self.lie else flip(data) if data else b"\x01"  # others'
            sibling = {"rfilename": name, "size": len(data), "blobId": git_blob_sha1(hashed)}
            if name.endswith(LFS):
                sibling["lfs"] = {"size": len(data), "sha256": hashlib.sha256(hashed).hexdigest(),
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

            def send(self, code, body=b"", headers=(), head=False, fault=None):
                """fault: None, or (kind, n): send only the body's first n bytes, then "reset"
                (RST), "close_early" (FIN) or "stall" (nothing more until the Hub closes)."""
                self.send_response(code)
                for key, value in headers:
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if head:
                    return
                if fault:
                    body = body[:fault[1]]
                pieces = [body[i:i + 16384] for i in range(0, len(body), 16384)] if body else []
                for piece in pieces:
                    self.wfile.write(piece)
                    if self.slow:
                        self.wfile.flush()
                        time.sleep(self.slow / len(pieces))
                if not fault:
                    return
                self.wfile.flush()
                self.close_connection = True
                kind = fault[0]
                if kind == "stall":
                    hub.closed.wait(120)
                elif kind == "reset":  # no linger: close() sends a RST, not a FIN
                    self.drain()  # which would drop what is not yet sent
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                               struct.pack("ii", 1, 0))
                    os.close(self.connection.detach())  # now, whatever still refers to it
                else:
                    self.connection.shutdown(socket.SHUT_WR)

            def drain(self, most=10):
                """Wait until the peer has acknowledged every byte written (Linux's SIOCOUTQ
                falls to 0), at most `most` seconds; elsewhere, not at all."""
                deadline = time.time() + most
                while time.time() < deadline and not hub.closed.is_set():
                    try:
                        queued = fcntl.ioctl(self.connection.fileno(), termios.TIOCOUTQ,
                                             struct.pack("i", 0))
                    except (OSError, AttributeError):
                        return
                    if struct.unpack("i", queued)[0] == 0:
                        return
                    time.sleep(0.005)

            def fault(self, name, start):
                """The fault of this GET of `name`, whose body starts at byte `start`, if any."""
                for kind, table in (("reset", hub.reset), ("close_early", hub.close_early),
                                    ("stall", hub.stall)):
                    if name not in table:
                        continue
                    offset = table[name][0] if kind == "reset" else table[name]
                    if start > offset:
                        continue
                    if kind == "reset":
                        with hub.lock:
                            if hub.resets_done.get(name, 0) >= table[name][1]:
                                continue
                            hub.resets_done[name] = hub.resets_done.get(name, 0) + 1
                    return kind, offset - start
                return None

            def answer(self, head):
                path = self.path.split("?")[0]
                self.slow = 0
                parts = path.strip("/").split("/")
                if parts[0] == "api" and parts[1:2] != ["models"]:  # unknown: not logged
                    return self.send(404, b'{"error": "not found"}', [], head)
                hub.requests.append((self.command, path, self.headers.get("Range")))
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
                    lfs = name.endswith(LFS)
                    etag = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
                    headers = [("X-Repo-Commit", COMMIT), ("Accept-Ranges", "bytes"),
                               ("ETag", f'"{etag}"')]
                    if lfs:
                        headers += [("X-Linked-Etag", f'"{etag}"'), ("X-Linked-Size", str(len(data)))]
                    if name in hub.corrupt:
                        data = flip(data)
                    self.slow = 0 if head else hub.slow.get(name, 0)
                    if self.headers.get("Range") and not head:
                        start = int(self.headers["Range"].split("=")[1].split("-")[0])
                        headers.append(("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}"))
                        return self.send(206, data[start:], headers, head, self.fault(name, start))
                    fault = None if head else self.fault(name, 0)
                    return self.send(200, data, headers, head, fault)  # a HEAD: the length, no body
                return self.send(404, b"not found", [], head)

        return Handler
