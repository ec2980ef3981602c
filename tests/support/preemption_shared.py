"""Shared by the tests: moved out of test_preemption.py (which imports them back) so other test modules import
them from here, not from a test module."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeMetadata:
    """Serves ``spot/instance-action`` (404 until ``notice``) behind an IMDSv2 token, and
    ``instance/preempted`` (FALSE until ``notice``) behind ``Metadata-Flavor: Google``."""

    TOKEN = "tok-123"
    AWS_IP, GCP_IP = "203.0.113.7", "198.51.100.9"  # documentation addresses (RFC 5737)

    def __init__(self):
        self.notice = False
        self.requests: list[tuple[str, str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _reply(self, status: int, body: bytes = b"") -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self):
                fake.requests.append(("PUT", self.path, {k.lower(): v for k, v in self.headers.items()}))
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    return self._reply(200, FakeMetadata.TOKEN.encode())
                self._reply(400)

            def do_GET(self):
                fake.requests.append(("GET", self.path, {k.lower(): v for k, v in self.headers.items()}))
                if self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") != FakeMetadata.TOKEN:
                        return self._reply(401)
                    if not fake.notice:
                        return self._reply(404, b"Not Found")
                    return self._reply(200, json.dumps({"action": "terminate",
                                                        "time": "2026-01-01T00:02:00Z"}).encode())
                if self.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._reply(403)
                    return self._reply(200, b"TRUE" if fake.notice else b"FALSE")
                if self.path == "/latest/meta-data/public-ipv4":
                    if self.headers.get("X-aws-ec2-metadata-token") != FakeMetadata.TOKEN:
                        return self._reply(401)
                    return self._reply(200, FakeMetadata.AWS_IP.encode())
                if self.path == "/computeMetadata/v1/instance/network-interfaces/0/access-configs/0/external-ip":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._reply(403)
                    return self._reply(200, FakeMetadata.GCP_IP.encode())
                self._reply(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        # a poll of 50 ms, not serve_forever's 500: shutdown() waits out one poll, at every test's teardown
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
