#!/usr/bin/env python3
"""ratewall side by side with nginx and HAProxy, on this machine, in one run.

Eight tables, each the median of RUNS runs of the same load, every server driven in turn
by one load process: wrk, or where wrk cannot serve, h2load (gRPC), bench/load's WebSocket
client or examples/tls_handshakes.rs:

- The main table. Starts an upstream that answers at once (nginx `return 200`), nginx as a
  plain proxy, nginx with limit_req, HAProxy with a stick-table limit, nginx with its Lua
  module keeping a token bucket per key in Redis (lua-resty-redis, one EVALSHA per request:
  bench/peers/README.md), a bare hyper proxy with no limiting (examples/hyper_proxy.rs: the
  stack ratewall started from), redis-server, and ratewall on the memory and Redis stores
  (and, for information, with one worker thread), each at its default parallelism; prints
  requests/s, p50/p99 latency, CPU time per request and ratios.
- The pinned table. Each server under test alone on CPU 1 (`taskset -c 1`) with one worker
  process or thread; wrk, the upstream and Redis on CPU 0. Prints requests/s and the CPU
  time per request of the server under test (all its processes, from /proc), and of Redis;
  its context switches per request; and its instructions per request under callgrind (each
  server again, alone under valgrind; CALLGRIND=0 skips that).

Every table's rounds are printed too, each figure as its median and its range over the
RUNS rounds: one round can be 20% off the next on a shared machine, and a figure is read
from the medians of three separate invocations (docs/performance.md says how).

- The TLS table (issue 16). ratewall's TLS listener against nginx `ssl` on the same
  certificate (made with `openssl req` at the start; EC P-256, or RSA 2048 with
  TLS_KEY=rsa), each alone on CPU 1 with one worker, wrk, the upstream and the handshake
  client on CPU 0: requests/s and CPU time per request over kept-alive TLS connections,
  full handshakes/s (examples/tls_handshakes.rs: one connection, handshake and request
  each; wrk cannot do this, it resumes sessions), resumed handshakes/s, and the cleartext
  figures of the same processes beside them.

- The pools table (issue 24), pinned as the pinned table is: three upstream servers (one
  nginx, one worker, `return 200` on three ports) on CPU 0 with wrk; on CPU 1, alone in
  turn: nginx `limit_req` through an `upstream` of the three with `keepalive 64` (and,
  for reference, of one), and ratewall on the memory store through a pool of the three
  (bench/ratewall-pool.toml; and of one), and through the same pool behind 20 routes
  where every request matches the last (bench/keys-route20.lua). Prints requests/s, CPU
  time per request and the ratios: the pool against nginx's upstream, the pool against
  one server, and what the 20 routes add.

- The ws table, pinned as the pools table is: bench/load's WebSocket echo server
  (bench-ws-echo, one thread) and load client (bench-ws-load, one thread: CONNECTIONS
  sockets, each keeping WS_IN_FLIGHT 32-byte text messages in flight, masked, for
  BENCH_SECS once all are open) on CPU 0; on CPU 1, alone in turn: nginx as a WebSocket
  proxy (`proxy_http_version 1.1`, `Upgrade`/`Connection: upgrade`, limit_req per address
  for the upgrade), ratewall on the memory store (bench/ratewall-ws.toml: a rule per client
  address admits the upgrade) and the same with a `messages = { rate, burst }` limit on that
  rule, never reached. Plus the echo server direct. Prints messages/s (a message: one
  round trip), CPU time per message of the server under test, how busy each CPU was, the
  sockets that failed, and the ratios to nginx.
- The grpc table, pinned alike: bench/load's backend (bench-h2-backend, one thread: h2c
  with prior knowledge, a gRPC unary echo with `grpc-status: 0` in trailers) and h2load
  (CONNECTIONS connections, GRPC_STREAMS calls in flight on each) on CPU 0; on CPU 1
  ratewall through an h2c pool (bench/ratewall-h2c.toml on the grpc table's ports) and, for
  information, nginx grpc_pass; and the backend direct. One call to each is checked with
  curl first (its message and grpc-status 0 back). Prints calls/s, CPU time per call and
  the ratios to direct and to nginx.
- The h2 table, pinned alike: bench-h2-backend (HTTP/1.1 and h2c on one port) and wrk on
  CPU 0; on CPU 1 ratewall through a pool of it spoken h2c (bench/ratewall-h2c.toml) and the
  same spoken HTTP/1.1; and the backend direct. Prints requests/s, CPU time per request and
  the ratios h2c / http1.
- The jwt table (issue 26), pinned alike: bench-h2-backend and wrk on CPU 0; on CPU 1
  ratewall with one rule counting by an API key, and the same rule counting by a verified
  token's `sub` (HS256 tokens made here with the standard library, JWT_IDENTITIES of them
  in turn, so each is verified once and then found in the verified-token cache). Prints
  requests/s, CPU time per request and the ratio of the two (target: under 1.05x).

- The keyflood table (issue 42, item 10), pinned alike: nginx `return 200` and wrk on CPU
  0; on CPU 1 ratewall alone, one worker, the memory store with `max_keys` = KEYFLOOD_KEYS
  (default 1,000,000) and a `1000/d` fixed window per API key (bench/soak's flood: states
  that live a day). wrk sends every request with a key never seen before, into a fresh
  gateway (the empty store: fewer keys than `max_keys`, no eviction), and into a fresh
  gateway first filled past `max_keys` by wrk (the full store: every new key evicts the
  least recently used). Prints requests/s of each per round, the medians, and the ratio
  full / empty (target: at least 0.80).

Everything listens on 127.0.0.1, runs for a bounded time and is stopped at the end, also on
Ctrl-C or a failure.

    bench/run                 # BENCH_SECS=10 RUNS=3 CONNECTIONS=64 THREADS=1 by default
    BENCH_ONLY=main bench/run     # only the main table (and memory per key)
    BENCH_ONLY=pinned bench/run   # only the pinned table
    BENCH_ONLY=tls bench/run      # only the TLS table (TLS_KEY=rsa: an RSA 2048 certificate)
    BENCH_ONLY=pools bench/run    # only the pools table
    BENCH_ONLY=ws bench/run       # only the ws table (WS_IN_FLIGHT=8 messages per socket)
    BENCH_ONLY=grpc bench/run     # only the grpc table (GRPC_STREAMS=8 calls per connection)
    BENCH_ONLY=h2 bench/run       # only the h2 table
    BENCH_ONLY=jwt bench/run      # only the jwt table (JWT_IDENTITIES=10000 tokens in turn)
    BENCH_ONLY=settle bench/run   # only the settle table (charge by status and by reported cost)
    BENCH_ONLY=replication bench/run  # only the replication table (async against WAIT 1)
    BENCH_ONLY=keyflood bench/run     # only the key flood table (issue 42, item 10)
"""

import base64
import hashlib
import hmac
import json
import os
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SECS = int(os.environ.get("BENCH_SECS", "10"))
RUNS = int(os.environ.get("RUNS", "3"))
CONNS = int(os.environ.get("CONNECTIONS", "64"))
THREADS = int(os.environ.get("THREADS", "1"))
ONLY = os.environ.get("BENCH_ONLY", "")
LAB = tempfile.mkdtemp(prefix="ratewall-bench-")
# Where cargo puts the release build: CARGO_TARGET_DIR (relative to the repository, where
# cargo runs) if set, as cargo itself reads it.
RELEASE = os.path.join(ROOT, os.environ.get("CARGO_TARGET_DIR") or "target", "release")
# The pinned table's servers listen on the main table's ports + PINNED_SHIFT (so that a
# server of the main table still shutting down never answers for one of the pinned table).
PINNED_SHIFT = 200
# Where the pinned table puts the server under test, and everything else.
SERVER_CPU, LOAD_CPU = 1, 0
procs = []


def start(cmd, cpu=None, env=None):
    """Starts a process in a process group of its own (so that stop_all reaches its children,
    as nginx's workers, and Ctrl-C reaches only this script), on CPU `cpu` if given. Not a
    session of its own: the scheduler's autogroups are per session, and every process of the
    benchmark stays in one, as wrk is."""
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                         preexec_fn=os.setpgrp)
    procs.append(p)
    return p


def start_nginx(name, text, cpu=None):
    """An nginx of its own from a config in bench/peers' form (paths under /tmp/lab), in the
    foreground so that it is one of `procs`; checked first, so a bad config says why."""
    text = text.replace("/tmp/lab/nginx", LAB).replace("/tmp/lab/lua", os.path.join(HERE, "peers", "lua"))
    path = os.path.join(LAB, name)
    open(path, "w").write(text)
    subprocess.run(["nginx", "-q", "-t", "-c", path], check=True)
    return start(["nginx", "-c", path, "-g", "daemon off;"], cpu)


def stop_all():
    """Stops every process started so far, with all the processes of its group. A group is
    signalled only while its leader is not yet reaped, so its id cannot be another's."""
    def signal_group(p, sig):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            pass
    for p in procs:
        signal_group(p, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            signal_group(p, signal.SIGKILL)
            p.wait()
    procs.clear()


def wait_port(port, secs=10):
    end = time.time() + secs
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on {port}")


def check_free(ports):
    """Fails if anything listens on these ports already (another bench run, say): its
    figures would be taken for ours."""
    for port in ports:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            continue
        sys.exit(f"something already listens on 127.0.0.1:{port}: is another bench running?")


def shifted(text, shift):
    """A config with every 127.0.0.1:<port> moved by `shift`."""
    return re.sub(r"127\.0\.0\.1:(\d+)", lambda m: f"127.0.0.1:{int(m.group(1)) + shift}", text)


def redis_cli(port, *args):
    return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True).stdout


def script_calls(port):
    """Script calls Redis has run (EVALSHA, and EVAL when a script was not loaded yet)."""
    return sum(int(n) for n in re.findall(r"cmdstat_eval(?:sha)?:calls=(\d+)",
                                          redis_cli(port, "INFO", "commandstats")))


def process_tree(pid):
    """A process and all its descendants (nginx's master and workers)."""
    children = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(children.get(p, []))
    return tree


def cpu_seconds(pid):
    """User and system CPU seconds a process and its descendants have used so far (all
    their threads; a descendant that exits takes its share with it)."""
    user = system = 0
    for p in process_tree(pid):
        try:
            fields = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user, system = user + int(fields[11]), system + int(fields[12])
    tick = os.sysconf("SC_CLK_TCK")
    return user / tick, system / tick


def ctx_switches(pid):
    """Voluntary and involuntary context switches a process and its descendants have made so
    far, all their threads (/proc/<pid>/task/<tid>/status)."""
    vol = invol = 0
    for p in process_tree(pid):
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                text = open(f"/proc/{p}/task/{t}/status").read()
            except OSError:
                continue
            v = re.search(r"^voluntary_ctxt_switches:\s+(\d+)", text, re.M)
            n = re.search(r"^nonvoluntary_ctxt_switches:\s+(\d+)", text, re.M)
            vol += int(v.group(1)) if v else 0
            invol += int(n.group(1)) if n else 0
    return vol, invol


class Tls(int):
    """A port that speaks TLS (wrk drives it with https://)."""


def unit(value, suffix):
    value = float(value)
    return value * {"us": 1e-3, "ms": 1.0, "s": 1e3}[suffix]


def wrk(port, script, cpu=None):
    """wrk against 127.0.0.1:`port`; over TLS where `port` is a `Tls` port. The "scripts"
    `full-handshakes` and `resumed-handshakes` run examples/tls_handshakes.rs instead (wrk
    resumes its sessions where the server lets it: it cannot count full handshakes). A
    `script` that is a function is the load itself, called as script(port, cpu): the ws
    table's bench-ws-load, the grpc table's h2load."""
    if callable(script):
        return script(port, cpu)
    if script in ("full-handshakes", "resumed-handshakes"):
        return handshakes(port, script == "resumed-handshakes", cpu)
    scheme = "https" if isinstance(port, Tls) else "http"
    cmd = ["wrk", f"-t{THREADS}", f"-c{CONNS}", f"-d{SECS}s", "--latency", "-s", os.path.join(HERE, script),
           f"{scheme}://127.0.0.1:{port}/"]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = unit(*re.search(r"50%\s+([\d.]+)(us|ms|s)", out).groups())
    p99 = unit(*re.search(r"99%\s+([\d.]+)(us|ms|s)", out).groups())
    total = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": rps, "p50": p50, "p99": p99, "total": total, "non2xx": int(non2xx.group(1)) if non2xx else 0}


def handshakes(port, resume, cpu=None):
    """examples/tls_handshakes.rs against 127.0.0.1:`port`: CONNS connections at once, each
    a TLS 1.3 handshake (full, or resumed where the server takes the session back) and one
    request with `Connection: close`."""
    cmd = [os.path.join(RELEASE, "examples", "tls_handshakes"), f"127.0.0.1:{port}", str(CONNS), str(SECS)]
    if resume:
        cmd.append("--resume")
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    f = dict(zip(out.split()[::2], out.split()[1::2]))
    total = int(f["requests"])
    return {"rps": int(f["ok"]) / float(f["seconds"]), "p50": float(f["p50_ms"]), "p99": float(f["p99_ms"]),
            "total": total, "non2xx": int(f["failed"]), "resumed": int(f["resumed"]) / max(total, 1)}


