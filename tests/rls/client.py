"""Envoy's rate limit service called as Envoy calls it, with a gRPC client generated
(grpcio-tools) from envoyproxy's own rls.proto and its imports, vendored in proto/.

    client.py PROTO_DIR TARGET TOKEN

Generates the Python messages and stub into a temporary folder, then answers one call
per line of standard input (JSON), one JSON line each on standard output:

    {"domain": "d", "descriptors": [{"entries": [["k", "v"]], "hits_addend": 2}],
     "hits_addend": 1}
    {"raw": "<hex>"}            the call's message as these bytes, unchecked

    -> {"status": "OK", "overall": "OVER_LIMIT",
        "statuses": [{"code": "OK", "limit": {"name": .., "requests_per_unit": 5,
                      "unit": "MINUTE"}, "remaining": 4, "reset": 60.0}],
        "headers": {"ratelimit": "...", "retry-after": "3"}}
    -> {"status": "INVALID_ARGUMENT", "details": "..."}   a call that failed
"""

import json
import os
import shutil
import sys
import tempfile

import grpc
import grpc_tools
from grpc_tools import protoc

PATH = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"


def generate(proto_dir, out):
    files = []
    for root, _, names in os.walk(proto_dir):
        for n in names:
            rel = os.path.relpath(os.path.join(root, n), proto_dir)
            # The well-known types come with the protobuf runtime.
            if n.endswith(".proto") and not rel.startswith("google" + os.sep):
                files.append(rel)
    wkt = os.path.join(os.path.dirname(grpc_tools.__file__), "_proto")
    rc = protoc.main(
        ["protoc", f"-I{proto_dir}", f"-I{wkt}", f"--python_out={out}", f"--grpc_python_out={out}"]
        + sorted(files)
    )
    if rc != 0:
        sys.exit(f"grpc_tools.protoc failed ({rc})")
    sys.path.insert(0, out)


def main():
    proto_dir, target, token = sys.argv[1:4]
    out = tempfile.mkdtemp(prefix="rls-client-")
    try:
        generate(proto_dir, out)
        from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
        from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2

        channel = grpc.insecure_channel(target)
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        raw = channel.unary_unary(PATH, request_serializer=None, response_deserializer=None)
        metadata = [("authorization", f"Bearer {token}")]
        Code = rls_pb2.RateLimitResponse.Code
        Unit = rls_pb2.RateLimitResponse.RateLimit.Unit
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            call = json.loads(line)
            try:
                if "raw" in call:
                    got = raw(bytes.fromhex(call["raw"]), metadata=metadata, timeout=10)
                    answer = rls_pb2.RateLimitResponse.FromString(got)
                else:
                    req = rls_pb2.RateLimitRequest(
                        domain=call["domain"], hits_addend=call.get("hits_addend", 0)
                    )
                    for d in call["descriptors"]:
                        desc = req.descriptors.add()
                        for k, v in d["entries"]:
                            desc.entries.add(key=k, value=v)
                        if "hits_addend" in d:
                            desc.hits_addend.value = d["hits_addend"]
                    answer = stub.ShouldRateLimit(req, metadata=metadata, timeout=10)
            except grpc.RpcError as e:
                print(json.dumps({"status": e.code().name, "details": e.details()}), flush=True)
                continue
            statuses = []
            for s in answer.statuses:
                limit = None
                if s.HasField("current_limit"):
                    limit = {
                        "name": s.current_limit.name,
                        "requests_per_unit": s.current_limit.requests_per_unit,
                        "unit": Unit.Name(s.current_limit.unit),
                    }
                reset = s.duration_until_reset.ToMicroseconds() / 1e6 if s.HasField("duration_until_reset") else None
                statuses.append(
                    {"code": Code.Name(s.code), "limit": limit, "remaining": s.limit_remaining, "reset": reset}
                )
            headers = {h.key: h.value for h in answer.response_headers_to_add}
            print(
                json.dumps(
                    {
                        "status": "OK",
                        "overall": Code.Name(answer.overall_code),
                        "statuses": statuses,
                        "headers": headers,
                    }
                ),
                flush=True,
            )
    finally:
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
