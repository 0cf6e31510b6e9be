#!/usr/bin/env python3
"""ratewall side by side with nginx and HAProxy, on this machine, in one run.

Starts an upstream that answers at once (nginx `return 200`), nginx as a plain proxy,
nginx with limit_req, HAProxy with a stick-table limit, a bare hyper proxy with no limiting
(examples/hyper_proxy.rs: the stack ratewall started from), redis-server, and ratewall on
the memory and Redis stores (and, for information, with one worker thread); drives each with the same wrk settings from one process; prints
requests/s, p50/p99 latency and ratios (median of RUNS runs). Everything listens on
127.0.0.1, runs for a bounded time and is stopped at the end.

    bench/run                 # BENCH_SECS=10 RUNS=3 CONNECTIONS=64 by default
"""

import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SECS = int(os.environ.get("BENCH_SECS", "10"))
RUNS = int(os.environ.get("RUNS", "3"))
CONNS = int(os.environ.get("CONNECTIONS", "64"))
THREADS = int(os.environ.get("THREADS", "1"))
LAB = tempfile.mkdtemp(prefix="ratewall-bench-")
procs = []


def start(cmd, **kw):
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, **kw)
    procs.append(p)
    return p


def wait_port(port, secs=10):
    end = time.time() + secs
    while time.time() < end:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on {port}")