def measure(targets, redis, wrk_cpu=None, label="", backends=(), per="req/s"):
    """Drives each target in turn, RUNS times; returns the medians of each figure by name
    (of a figure named `err_*`, the largest of the runs: one bad run shows).

    A target is (name, port, wrk script, counts Redis calls, the process whose CPU time is
    measured, with its descendants, or None). `redis` is redis-server's port and process:
    the Redis calls per request, and Redis' CPU time per request, of each target that
    counts Redis calls. `busy` is that process's CPU time over the run's length (1.0: a
    whole CPU); `load_busy` that of the load client (wrk or its stand-in, from its
    rusage) and of the `backends` processes together, where the ones on the load CPU
    leave it. `per` names a figure of the load's in the progress lines."""
    redis_port, redis_proc = redis
    results = {}
    for run in range(RUNS):
        for name, port, script, counts_redis, proc in targets:
            before = script_calls(redis_port) if counts_redis else None
            cpu_before = cpu_seconds(proc.pid) if proc else None
            cs_before = ctx_switches(proc.pid) if proc else None
            redis_before = cpu_seconds(redis_proc.pid) if counts_redis else None
            backends_before = sum(sum(cpu_seconds(b.pid)) for b in backends)
            children_before = resource.getrusage(resource.RUSAGE_CHILDREN)
            r = wrk(port, script, wrk_cpu)
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            secs = r.pop("seconds", SECS)
            load = (children.ru_utime - children_before.ru_utime + children.ru_stime - children_before.ru_stime
                    + sum(sum(cpu_seconds(b.pid)) for b in backends) - backends_before)
            r["load_busy"] = load / secs
            n = max(r["total"], 1)
            r["redis_per_req"] = (script_calls(redis_port) - before) / n if counts_redis else None
            r["redis_us"] = sum(cpu_seconds(redis_proc.pid)) - sum(redis_before) if counts_redis else None
            if r["redis_us"] is not None:
                r["redis_us"] *= 1e6 / n
            if proc:
                (u0, s0), (u1, s1) = cpu_before, cpu_seconds(proc.pid)
                r["user_us"] = (u1 - u0) * 1e6 / n
                r["sys_us"] = (s1 - s0) * 1e6 / n
                r["busy"] = (u1 - u0 + s1 - s0) / secs
                (v0, i0), (v1, i1) = cs_before, ctx_switches(proc.pid)
                r["vcs"], r["ivcs"] = (v1 - v0) / n, (i1 - i0) / n
            else:
                r["user_us"] = r["sys_us"] = r["busy"] = r["vcs"] = r["ivcs"] = None
            results.setdefault(name, []).append(r)
            p99 = "" if r["p99"] is None else f"  p99 {r['p99']:.2f} ms"
            errors = "".join(f"  {k[4:]} {v:.0f}" for k, v in r.items() if k.startswith("err_") and v)
            print(f"  {label}run {run + 1}/{RUNS} {name:40} {r['rps']:>9.0f} {per}{p99}{errors}", flush=True)
    def pick(k):
        return max if k.startswith("err_") else statistics.median
    med = {n: {k: pick(k)(x[k] for x in rs) if rs[0][k] is not None else None for k in rs[0]}
           for n, rs in results.items()}
    rounds(results, label, per)
    return med


# The figures `rounds` shows the spread of, as they are named in `measure`'s results.
ROUND_FIGURES = (("rps", "{:,.0f}", ""), ("p99", "{:.2f}", " ms"), ("cpu", "{:.1f}", " us"),
                 ("vcs", "{:.3f}", ""), ("ivcs", "{:.3f}", ""))


def rounds(results, label, per):
    """Each target's figures over its RUNS rounds: the median and, in brackets, the range
    (least to most), so that a reader sees how far one round is from the next. CPU: user +
    system per request of the server under test; vcs/ivcs: its voluntary and involuntary
    context switches per request (all its threads)."""
    if RUNS < 2:
        return
    print(f"  {label}rounds: median [range] of {RUNS}; {per}, p99, CPU per request, context switches per "
          f"request (voluntary, involuntary)")
    for name, rs in results.items():
        cells = []
        for key, fmt, suffix in ROUND_FIGURES:
            xs = [cpu_us(x) if key == "cpu" else x.get(key) for x in rs]
            if any(v is None for v in xs):
                continue
            cells.append(f"{key} {fmt.format(statistics.median(xs))}{suffix} "
                         f"[{fmt.format(min(xs))}-{fmt.format(max(xs))}]")
        print(f"    {name:40} " + "  ".join(cells))


def cpu_us(m):
    return None if m["user_us"] is None else m["user_us"] + m["sys_us"]


def verdict(ok):
    return "met" if ok else "NOT met"


