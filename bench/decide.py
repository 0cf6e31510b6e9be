#!/usr/bin/env python3
"""The decision service's cost (issue 44, "Measure"): `/v1/decide` one decision a call and
ten a call, on the memory and Redis stores, against a proxied request through the same
gateway on the same kind of rule, and against the same limit done in nginx (`limit_req`
behind `auth_request`), all in one run.

Pinned as bench/run's pinned table is (bench/bench.py's helpers: `start`, `measure`,
`cpu_seconds`): each server under test alone on CPU 1 with one worker (ratewall `workers =
1`, nginx `worker_processes 1`); wrk, the upstream (nginx `return 200`, one worker) and
redis-server on CPU 0. Servers (configs under bench/decide.d/):

- ratewall on the memory store (ratewall-memory.toml) and on the Redis store
  (ratewall-redis.toml), each with its proxy and its `[decide]` listener: rule `r` (`match
  = { proxied = false }`, `key = "api_key"`) for the decision API, rule `p` (`/api`, the
  same kind of rule) for the proxy, both 1,000,000/s burst 100,000: never denied.
- nginx (nginx-peer.conf): POST /v1/decide checks the bearer token, `auth_request`s an
  internal location that applies `limit_req` per key (the same zone as bench/peers'
  per_key) and answers 204, or 429 when the limit is reached; and, for reference, a
  proxied request with `limit_req` (bench/peers/nginx.conf's 18082).

Load: wrk -t1 -c64 (CONNECTIONS, THREADS) for BENCH_SECS (default 8) a case, RUNS rounds
(default 3) with the cases in turn, the medians printed; scripts bench/decide.d/single.lua
(`{"rule":"r","key":"key-N"}`, 100,000 keys in turn, the bearer token; the key also in
X-Api-Key, which the nginx peer keys by), batch.lua (a list of 10 such) and proxied.lua
(GET /api/items, X-Api-Key). Before measuring, each server is checked: ratewall's
answers allowed by rule r (ten of them for a list), its proxied answer carrying
RateLimit, a wrong token refused (401) by ratewall and nginx, and nginx's tight twin
(1 r/m, burst 2) answering the fourth call in a row 429 (one at the rate, two of burst).

CPU per decision: the server process's user + system time (/proc, all its threads and
processes) over the decisions wrk completed; a batch call is 10 decisions. The upstream's
and Redis' CPU are not in it (Redis' is printed apart).

    bench/decide                  # BENCH_SECS=8 RUNS=3
    CALLGRIND=1 bench/decide      # also instructions per decision under callgrind
    CALLGRIND=only bench/decide   # only those

Everything listens on 127.0.0.1, runs for a bounded time and is stopped at the end.
"""

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import urllib.error
import urllib.request