def stop_all():
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            p.kill()
    subprocess.run(["nginx", "-c", os.path.join(LAB, "nginx.conf"), "-s", "quit"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shutil.rmtree(LAB, ignore_errors=True)


def redis_cli(*args):
    return subprocess.run(["redis-cli", "-p", "16379", *args], capture_output=True, text=True).stdout


def evalsha_calls():
    m = re.search(r"cmdstat_evalsha:calls=(\d+)", redis_cli("INFO", "commandstats"))
    return int(m.group(1)) if m else 0


def cpu_seconds(pid):
    """User and system CPU seconds a process has used so far (all its threads)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def unit(value, suffix):
    value = float(value)
    return value * {"us": 1e-3, "ms": 1.0, "s": 1e3}[suffix]


def wrk(port, script):
    out = subprocess.run(
        ["wrk", f"-t{THREADS}", f"-c{CONNS}", f"-d{SECS}s", "--latency", "-s", os.path.join(HERE, script),
         f"http://127.0.0.1:{port}/"],
        capture_output=True, text=True, check=True).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    p50 = unit(*re.search(r"50%\s+([\d.]+)(us|ms|s)", out).groups())
    p99 = unit(*re.search(r"99%\s+([\d.]+)(us|ms|s)", out).groups())
    total = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": rps, "p50": p50, "p99": p99, "total": total, "non2xx": int(non2xx.group(1)) if non2xx else 0}


def main():
    for tool in ("nginx", "haproxy", "wrk", "redis-server", "redis-cli"):
        if not shutil.which(tool):
            sys.exit(f"{tool} is missing: bench/run installs it")
    print(f"building ratewall (release)...", flush=True)
    subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "ratewall", "--example", "measure_memory",
                    "--example", "hyper_proxy"],
                   cwd=ROOT, check=True)
    binary = os.path.join(ROOT, "target", "release", "ratewall")

    conf = open(os.path.join(HERE, "peers", "nginx.conf")).read().replace("/tmp/lab/nginx", LAB)
    for d in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(LAB, d), exist_ok=True)
    open(os.path.join(LAB, "nginx.conf"), "w").write(conf)
    subprocess.run(["nginx", "-c", os.path.join(LAB, "nginx.conf")], check=True)
    haproxy = start(["haproxy", "-db", "-f", os.path.join(HERE, "peers", "haproxy.cfg")])
    start(["redis-server", "--port", "16379", "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
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
    bare = start([os.path.join(ROOT, "target", "release", "examples", "hyper_proxy"),
                  "127.0.0.1:18088", "http://127.0.0.1:18080"])
    for port in (18080, 18081, 18082, 18083, 18084, 16379, 18085, 18086, 18087, 18088, 18089, 18090):
        wait_port(port)

    # (name, port, wrk script, counts Redis calls, the process whose CPU time is measured:
    # none for nginx, whose proxies share their worker processes with the upstream)
    targets = [
        ("direct to upstream", 18080, "keys.lua", False, None),
        ("nginx proxy_pass", 18081, "keys.lua", False, None),
        ("nginx limit_req", 18082, "keys.lua", False, None),
        ("HAProxy stick table", 18083, "keys.lua", False, haproxy),
        ("bare hyper proxy (no limiting)", 18088, "keys.lua", False, bare),
        ("ratewall memory", 18085, "keys.lua", False, gateways["ratewall-memory.toml"]),
        ("ratewall redis", 18086, "keys.lua", True, gateways["ratewall-redis.toml"]),
        ("ratewall memory, 1 worker", 18089, "keys.lua", False, gateways["one-worker-ratewall-memory.toml"]),
        ("nginx limit_req, one key (abuse)", 18084, "one-key.lua", False, None),
        ("ratewall redis, one key (abuse)", 18087, "one-key.lua", True, gateways["ratewall-redis-tight.toml"]),
        ("ratewall redis, abuse, 1 worker", 18090, "one-key.lua", True,
         gateways["one-worker-ratewall-redis-tight.toml"]),
    ]
    results = {}
    for run in range(RUNS):
        for name, port, script, redis, proc in targets:
            before = evalsha_calls()
            cpu_before = cpu_seconds(proc.pid) if proc else None
            r = wrk(port, script)
            r["redis_per_req"] = (evalsha_calls() - before) / max(r["total"], 1) if redis else None
            if proc:
                (u0, s0), (u1, s1) = cpu_before, cpu_seconds(proc.pid)
                r["user_us"] = (u1 - u0) * 1e6 / max(r["total"], 1)
                r["sys_us"] = (s1 - s0) * 1e6 / max(r["total"], 1)
            else:
                r["user_us"] = r["sys_us"] = None
            results.setdefault(name, []).append(r)
            print(f"  run {run + 1}/{RUNS} {name:34} {r['rps']:>9.0f} req/s  p99 {r['p99']:.2f} ms", flush=True)

    med = {n: {k: statistics.median(x[k] for x in rs) if rs[0][k] is not None else None for k in rs[0]}
           for n, rs in results.items()}
    nginx_lr, haproxy, direct = med["nginx limit_req"], med["HAProxy stick table"], med["direct to upstream"]
    nginx_proxy = med["nginx proxy_pass"]
    print()
    print(f"median of {RUNS} runs, wrk -t{THREADS} -c{CONNS} -d{SECS}s, {os.cpu_count()} cores")
    print(f"{'':36}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'non-2xx':>10}{'Redis/req':>11}"
          f"{'CPU us/req':>12}{'vs nginx lr':>12}{'vs HAProxy':>11}")
    for name, _, _, _, _ in targets:
        m = med[name]
        per = "" if m["redis_per_req"] is None else f"{m['redis_per_req']:.3f}"
        cpu = "" if m["user_us"] is None else f"{m['user_us']:.1f}+{m['sys_us']:.1f}"
        print(f"{name:36}{m['rps']:>10.0f}{m['p50']:>9.2f}{m['p99']:>9.2f}{m['non2xx']:>10.0f}{per:>11}{cpu:>12}"
              f"{m['rps'] / nginx_lr['rps']:>11.2f}x{m['rps'] / haproxy['rps']:>10.2f}x")
    print("(CPU us/req: user+system CPU time of the server under test per request, where it is one process;")
    print(" the 1-worker rows: ratewall with [server] workers = 1, for information, not a target)")
    abuse_nginx, abuse_rw = med["nginx limit_req, one key (abuse)"], med["ratewall redis, one key (abuse)"]
    print()
    print("targets (issue 8), from the medians above:")
    checks = [
        ("memory store >= 1.0x HAProxy", med["ratewall memory"]["rps"] / haproxy["rps"], 1.0),
        ("memory store >= 1.2x nginx limit_req", med["ratewall memory"]["rps"] / nginx_lr["rps"], 1.2),
        ("redis store >= 1.0x nginx limit_req", med["ratewall redis"]["rps"] / nginx_lr["rps"], 1.0),
        ("abuse: denied/s >= 1.0x nginx limit_req", abuse_rw["rps"] / abuse_nginx["rps"], 1.0),
    ]
    for label, ratio, goal in checks:
        print(f"  {label:44} {ratio:5.2f}x  {'met' if ratio >= goal else 'NOT met'}")
    per = med["ratewall redis"]["redis_per_req"]
    print(f"  {'redis calls per allowed request <= 1.00':44} {per:5.3f}   {'met' if round(per, 3) <= 1.0 else 'NOT met'}")
    per = abuse_rw["redis_per_req"]
    print(f"  {'redis calls per denied request <= 0.01':44} {per:5.3f}   {'met' if round(per, 3) <= 0.01 else 'NOT met'}")
    added_rw = med["ratewall memory"]["p99"] - direct["p99"]
    added_nginx = nginx_proxy["p99"] - direct["p99"]
    print(f"  {'added p99: ratewall memory vs nginx proxy':44} {added_rw:+.2f} ms vs {added_nginx:+.2f} ms  "
          f"{'met' if added_rw <= added_nginx else 'NOT met'}")
    print()
    print("memory per tracked key (memory store):")
    out = subprocess.run([os.path.join(ROOT, "target", "release", "examples", "measure_memory")],
                         capture_output=True, text=True, check=True).stdout
    print("  " + "\n  ".join(out.strip().splitlines()[:6]))


if __name__ == "__main__":
    try:
        main()
    finally:
        stop_all()