def main_table():
    """Every server at its default parallelism, sharing the machine with wrk and the upstream."""
    check_free((18080, 18081, 18082, 18083, 18084, 16379, 18085, 18086, 18087, 18088, 18089, 18090,
                18091, 18092))
    binary = os.path.join(RELEASE, "ratewall")
    for d in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(LAB, d), exist_ok=True)
    start_nginx("nginx.conf", open(os.path.join(HERE, "peers", "nginx.conf")).read())
    haproxy = start(["haproxy", "-db", "-f", os.path.join(HERE, "peers", "haproxy.cfg")])
    redis = start(["redis-server", "--port", "16379", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
    # An nginx of its own (it loads the Lua module), so its CPU time is its alone.
    lua = start_nginx("nginx-lua-redis.conf", open(os.path.join(HERE, "peers", "nginx-lua-redis.conf")).read())
    env = dict(os.environ, RUST_LOG="warn")  # nginx runs with access_log off: so does ratewall
    gateways = {name: start([binary, "--config", os.path.join(HERE, name)], env=env)
                for name in ("ratewall-memory.toml", "ratewall-redis.toml", "ratewall-redis-tight.toml")}
    # The same two gateways with one worker thread instead of one per core: on a machine the
    # gateway shares with wrk and the upstream, how much its own parallelism costs it.
    for name, port in (("ratewall-memory.toml", 18089), ("ratewall-redis-tight.toml", 18090)):
        text = open(os.path.join(HERE, name)).read()
        text = re.sub(r'listen = "127.0.0.1:\d+"', f'listen = "127.0.0.1:{port}"\nworkers = 1', text)
        path = os.path.join(LAB, "one-worker-" + name)
        open(path, "w").write(text)
        gateways["one-worker-" + name] = start([binary, "--config", path], env=env)
    # hyper's server and client with nothing else: what the stack costs before any limiting
    bare = start([os.path.join(RELEASE, "examples", "hyper_proxy"), "127.0.0.1:18088", "http://127.0.0.1:18080"])
    for port in (18080, 18081, 18082, 18083, 18084, 16379, 18085, 18086, 18087, 18088, 18089, 18090, 18091, 18092):
        wait_port(port)

    # (name, port, wrk script, counts Redis calls, the process whose CPU time is measured:
    # none for nginx, whose proxies share their worker processes with the upstream)
    targets = [
        ("direct to upstream", 18080, "keys.lua", False, None),
        ("nginx proxy_pass", 18081, "keys.lua", False, None),
        ("nginx limit_req", 18082, "keys.lua", False, None),
        ("HAProxy stick table", 18083, "keys.lua", False, haproxy),
        ("nginx + Lua + Redis (lua-resty-redis)", 18091, "keys.lua", True, lua),
        ("bare hyper proxy (no limiting)", 18088, "keys.lua", False, bare),
        ("ratewall memory", 18085, "keys.lua", False, gateways["ratewall-memory.toml"]),
        ("ratewall redis", 18086, "keys.lua", True, gateways["ratewall-redis.toml"]),
        ("ratewall memory, 1 worker", 18089, "keys.lua", False, gateways["one-worker-ratewall-memory.toml"]),
        ("nginx limit_req, one key (abuse)", 18084, "one-key.lua", False, None),
        ("nginx + Lua + Redis, one key (abuse)", 18092, "one-key.lua", True, lua),
        ("ratewall redis, one key (abuse)", 18087, "one-key.lua", True, gateways["ratewall-redis-tight.toml"]),
        ("ratewall redis, abuse, 1 worker", 18090, "one-key.lua", True,
         gateways["one-worker-ratewall-redis-tight.toml"]),
    ]
    med = measure(targets, (16379, redis))

    nginx_lr, haproxy, direct = med["nginx limit_req"], med["HAProxy stick table"], med["direct to upstream"]
    nginx_proxy = med["nginx proxy_pass"]
    print()
    print(f"median of {RUNS} runs, wrk -t{THREADS} -c{CONNS} -d{SECS}s, {os.cpu_count()} cores")
    print(f"{'':40}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'non-2xx':>10}{'Redis/req':>11}"
          f"{'CPU us/req':>12}{'cs/req':>13}{'vs nginx lr':>12}{'vs HAProxy':>11}")
    for name, _, _, _, _ in targets:
        m = med[name]
        per = "" if m["redis_per_req"] is None else f"{m['redis_per_req']:.3f}"
        cpu = "" if m["user_us"] is None else f"{m['user_us']:.1f}+{m['sys_us']:.1f}"
        cs = "" if m["vcs"] is None else f"{m['vcs']:.3f}+{m['ivcs']:.3f}"
        print(f"{name:40}{m['rps']:>10.0f}{m['p50']:>9.2f}{m['p99']:>9.2f}{m['non2xx']:>10.0f}{per:>11}{cpu:>12}"
              f"{cs:>13}{m['rps'] / nginx_lr['rps']:>11.2f}x{m['rps'] / haproxy['rps']:>10.2f}x")
    print("(CPU us/req: user+system CPU time of the server under test per request, where it runs in processes of")
    print(" its own (nginx + Lua + Redis: its master and workers); cs/req: its context switches per request, voluntary")
    print(" + involuntary, all its threads; Redis/req: script calls (EVALSHA, EVAL) per request;")
    print(" the 1-worker rows: ratewall with [server] workers = 1, for information, not a target)")
    lua_allowed, lua_abuse = med["nginx + Lua + Redis (lua-resty-redis)"], med["nginx + Lua + Redis, one key (abuse)"]
    print()
    print("ratewall's Redis store against nginx + Lua + Redis (requests/s):")
    for name, peer in (("ratewall redis", lua_allowed), ("ratewall redis, one key (abuse)", lua_abuse),
                       ("ratewall redis, abuse, 1 worker", lua_abuse)):
        print(f"  {name:38} {med[name]['rps'] / peer['rps']:5.2f}x  at {med[name]['redis_per_req']:.3f} Redis "
              f"calls/req against {peer['redis_per_req']:.3f}")
    abuse_nginx, abuse_rw = med["nginx limit_req, one key (abuse)"], med["ratewall redis, one key (abuse)"]
    print()
    print("targets (issues 8 and 15), from the medians above:")
    checks = [
        ("memory store >= 1.0x HAProxy", med["ratewall memory"]["rps"] / haproxy["rps"], 1.0),
        ("memory store >= 1.2x nginx limit_req", med["ratewall memory"]["rps"] / nginx_lr["rps"], 1.2),
        ("redis store >= 1.0x nginx limit_req", med["ratewall redis"]["rps"] / nginx_lr["rps"], 1.0),
        ("redis store >= 2.0x nginx + Lua + Redis", med["ratewall redis"]["rps"] / lua_allowed["rps"], 2.0),
        ("abuse: denied/s >= 1.0x nginx limit_req", abuse_rw["rps"] / abuse_nginx["rps"], 1.0),
    ]
    for label, ratio, goal in checks:
        print(f"  {label:44} {ratio:5.2f}x  {verdict(ratio >= goal)}")
    per = med["ratewall redis"]["redis_per_req"]
    print(f"  {'redis calls per allowed request <= 1.00':44} {per:5.3f}   {verdict(round(per, 3) <= 1.0)}")
    per = abuse_rw["redis_per_req"]
    print(f"  {'redis calls per denied request <= 0.01':44} {per:5.3f}   {verdict(round(per, 3) <= 0.01)}")
    added_rw = med["ratewall memory"]["p99"] - direct["p99"]
    added_nginx = nginx_proxy["p99"] - direct["p99"]
    print(f"  {'added p99: ratewall memory vs nginx proxy':44} {added_rw:+.2f} ms vs {added_nginx:+.2f} ms  "
          f"{verdict(added_rw <= added_nginx)}")
    print()
    print("memory per tracked key (memory store):")
    out = subprocess.run([os.path.join(RELEASE, "examples", "measure_memory")],
                         capture_output=True, text=True, check=True).stdout
    print("  " + "\n  ".join(out.strip().splitlines()[:6]))


# Instructions per request (callgrind) beside the pinned table's CPU figures: CALLGRIND=0
# skips them. Each server runs under valgrind on its pinned port + CALLGRIND_SHIFT, warmed
# up, then counted over CALLGRIND_SECS of wrk with 8 connections (valgrind is ~50x slower).
CALLGRIND = os.environ.get("CALLGRIND", "1") != "0"
CALLGRIND_SHIFT = 100
CALLGRIND_SECS = int(os.environ.get("CALLGRIND_SECS", "10"))


def wrk_count(port, script, secs, conns=8):
    """The requests one wrk run of `secs` completed against `port` (on the load CPU)."""
    out = subprocess.run(["taskset", "-c", str(LOAD_CPU), "wrk", "-t1", f"-c{conns}", f"-d{secs}s",
                          "-s", os.path.join(HERE, script), f"http://127.0.0.1:{port}/"],
                         capture_output=True, text=True, check=True).stdout
    return int(re.search(r"(\d+) requests in", out).group(1))


def instructions(cmd, ports, env=None):
    """Instructions per request of a server under callgrind (all its threads), for each
    (port, wrk script) in `ports`: started on the server CPU under valgrind, warmed up with
    3 s of wrk, its counters zeroed, driven for CALLGRIND_SECS, and dumped. Unlike CPU time,
    the count barely moves between runs: the figure to guard regressions with. (Under
    valgrind the CPU lacks SHA-NI and AVX-512, so what uses them counts more than it runs.)"""
    out = os.path.join(LAB, f"callgrind-{ports[0][0]}.out")
    p = start(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *cmd], SERVER_CPU, env)
    counts = []
    try:
        for i, (port, script) in enumerate(ports):
            wait_port(port, 60)
            wrk_count(port, script, 3)
            subprocess.run(["callgrind_control", "-z", str(p.pid)], capture_output=True, check=True)
            n = wrk_count(port, script, CALLGRIND_SECS)
            subprocess.run(["callgrind_control", "-d", str(p.pid)], capture_output=True, check=True)
            dump = f"{out}.{i + 1}"
            for _ in range(100):
                if os.path.exists(dump) and "totals:" in open(dump, errors="replace").read()[-4096:]:
                    break
                time.sleep(0.1)
            total = int(re.search(r"^summary: (\d+)", open(dump, errors="replace").read(), re.M).group(1))
            counts.append(total / max(n, 1))
    finally:
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        procs.remove(p)
    return counts


def pinned_instructions(configs, s):
    """Instructions per request of the pinned table's servers under test, by row name, each
    alone under callgrind with the pinned table's config moved by CALLGRIND_SHIFT (the
    upstream and Redis stay those of the pinned table). `configs`: name -> (kind, text)."""
    c = CALLGRIND_SHIFT

    def moved(text):
        text = shifted(text, c)
        for port in (18080 + s, 16379 + s):
            text = text.replace(f"127.0.0.1:{port + c}", f"127.0.0.1:{port}")
            text = text.replace(f"port={port + c}", f"port={port}")
        return text

    counts = {}
    print(f"  callgrind: each server alone under valgrind, wrk -c8 {CALLGRIND_SECS}s after a 3 s warm-up", flush=True)
    nginx = moved(configs["nginx"]).replace("nginx.pid", "nginx-cg.pid")
    path = os.path.join(LAB, "callgrind-nginx.conf")
    open(path, "w").write("master_process off;\n" + nginx)
    subprocess.run(["nginx", "-q", "-t", "-c", path], check=True)
    counts["nginx limit_req"], counts["nginx limit_req, one key (abuse)"] = instructions(
        ["nginx", "-c", path, "-g", "daemon off;"], [(18082 + s + c, "keys.lua"), (18084 + s + c, "one-key.lua")])
    path = os.path.join(LAB, "callgrind-haproxy.cfg")
    open(path, "w").write(moved(configs["haproxy"]))
    counts["HAProxy stick table"], = instructions(["haproxy", "-db", "-f", path], [(18083 + s + c, "keys.lua")])
    counts["bare hyper proxy (no limiting)"], = instructions(
        [os.path.join(RELEASE, "examples", "hyper_proxy"), f"127.0.0.1:{18088 + s + c}", f"http://127.0.0.1:{18080 + s}"],
        [(18088 + s + c, "keys.lua")])
    env = dict(os.environ, RUST_LOG="warn")
    for row, name, port, script in (("ratewall memory", "ratewall-memory.toml", 18085, "keys.lua"),
                                    ("ratewall redis", "ratewall-redis.toml", 18086, "keys.lua"),
                                    ("ratewall redis, one key (abuse)", "ratewall-redis-tight.toml", 18087,
                                     "one-key.lua")):
        path = os.path.join(LAB, "callgrind-" + name)
        open(path, "w").write(moved(configs[name]))
        counts[row], = instructions([os.path.join(RELEASE, "ratewall"), "--config", path],
                                    [(port + s + c, script)], env)
    return counts


def one_worker_nginx(text, keep_upstream):
    """nginx.conf for the pinned table: one worker, and either only the upstream's server
    (keep_upstream) or everything but it, each nginx with its own pid file and error log."""
    upstream = re.compile(r"^\s*server \{ listen 127\.0\.0\.1:18080;.*$", re.M)
    if not upstream.search(text):
        sys.exit("bench/peers/nginx.conf: no upstream server on 18080 to move to CPU 0")
    if keep_upstream:
        text = re.sub(r"^\s*server \{ listen (?!127\.0\.0\.1:18080;).*$\n?", "", text, flags=re.M)
        text = text.replace("nginx.pid", "nginx-upstream.pid").replace("error.log", "error-upstream.log")
    else:
        text = upstream.sub("", text)
    text, n = re.subn(r"^worker_processes \w+;", "worker_processes 1;", text, flags=re.M)
    if n != 1:
        sys.exit("an nginx config without a worker_processes line")
    return shifted(text, PINNED_SHIFT)


def pinned_table():
    """Each server under test alone on CPU 1 with one worker process or thread; wrk, the
    upstream and Redis on CPU 0. What each server spends per request, with the hand-overs
    between the processes on one CPU out of its figure."""
    s = PINNED_SHIFT
    check_free(p + s for p in (18080, 18081, 18082, 18083, 18084, 16379, 18085, 18086, 18087, 18088, 18091, 18092))
    binary = os.path.join(RELEASE, "ratewall")
    for d in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(LAB, d), exist_ok=True)
    nginx_conf = open(os.path.join(HERE, "peers", "nginx.conf")).read()
    start_nginx("pinned-upstream.conf", one_worker_nginx(nginx_conf, True), LOAD_CPU)
    redis = start(["redis-server", "--port", str(16379 + s), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                  LOAD_CPU)
    configs = {"nginx": one_worker_nginx(nginx_conf, False).replace("/tmp/lab/nginx", LAB)}
    servers = {"nginx": start_nginx("pinned-nginx.conf", configs["nginx"], SERVER_CPU)}
    text = shifted(open(os.path.join(HERE, "peers", "haproxy.cfg")).read(), s)
    text, n = re.subn(r"^global$", "global\n  nbthread 1", text, flags=re.M)
    if n != 1:
        sys.exit("bench/peers/haproxy.cfg: no global section")
    path = os.path.join(LAB, "pinned-haproxy.cfg")
    open(path, "w").write(text)
    configs["haproxy"] = text
    servers["haproxy"] = start(["haproxy", "-db", "-f", path], SERVER_CPU)
    text = open(os.path.join(HERE, "peers", "nginx-lua-redis.conf")).read()
    text = re.sub(r"^worker_processes \w+;", "worker_processes 1;", text, flags=re.M)
    servers["lua"] = start_nginx("pinned-nginx-lua-redis.conf", shifted(text, s).replace("nginx-lua.pid", "nginx-lua-pinned.pid"),
                                 SERVER_CPU)
    env = dict(os.environ, RUST_LOG="warn")
    for name in ("ratewall-memory.toml", "ratewall-redis.toml", "ratewall-redis-tight.toml"):
        text = shifted(open(os.path.join(HERE, name)).read(), s)
        text, n = re.subn(r'^(listen = "127.0.0.1:\d+")$', r"\1\nworkers = 1", text, flags=re.M)
        if n != 1:
            sys.exit(f"bench/{name}: no listen line")
        path = os.path.join(LAB, "pinned-" + name)
        open(path, "w").write(text)
        configs[name] = text
        servers[name] = start([binary, "--config", path], SERVER_CPU, env)
    # available_parallelism() counts the CPUs it may run on: one worker thread
    servers["bare"] = start([os.path.join(RELEASE, "examples", "hyper_proxy"), f"127.0.0.1:{18088 + s}",
                             f"http://127.0.0.1:{18080 + s}"], SERVER_CPU)
    for port in (18080, 18081, 18082, 18083, 18084, 16379, 18085, 18086, 18087, 18088, 18091, 18092):
        wait_port(port + s)
    for proc in procs:
        want = {SERVER_CPU} if proc in servers.values() else {LOAD_CPU}
        for pid in process_tree(proc.pid):
            if os.sched_getaffinity(pid) != want:
                sys.exit(f"process {pid} runs on CPUs {sorted(os.sched_getaffinity(pid))}, not {sorted(want)}")

    # (name, port, wrk script, counts Redis calls, the server under test: all its processes)
    targets = [
        ("nginx proxy_pass", 18081 + s, "keys.lua", False, servers["nginx"]),
        ("nginx limit_req", 18082 + s, "keys.lua", False, servers["nginx"]),
        ("HAProxy stick table", 18083 + s, "keys.lua", False, servers["haproxy"]),
        ("bare hyper proxy (no limiting)", 18088 + s, "keys.lua", False, servers["bare"]),
        ("ratewall memory", 18085 + s, "keys.lua", False, servers["ratewall-memory.toml"]),
        ("ratewall redis", 18086 + s, "keys.lua", True, servers["ratewall-redis.toml"]),
        ("nginx + Lua + Redis (lua-resty-redis)", 18091 + s, "keys.lua", True, servers["lua"]),
        ("nginx limit_req, one key (abuse)", 18084 + s, "one-key.lua", False, servers["nginx"]),
        ("ratewall redis, one key (abuse)", 18087 + s, "one-key.lua", True, servers["ratewall-redis-tight.toml"]),
        ("nginx + Lua + Redis, one key (abuse)", 18092 + s, "one-key.lua", True, servers["lua"]),
    ]
    med = measure(targets, (16379 + s, redis), LOAD_CPU, "pinned ")
    haproxy, nginx_lr = med["HAProxy stick table"], med["nginx limit_req"]
    ir = pinned_instructions(configs, s) if CALLGRIND else {}
    print()
    print(f"pinned: the server under test alone on CPU {SERVER_CPU}, one worker/thread; wrk, the upstream (nginx, "
          f"1 worker) and Redis on CPU {LOAD_CPU}")
    print(f"median of {RUNS} runs, wrk -t{THREADS} -c{CONNS} -d{SECS}s")
    print(f"{'':40}{'req/s':>9}{'p99 ms':>8}{'CPU us/req':>12}{'instr':>8}{'cs/req':>13}{'Redis/req':>10}"
          f"{'Redis us':>9}{'CPU vs':>8}{'CPU vs':>8}{'req/s vs':>9}{'req/s vs':>9}")
    print(f"{'':40}{'':>9}{'':>8}{'user+sys':>12}{'/req':>8}{'vol+invol':>13}{'':>10}{'/req':>9}"
          f"{'HAProxy':>8}{'nginx lr':>9}{'HAProxy':>8}{'nginx lr':>9}")
    for name, _, _, _, _ in targets:
        m = med[name]
        per = "" if m["redis_per_req"] is None else f"{m['redis_per_req']:.3f}"
        redis_us = "" if m["redis_us"] is None else f"{m['redis_us']:.1f}"
        instr = f"{ir[name]:,.0f}" if name in ir else ""
        cs = f"{m['vcs']:.3f}+{m['ivcs']:.3f}"
        print(f"{name:40}{m['rps']:>9.0f}{m['p99']:>8.2f}{m['user_us']:>6.1f}+{m['sys_us']:<5.1f}{instr:>8}{cs:>13}"
              f"{per:>10}{redis_us:>9}"
              f"{cpu_us(m) / cpu_us(haproxy):>7.2f}x{cpu_us(m) / cpu_us(nginx_lr):>8.2f}x"
              f"{m['rps'] / haproxy['rps']:>8.2f}x{m['rps'] / nginx_lr['rps']:>8.2f}x")
    print("(CPU us/req: user+system CPU time of the server under test per request, all its processes (nginx: master")
    print(" and worker); instr/req: its instructions per request under callgrind (CALLGRIND=0 skips them; nginx + Lua")
    print(" is not run under valgrind); cs/req: its context switches per request, voluntary + involuntary, all its")
    print(" threads; Redis us/req: redis-server's CPU time per request; CPU vs: the server's CPU per request over")
    print(" HAProxy's or nginx limit_req's, lower is leaner; the abuse rows are measured against the allowed rows too)")
    lua_allowed, lua_abuse = med["nginx + Lua + Redis (lua-resty-redis)"], med["nginx + Lua + Redis, one key (abuse)"]
    print()
    print("targets (issue 15), from the pinned medians above:")
    memory = cpu_us(med["ratewall memory"])
    for label, peer in (("HAProxy", haproxy), ("nginx limit_req", nginx_lr)):
        print(f"  {'memory store CPU us/req <= ' + label:44} {memory:5.1f} vs {cpu_us(peer):5.1f}  "
              f"{verdict(memory <= cpu_us(peer))}")
    for label, ours, peer in (("redis store", med["ratewall redis"], lua_allowed),
                              ("abuse", med["ratewall redis, one key (abuse)"], lua_abuse)):
        ratio = ours["rps"] / peer["rps"]
        print(f"  {label + ' req/s >= 2.0x nginx + Lua + Redis':44} {ratio:5.2f}x  {verdict(ratio >= 2.0)}  "
              f"(CPU us/req {cpu_us(ours):.1f} + Redis {ours['redis_us']:.1f} against "
              f"{cpu_us(peer):.1f} + {peer['redis_us']:.1f})")


# The TLS table's ports: the upstream (on CPU 0), then nginx and ratewall (each alone on CPU 1),
# each with a cleartext and a TLS listener.
TLS_UPSTREAM, NGINX_PLAIN, NGINX_TLS, RATEWALL_PLAIN, RATEWALL_TLS = 18380, 18381, 18382, 18385, 18386
# The certificate both serve: EC P-256 by default, TLS_KEY=rsa for RSA 2048.
TLS_KEY = os.environ.get("TLS_KEY", "ec")

NGINX_TLS_CONF = """
worker_processes 1;
pid /tmp/lab/nginx/nginx-tls.pid;
error_log /tmp/lab/nginx/error-tls.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path /tmp/lab/nginx/body;
  proxy_temp_path /tmp/lab/nginx/proxy;
  fastcgi_temp_path /tmp/lab/nginx/fcgi;
  uwsgi_temp_path /tmp/lab/nginx/uwsgi;
  scgi_temp_path /tmp/lab/nginx/scgi;
  upstream backend { server 127.0.0.1:UPSTREAM; keepalive 64; }
  map $http_x_api_key $rl_key { default $http_x_api_key; }
  limit_req_zone $rl_key zone=per_key:20m rate=1000000r/s;
  ssl_certificate /tmp/lab/nginx/cert.pem;
  ssl_certificate_key /tmp/lab/nginx/key.pem;
  ssl_protocols TLSv1.2 TLSv1.3;
  ssl_session_cache shared:SSL:10m;
  server {
    listen 127.0.0.1:PLAIN;
    listen 127.0.0.1:TLS ssl http2;
    location / { limit_req zone=per_key burst=100000 nodelay; limit_req_status 429; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_pass http://backend; }
  }
}
"""


def make_certificate():
    """A self-signed certificate for 127.0.0.1 in LAB (as the README's quick start makes one)."""
    new_key = ["-newkey", "rsa:2048"] if TLS_KEY == "rsa" else ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
    subprocess.run(["openssl", "req", "-x509", *new_key, "-nodes", "-days", "2", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", os.path.join(LAB, "key.pem"), "-out", os.path.join(LAB, "cert.pem")],
                   check=True, capture_output=True)


def tls_table():
    """ratewall's TLS listener against nginx `ssl` on the same certificate, pinned as the
    pinned table is: each alone on CPU 1 with one worker, wrk and the upstream on CPU 0.
    Requests/s and CPU time per request over kept-alive TLS connections, and with one
    request per connection (`Connection: close`: a full handshake each, wrk resumes no
    session: the full-handshake rows use examples/tls_handshakes.rs); the cleartext
    figures of the same two processes beside them."""
    check_free((TLS_UPSTREAM, NGINX_PLAIN, NGINX_TLS, RATEWALL_PLAIN, RATEWALL_TLS))
    if TLS_KEY not in ("ec", "rsa"):
        sys.exit(f"TLS_KEY={TLS_KEY}: ec or rsa")
    binary = os.path.join(RELEASE, "ratewall")
    for d in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(LAB, d), exist_ok=True)
    make_certificate()
    upstream = f"""worker_processes 1;
pid /tmp/lab/nginx/nginx-tls-upstream.pid;
error_log /tmp/lab/nginx/error-tls-upstream.log warn;
events {{ worker_connections 4096; }}
http {{ access_log off; client_body_temp_path /tmp/lab/nginx/body;
  server {{ listen 127.0.0.1:{TLS_UPSTREAM}; location / {{ return 200 "ok\\n"; }} }} }}
"""
    start_nginx("tls-upstream.conf", upstream, LOAD_CPU)
    conf = (NGINX_TLS_CONF.replace("UPSTREAM", str(TLS_UPSTREAM)).replace("PLAIN", str(NGINX_PLAIN))
            .replace(":TLS ssl", f":{NGINX_TLS} ssl"))
    nginx = start_nginx("tls-nginx.conf", conf, SERVER_CPU)
    text = open(os.path.join(HERE, "ratewall-memory.toml")).read()
    text, n = re.subn(r'^listen = "127.0.0.1:\d+"$',
                      f'listen = "127.0.0.1:{RATEWALL_PLAIN}"\nworkers = 1\n\n[server.tls]\n'
                      f'listen = "127.0.0.1:{RATEWALL_TLS}"\n'
                      f'certificates = [{{ cert = "cert.pem", key = "key.pem" }}]', text, flags=re.M)
    text = text.replace("127.0.0.1:18080", f"127.0.0.1:{TLS_UPSTREAM}")
    if n != 1:
        sys.exit("bench/ratewall-memory.toml: no listen line")
    path = os.path.join(LAB, "tls-ratewall-memory.toml")
    open(path, "w").write(text)
    ratewall = start([binary, "--config", path], SERVER_CPU, dict(os.environ, RUST_LOG="warn"))
    for port in (TLS_UPSTREAM, NGINX_PLAIN, NGINX_TLS, RATEWALL_PLAIN, RATEWALL_TLS):
        wait_port(port)
    for proc in procs:
        want = {SERVER_CPU} if proc in (nginx, ratewall) else {LOAD_CPU}
        for pid in process_tree(proc.pid):
            if os.sched_getaffinity(pid) != want:
                sys.exit(f"process {pid} runs on CPUs {sorted(os.sched_getaffinity(pid))}, not {sorted(want)}")

    targets = [
        ("nginx limit_req, cleartext", NGINX_PLAIN, "keys.lua", False, nginx),
        ("ratewall memory, cleartext", RATEWALL_PLAIN, "keys.lua", False, ratewall),
        ("nginx ssl limit_req, kept-alive TLS", Tls(NGINX_TLS), "keys.lua", False, nginx),
        ("ratewall memory, kept-alive TLS", Tls(RATEWALL_TLS), "keys.lua", False, ratewall),
        ("nginx limit_req, connection each", NGINX_PLAIN, "keys-close.lua", False, nginx),
        ("ratewall memory, connection each", RATEWALL_PLAIN, "keys-close.lua", False, ratewall),
        ("nginx ssl limit_req, full handshake each", Tls(NGINX_TLS), "full-handshakes", False, nginx),
        ("ratewall memory, full handshake each", Tls(RATEWALL_TLS), "full-handshakes", False, ratewall),
        ("nginx ssl limit_req, resumed where it can", Tls(NGINX_TLS), "resumed-handshakes", False, nginx),
        ("ratewall memory, resumed where it can", Tls(RATEWALL_TLS), "resumed-handshakes", False, ratewall),
    ]
    med = measure(targets, (None, None), LOAD_CPU, "tls ")
    version = subprocess.run(["openssl", "version"], capture_output=True, text=True).stdout.strip()
    print()
    print(f"TLS: the server under test alone on CPU {SERVER_CPU}, one worker; wrk and the upstream (nginx, 1 worker) "
          f"on CPU {LOAD_CPU}; certificate {'RSA 2048' if TLS_KEY == 'rsa' else 'EC P-256'}, TLS 1.3 "
          f"(wrk's {version})")
    print(f"median of {RUNS} runs, wrk -t{THREADS} -c{CONNS} -d{SECS}s")
    print(f"{'':42}{'req/s':>9}{'p99 ms':>8}{'CPU us/req':>12}{'failed':>8}{'resumed':>8}{'req/s vs':>10}"
          f"{'CPU vs':>8}")
    print(f"{'':42}{'':>9}{'':>8}{'user+sys':>12}{'':>8}{'':>8}{'nginx':>10}{'nginx':>8}")
    for i, (name, _, _, _, _) in enumerate(targets):
        m, peer = med[name], med[targets[i - i % 2][0]]
        resumed = f"{m['resumed']:.0%}" if "resumed" in m else ""
        print(f"{name:42}{m['rps']:>9.0f}{m['p99']:>8.2f}{m['user_us']:>6.1f}+{m['sys_us']:<5.1f}{m['non2xx']:>8.0f}"
              f"{resumed:>8}{m['rps'] / peer['rps']:>9.2f}x{cpu_us(m) / cpu_us(peer):>7.2f}x")
    print("(each ratewall row against the nginx row above it; CPU us/req: user+system CPU time of the server under")
    print(" test per request, all its processes; failed: non-2xx answers, or connections that failed; the handshake")
    print(" rows are examples/tls_handshakes.rs (rustls, TLS 1.3, X25519): one connection, one handshake and one")
    print(" request each; \"resumed where it can\" offers the last session's ticket, and `resumed` is the share the")
    print(" server took back)")
    print()
    print("targets (issue 16), from the medians above:")
    for label, ours, peer in (("kept-alive TLS req/s", "ratewall memory, kept-alive TLS",
                               "nginx ssl limit_req, kept-alive TLS"),
                              ("full handshakes/s", "ratewall memory, full handshake each",
                               "nginx ssl limit_req, full handshake each")):
        ratio = med[ours]["rps"] / med[peer]["rps"]
        cpu = cpu_us(med[peer]) / cpu_us(med[ours])
        print(f"  {label + ' >= 1.0x nginx':44} {ratio:5.2f}x  {verdict(ratio >= 1.0)}  "
              f"(per CPU second: {cpu:.2f}x)")


# The pools table's ports: the three upstream servers (on CPU 0), nginx's upstream of three
# and of one, ratewall's pool of three, of one, and of three behind 20 routes (on CPU 1).
POOL_UPSTREAMS = (18480, 18481, 18482)
NGINX_POOL, NGINX_ONE, RATEWALL_POOL, RATEWALL_ONE, RATEWALL_ROUTES = 18483, 18484, 18486, 18485, 18487

NGINX_POOL_CONF = """
worker_processes 1;
pid /tmp/lab/nginx/nginx-pool.pid;
error_log /tmp/lab/nginx/error-pool.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path /tmp/lab/nginx/body;
  proxy_temp_path /tmp/lab/nginx/proxy;
  fastcgi_temp_path /tmp/lab/nginx/fcgi;
  uwsgi_temp_path /tmp/lab/nginx/uwsgi;
  scgi_temp_path /tmp/lab/nginx/scgi;
  upstream three { server 127.0.0.1:UP0; server 127.0.0.1:UP1; server 127.0.0.1:UP2; keepalive 64; }
  upstream one { server 127.0.0.1:UP0; keepalive 64; }
  map $http_x_api_key $rl_key { default $http_x_api_key; }
  limit_req_zone $rl_key zone=per_key:20m rate=1000000r/s;
  server { listen 127.0.0.1:POOL; location / { limit_req zone=per_key burst=100000 nodelay; limit_req_status 429; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_pass http://three; } }
  server { listen 127.0.0.1:ONE; location / { limit_req zone=per_key burst=100000 nodelay; limit_req_status 429; proxy_http_version 1.1; proxy_set_header Connection ""; proxy_pass http://one; } }
}
"""


def pool_configs():
    """bench/ratewall-pool.toml with one worker, and the two configs made from it: one
    server instead of three, and the pool named `api` behind 20 routes (`/svc1/` to
    `/svc20/`, no pool `default`) of which bench/keys-route20.lua's requests match the
    last. (name, port, config text) each."""
    text = open(os.path.join(HERE, "ratewall-pool.toml")).read()
    text, n = re.subn(r'^(listen = "127.0.0.1:\d+")$', r"\1\nworkers = 1", text, flags=re.M)
    if n != 1 or f"127.0.0.1:{RATEWALL_POOL}" not in text:
        sys.exit(f"bench/ratewall-pool.toml: no listen line on {RATEWALL_POOL}")
    servers = re.compile(r"^servers = \[.*\]$", re.M)
    if not servers.search(text):
        sys.exit("bench/ratewall-pool.toml: no servers line")
    one = servers.sub(f'servers = ["http://127.0.0.1:{POOL_UPSTREAMS[0]}"]', text)
    one = one.replace(f"127.0.0.1:{RATEWALL_POOL}", f"127.0.0.1:{RATEWALL_ONE}")
    routes = text.replace(f"127.0.0.1:{RATEWALL_POOL}", f"127.0.0.1:{RATEWALL_ROUTES}")
    routes = routes.replace('name = "default"', 'name = "api"')
    routes += "".join(f'[[routes]]\nname = "svc{i}"\nmatch = {{ path_prefix = "/svc{i}/" }}\nupstream = "api"\n'
                      for i in range(1, 21))
    return [("pool", RATEWALL_POOL, text), ("one", RATEWALL_ONE, one), ("routes", RATEWALL_ROUTES, routes)]


def pools_table():
    """ratewall's pools against nginx's `upstream`, pinned as the pinned table is: each
    server under test alone on CPU 1 with one worker; wrk and the three upstream servers
    (one nginx, one worker) on CPU 0. Requests/s and CPU time per request."""
    check_free((*POOL_UPSTREAMS, NGINX_POOL, NGINX_ONE, RATEWALL_POOL, RATEWALL_ONE, RATEWALL_ROUTES))
    binary = os.path.join(RELEASE, "ratewall")
    for d in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(LAB, d), exist_ok=True)
    listens = " ".join(f"listen 127.0.0.1:{p};" for p in POOL_UPSTREAMS)
    upstream = f"""worker_processes 1;
pid /tmp/lab/nginx/nginx-pool-upstream.pid;
error_log /tmp/lab/nginx/error-pool-upstream.log warn;
events {{ worker_connections 4096; }}
http {{ access_log off; client_body_temp_path /tmp/lab/nginx/body;
  server {{ {listens} location / {{ return 200 "ok\\n"; }} }} }}
"""
    start_nginx("pool-upstream.conf", upstream, LOAD_CPU)
    conf = NGINX_POOL_CONF.replace("POOL", str(NGINX_POOL)).replace(":ONE", f":{NGINX_ONE}")
    for i, port in enumerate(POOL_UPSTREAMS):
        conf = conf.replace(f"UP{i}", str(port))
    nginx = start_nginx("pool-nginx.conf", conf, SERVER_CPU)
    env = dict(os.environ, RUST_LOG="warn")
    gateways = {}
    for name, _, text in pool_configs():
        path = os.path.join(LAB, f"ratewall-{name}.toml")
        open(path, "w").write(text)
        gateways[name] = start([binary, "--config", path], SERVER_CPU, env)
    for port in (*POOL_UPSTREAMS, NGINX_POOL, NGINX_ONE, RATEWALL_POOL, RATEWALL_ONE, RATEWALL_ROUTES):
        wait_port(port)
    for proc in procs:
        want = {SERVER_CPU} if proc in (nginx, *gateways.values()) else {LOAD_CPU}
        for pid in process_tree(proc.pid):
            if os.sched_getaffinity(pid) != want:
                sys.exit(f"process {pid} runs on CPUs {sorted(os.sched_getaffinity(pid))}, not {sorted(want)}")

    targets = [
        ("nginx limit_req, upstream of 3", NGINX_POOL, "keys.lua", False, nginx),
        ("ratewall memory, pool of 3", RATEWALL_POOL, "keys.lua", False, gateways["pool"]),
        ("nginx limit_req, upstream of 1", NGINX_ONE, "keys.lua", False, nginx),
        ("ratewall memory, pool of 1", RATEWALL_ONE, "keys.lua", False, gateways["one"]),
        ("ratewall memory, pool of 3, 20 routes", RATEWALL_ROUTES, "keys-route20.lua", False, gateways["routes"]),
    ]
    med = measure(targets, (None, None), LOAD_CPU, "pools ")
    print()
    print(f"pools: the server under test alone on CPU {SERVER_CPU}, one worker; wrk and the three upstream servers "
          f"(nginx, 1 worker) on CPU {LOAD_CPU}")
    print(f"median of {RUNS} runs, wrk -t{THREADS} -c{CONNS} -d{SECS}s")
    print(f"{'':40}{'req/s':>9}{'p99 ms':>8}{'CPU us/req':>12}{'non-2xx':>9}")
    print(f"{'':40}{'':>9}{'':>8}{'user+sys':>12}{'':>9}")
    for name, _, _, _, _ in targets:
        m = med[name]
        print(f"{name:40}{m['rps']:>9.0f}{m['p99']:>8.2f}{m['user_us']:>6.1f}+{m['sys_us']:<5.1f}{m['non2xx']:>9.0f}")
    print("(CPU us/req: user+system CPU time of the server under test per request, all its processes (nginx: master")
    print(" and worker, which serves both of its upstream rows); the 20-routes row's requests match only the last")
    print(" route, /svc20/)")
    pool, peer = med["ratewall memory, pool of 3"], med["nginx limit_req, upstream of 3"]
    one, routes = med["ratewall memory, pool of 1"], med["ratewall memory, pool of 3, 20 routes"]
    print()
    print("targets (issue 24), from the medians above:")
    ratio = pool["rps"] / peer["rps"]
    print(f"  {'pool of 3 req/s >= 1.0x nginx upstream':44} {ratio:5.2f}x  {verdict(ratio >= 1.0)}")
    ratio = cpu_us(pool) / cpu_us(peer)
    print(f"  {'pool of 3 CPU us/req <= 1.0x nginx upstream':44} {ratio:5.2f}x  {verdict(ratio <= 1.0)}  "
          f"({cpu_us(pool):.1f} vs {cpu_us(peer):.1f})")
    print("for information:")
    print(f"  {'pool of 3 against pool of 1, CPU us/req':44} {cpu_us(pool) - cpu_us(one):+5.1f}   "
          f"({cpu_us(pool):.1f} vs {cpu_us(one):.1f}; req/s {pool['rps'] / one['rps']:.2f}x)")
    print(f"  {'20 routes, the last matching, CPU us/req':44} {cpu_us(routes) - cpu_us(pool):+5.1f}   "
          f"({cpu_us(routes):.1f} vs {cpu_us(pool):.1f}; req/s {routes['rps'] / pool['rps']:.2f}x)")


