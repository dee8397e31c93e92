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

Xet mode, StandInHub(xet=True): the LFS files are on Xet storage, as on the real Hub; the rest
(json files, the API) as above. A second server on 127.0.0.1, at `cas_url`, is the storage (CAS).
HEAD or GET of an LFS file's resolve URL answers a 302 to /xet-bridge/{repo}/{file} there, with
X-Xet-Hash (the file's id, in `xet_hashes`: a SHA-256, not Xet's own hash), Link: <token URL>;
rel="xet-auth", X-Linked-Size, X-Linked-Etag: huggingface_hub 2.4 does not follow a redirect to
another port and reads these, then calls xet_get; 2.1 follows it, and the bridge's answer carries
the same headers (its GET, the plain file, is for a client without Xet). GET
/api/models/{repo}/xet-read-token/{rev} answers the storage's URL and a token, in headers (for
huggingface_hub) and as JSON (for hf_xet's refresh). hf_xet asks the storage GET
/v2/reconstructions/{id} (Range: the bytes of the file; /v1/ the same answer): the file is cut into
uncompressed chunks of 64 KiB (an 8-byte header each: version 0, u24 length, scheme 0, u24
length), 16 to a xorb, and the answer lists, per xorb, the chunks and their bytes; then it GETs
/xorbs/{repo}/{xorb hash}/{file} with a Range of that xorb's bytes. hf_xet checks no hash.
Storage faults, per file: `corrupt` (the chunks hold the changed byte), `slow` (its xorb GETs share
one rate, the file's size over that many seconds), `reset`, `close_early` and `stall` as above,
the offset counted in the file, on the xorb GET that carries that byte (`times`: such GETs);
`malformed` (a set: the chunk holding the middle byte says version 1, which hf_xet refuses as
Malformed data); `storage_status` (name -> (status, "reconstruction" or "xorb", times): the
storage answers that status to those GETs of the file, the first `times` of them, counted in
`statuses_done`); `storage_down` (True: the token names a closed port on 127.0.0.1 as the storage).
`status` stays the Hub's answer at the resolve URL. The storage answers 401 to a reconstruction
GET without the token, and 200 to hf_xet's telemetry (POST /v1/telemetry, not logged).
"""
import fcntl
import hashlib
import json
import os
import socket
import struct
import sys
import termios
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
LFS = (".safetensors", ".gguf")  # announced by SHA-256, as LFS files; in Xet mode, on Xet storage
TOKEN = "xet-read-token-of-the-stand-in"  # the storage's access token
CHUNK, XORB = 65536, 16  # bytes of the file a chunk holds, chunks a xorb holds


def git_blob_sha1(data):
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def flip(data):
    """The bytes with the middle one changed."""
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1:]


def asked(header, size):
    """The bytes a Range header asks of `size`, (first, last), the last included; all without one."""
    if not header:
        return 0, size - 1
    first, _, last = header.split("=")[1].partition("-")
    return int(first), min(int(last), size - 1) if last else size - 1


def xorbs(data, malformed=False):
    """The file as Xet stores it: a list of xorbs, (hash, bytes, chunks), each chunk (offset in
    the file, length, offset of its header in the xorb); with `malformed`, the chunk holding the
    middle byte has version 1 in its header."""
    result = []
    for first in range(0, len(data), CHUNK * XORB):
        body, chunks, at = [], [], 0
        for start in range(first, min(first + CHUNK * XORB, len(data)), CHUNK):
            piece = data[start:start + CHUNK]
            size = len(piece).to_bytes(3, "little")
            version = int(malformed and start <= len(data) // 2 < start + len(piece))
            body += [bytes([version]) + size + b"\0" + size, piece]
            chunks.append((start, len(piece), at))
            at += 8 + len(piece)
        body = b"".join(body)
        result.append((hashlib.sha256(body).hexdigest(), body, chunks))
    return result


class Quiet(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        """No traceback for a client that went away (hf_xet drops its other connections when
        one fails)."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class StandInHub:
    def __init__(self, xet=False):
        self.repos, self.status, self.corrupt, self.slow, self.requests = {}, {}, set(), {}, []
        self.reset, self.resets_done, self.close_early, self.stall, self.lie = {}, {}, {}, {}, set()
        self.malformed, self.storage_status, self.statuses_done = set(), {}, {}
        self.storage_down = False
        self.xet_hashes, self.layouts = {}, {}  # (repo, name) -> id; (id, faults) -> xorbs
        self.turns = {}  # a slow file in Xet mode: when its next piece may go
        self.closed, self.lock = threading.Event(), threading.Lock()
        self.server, self.url = self.serve()
        self.storage, self.cas_url = self.serve() if xet else (None, None)
        with socket.socket() as nowhere:  # a port on 127.0.0.1 that nothing listens on
            nowhere.bind(("127.0.0.1", 0))
            self.nowhere = f"http://127.0.0.1:{nowhere.getsockname()[1]}"

    def serve(self):
        server = Quiet(("127.0.0.1", 0), self.handler())
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    def add_repo(self, repo, folder, names):
        """Serve the files `names` of a local folder as the repo `repo` (org/name)."""
        self.repos[repo] = {name: (Path(folder) / name).read_bytes() for name in names}
        for name, data in self.repos[repo].items():
            self.xet_hashes[repo, name] = hashlib.sha256(f"{repo}/{name}".encode() + data).hexdigest()

    def close(self):
        self.closed.set()  # stalled answers end
        for server in filter(None, (self.server, self.storage)):
            server.shutdown()
            server.server_close()

    def counted(self, done, name, times):
        """Whether a fault acts once more (at most `times` in all), counted in `done`."""
        with self.lock:
            if done.get(name, 0) >= times:
                return False
            done[name] = done.get(name, 0) + 1
            return True

    def turn(self, name, seconds, size):
        """How long to wait before sending `size` more bytes of a slow file, at `seconds` a byte
        for all its GETs together."""
        with self.lock:
            now = time.time()
            start = max(now, self.turns.get(name, now))
            self.turns[name] = start + size * seconds
            return start - now

    def layout(self, repo, name):
        """The xorbs of a file as served now (its faults included)."""
        key = (self.xet_hashes[repo, name], name in self.corrupt, name in self.malformed)
        if key not in self.layouts:
            data = self.repos[repo][name]
            self.layouts[key] = xorbs(flip(data) if key[1] else data, key[2])
        return self.layouts[key]

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
                    if self.pace:  # a slow file's xorb GETs: one rate for all
                        time.sleep(hub.turn(*self.pace, len(piece)))
                    self.wfile.write(piece)
                    if self.slow or self.pace:
                        self.wfile.flush()
                    if self.slow:
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

            def fault(self, name, where):
                """The fault of this GET of `name`, if any: where(offset) is the place in its body
                of that byte of the file, or None if the body does not carry it."""
                for kind, table in (("reset", hub.reset), ("close_early", hub.close_early),
                                    ("stall", hub.stall)):
                    if name not in table:
                        continue
                    offset = table[name][0] if kind == "reset" else table[name]
                    if where(offset) is None:
                        continue
                    if kind == "reset" and not hub.counted(hub.resets_done, name, table[name][1]):
                        continue
                    return kind, where(offset)
                return None

            def refused(self, name, what, head):
                """Whether the storage's fault status for this GET (`what`) of the file was sent."""
                code, target, times = hub.storage_status.get(name, (None, None, 0))
                if target == what and hub.counted(hub.statuses_done, name, times):
                    self.send(code, b'{"error": "trouble"}', [], head)
                    return True
                return False

            def storage_answer(self, parts, head):
                """The storage server: a file's reconstruction, a range of a xorb."""
                if parts[0] in ("v1", "v2") and parts[1:2] == ["reconstructions"] and len(parts) == 3:
                    if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                        return self.send(401, b'{"error": "no token"}', [], head)
                    found = [key for key, value in hub.xet_hashes.items() if value == parts[2]]
                    if not found:
                        return self.send(404, b'{"error": "not found"}', [], head)
                    repo, name = found[0]
                    if self.refused(name, "reconstruction", head):
                        return
                    size = len(hub.repos[repo][name])
                    first, last = asked(self.headers.get("Range"), size)  # of the file
                    if first >= size:
                        return self.send(416, b'{"error": "range"}', [], head)
                    terms, by_xorb, fetch_info, offset = [], {}, {}, None
                    for xorb, body, chunks in hub.layout(repo, name):
                        used = [i for i, (at, n, _) in enumerate(chunks)
                                if at <= last and at + n > first]
                        if not used:
                            continue
                        start, end = used[0], used[-1] + 1
                        offset = first - chunks[start][0] if offset is None else offset
                        span = {"start": start, "end": end}  # chunks, end exclusive
                        byte_range = {"start": chunks[start][2],  # bytes, end inclusive
                                      "end": chunks[end - 1][2] + 8 + chunks[end - 1][1] - 1}
                        terms.append({"hash": xorb, "range": span,
                                      "unpacked_length": sum(n for _, n, _ in chunks[start:end])})
                        url = f"{hub.cas_url}/xorbs/{repo}/{xorb}/{name}"
                        by_xorb[xorb] = [{"url": url,
                                          "ranges": [{"chunks": span, "bytes": byte_range}]}]
                        fetch_info[xorb] = [{"range": span, "url": url, "url_range": byte_range}]
                    answer = {"offset_into_first_range": offset, "terms": terms, "xorbs": by_xorb,
                              "fetch_info": fetch_info}  # v2's, v1's
                    return self.send(200, json.dumps(answer).encode(),
                                     [("Content-Type", "application/json")], head)
                if parts[0] == "xorbs" and len(parts) >= 5:
                    repo, xorb, name = "/".join(parts[1:3]), parts[3], "/".join(parts[4:])
                    if name not in hub.repos.get(repo, {}):
                        return self.send(404, b'{"error": "not found"}', [], head)
                    found = [(body, chunks) for h, body, chunks in hub.layout(repo, name) if h == xorb]
                    if not found:
                        return self.send(404, b'{"error": "not found"}', [], head)
                    if self.refused(name, "xorb", head):
                        return
                    body, chunks = found[0]
                    first, last = asked(self.headers.get("Range"), len(body))  # of the xorb

                    def where(offset):  # a byte of the file: where in this answer
                        for at, n, header in chunks:
                            if at <= offset < at + n and first <= header <= last - 8 - n + 1:
                                return header + 8 + offset - at - first
                        return None

                    if name in hub.slow and not head:  # seconds a byte
                        self.pace = name, hub.slow[name] / len(hub.repos[repo][name])
                    return self.send(206, body[first:last + 1], [("Content-Range",
                                     f"bytes {first}-{last}/{len(body)}")], head,
                                     None if head else self.fault(name, where))
                return self.send(404, b'{"error": "not found"}', [], head)

            def do_POST(self):  # hf_xet's telemetry, to the storage: not logged
                if self.server is not hub.storage:
                    return self.send_error(501, f"Unsupported method ({self.command!r})")
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.slow, self.pace = 0, None
                self.send(200, b"{}")

            def answer(self, head):
                path = self.path.split("?")[0]
                self.slow, self.pace = 0, None
                parts = path.strip("/").split("/")
                if parts[0] == "api" and parts[1:2] != ["models"]:  # unknown: not logged
                    return self.send(404, b'{"error": "not found"}', [], head)
                hub.requests.append((self.command, path, self.headers.get("Range")))
                if self.server is hub.storage and parts[0] == "xet-bridge":  # the plain file
                    parts = parts[1:3] + ["resolve", COMMIT] + parts[3:]
                elif self.server is hub.storage:
                    return self.storage_answer(parts, head)
                if parts[0] == "api" and parts[1] == "models":
                    repo = "/".join(parts[2:4])
                    if repo not in hub.repos:
                        return self.send(404, b'{"error": "Repository not found"}',
                                         [("X-Error-Code", "RepoNotFound")], head)
                    if len(parts) > 4 and parts[4] == "xet-read-token" and hub.storage:
                        cas = hub.nowhere if hub.storage_down else hub.cas_url
                        expires = int(time.time()) + 3600
                        return self.send(200, json.dumps({"accessToken": TOKEN, "exp": expires,
                                         "casUrl": cas}).encode(), [("X-Xet-Cas-Url", cas),
                                         ("X-Xet-Access-Token", TOKEN), ("X-Xet-Token-Expiration",
                                         str(expires)), ("Content-Type", "application/json")], head)
                    if len(parts) > 4 and parts[4] == "tree":
                        info = hub.info(repo)["siblings"]
                        tree = [{"type": "file", "path": s["rfilename"], "size": s["size"],
                                 "oid": s["blobId"], **({"lfs": {"oid": s["lfs"]["sha256"],
                                 "size": s["size"], "pointerSize": 134}} if "lfs" in s else {}),
                                 **({"xetHash": hub.xet_hashes[repo, s["rfilename"]]}
                                    if "lfs" in s and hub.storage else {})}
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
                    if lfs and hub.storage:  # on Xet: the Hub and its bridge say so
                        token = f"{hub.url}/api/models/{repo}/xet-read-token/{COMMIT}"
                        headers += [("X-Xet-Hash", hub.xet_hashes[repo, name]),
                                    ("Link", f'<{token}>; rel="xet-auth"')]
                        if self.server is hub.server:
                            return self.send(302, b"", headers + [
                                ("Location", f"{hub.cas_url}/xet-bridge/{repo}/{name}")], head)
                    if name in hub.corrupt:
                        data = flip(data)
                    self.slow = 0 if head else hub.slow.get(name, 0)
                    if self.headers.get("Range") and not head:
                        start = int(self.headers["Range"].split("=")[1].split("-")[0])
                        headers.append(("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}"))
                        return self.send(206, data[start:], headers, head, self.fault(
                            name, lambda offset: offset - start if offset >= start else None))
                    fault = None if head else self.fault(name, lambda offset: offset)
                    return self.send(200, data, headers, head, fault)  # a HEAD: the length, no body
                return self.send(404, b"not found", [], head)

        return Handler
