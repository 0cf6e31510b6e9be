#!/usr/bin/env python3
"""An OpenAI-compatible backend that compresses its answers, for the settlement tests.

Run by tests/it/common/gzip_backend.rs. It listens on a free port of 127.0.0.1 (HTTP/1.1,
keep-alive) and says `{"listening": <port>}` on stdout once bound, then one line
`{"path": <target>, "accept_encoding": <the request's Accept-Encoding or null>,
"gzipped": <bool>}` per answer.

Every answer is a chat completion (JSON) whose `usage` reports `prompt_tokens` and
`completion_tokens` from the query (`?prompt=10&completion=4000`), `total_tokens` their sum.
By path:

- `/accept/...`: gzipped (`Content-Encoding: gzip`) when the request's Accept-Encoding
  allows gzip, plain otherwise;
- `/always/...`: gzipped whatever the request says;
- anything else: plain.

It exits when its standard input ends (the test that ran it is gone).
"""

import gzip
import json
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def say(**fields):
    print(json.dumps(fields), flush=True)


def accepts_gzip(value):
    for item in (value or "").split(","):
        parts = [p.strip() for p in item.split(";")]
        if parts[0].lower() not in ("gzip", "x-gzip", "*"):
            continue
        q = 1.0
        for p in parts[1:]:
            if p.lower().startswith("q="):
                try:
                    q = float(p[2:])
                except ValueError:
                    q = 0.0
        if q > 0:
            return True
    return False


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *_args):
        pass

    def do_GET(self):
        self.answer()

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.answer()

    def answer(self):
        url = urllib.parse.urlsplit(self.path)
        q = dict(urllib.parse.parse_qsl(url.query))
        prompt, completion = int(q.get("prompt", 0)), int(q.get("completion", 0))
        body = json.dumps({
            "id": "chatcmpl-gz",
            "object": "chat.completion",
            "created": 1700000000,
            "model": "test-model",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello " * 50},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "total_tokens": prompt + completion},
        }).encode()
        accept = self.headers.get("Accept-Encoding")
        gzipped = url.path.startswith("/always/") or (
            url.path.startswith("/accept/") and accepts_gzip(accept))
        if gzipped:
            body = gzip.compress(body)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.send_header("Vary", "Accept-Encoding")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        say(path=self.path, accept_encoding=accept, gzipped=gzipped)


def main():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    say(listening=server.server_address[1])
    sys.stdin.read()


if __name__ == "__main__":
    main()