def bench_binary(name):
    """A binary of bench/load (the ratewall-bench crate), built by main."""
    return os.path.join(RELEASE, name)


def check_pinned(servers):
    """Fails unless every process started so far (and each of its children) runs where it
    should: the `servers` under test on SERVER_CPU, everything else on LOAD_CPU."""
    for proc in procs:
        want = {SERVER_CPU} if proc in servers else {LOAD_CPU}
        for pid in process_tree(proc.pid):
            if os.sched_getaffinity(pid) != want:
                sys.exit(f"process {pid} runs on CPUs {sorted(os.sched_getaffinity(pid))}, not {sorted(want)}")


def with_one_worker(text, port, what):
    """A ratewall config with `workers = 1` under its listen line, which must be on `port`."""
    text, n = re.subn(r'^(listen = "127.0.0.1:\d+")$', r"\1\nworkers = 1", text, flags=re.M)
    if n != 1 or f'listen = "127.0.0.1:{port}"' not in text:
        sys.exit(f"{what}: no listen line on {port}")
    return text


def start_ratewall(name, text, cpu=SERVER_CPU):
    path = os.path.join(LAB, name)
    open(path, "w").write(text)
    return start([os.path.join(RELEASE, "ratewall"), "--config", path], cpu, dict(os.environ, RUST_LOG="warn"))