os.environ.setdefault("BENCH_SECS", "8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (bench/bench.py: its helpers, LAB, SECS, RUNS, CONNS, THREADS)
from bench import HERE, LAB, RELEASE, SERVER_CPU, LOAD_CPU, cpu_us, verdict  # noqa: E402

# CALLGRIND=1: instructions per decision under callgrind too; CALLGRIND=only: those alone.
CALLGRIND = os.environ.get("CALLGRIND", "0") in ("1", "only")
CALLGRIND_ONLY = os.environ.get("CALLGRIND", "0") == "only"
TOKEN = "bench-decide-token-0123456789"
UPSTREAM, REDIS = 19480, 19479
MEMORY_PROXY, MEMORY_DECIDE, REDIS_PROXY, REDIS_DECIDE = 19481, 19482, 19483, 19484
NGINX_DECIDE, NGINX_PROXY, NGINX_TIGHT = 19485, 19486, 19487
# Callgrind's gateways: the same configs with their own listeners moved by this much.
CG_SHIFT = 100
BATCH = 10
DIR = os.path.join(HERE, "decide.d")


def call(port, path, body=None, headers=None, method=None):
    """(status, headers, body) of one call to 127.0.0.1:`port`."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body, headers=headers or {},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def decide_headers(key, token=TOKEN):
    return {"Authorization": f"Bearer {token}", "Content-Type": "application/json", "X-Api-Key": key}


def check(cond, what):
    if not cond:
        sys.exit(f"check failed: {what}")


def check_servers():
    """Every server answers as the benchmark assumes before any figure is taken."""
    for name, proxy, decide in (("memory", MEMORY_PROXY, MEMORY_DECIDE), ("redis", REDIS_PROXY, REDIS_DECIDE)):
        status, _, body = call(decide, "/v1/decide", b'{"rule":"r","key":"check-1"}', decide_headers("check-1"))
        a = json.loads(body) if status == 200 else None
        check(status == 200 and a["allowed"] and [r["rule"] for r in a["rules"]] == ["r"],
              f"ratewall {name}: one decision by rule r ({status} {body[:200]!r})")
        batch = json.dumps([{"rule": "r", "key": f"check-{i}"} for i in range(BATCH)]).encode()
        status, _, body = call(decide, "/v1/decide", batch, decide_headers("check-0"))
        a = json.loads(body) if status == 200 else None
        check(status == 200 and len(a) == BATCH and all(x["allowed"] and x["rules"][0]["rule"] == "r" for x in a),
              f"ratewall {name}: a batch of {BATCH} ({status} {body[:200]!r})")
        status, _, _ = call(decide, "/v1/decide", b'{"rule":"r","key":"check-1"}', decide_headers("check-1", "x" * 20))
        check(status == 401, f"ratewall {name}: a wrong token is refused with 401 (got {status})")
        status, headers, body = call(proxy, "/api/items", headers={"X-Api-Key": "check-1"})
        check(status == 200 and body == b"ok\n" and headers.get("RateLimit"),
              f"ratewall {name}: /api proxied and limited by rule p ({status}, RateLimit {headers.get('RateLimit')})")
    status, _, _ = call(NGINX_DECIDE, "/v1/decide", b'{"rule":"r","key":"check-1"}', decide_headers("check-1"))
    check(status == 204, f"nginx: a decision answered 204 (got {status})")
    status, _, _ = call(NGINX_DECIDE, "/v1/decide", b'{"rule":"r","key":"check-1"}', decide_headers("check-1", "x" * 20))
    check(status == 401, f"nginx: a wrong token refused with 401 (got {status})")
    got = [call(NGINX_TIGHT, "/v1/decide", b'{"rule":"r","key":"check-1"}', decide_headers("check-1"))[0]
           for _ in range(4)]
    check(got == [204, 204, 204, 429], f"nginx: the tight twin (1 r/m, burst 2) answers 204 x3 then 429 (got {got})")
    status, _, body = call(NGINX_PROXY, "/api/items", headers={"X-Api-Key": "check-1"})
    check(status == 200 and body == b"ok\n", f"nginx: /api proxied ({status})")


def ratewall_config(name, shift=0):
    """bench/decide.d/`name` with `workers = 1` (and its two listeners moved by `shift`)."""
    text = open(os.path.join(DIR, name)).read()
    for port in (MEMORY_PROXY, MEMORY_DECIDE, REDIS_PROXY, REDIS_DECIDE):
        text = text.replace(f'listen = "127.0.0.1:{port}"', f'listen = "127.0.0.1:{port + shift}"')
    text, n = re.subn(r'^(\[server\]\nlisten = "127.0.0.1:\d+")$', r"\1\nworkers = 1", text, flags=re.M)
    if n != 1:
        sys.exit(f"bench/decide.d/{name}: no [server] listen line")
    return text


def instructions():
    """Instructions per decision (and per proxied request) of ratewall under callgrind,
    each store's gateway alone on CPU 1 (bench.py's `instructions`: 3 s of warm-up, then
    CALLGRIND_SECS of wrk -c8)."""
    counts = {}
    for store, name, proxy, decide in (("memory", "ratewall-memory.toml", MEMORY_PROXY, MEMORY_DECIDE),
                                       ("redis", "ratewall-redis.toml", REDIS_PROXY, REDIS_DECIDE)):
        path = os.path.join(LAB, "callgrind-" + name)
        open(path, "w").write(ratewall_config(name, CG_SHIFT))
        single, batch, proxied = bench.instructions(
            [os.path.join(RELEASE, "ratewall"), "--config", path],
            [(decide + CG_SHIFT, "decide.d/single.lua"), (decide + CG_SHIFT, "decide.d/batch.lua"),
             (proxy + CG_SHIFT, "decide.d/proxied.lua")], dict(os.environ, RUST_LOG="warn"))
        counts[store] = (single, batch / BATCH, proxied)
    return counts


def print_instructions(counts, rev):
    print()
    print(f"instructions under callgrind at {rev} (each gateway alone under valgrind on CPU {SERVER_CPU}, wrk -c8 "
          f"{bench.CALLGRIND_SECS}s after a 3 s warm-up; no SHA-NI under valgrind):")
    for store, (single, batched, proxied) in counts.items():
        print(f"  ratewall {store:7} decide 1 a call {single:9,.0f}/decision   10 a call {batched:9,.0f}/decision"
              f"   proxied /api {proxied:9,.0f}/request   (1 a call / proxied {single / proxied:.2f}x,"
              f" 10 a call / 3 proxied {batched * BATCH / (3 * proxied):.2f}x)")


def main():
    for tool in ("nginx", "wrk", "redis-server", "redis-cli", "taskset") + (
            ("valgrind", "callgrind_control") if CALLGRIND else ()):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: bench/decide installs it")
    if len(os.sched_getaffinity(0) & {SERVER_CPU, LOAD_CPU}) < 2:
        sys.exit(f"bench/decide needs CPUs {LOAD_CPU} and {SERVER_CPU}")
    ports = (UPSTREAM, REDIS, MEMORY_PROXY, MEMORY_DECIDE, REDIS_PROXY, REDIS_DECIDE, NGINX_DECIDE, NGINX_PROXY,
             NGINX_TIGHT)
    bench.check_free(ports + ((MEMORY_PROXY + CG_SHIFT, MEMORY_DECIDE + CG_SHIFT, REDIS_PROXY + CG_SHIFT,
                               REDIS_DECIDE + CG_SHIFT) if CALLGRIND else ()))
    print("building ratewall (release)...", flush=True)
    subprocess.run(["nice", "-n", "10", "cargo", "build", "--release", "--quiet", "--bin", "ratewall"],
                   cwd=bench.ROOT, check=True)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=bench.ROOT, capture_output=True,
                         text=True).stdout.strip()
    for d in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(LAB, d), exist_ok=True)
    bench.start_nginx("decide-upstream.conf", open(os.path.join(DIR, "nginx-upstream.conf")).read(), LOAD_CPU)
    redis = bench.start(["redis-server", "--port", str(REDIS), "--bind", "127.0.0.1", "--save", "",
                         "--appendonly", "no"], LOAD_CPU)
    servers = {"nginx": bench.start_nginx("decide-peer.conf", open(os.path.join(DIR, "nginx-peer.conf")).read(),
                                          SERVER_CPU)}
    for store in ("memory", "redis"):
        servers[store] = bench.start_ratewall(f"decide-{store}.toml", ratewall_config(f"ratewall-{store}.toml"))
    for port in ports:
        bench.wait_port(port)
    bench.check_pinned(set(servers.values()))
    check_servers()

    # (name, port, wrk script, counts Redis calls, the server under test)
    targets = [
        ("ratewall memory: decide, 1 a call", MEMORY_DECIDE, "decide.d/single.lua", False, servers["memory"]),
        ("ratewall memory: decide, 10 a call", MEMORY_DECIDE, "decide.d/batch.lua", False, servers["memory"]),
        ("ratewall memory: proxied /api", MEMORY_PROXY, "decide.d/proxied.lua", False, servers["memory"]),
        ("ratewall redis: decide, 1 a call", REDIS_DECIDE, "decide.d/single.lua", True, servers["redis"]),
        ("ratewall redis: decide, 10 a call", REDIS_DECIDE, "decide.d/batch.lua", True, servers["redis"]),
        ("ratewall redis: proxied /api", REDIS_PROXY, "decide.d/proxied.lua", True, servers["redis"]),
        ("nginx auth_request + limit_req", NGINX_DECIDE, "decide.d/single.lua", False, servers["nginx"]),
        ("nginx limit_req: proxied /api", NGINX_PROXY, "decide.d/proxied.lua", False, servers["nginx"]),
    ]
    if CALLGRIND_ONLY:
        print_instructions(instructions(), rev)
        return
    med = bench.measure(targets, (REDIS, redis), LOAD_CPU, "decide ")
    counts = instructions() if CALLGRIND else {}

    def per(name):
        return BATCH if "10 a call" in name else 1

    peer = med["nginx auth_request + limit_req"]
    peer_cpu = cpu_us(peer)
    print()
    print(f"decide (issue 44) at {rev}: each server alone on CPU {SERVER_CPU}, one worker; wrk, the upstream "
          f"(nginx, 1 worker) and Redis on CPU {LOAD_CPU}")
    print(f"median of {bench.RUNS} rounds, wrk -t{bench.THREADS} -c{bench.CONNS} -d{bench.SECS}s a case")
    print(f"{'':38}{'calls/s':>9}{'decis./s':>10}{'p99 ms':>8}{'non2xx':>7}{'CPU us/call':>13}{'CPU us':>8}"
          f"{'Redis':>7}{'Redis us':>9}{'CPU vs':>8}{'dec./s vs':>10}{'CPU vs':>8}")
    print(f"{'':38}{'':>9}{'':>10}{'':>8}{'':>7}{'user+sys':>13}{'/dec.':>8}{'/dec.':>7}{'/dec.':>9}"
          f"{'nginx':>8}{'nginx':>10}{'proxied':>8}")
    for name, *_ in targets:
        m, k = med[name], per(name)
        cpu = cpu_us(m)
        store = name.split(":")[0]
        proxied = med.get(f"{store}: proxied /api")
        redis_calls = "" if m["redis_per_req"] is None else f"{m['redis_per_req'] / k:.3f}"
        redis_us = "" if m["redis_us"] is None else f"{m['redis_us'] / k:.1f}"
        vs_proxied = "" if proxied is None or proxied is m else f"{cpu / k / cpu_us(proxied):.2f}x"
        split = f"{m['user_us']:.1f}+{m['sys_us']:.1f}"
        print(f"{name:38}{m['rps']:>9.0f}{m['rps'] * k:>10.0f}{m['p99']:>8.2f}{m['non2xx']:>7.0f}{split:>13}"
              f"{cpu / k:>8.2f}{redis_calls:>7}{redis_us:>9}{cpu / k / peer_cpu:>7.2f}x"
              f"{m['rps'] * k / peer['rps']:>9.2f}x{vs_proxied:>8}")
    print("(a call: one wrk request; a decision: one key decided (a proxied request: one request); CPU: user +")
    print(" system time of the server under test (ratewall: the one process, all its threads; nginx: master and")
    print(" worker), not the upstream's nor Redis', each the median of the rounds' (CPU us/dec.: their sum over")
    print(" the decisions of a call); Redis /dec.: script calls per decision, Redis us/dec.:")
    print(" redis-server's CPU per decision; CPU vs nginx: CPU per decision over nginx auth_request + limit_req's;")
    print(" dec./s vs nginx: decisions/s over its; CPU vs proxied: per decision over a proxied request's, same store)")
    if counts:
        print_instructions(counts, rev)
    print()
    print("targets (issue 44): a decision costs less CPU than a proxied request, a call of 10 less than 3")
    for store in ("memory", "redis"):
        proxied = cpu_us(med[f"ratewall {store}: proxied /api"])
        single = cpu_us(med[f"ratewall {store}: decide, 1 a call"])
        batch = cpu_us(med[f"ratewall {store}: decide, 10 a call"])
        print(f"  {store:7} 1 decision  < 1 proxied request  {single:6.1f} vs {proxied:6.1f} us  "
              f"{single / proxied:5.2f}x  {verdict(single < proxied)}")
        print(f"  {store:7} 10 decisions < 3 proxied requests {batch:6.1f} vs {3 * proxied:6.1f} us  "
              f"{batch / (3 * proxied):5.2f}x  {verdict(batch < 3 * proxied)}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, bench.stop)
    signal.signal(signal.SIGHUP, bench.stop)
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted: stopping what was started", file=sys.stderr)
        sys.exit(130)
    finally:
        bench.stop_all()
        shutil.rmtree(LAB, ignore_errors=True)
