"""A real gRPC client (grpcio's own) for the end-to-end tests in tests/it/grpc.rs.

No protoc: raw bytes in and out (no (de)serializers). Reads a JSON plan on stdin:

    {"target": "127.0.0.1:8080", "calls": [CALL, ...]}

and makes the calls one after the other on one channel (cleartext HTTP/2, prior
knowledge: the gateway's listener), then prints one JSON line on stdout: a list with one
result per call. A CALL:

    {"kind": "unary" | "server_stream" | "client_stream" | "bidi",
     "method": "/pkg.Echo/Say",
     "messages": ["<hex>", ...],          # the request messages (unary: exactly one)
     "generate": {"count": 1024, "size": 65536},   # client_stream: generated instead
     "metadata": [["x-key", "value"]],
     "timeout": 30}                       # the call's own deadline, in seconds

`bidi` is a ping-pong: each message is sent only once the answer to the previous one has
arrived, so that the answers are proven to come while the request is still open. A
result:

    {"code": "OK", "code_number": 0, "details": null,
     "responses": ["<hex>", ...],         # in the order they arrived
     "initial_metadata": [[k, v]], "trailing_metadata": [[k, v]],
     "elapsed_ms": 12,
     "generated": {"messages": n, "bytes": n, "sha256": "<hex>"}}   # with `generate`

Metadata values are text, but hex for `-bin` keys (grpcio hands those over as bytes). A
failed call is a result like any other (its code in the client's own words,
grpc.StatusCode); the exit status is 0 unless the plan itself is wrong.
"""

import hashlib
import json
import queue
import sys
import time

import grpc


def metadata(md):
    out = []
    for item in md or ():
        key, value = item[0], item[1]
        if isinstance(value, bytes):
            value = value.hex()
        out.append([key, value])
    return out


def generated(spec, digest):
    count, size = spec["count"], spec["size"]
    for i in range(count):
        seed = hashlib.sha256(i.to_bytes(8, "big")).digest()
        m = (seed * (size // len(seed) + 1))[:size]
        digest["messages"] += 1
        digest["bytes"] += len(m)
        digest["sha256"].update(m)
        yield m


def run(channel, call):
    kind, method = call["kind"], call["method"]
    messages = [bytes.fromhex(m) for m in call.get("messages", [])]
    md = [tuple(kv) for kv in call.get("metadata", [])]
    timeout = call.get("timeout", 30)
    result = {
        "code": "OK",
        "code_number": 0,
        "details": None,
        "responses": [],
        "initial_metadata": [],
        "trailing_metadata": [],
    }
    digest = None
    started = time.monotonic()
    try:
        if kind == "unary":
            (request,) = messages
            stub = channel.unary_unary(method)
            response, c = stub.with_call(request, metadata=md, timeout=timeout)
            result["responses"].append(response.hex())
        elif kind == "server_stream":
            (request,) = messages
            c = channel.unary_stream(method)(request, metadata=md, timeout=timeout)
            for response in c:
                result["responses"].append(response.hex())
        elif kind == "client_stream":
            stub = channel.stream_unary(method)
            if "generate" in call:
                digest = {"messages": 0, "bytes": 0, "sha256": hashlib.sha256()}
                requests = generated(call["generate"], digest)
            else:
                requests = iter(messages)
            response, c = stub.with_call(requests, metadata=md, timeout=timeout)
            result["responses"].append(response.hex())
        elif kind == "bidi":
            turn = queue.Queue()

            def requests():
                for m in messages:
                    yield m
                    # The next one only once this one's answer came back.
                    if turn.get(timeout=timeout) is None:
                        return

            c = channel.stream_stream(method)(
                requests(), metadata=md, timeout=timeout
            )
            try:
                for response in c:
                    result["responses"].append(response.hex())
                    turn.put(True)
            finally:
                turn.put(None)
        else:
            raise SystemExit(f"unknown kind {kind!r}")
        result["initial_metadata"] = metadata(c.initial_metadata())
        result["trailing_metadata"] = metadata(c.trailing_metadata())
        result["details"] = c.details() or None
    except grpc.RpcError as e:
        result["code"] = e.code().name
        result["code_number"] = e.code().value[0]
        result["details"] = e.details()
        result["initial_metadata"] = metadata(e.initial_metadata())
        result["trailing_metadata"] = metadata(e.trailing_metadata())
    result["elapsed_ms"] = int((time.monotonic() - started) * 1000)
    if digest is not None:
        digest["sha256"] = digest["sha256"].hexdigest()
        result["generated"] = digest
    return result


def main():
    plan = json.load(sys.stdin)
    options = [
        # The gateway is the target: no proxy from the environment, and no retry of
        # grpcio's own (each call is one attempt the gateway and the backend see).
        ("grpc.enable_http_proxy", 0),
        ("grpc.enable_retries", 0),
        ("grpc.max_receive_message_length", 16 << 20),
        ("grpc.max_send_message_length", 16 << 20),
    ]
    with grpc.insecure_channel(plan["target"], options=options) as channel:
        results = [run(channel, call) for call in plan["calls"]]
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