def fmt_pct(x):
    return "" if x is None else f"{x:.0%}"


def fmt_cpu(m, digits=1):
    if m["user_us"] is None:
        return f"{'':12}"
    return f"{m['user_us']:>6.{digits}f}+{m['sys_us']:<5.{digits}f}"


def fmt_ratio(a, b):
    return "" if a is None or b is None else f"{a / b:.2f}x"


# The ws table: the echo server (on CPU 0), nginx as a WebSocket proxy, and ratewall
# without and with a `messages` limit (each alone on CPU 1). Messages kept in flight per
# socket, and their size.
WS_ECHO, NGINX_WS, RATEWALL_WS, RATEWALL_WS_METERED = 18580, 18583, 18586, 18587
WS_IN_FLIGHT = int(os.environ.get("WS_IN_FLIGHT", "8"))
WS_SIZE = 32
# Never reached: a socket takes a tenth of a second of the rate at a time (100,000
# frames), and the 64 sockets' first takes fit in the burst with room to spare.
WS_MESSAGES = 'messages = { rate = "1000000/s", burst = 10000000 }'

NGINX_WS_CONF = """
worker_processes 1;
pid /tmp/lab/nginx/nginx-ws.pid;
error_log /tmp/lab/nginx/error-ws.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path /tmp/lab/nginx/body;
  proxy_temp_path /tmp/lab/nginx/proxy;
  fastcgi_temp_path /tmp/lab/nginx/fcgi;
  uwsgi_temp_path /tmp/lab/nginx/uwsgi;
  scgi_temp_path /tmp/lab/nginx/scgi;
  limit_req_zone $binary_remote_addr zone=per_ip:1m rate=1000000r/s;
  server {
    listen 127.0.0.1:NGINX;
    location / {
      limit_req zone=per_ip burst=100000 nodelay; limit_req_status 429;
      proxy_http_version 1.1;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection "upgrade";
      proxy_read_timeout 1h; proxy_send_timeout 1h;
      proxy_pass http://127.0.0.1:ECHO;
    }
  }
}
"""


def ws_load(port, cpu=None):
    """bench-ws-load against 127.0.0.1:`port`: CONNS sockets, WS_IN_FLIGHT messages of
    WS_SIZE bytes in flight on each, for SECS seconds once all are open. A "request" is one
    message's round trip; `non2xx` the sockets refused an upgrade."""
    cmd = [bench_binary("bench-ws-load"), f"127.0.0.1:{port}", str(CONNS), str(WS_IN_FLIGHT), str(SECS), str(WS_SIZE)]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    for line in run.stderr.strip().splitlines():
        print(f"    bench-ws-load, port {port}: {line}", flush=True)
    f = dict(zip(run.stdout.split()[::2], run.stdout.split()[1::2]))
    secs, messages = float(f["seconds"]), int(f["messages"])
    if messages == 0:
        sys.exit(f"no message came back through {port}: {run.stdout.strip()}")
    return {"rps": messages / secs, "p50": int(f["p50_us"]) / 1e3, "p99": int(f["p99_us"]) / 1e3,
            "total": messages, "non2xx": int(f["refused"]), "seconds": secs, "min_per_conn": int(f["min_per_conn"]),
            "err_refused": int(f["refused"]), "err_failed": int(f["failed"]), "err_closed": int(f["closed"]),
            "err_stalled": int(f["stalled"]), "err_unclean": int(f["unclean"])}


def ws_table():
    """WebSocket echo messages through ratewall against nginx as a WebSocket proxy, pinned
    as the pools table is: each server under test alone on CPU 1 with one worker;
    bench-ws-load and bench-ws-echo (one thread each) on CPU 0. Messages/s and the CPU
    time per message of the server under test."""
    check_free((WS_ECHO, NGINX_WS, RATEWALL_WS, RATEWALL_WS_METERED))
    for d in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(LAB, d), exist_ok=True)
    echo = start([bench_binary("bench-ws-echo"), f"127.0.0.1:{WS_ECHO}"], LOAD_CPU)
    nginx = start_nginx("ws-nginx.conf", NGINX_WS_CONF.replace("NGINX", str(NGINX_WS)).replace("ECHO", str(WS_ECHO)),
                        SERVER_CPU)
    text = with_one_worker(open(os.path.join(HERE, "ratewall-ws.toml")).read(), RATEWALL_WS, "bench/ratewall-ws.toml")
    if f"127.0.0.1:{WS_ECHO}" not in text:
        sys.exit(f"bench/ratewall-ws.toml: no upstream on {WS_ECHO}")
    metered, n = re.subn(r"^(burst = \d+)$", rf"\1\n{WS_MESSAGES}", text, count=1, flags=re.M)
    if n != 1:
        sys.exit("bench/ratewall-ws.toml: no burst line in its rule")
    metered = metered.replace(f"127.0.0.1:{RATEWALL_WS}", f"127.0.0.1:{RATEWALL_WS_METERED}")
    ratewall = start_ratewall("ws-ratewall.toml", text)
    ratewall_metered = start_ratewall("ws-ratewall-messages.toml", metered)
    for port in (WS_ECHO, NGINX_WS, RATEWALL_WS, RATEWALL_WS_METERED):
        wait_port(port)
    check_pinned((nginx, ratewall, ratewall_metered))

    targets = [
        ("direct to the echo server", WS_ECHO, ws_load, False, None),
        ("nginx WebSocket proxy, limit_req", NGINX_WS, ws_load, False, nginx),
        ("ratewall memory", RATEWALL_WS, ws_load, False, ratewall),
        ("ratewall memory, messages limit", RATEWALL_WS_METERED, ws_load, False, ratewall_metered),
    ]
    med = measure(targets, (None, None), LOAD_CPU, "ws ", (echo,), "msgs/s")
    print()
    print(f"ws: the server under test alone on CPU {SERVER_CPU}, one worker; bench-ws-load and bench-ws-echo (one "
          f"thread each) on CPU {LOAD_CPU}")
    print(f"median of {RUNS} runs, {CONNS} sockets x {WS_IN_FLIGHT} messages in flight, {WS_SIZE}-byte text, "
          f"{SECS} s")
    print(f"{'':36}{'msgs/s':>9}{'p50 ms':>8}{'p99 ms':>8}{'CPU us/msg':>12}{'CPU1':>6}{'CPU0':>6}{'errors':>8}"
          f"{'msgs/s vs':>11}{'CPU vs':>8}")
    print(f"{'':36}{'':>9}{'':>8}{'':>8}{'user+sys':>12}{'':>6}{'':>6}{'':>8}{'nginx':>11}{'nginx':>8}")
    peer = med["nginx WebSocket proxy, limit_req"]
    for name, _, _, _, _ in targets:
        m = med[name]
        errors = sum(v for k, v in m.items() if k.startswith("err_"))
        print(f"{name:36}{m['rps']:>9.0f}{m['p50']:>8.2f}{m['p99']:>8.2f}{fmt_cpu(m, 2)}{fmt_pct(m['busy']):>6}"
              f"{fmt_pct(m['load_busy']):>6}{errors:>8.0f}{fmt_ratio(m['rps'], peer['rps']):>11}"
              f"{fmt_ratio(cpu_us(m), cpu_us(peer)):>8}")
    print("(a message: one echo's round trip, a frame each way through the server under test; CPU us/msg: user+system")
    print(" CPU time of the server under test per message, all its processes; CPU1: that CPU time over the run's")
    print(f" length; CPU0: bench-ws-load's and bench-ws-echo's, where the load side leaves CPU {LOAD_CPU}; errors:")
    print(" sockets refused an upgrade, broken, closed early by the server, without an echo in the run's last second,")
    print(" or whose close got none back, the most of any run; the messages row's rule carries")
    print(f" `{WS_MESSAGES}`, never reached)")
    ours, metered = med["ratewall memory"], med["ratewall memory, messages limit"]
    print()
    print("targets, from the medians above:")
    for label, m in (("ratewall msgs/s >= 1.0x nginx", ours), ("with a messages limit, msgs/s >= 1.0x nginx", metered)):
        ratio = m["rps"] / peer["rps"]
        print(f"  {label:44} {ratio:5.2f}x  {verdict(ratio >= 1.0)}  (CPU us/msg {cpu_us(m):.2f} vs "
              f"{cpu_us(peer):.2f})")
    print("for information:")
    print(f"  {'the messages limit, CPU us/msg':44} {cpu_us(metered) - cpu_us(ours):+5.2f}   "
          f"({cpu_us(metered):.2f} vs {cpu_us(ours):.2f}; msgs/s {metered['rps'] / ours['rps']:.2f}x)")


