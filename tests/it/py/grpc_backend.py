"""A real gRPC backend (grpcio's own server) for the end-to-end tests in tests/it/grpc.rs.

No protoc: generic handlers, raw bytes in and out (no (de)serializers). It binds
127.0.0.1 on a port of the kernel's choice (or --port), cleartext or, with --cert and
--key, TLS (grpc.ssl_server_credentials, ALPN h2), and prints one line
`listening <port>` on stdout once it serves. Each call's method is appended to --seen
(one line, flushed before the handler answers), so that a test can tell which calls
reached the backend.

Services (messages are raw bytes):
- /pkg.Echo/Say (unary): the request back; initial metadata x-echo-initial: hello, and
  the trailer x-echo-trailer: said.
- /pkg.Other/Say (unary): the same, for a service no rule matches.
- /pkg.Echo/Expand (server streaming): the request is items, each a 4-byte big-endian
  length and its bytes; each item comes back as one message, in order.
- /pkg.Echo/Collect (client streaming): every message, in order, as items (as above).
- /pkg.Echo/Count (client streaming): JSON {"messages", "bytes", "sha256"} of what came.
- /pkg.Echo/Chat (bidirectional): each message back as it comes.
- /pkg.Echo/Fail (unary): NOT_FOUND, the message `no such echo: <request>` (the request
  read as UTF-8), with the trailers x-detail: missing and x-detail-bin: 00 ff 10.
- /pkg.Echo/ExpandThenFail (server streaming): the items of Expand, then as Fail.
- /pkg.Echo/Slow (unary): the request back after --slow seconds (default 5).
"""

import argparse
import hashlib
import json
import struct
import sys
import threading
import time
from concurrent import futures

import grpc


def items(payload):
    out, i = [], 0
    while i < len(payload):
        (n,) = struct.unpack(">I", payload[i : i + 4])
        out.append(payload[i + 4 : i + 4 + n])
        i += 4 + n
    return out


def pack(messages):
    return b"".join(struct.pack(">I", len(m)) + m for m in messages)


class Seen:
    def __init__(self, path):
        self.lock = threading.Lock()
        self.file = open(path, "a", encoding="utf-8") if path else None

    def note(self, method):
        if self.file is None:
            return
        with self.lock:
            self.file.write(method + "\n")
            self.file.flush()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--cert")
    p.add_argument("--key")
    p.add_argument("--seen")
    p.add_argument("--slow", type=float, default=5.0)
    args = p.parse_args()
    seen = Seen(args.seen)

    def fail(request, context):
        context.set_trailing_metadata(
            (("x-detail", "missing"), ("x-detail-bin", b"\x00\xff\x10"))
        )
        context.abort(
            grpc.StatusCode.NOT_FOUND,
            "no such echo: " + request.decode("utf-8", "replace"),
        )

    def say(method):
        def handler(request, context):
            seen.note(method)
            context.send_initial_metadata((("x-echo-initial", "hello"),))
            context.set_trailing_metadata((("x-echo-trailer", "said"),))
            return request

        return handler

    def expand(request, context):
        seen.note("/pkg.Echo/Expand")
        for m in items(request):
            yield m

    def collect(request_iterator, context):
        seen.note("/pkg.Echo/Collect")
        return pack(list(request_iterator))

    def count(request_iterator, context):
        seen.note("/pkg.Echo/Count")
        n, total, digest = 0, 0, hashlib.sha256()
        for m in request_iterator:
            n += 1
            total += len(m)
            digest.update(m)
        return json.dumps(
            {"messages": n, "bytes": total, "sha256": digest.hexdigest()}
        ).encode()

    def chat(request_iterator, context):
        seen.note("/pkg.Echo/Chat")
        for m in request_iterator:
            yield m

    def fail_unary(request, context):
        seen.note("/pkg.Echo/Fail")
        fail(request, context)

    def expand_then_fail(request, context):
        seen.note("/pkg.Echo/ExpandThenFail")
        for m in items(request):
            yield m
        fail(b"after the stream", context)

    def slow(request, context):
        seen.note("/pkg.Echo/Slow")
        time.sleep(args.slow)
        return request

    echo = grpc.method_handlers_generic_handler(
        "pkg.Echo",
        {
            "Say": grpc.unary_unary_rpc_method_handler(say("/pkg.Echo/Say")),
            "Expand": grpc.unary_stream_rpc_method_handler(expand),
            "Collect": grpc.stream_unary_rpc_method_handler(collect),
            "Count": grpc.stream_unary_rpc_method_handler(count),
            "Chat": grpc.stream_stream_rpc_method_handler(chat),
            "Fail": grpc.unary_unary_rpc_method_handler(fail_unary),
            "ExpandThenFail": grpc.unary_stream_rpc_method_handler(expand_then_fail),
            "Slow": grpc.unary_unary_rpc_method_handler(slow),
        },
    )
    other = grpc.method_handlers_generic_handler(
        "pkg.Other",
        {"Say": grpc.unary_unary_rpc_method_handler(say("/pkg.Other/Say"))},
    )
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=16),
        options=[
            ("grpc.max_receive_message_length", 16 << 20),
            ("grpc.max_send_message_length", 16 << 20),
        ],
    )
    server.add_generic_rpc_handlers((echo, other))
    address = f"127.0.0.1:{args.port}"
    if args.cert:
        with open(args.key, "rb") as k, open(args.cert, "rb") as c:
            creds = grpc.ssl_server_credentials(((k.read(), c.read()),))
        port = server.add_secure_port(address, creds)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        print(f"cannot bind {address}", file=sys.stderr, flush=True)
        sys.exit(1)
    server.start()
    print(f"listening {port}", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
