"""ShouldRateLimit decisions per second and CPU per decision, memory and Redis stores,
three runs each (issue 44, item 2). bench/rls runs this; see its header.

Pinned as bench/run's pinned table: ratewall alone on CPU 1 with one worker; the load
(h2load, HTTP/2 with prior knowledge, N streams over C connections) and redis-server on
CPU 0. Every call is the same framed RateLimitRequest (its message made with the classes
grpcio-tools generates from proto/, as tests/rls/client.py makes them) of one descriptor,
`("user", "u1")`, under a YAML rule of 1000000000 a second (fixed window): every call is
decided, by the store, and allowed.

decisions/s: h2load's requests per second. CPU/decision: ratewall's own user+system time
(/proc/<pid>/stat) over the run, divided by the decisions ratewall_decisions_total counted
({frontend="rls"}), which must equal the calls made (a call answered with a gRPC error
would not count: checked). Raw h2load output goes to bench/results/.
"""

import datetime
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "rls"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import bench as harness  # noqa: E402  (bench/bench.py: its pinning, ports and CPU clock)
import client  # noqa: E402  (tests/rls/client.py: the message generator)

shutil.rmtree(harness.LAB, ignore_errors=True)  # bench.py's own scratch folder, unused here
SERVER_CPU, LOAD_CPU = harness.SERVER_CPU, harness.LOAD_CPU
wait_port = harness.wait_port
TOKEN = "bench-rls-token-0123456789"
CALLS = int(os.environ.get("RLS_CALLS", "200000"))
CONNS = int(os.environ.get("RLS_CONNS", "4"))
STREAMS = int(os.environ.get("RLS_STREAMS", "32"))
RUNS = 3
PATH = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_secs(pid):
    return sum(harness.cpu_seconds(pid))


def decisions(admin):
    text = urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics").read().decode()
    return sum(
        float(l.rsplit(" ", 1)[1])
        for l in text.splitlines()
        if l.startswith("ratewall_decisions_total") and 'frontend="rls"' in l
    )


def body(work):
    client.generate(os.path.join(ROOT, "proto"), work)
    from envoy.service.ratelimit.v3 import rls_pb2

    req = rls_pb2.RateLimitRequest(domain="bench", hits_addend=1)
    req.descriptors.add().entries.add(key="user", value="u1")
    msg = req.SerializeToString()
    path = os.path.join(work, "call.bin")
    with open(path, "wb") as f:
        f.write(b"\0" + len(msg).to_bytes(4, "big") + msg)
    return path


def run(store, n, work, call, results, stamp):
    port, admin, decide = free_port(), free_port(), free_port()
    with open(os.path.join(work, "rl.yaml"), "w") as f:
        f.write("domain: bench\ndescriptors:\n  - key: user\n    rate_limit: { unit: second, requests_per_unit: 1000000000 }\n")
    with open(os.path.join(work, "limits.toml"), "w") as f:
        f.write(
            f'[server]\nlisten = "127.0.0.1:{port}"\nadmin_listen = "127.0.0.1:{admin}"\nworkers = 1\n'
            f'[upstream]\nurl = "http://127.0.0.1:9"\n{store["toml"]}'
            f'[decide]\nlisten = "127.0.0.1:{decide}"\ntoken = "{TOKEN}"\nenvoy_config = "rl.yaml"\n'
        )
    gw = subprocess.Popen(
        ["taskset", "-c", str(SERVER_CPU), os.path.join(harness.RELEASE, "ratewall"), "--config", os.path.join(work, "limits.toml")],
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(work, "ratewall.log"), "w"),
        env={**os.environ, "RUST_LOG": "warn"},
    )
    try:
        wait_port(decide)
        wait_port(admin)
        h2 = ["taskset", "-c", str(LOAD_CPU), "h2load", f"-n{CALLS}", f"-c{CONNS}", f"-m{STREAMS}", "-d", call,
              "-H", "content-type: application/grpc", "-H", "te: trailers", "-H", f"authorization: Bearer {TOKEN}",
              f"http://127.0.0.1:{decide}{PATH}"]
        # A warm-up of a tenth, then the run.
        subprocess.run(h2[:4] + [f"-n{CALLS // 10}"] + h2[5:], capture_output=True, check=True)
        before_cpu, before_n = cpu_secs(gw.pid), decisions(admin)
        out = subprocess.run(h2, capture_output=True, text=True, check=True).stdout
        cpu, counted = cpu_secs(gw.pid) - before_cpu, decisions(admin) - before_n
    finally:
        gw.terminate()
        gw.wait()
    raw = os.path.join(results, f"{stamp}-rls-{store['name']}-{n}.txt")
    with open(raw, "w") as f:
        f.write(f"# bench/rls: {store['name']} store, run {n}; {' '.join(h2)}\n")
        f.write(f"# ratewall cpu {cpu:.2f}s, decisions counted {counted:.0f}\n{out}")
    rps = float(re.search(r"finished in [\d.]+\w+, ([\d.]+) req/s", out).group(1))
    ok = int(re.search(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded", out).group(1))
    if ok != CALLS or int(counted) != CALLS:
        sys.exit(f"{raw}: {ok} of {CALLS} calls succeeded, {counted:.0f} decisions counted: not every call was decided")
    return rps, cpu / counted * 1e6


def main():
    for tool in ("h2load", "taskset", "redis-server"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing (bench/rls installs h2load: apt-get install nghttp2-client)")
    results = os.path.join(ROOT, "bench", "results")
    stamp = datetime.date.today().isoformat()
    work = tempfile.mkdtemp(prefix="bench-rls-")
    call = body(work)
    rport = free_port()
    redis = subprocess.Popen(
        ["taskset", "-c", str(LOAD_CPU), "redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_port(rport)
        stores = [
            {"name": "memory", "toml": '[store]\nbackend = "memory"\n'},
            {"name": "redis", "toml": f'[store]\nbackend = "redis"\nurl = "redis://127.0.0.1:{rport}"\ntimeout = "1s"\n'},
        ]
        print(f"ShouldRateLimit, one descriptor a call, {CALLS} calls a run over {CONNS} h2c connections x {STREAMS} streams;")
        print(f"ratewall on CPU {SERVER_CPU} (workers = 1), h2load and redis-server on CPU {LOAD_CPU}; three runs, median (min-max)")
        print(f"{'store':8} {'decisions/s':>28} {'CPU us/decision':>26}")
        for store in stores:
            got = [run(store, n, work, call, results, stamp) for n in (1, 2, 3)]
            rps = [g[0] for g in got]
            cpu = [g[1] for g in got]
            print(
                f"{store['name']:8} {statistics.median(rps):>12,.0f} ({min(rps):,.0f}-{max(rps):,.0f})"
                f" {statistics.median(cpu):>10.1f} ({min(cpu):.1f}-{max(cpu):.1f})"
            )
    finally:
        redis.terminate()
        redis.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