# The grpc table: bench-h2-backend (on CPU 0), nginx grpc_pass and ratewall's h2c pool (each
# alone on CPU 1). Streams h2load keeps open per connection.
GRPC_BACKEND, NGINX_GRPC, RATEWALL_GRPC = 18680, 18683, 18686
GRPC_STREAMS = int(os.environ.get("GRPC_STREAMS", "8"))
# The call's one message: a protobuf `string` field 1, "hello, ratewall".
GRPC_PAYLOAD = b"\x0a\x0fhello, ratewall"
GRPC_PATH = "/bench.Echo/Say"

NGINX_GRPC_CONF = """
worker_processes 1;
pid /tmp/lab/nginx/nginx-grpc.pid;
error_log /tmp/lab/nginx/error-grpc.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path /tmp/lab/nginx/body;
  proxy_temp_path /tmp/lab/nginx/proxy;
  fastcgi_temp_path /tmp/lab/nginx/fcgi;
  uwsgi_temp_path /tmp/lab/nginx/uwsgi;
  scgi_temp_path /tmp/lab/nginx/scgi;
  # h2load does not reconnect: at the default keepalive_requests (1000) each of its
  # connections would end after 1000 calls (GOAWAY), and the run with it.
  keepalive_requests 100000000;
  upstream grpc_backend { server 127.0.0.1:BACKEND; keepalive KEEPALIVE; keepalive_requests 100000000; }
  map $http_x_api_key $rl_key { default $http_x_api_key; }
  limit_req_zone $rl_key zone=per_key:20m rate=1000000r/s;
  server {
    listen 127.0.0.1:NGINX http2;
    location / { limit_req zone=per_key burst=100000 nodelay; limit_req_status 429; grpc_pass grpc://grpc_backend; }
  }
}
"""


def grpc_message():
    """The file h2load sends as each call's body: the message, length-prefixed (the gRPC
    over HTTP/2 framing: not compressed, a 4-byte big-endian length)."""
    path = os.path.join(LAB, "grpc-message.bin")
    open(path, "wb").write(b"\x00" + len(GRPC_PAYLOAD).to_bytes(4, "big") + GRPC_PAYLOAD)
    return path


def grpc_call_check(port):
    """One call to 127.0.0.1:`port` with curl, over h2c: fails unless it is answered 200
    with the message sent back and `grpc-status: 0` in the trailers (h2load counts
    statuses, not gRPC's)."""
    cmd = ["curl", "-sv", "--http2-prior-knowledge", "--max-time", "5", "-H", "content-type: application/grpc",
           "-H", "te: trailers", "-H", "x-api-key: grpc-bench", "--data-binary", "@" + grpc_message(),
           "-o", os.path.join(LAB, "grpc-answer.bin"), f"http://127.0.0.1:{port}{GRPC_PATH}"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line.strip() for line in run.stderr.splitlines() if line.startswith("< ")]
    body = open(os.path.join(LAB, "grpc-answer.bin"), "rb").read() if run.returncode == 0 else b""
    if "< HTTP/2 200" not in lines or "< grpc-status: 0" not in lines or body[5:] != GRPC_PAYLOAD:
        sys.exit(f"a gRPC call to {port} was not answered with its message and grpc-status 0: curl exited "
                 f"{run.returncode}, said {lines}, body {body!r}")


def h2load(port, cpu=None):
    """h2load against 127.0.0.1:`port`, over h2c: CONNS connections, GRPC_STREAMS calls in
    flight on each, for SECS seconds, each call a POST of grpc_message(). A "request" is a
    call answered 2xx (h2load's `succeeded`); `non2xx` the calls answered otherwise, and
    `failed` those plus the 2xx ones whose stream then failed. h2load gives no percentiles:
    `mean` and `max` latency, in ms."""
    cmd = ["h2load", f"-c{CONNS}", f"-m{GRPC_STREAMS}", "-t1", "-D", str(SECS), "-d", grpc_message(),
           "-H", "content-type: application/grpc", "-H", "te: trailers", "-H", "x-api-key: grpc-bench",
           f"http://127.0.0.1:{port}{GRPC_PATH}"]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    secs = float(re.search(r"finished in ([\d.]+)s", out).group(1))
    done = re.search(r"(\d+) succeeded, (\d+) failed, (\d+) errored, (\d+) timeout", out)
    succeeded, failed, errored, timeout = (int(x) for x in done.groups())
    if succeeded == 0:
        sys.exit(f"no call to {port} succeeded: {out.strip()}")
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", out)
    non2xx = sum(int(x) for x in codes.groups()[1:])
    latency = re.search(r"time for request:\s+([\d.]+)(us|ms|s)\s+([\d.]+)(us|ms|s)\s+([\d.]+)(us|ms|s)", out)
    return {"rps": succeeded / secs, "p50": None, "p99": None, "mean": unit(*latency.group(5, 6)),
            "max": unit(*latency.group(3, 4)), "total": succeeded, "non2xx": non2xx, "seconds": secs,
            "err_failed": failed, "err_errored": errored, "err_timeout": timeout}


def grpc_table():
    """gRPC unary calls through ratewall's h2c pool against direct to the backend (and,
    for information, nginx grpc_pass), pinned as the pools table is: the server under test
    alone on CPU 1 with one worker; h2load and bench-h2-backend (one thread each) on CPU 0.
    Calls/s and the CPU time per call of the server under test."""
    check_free((GRPC_BACKEND, NGINX_GRPC, RATEWALL_GRPC))
    for d in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(LAB, d), exist_ok=True)
    backend = start([bench_binary("bench-h2-backend"), f"127.0.0.1:{GRPC_BACKEND}"], LOAD_CPU)
    # nginx sends one call per upstream connection at a time: it keeps as many idle as there
    # are calls in flight, or it would open and close connections all the run long.
    conf = (NGINX_GRPC_CONF.replace("BACKEND", str(GRPC_BACKEND)).replace(":NGINX", f":{NGINX_GRPC}")
            .replace("KEEPALIVE", str(CONNS * GRPC_STREAMS)))
    nginx = start_nginx("grpc-nginx.conf", conf, SERVER_CPU)
    text = shifted(open(os.path.join(HERE, "ratewall-h2c.toml")).read(), GRPC_BACKEND - H2_BACKEND)
    ratewall = start_ratewall("grpc-ratewall.toml", with_one_worker(text, RATEWALL_GRPC, "bench/ratewall-h2c.toml"))
    for port in (GRPC_BACKEND, NGINX_GRPC, RATEWALL_GRPC):
        wait_port(port)
    check_pinned((nginx, ratewall))
    for port in (GRPC_BACKEND, NGINX_GRPC, RATEWALL_GRPC):
        grpc_call_check(port)

    targets = [
        ("direct to the backend", GRPC_BACKEND, h2load, False, None),
        ("nginx grpc_pass, limit_req", NGINX_GRPC, h2load, False, nginx),
        ("ratewall memory, h2c pool", RATEWALL_GRPC, h2load, False, ratewall),
    ]
    med = measure(targets, (None, None), LOAD_CPU, "grpc ", (backend,), "calls/s")
    version = subprocess.run(["h2load", "--version"], capture_output=True, text=True).stdout.strip()
    print()
    print(f"grpc: the server under test alone on CPU {SERVER_CPU}, one worker; h2load ({version}) and "
          f"bench-h2-backend (one thread each) on CPU {LOAD_CPU}")
    print(f"median of {RUNS} runs, h2load -c{CONNS} -m{GRPC_STREAMS} -D {SECS}, unary calls of a "
          f"{len(GRPC_PAYLOAD)}-byte message, echoed")
    print(f"{'':32}{'calls/s':>9}{'mean ms':>9}{'max ms':>8}{'CPU us/call':>12}{'CPU1':>6}{'CPU0':>6}{'errors':>8}"
          f"{'calls/s vs':>11}{'CPU vs':>8}")
    print(f"{'':32}{'':>9}{'':>9}{'':>8}{'user+sys':>12}{'':>6}{'':>6}{'':>8}{'direct':>11}{'nginx':>8}")
    direct, peer = med["direct to the backend"], med["nginx grpc_pass, limit_req"]
    for name, _, _, _, _ in targets:
        m = med[name]
        errors = sum(v for k, v in m.items() if k.startswith("err_"))
        print(f"{name:32}{m['rps']:>9.0f}{m['mean']:>9.2f}{m['max']:>8.1f}{fmt_cpu(m)}{fmt_pct(m['busy']):>6}"
              f"{fmt_pct(m['load_busy']):>6}{errors:>8.0f}{fmt_ratio(m['rps'], direct['rps']):>11}"
              f"{fmt_ratio(cpu_us(m), cpu_us(peer)):>8}")
    print("(CPU us/call: user+system CPU time of the server under test per call, all its processes; CPU1: that CPU")
    print(f" time over the run's length; CPU0: h2load's and the backend's, where the load side leaves CPU {LOAD_CPU};")
    print(" errors: calls h2load counts failed (answered other than 2xx, or their stream broke), errored or timed")
    print(" out, the most of any run; one call to each, checked with curl before the runs, came back with its message")
    print(" and grpc-status 0; every call has one x-api-key, both servers a per-key limit too high to deny; nginx")
    print(f" keeps {CONNS * GRPC_STREAMS} idle upstream connections, one a call in flight: it multiplexes none)")
    ours = med["ratewall memory, h2c pool"]
    print()
    print("for information, from the medians above:")
    print(f"  {'ratewall h2c pool calls/s against direct':44} {ours['rps'] / direct['rps']:5.2f}x")
    print(f"  {'ratewall h2c pool against nginx grpc_pass':44} {ours['rps'] / peer['rps']:5.2f}x calls/s, "
          f"{cpu_us(ours) / cpu_us(peer):.2f}x CPU us/call ({cpu_us(ours):.1f} vs {cpu_us(peer):.1f})")


# The h2 table: bench-h2-backend (on CPU 0), and ratewall through a pool of it spoken
# HTTP/1.1 and one spoken h2c (each alone on CPU 1).
H2_BACKEND, RATEWALL_H1, RATEWALL_H2C = 18780, 18785, 18786


def pinned_rows(targets, med, base, against):
    """The rows of a pinned table of ratewall against itself: requests/s, p99, CPU time per
    request, how busy each CPU was, and the ratios to `base` (the row named `against`)."""
    print(f"{'':36}{'req/s':>9}{'p99 ms':>8}{'CPU us/req':>12}{'CPU1':>6}{'CPU0':>6}{'non-2xx':>9}{'req/s vs':>10}"
          f"{'CPU vs':>8}")
    print(f"{'':36}{'':>9}{'':>8}{'user+sys':>12}{'':>6}{'':>6}{'':>9}{against:>10}{against:>8}")
    for name, _, _, _, _ in targets:
        m = med[name]
        print(f"{name:36}{m['rps']:>9.0f}{m['p99']:>8.2f}{fmt_cpu(m)}{fmt_pct(m['busy']):>6}"
              f"{fmt_pct(m['load_busy']):>6}{m['non2xx']:>9.0f}{fmt_ratio(m['rps'], base['rps']):>10}"
              f"{fmt_ratio(cpu_us(m), cpu_us(base)):>8}")


def h2_table():
    """ratewall's HTTP/2 pools (h2c) against its HTTP/1.1 ones, to the same backend, pinned
    as the pools table is: ratewall alone on CPU 1 with one worker; wrk and
    bench-h2-backend (one thread, HTTP/1.1 and h2c on one port) on CPU 0. Requests/s and
    CPU time per request."""
    check_free((H2_BACKEND, RATEWALL_H1, RATEWALL_H2C))
    backend = start([bench_binary("bench-h2-backend"), f"127.0.0.1:{H2_BACKEND}"], LOAD_CPU)
    h2c = with_one_worker(open(os.path.join(HERE, "ratewall-h2c.toml")).read(), RATEWALL_H2C, "bench/ratewall-h2c.toml")
    http1, n = re.subn(r'^protocol = "h2c"$', 'protocol = "http1"', h2c, flags=re.M)
    if n != 1 or f"127.0.0.1:{H2_BACKEND}" not in h2c:
        sys.exit(f'bench/ratewall-h2c.toml: no protocol = "h2c" line, or no server on {H2_BACKEND}')
    http1 = http1.replace(f"127.0.0.1:{RATEWALL_H2C}", f"127.0.0.1:{RATEWALL_H1}")
    gateways = {"http1": start_ratewall("h2-ratewall-http1.toml", http1),
                "h2c": start_ratewall("h2-ratewall-h2c.toml", h2c)}
    for port in (H2_BACKEND, RATEWALL_H1, RATEWALL_H2C):
        wait_port(port)
    check_pinned(gateways.values())

    targets = [
        ("direct to the backend (HTTP/1.1)", H2_BACKEND, "keys.lua", False, None),
        ("ratewall memory, http1 pool", RATEWALL_H1, "keys.lua", False, gateways["http1"]),
        ("ratewall memory, h2c pool", RATEWALL_H2C, "keys.lua", False, gateways["h2c"]),
    ]
    med = measure(targets, (None, None), LOAD_CPU, "h2 ", (backend,))
    print()
    print(f"h2: ratewall alone on CPU {SERVER_CPU}, one worker; wrk and bench-h2-backend (one thread: HTTP/1.1 and h2c) "
          f"on CPU {LOAD_CPU}")
    print(f"median of {RUNS} runs, wrk -t{THREADS} -c{CONNS} -d{SECS}s (HTTP/1.1 to ratewall)")
    base = med["ratewall memory, http1 pool"]
    pinned_rows(targets, med, base, "http1")
    print("(CPU us/req: user+system CPU time of ratewall per request, all its processes; CPU1: that CPU time over the")
    print(f" run's length; CPU0: wrk's and the backend's, where the load side leaves CPU {LOAD_CPU}; every request")
    print(" another API key of bench/keys.lua's, the per-key rule of bench/ratewall-h2c.toml; the http1 row is the")
    print(" same config with protocol = \"http1\")")
    h2c = med["ratewall memory, h2c pool"]
    print()
    print("for information, from the medians above:")
    print(f"  {'h2c pool against http1 pool, req/s':44} {h2c['rps'] / base['rps']:5.2f}x")
    print(f"  {'h2c pool against http1 pool, CPU us/req':44} {cpu_us(h2c) / cpu_us(base):5.2f}x  "
          f"({cpu_us(h2c):.1f} vs {cpu_us(base):.1f})")


# The jwt table: bench-h2-backend (HTTP/1.1) and wrk on CPU 0; on CPU 1, alone in turn,
# ratewall with one per-key rule counting by an API key, and the same rule counting by a
# verified token's `sub` (`key = "jwt:sub"`, HS256). Each wrk script rotates over
# JWT_IDENTITIES identities, every one sent many times a run: the tokens are verified once
# and then found in the verified-token cache, as a client's repeated token is.
JWT_BACKEND, RATEWALL_APIKEY, RATEWALL_JWT = 18980, 18981, 18982
JWT_IDENTITIES = int(os.environ.get("JWT_IDENTITIES", "10000"))
JWT_SECRET = "bench-secret-of-32-bytes-or-more!!"
JWT_RULE = """
[[upstreams]]
name = "default"
servers = ["http://127.0.0.1:BACKEND"]
[store]
backend = "memory"
[[rules]]
name = "per-identity"
key = "KEY"
rate = "1000000/s"
burst = 100000
"""


def b64url(data):
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def hs256_token(claims):
    """A compact JWS (RFC 7515), HS256, made with the standard library."""
    head = b64url(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
    body = b64url(json.dumps(claims, separators=(",", ":")).encode())
    mac = hmac.new(JWT_SECRET.encode(), f"{head}.{body}".encode(), hashlib.sha256).digest()
    return f"{head}.{body}.{b64url(mac)}"


def rotating_script(name, header, values):
    """A wrk script sending `header` with each of `values` in turn."""
    path = os.path.join(LAB, name)
    with open(path, "w") as f:
        f.write("local values = {\n")
        for v in values:
            f.write(f'  "{v}",\n')
        f.write("}\nlocal counter = 0\nrequest = function()\n  counter = counter % #values + 1\n")
        f.write(f'  return wrk.format("GET", "/", {{ ["{header}"] = values[counter] }}, nil)\nend\n')
    return path


def jwt_table():
    """ratewall counting by a verified token's claim (cache hits) against the same rule
    counting by an API key, pinned as the h2 table is. Requests/s and CPU time per request."""
    check_free((JWT_BACKEND, RATEWALL_APIKEY, RATEWALL_JWT))
    backend = start([bench_binary("bench-h2-backend"), f"127.0.0.1:{JWT_BACKEND}"], LOAD_CPU)
    rule = JWT_RULE.replace("BACKEND", str(JWT_BACKEND))
    api_key = f'[server]\nlisten = "127.0.0.1:{RATEWALL_APIKEY}"\nworkers = 1\n' + rule.replace("KEY", "api_key")
    jwt = (f'[server]\nlisten = "127.0.0.1:{RATEWALL_JWT}"\nworkers = 1\n'
           '[jwt]\nalgorithms = ["HS256"]\nsecret_env = "BENCH_JWT_SECRET"\n'
           'issuer = "https://issuer.bench"\naudience = "bench"\n' + rule.replace("KEY", "jwt:sub"))
    os.environ["BENCH_JWT_SECRET"] = JWT_SECRET
    gateways = {"api_key": start_ratewall("jwt-ratewall-apikey.toml", api_key),
                "jwt": start_ratewall("jwt-ratewall-jwt.toml", jwt)}
    exp = int(time.time()) + 86400
    tokens = [hs256_token({"sub": f"user-{i}", "iss": "https://issuer.bench", "aud": "bench", "exp": exp,
                           "iat": exp - 86400}) for i in range(JWT_IDENTITIES)]
    scripts = {"api_key": rotating_script("apikeys.lua", "x-api-key", [f"key-{i:08}-bench" for i in range(JWT_IDENTITIES)]),
               "jwt": rotating_script("tokens.lua", "authorization", [f"Bearer {t}" for t in tokens])}
    for port in (JWT_BACKEND, RATEWALL_APIKEY, RATEWALL_JWT):
        wait_port(port)
    check_pinned(gateways.values())
    for port, header, value in ((RATEWALL_APIKEY, "x-api-key", "key-0"), (RATEWALL_JWT, "authorization",
                                                                         f"Bearer {tokens[0]}")):
        out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H", f"{header}: {value}",
                              f"http://127.0.0.1:{port}/"], capture_output=True, text=True).stdout
        if out != "200":
            sys.exit(f"ratewall on {port} answered {out or 'nothing'} to one request with {header}, not 200")

    targets = [
        ("direct to the backend", JWT_BACKEND, scripts["api_key"], False, None),
        ("ratewall, rule on an API key", RATEWALL_APIKEY, scripts["api_key"], False, gateways["api_key"]),
        ("ratewall, rule on jwt:sub (cached)", RATEWALL_JWT, scripts["jwt"], False, gateways["jwt"]),
    ]
    med = measure(targets, (None, None), LOAD_CPU, "jwt ", (backend,))
    print()
    print(f"jwt: ratewall alone on CPU {SERVER_CPU}, one worker; wrk and bench-h2-backend on CPU {LOAD_CPU}; "
          f"{JWT_IDENTITIES} identities in turn")
    print(f"median of {RUNS} runs, wrk -t{THREADS} -c{CONNS} -d{SECS}s")
    base = med["ratewall, rule on an API key"]
    pinned_rows(targets, med, base, "API key")
    print("(CPU us/req: user+system CPU time of ratewall per request; the tokens: HS256, sub, iss, aud, iat, exp,")
    print(" 180 bytes or so, each verified once and then served from the verified-token cache)")
    jwt_m = med["ratewall, rule on jwt:sub (cached)"]
    ratio = cpu_us(jwt_m) / cpu_us(base)
    print()
    print("target (issue 26), from the medians above:")
    print(f"  {'jwt (cache hit) CPU/req < 1.05x API key':44} {ratio:5.2f}x  ({cpu_us(jwt_m):.1f} vs "
          f"{cpu_us(base):.1f} us)  {verdict(ratio < 1.05)}")


SETTLE_BACKEND, SETTLE_REDIS = 18990, 18999
SETTLE_PORTS = {"memory": 18991, "redis": 18992}
SETTLE_NGINX = """
worker_processes 1;
pid /tmp/lab/nginx/nginx-settle.pid;
error_log /tmp/lab/nginx/error-settle.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path /tmp/lab/nginx/body;
  proxy_temp_path /tmp/lab/nginx/proxy;
  fastcgi_temp_path /tmp/lab/nginx/fcgi;
  uwsgi_temp_path /tmp/lab/nginx/uwsgi;
  scgi_temp_path /tmp/lab/nginx/scgi;
  server {
    listen 127.0.0.1:BACKEND;
    keepalive_requests 1000000;
    location /fail { return 500 "failed\n"; }
    location /cost { add_header x-ratelimit-cost 3; return 200 "ok\n"; }
    location / { return 200 "ok\n"; }
  }
}
"""
# One rule, never denying (limits as high as the main table's): "always" is the rule as it
# was before issue 27; "statuses" charges 2xx only; "cost" settles a reported cost.
SETTLE_RULE = """
[[upstreams]]
name = "default"
servers = ["http://127.0.0.1:BACKEND"]
STORE
[[rules]]
name = "per-key"
key = "api_key"
rate = "1000000/s"
burst = 100000
"""


def settle_table():
    """What settling costs a request: ratewall pinned on one CPU with one worker, per store,
    a rule charging always (no settlement), charging 2xx only against answers that are 2xx
    (nothing to settle) and 500 (a refund each), and settling a reported cost (a settlement
    each). Requests/s, CPU per request, and Redis calls per request."""
    check_free((SETTLE_BACKEND, SETTLE_REDIS, *SETTLE_PORTS.values(),
                *(p + 10 for p in SETTLE_PORTS.values()), *(p + 20 for p in SETTLE_PORTS.values())))
    os.makedirs(os.path.join(LAB, "nginx"), exist_ok=True)
    backend = start_nginx("nginx-settle.conf", SETTLE_NGINX.replace("BACKEND", str(SETTLE_BACKEND)), LOAD_CPU)
    redis = start(["redis-server", "--port", str(SETTLE_REDIS), "--save", "", "--appendonly", "no"], LOAD_CPU)
    wait_port(SETTLE_REDIS)
    stores = {"memory": '[store]\nbackend = "memory"',
              "redis": f'[store]\nbackend = "redis"\nurl = "redis://127.0.0.1:{SETTLE_REDIS}"\ntimeout = "500ms"'}
    policies = {"always": "", "statuses": 'charge = { statuses = ["2xx"] }\n',
                "cost": 'charge = { statuses = ["2xx"] }\ncost_header = "x-ratelimit-cost"\n'}
    gateways, targets = {}, []
    for store, base in SETTLE_PORTS.items():
        for shift, (policy, extra) in zip((0, 10, 20), policies.items()):
            port = base + shift
            text = (f'[server]\nlisten = "127.0.0.1:{port}"\nworkers = 1\n'
                    + SETTLE_RULE.replace("BACKEND", str(SETTLE_BACKEND)).replace("STORE", stores[store]) + extra)
            gateways[port] = start_ratewall(f"settle-{store}-{policy}.toml", text)
    for port in (SETTLE_BACKEND, *gateways):
        wait_port(port)
    check_pinned(gateways.values())
    scripts = {}
    for path in ("ok", "fail", "cost"):
        scripts[path] = os.path.join(LAB, f"settle-{path}.lua")
        open(scripts[path], "w").write(f'wrk.path = "/{path}"\nwrk.headers["x-api-key"] = "bench-key"\n')
    for store, base in SETTLE_PORTS.items():
        shared = store != "memory"
        targets += [
            (f"{store}: charge always, 200", base, scripts["ok"], shared, gateways[base]),
            (f"{store}: charge always, 500", base, scripts["fail"], shared, gateways[base]),
            (f"{store}: charge 2xx, 200 (kept)", base + 10, scripts["ok"], shared, gateways[base + 10]),
            (f"{store}: charge 2xx, 500 (refunded)", base + 10, scripts["fail"], shared, gateways[base + 10]),
            (f"{store}: cost_header, 3 reported", base + 20, scripts["cost"], shared, gateways[base + 20]),
        ]
    med = measure(targets, (SETTLE_REDIS, redis), LOAD_CPU, "settle ", (backend,))
    print()
    print(f"settle: ratewall alone on CPU {SERVER_CPU}, one worker; wrk, nginx (the backend) and redis-server "
          f"on CPU {LOAD_CPU}")
    print(f"median of {RUNS} runs, wrk -t{THREADS} -c{CONNS} -d{SECS}s; one API key, a limit never reached")
    print(f"{'target':40} {'req/s':>9} {'p99 ms':>7} {'CPU us/req':>10} {'Redis calls/req':>15}")
    for name, *_ in targets:
        m = med[name]
        calls = "" if m["redis_per_req"] is None else f"{m['redis_per_req']:.2f}"
        print(f"{name:40} {m['rps']:>9.0f} {m['p99']:>7.2f} {cpu_us(m):>10.1f} {calls:>15}")
    print("(a refund or a settlement is one more script call, made only when it changes the charge;")
    print(" CPU us/req: user+system CPU time of ratewall per request)")


REPL_BACKEND, REPL_PRIMARY, REPL_REPLICA = 19090, 19099, 19098
REPL_PORTS = {"async": 19091, "wait = 1, 5ms": 19092, "wait = 1, 50ms": 19093}
REPL_MODES = {"async": '"async"', "wait = 1, 5ms": '{ wait = 1, timeout = "5ms" }',
              "wait = 1, 50ms": '{ wait = 1, timeout = "50ms" }'}


def replication_table():
    """What `[store] replication = { wait = 1 }` costs (issue 28): one Redis with one
    replica (both on the load CPU, as the backend and wrk are), ratewall pinned on CPU 1 with
    one worker, a rule never denying, one API key; async against WAIT 1 after every script
    call. Requests/s, p50/p99 latency, CPU per request, script calls and WAITs per request."""
    check_free((REPL_BACKEND, REPL_PRIMARY, REPL_REPLICA, *REPL_PORTS.values()))
    os.makedirs(os.path.join(LAB, "nginx"), exist_ok=True)
    backend = start_nginx("nginx-repl.conf", SETTLE_NGINX.replace("BACKEND", str(REPL_BACKEND))
                          .replace("settle", "repl"), LOAD_CPU)
    redis_args = ["--save", "", "--appendonly", "no", "--bind", "127.0.0.1"]
    redis = start(["redis-server", "--port", str(REPL_PRIMARY), *redis_args], LOAD_CPU)
    wait_port(REPL_PRIMARY)
    start(["redis-server", "--port", str(REPL_REPLICA), *redis_args, "--replicaof", "127.0.0.1", str(REPL_PRIMARY)],
          LOAD_CPU)
    wait_port(REPL_REPLICA)
    end = time.time() + 20
    while "master_link_status:up" not in redis_cli(REPL_REPLICA, "INFO", "replication"):
        if time.time() > end:
            sys.exit("the replica never synced with its primary")
        time.sleep(0.1)
    gateways, targets = {}, []
    for mode, port in REPL_PORTS.items():
        text = (f'[server]\nlisten = "127.0.0.1:{port}"\nworkers = 1\n'
                + SETTLE_RULE.replace("BACKEND", str(REPL_BACKEND)).replace(
                    "STORE", f'[store]\nbackend = "redis"\nurl = "redis://127.0.0.1:{REPL_PRIMARY}"\n'
                             f'timeout = "500ms"\nreplication = {REPL_MODES[mode]}'))
        gateways[port] = start_ratewall(f"repl-{port}.toml", text)
    for port in (REPL_BACKEND, *gateways):
        wait_port(port)
    check_pinned(gateways.values())
    script = os.path.join(LAB, "repl.lua")
    open(script, "w").write('wrk.path = "/ok"\nwrk.headers["x-api-key"] = "bench-key"\n')
    for mode, port in REPL_PORTS.items():
        targets.append((mode, port, script, True, gateways[port]))
    med = measure(targets, (REPL_PRIMARY, redis), LOAD_CPU, "replication ", (backend,))
    calls = int((re.findall(r"cmdstat_wait:calls=(\d+)", redis_cli(REPL_PRIMARY, "INFO", "commandstats")) or ["0"])[0])
    print()
    print(f"replication: ratewall alone on CPU {SERVER_CPU}, one worker; wrk, nginx (the backend), redis-server "
          f"and its replica on CPU {LOAD_CPU}")
    print(f"median of {RUNS} runs, wrk -t{THREADS} -c{CONNS} -d{SECS}s; one API key, a limit never reached")
    print(f"{'replication':24} {'req/s':>9} {'p50 ms':>7} {'p99 ms':>7} {'non-2xx':>8} {'CPU us/req':>10} "
          f"{'scripts/req':>11}")
    for name, *_ in targets:
        m = med[name]
        print(f"{name:24} {m['rps']:>9.0f} {m['p50']:>7.2f} {m['p99']:>7.2f} {m['non2xx']:>8.0f} {cpu_us(m):>10.1f} "
              f"{m['redis_per_req']:>11.3f}")
    base = med["async"]
    for name, *_ in targets[1:]:
        m = med[name]
        print(f"  {name}: {m['rps'] / base['rps']:.2f}x the requests/s of async, p50 {m['p50'] - base['p50']:+.2f} ms, "
              f"p99 {m['p99'] - base['p99']:+.2f} ms")
    print(f"(WAIT calls on the primary over the whole table: {calls}; a WAIT follows every script call of the")
    print(" wait rows, one per batch of the requests a worker decides in one turn of its event loop;")
    print(" non-2xx: 503s, calls whose WAIT saw no replica in time: on_error = deny)")


# The keyflood table: the backend, and the gateway (one at a time, on the same port).
KEYFLOOD_BACKEND, KEYFLOOD_PORT, KEYFLOOD_ADMIN = 19190, 19191, 19192
KEYFLOOD_KEYS = int(os.environ.get("KEYFLOOD_KEYS", "1000000"))


def keyflood_metric(name, labels):
    """The sum of a series of the gateway's /metrics whose line starts with name{labels."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{KEYFLOOD_ADMIN}/metrics", timeout=5).read().decode()
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith(f"{name}{{{labels}"))


def keyflood_script(prefix):
    """A wrk script whose every request carries an API key never sent before (`prefix`
    apart: wrk's Lua starts from the same random seed every time)."""
    path = os.path.join(LAB, f"keyflood-{prefix}.lua")
    open(path, "w").write(f"""local n = 0
request = function()
  n = n + 1
  return wrk.format("GET", "/", {{ ["x-api-key"] = "{prefix}-" .. n }}, nil)
end
""")
    return path


def keyflood_table():
    """A flood of distinct keys into an empty memory store and into a full one (issue 42,
    item 10): requests/s of each, and full / empty."""
    check_free((KEYFLOOD_BACKEND, KEYFLOOD_PORT, KEYFLOOD_ADMIN))
    os.makedirs(os.path.join(LAB, "nginx"), exist_ok=True)
    start_nginx("nginx-keyflood.conf", SETTLE_NGINX.replace("BACKEND", str(KEYFLOOD_BACKEND))
                .replace("settle", "keyflood"), LOAD_CPU)
    wait_port(KEYFLOOD_BACKEND)
    text = (f'[server]\nlisten = "127.0.0.1:{KEYFLOOD_PORT}"\nadmin_listen = "127.0.0.1:{KEYFLOOD_ADMIN}"\n'
            f'workers = 1\n[upstream]\nurl = "http://127.0.0.1:{KEYFLOOD_BACKEND}"\n'
            f'[store]\nmax_keys = {KEYFLOOD_KEYS}\n'
            '[[rules]]\nname = "daily"\nkey = "api_key"\nalgorithm = "fixed_window"\nrate = "1000/d"\n')
    evictions = ("ratewall_store_evictions_total", 'store="memory"')
    results = {"empty": [], "full": []}
    for run in range(RUNS):
        for mode in results:
            gw = start_ratewall("keyflood.toml", text)
            wait_port(KEYFLOOD_PORT)
            wait_port(KEYFLOOD_ADMIN)
            filled = 0
            if mode == "full":
                # Past max_keys: until the store evicts.
                while keyflood_metric(*evictions) == 0:
                    filled += wrk(KEYFLOOD_PORT, keyflood_script(f"fill{run}-{filled}"), LOAD_CPU)["total"]
            before = keyflood_metric(*evictions)
            r = wrk(KEYFLOOD_PORT, keyflood_script(f"flood{run}"), LOAD_CPU)
            evicted = keyflood_metric(*evictions) - before
            results[mode].append(r)
            print(f"  keyflood run {run + 1}/{RUNS} {mode:6} {r['rps']:>9.0f} req/s  p99 {r['p99']:.2f} ms  "
                  f"non-2xx {r['non2xx']}  {r['total']} keys, {evicted:.0f} evicted"
                  + (f" (filled with {filled} keys first)" if filled else ""), flush=True)
            if mode == "empty" and evicted:
                print(f"  (the empty run evicted: raise KEYFLOOD_KEYS above {r['total']})")
            gw.terminate()
            gw.wait(timeout=15)
            procs.remove(gw)
    med = {m: statistics.median(r["rps"] for r in rs) for m, rs in results.items()}
    print()
    print(f"keyflood: ratewall alone on CPU {SERVER_CPU}, one worker, max_keys {KEYFLOOD_KEYS}, a 1000/d fixed "
          f"window per API key; wrk and nginx (the backend) on CPU {LOAD_CPU}")
    print(f"median of {RUNS} runs, wrk -t{THREADS} -c{CONNS} -d{SECS}s; every request a key never seen before")
    for m, rs in results.items():
        xs = [r["rps"] for r in rs]
        print(f"{m + ' store':12} {med[m]:>9.0f} req/s  [{min(xs):.0f}-{max(xs):.0f}]")
    ratio = med["full"] / med["empty"]
    print(f"full / empty: {ratio:.2f} (target at least 0.80: {verdict(ratio >= 0.80)})")


def main():
    tables = {"main": main_table, "pinned": pinned_table, "tls": tls_table, "pools": pools_table,
              "ws": ws_table, "grpc": grpc_table, "h2": h2_table,
              "jwt": jwt_table, "settle": settle_table, "replication": replication_table,
              "keyflood": keyflood_table}
    if ONLY not in ("", *tables):
        sys.exit(f"BENCH_ONLY={ONLY}: {', '.join(tables)}, or unset for all {len(tables)}")
    # What each table runs (the pools table: nginx and wrk only).
    needs = {"main": ("nginx", "haproxy", "wrk", "redis-server", "redis-cli", "taskset"),
             "pinned": ("nginx", "haproxy", "wrk", "redis-server", "redis-cli", "taskset")
             + (("valgrind", "callgrind_control") if CALLGRIND else ()),
             "tls": ("nginx", "wrk", "taskset", "openssl"),
             "pools": ("nginx", "wrk", "taskset"),
             "ws": ("nginx", "taskset"),
             "grpc": ("nginx", "h2load", "curl", "taskset"),
             "h2": ("wrk", "taskset"),
             "jwt": ("wrk", "taskset", "curl"),
             "settle": ("nginx", "wrk", "redis-server", "redis-cli", "taskset"),
             "replication": ("nginx", "wrk", "redis-server", "redis-cli", "taskset"),
             "keyflood": ("nginx", "wrk", "taskset")}
    for tool in sorted({t for table in ([ONLY] if ONLY else needs) for t in needs[table]}):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: bench/run installs it")
    if ONLY in ("", "main", "pinned") and not os.path.exists("/usr/share/nginx/modules/ngx_http_lua_module.so"):
        sys.exit("nginx's Lua module is missing: bench/run installs it (libnginx-mod-http-lua)")
    if ONLY != "main" and len(os.sched_getaffinity(0) & {SERVER_CPU, LOAD_CPU}) < 2:
        sys.exit(f"every table but the main one needs CPUs {LOAD_CPU} and {SERVER_CPU}")
    print(f"building ratewall (release)...", flush=True)
    subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "ratewall", "--example", "measure_memory",
                    "--example", "hyper_proxy", "--example", "tls_handshakes"],
                   cwd=ROOT, check=True)
    if ONLY in ("", "ws", "grpc", "h2", "jwt"):
        print(f"building bench/load (release)...", flush=True)
        subprocess.run(["cargo", "build", "--release", "--quiet", "-p", "ratewall-bench"], cwd=ROOT, check=True)
    for i, name in enumerate([ONLY] if ONLY else list(tables)):
        if i:
            print()
        tables[name]()
        stop_all()


def stop(signum, _frame):
    # As Ctrl-C does: unwinds through main's finally, which stops what was started.
    sys.exit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGHUP, stop)
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted: stopping what was started", file=sys.stderr)
        sys.exit(130)
    finally:
        stop_all()
        shutil.rmtree(LAB, ignore_errors=True)
