#!/usr/bin/env python3
"""Two ratewall builds, A and B, side by side in one session: did a change cost throughput?

    bench/ab OLD_BINARY [NEW_BINARY]     # NEW defaults to this tree's target/release/ratewall

Starts an upstream that answers at once (nginx `return 200`, as in bench/run) and both
gateways on the memory store with bench/ratewall-memory.toml's rule, then drives them in
turn with the same wrk settings as bench/run (1 thread, 64 connections, a key out of
100,000 per request), ROUNDS times each (default 6, BENCH_SECS=8 each), alternating, so
that both see the same machine. Prints requests/s and CPU µs per request (user + system,
from /proc) of every round and their medians. Everything on 127.0.0.1; stops by itself.

    CALLGRIND=1 bench/ab OLD_BINARY [NEW_BINARY]

counts instead each build's instructions per request under valgrind's callgrind (one
worker, wrk -c8 for CALLGRIND_SECS, default 10, after a 3 s warm-up): forwarded (a key out
of 100,000 per request, never denied) and denied (one key past a limit of 1/h). Unlike CPU
time the counts barely move between runs: the figure to guard "pay only for what you use"
with (valgrind's CPU has no SHA-NI: the key's SHA-256 counts more than it runs).
NO_RULES=1 adds a third count: a forwarded request with the rule taken out of the config
(the proxy alone), so that what one rule costs is the difference.
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
SECS = int(os.environ.get("BENCH_SECS", "8"))
CALLGRIND = os.environ.get("CALLGRIND", "0") == "1"
CALLGRIND_SECS = int(os.environ.get("CALLGRIND_SECS", "10"))
ROUNDS = int(os.environ.get("ROUNDS", "6"))
LAB = tempfile.mkdtemp(prefix="ratewall-ab-")

CONFIG = open(os.path.join(HERE, "ratewall-memory.toml")).read()


def wait_port(port):
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on {port}")


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / tick


def wrk(port):
    out = subprocess.run(["wrk", "-t1", "-c64", f"-d{SECS}s", "-s", os.path.join(HERE, "keys.lua"),
                          f"http://127.0.0.1:{port}/"], capture_output=True, text=True).stdout
    m = re.search(r"(\d+) requests in", out)
    return int(m.group(1)) if m else 0


DENY_CONFIG = """[server]
listen = "127.0.0.1:18085"
workers = 1
[upstream]
url = "http://127.0.0.1:18080"
[store]
backend = "memory"
[[rules]]
name = "tight"
key = "api_key"
rate = "1/h"
burst = 1
"""


def instructions(binary, config, script, port):
    """Instructions per request of `binary` on `config` under callgrind, driven by `script`."""
    path = os.path.join(LAB, f"cg-{port}.toml")
    open(path, "w").write(config.replace("127.0.0.1:18085", f"127.0.0.1:{port}"))
    out = os.path.join(LAB, f"cg-{port}.out")
    p = subprocess.Popen(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", binary, "--config", path],
                         env=dict(os.environ, RUST_LOG="warn"), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        run = lambda secs: subprocess.run(["wrk", "-t1", "-c8", f"-d{secs}s", "-s", os.path.join(HERE, script),
                                           f"http://127.0.0.1:{port}/"], capture_output=True, text=True).stdout
        run(3)
        subprocess.run(["callgrind_control", "-z", str(p.pid)], capture_output=True, check=True)
        n = int(re.search(r"(\d+) requests in", run(CALLGRIND_SECS)).group(1))
        subprocess.run(["callgrind_control", "-d", str(p.pid)], capture_output=True, check=True)
        dump = f"{out}.1"
        for _ in range(100):
            if os.path.exists(dump) and "totals:" in open(dump, errors="replace").read()[-4096:]:
                break
            time.sleep(0.1)
        total = int(re.search(r"^summary: (\d+)", open(dump, errors="replace").read(), re.M).group(1))
        return total / max(n, 1)
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)


def callgrind(binaries):
    forward = CONFIG if "workers" in CONFIG else CONFIG.replace("[server]\n", "[server]\nworkers = 1\n", 1)
    # The proxy alone: the same config without its rule (NO_RULES=1 adds this column).
    bare = forward.split("[[rules]]")[0]
    for name, binary in sorted(binaries.items()):
        f = instructions(binary, forward, "keys.lua", 18185)
        d = instructions(binary, DENY_CONFIG, "one-key.lua", 18186)
        line = f"{name} {binary}: {f:9.0f} instructions/req forwarded, {d:9.0f} denied"
        if os.environ.get("NO_RULES") == "1":
            line += f", {instructions(binary, bare, 'keys.lua', 18187):9.0f} forwarded with no rule"
        print(line, flush=True)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    binaries = {"A": sys.argv[1],
                "B": sys.argv[2] if len(sys.argv) > 2 else os.path.join(ROOT, "target", "release", "ratewall")}
    conf = open(os.path.join(HERE, "peers", "nginx.conf")).read().replace("/tmp/lab/nginx", LAB)
    for d in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(LAB, d), exist_ok=True)
    open(os.path.join(LAB, "nginx.conf"), "w").write(conf)
    subprocess.run(["nginx", "-c", os.path.join(LAB, "nginx.conf")], check=True)
    procs = {}
    try:
        wait_port(18080)
        if CALLGRIND:
            callgrind(binaries)
            return
        for i, (name, binary) in enumerate(sorted(binaries.items())):
            port = 18185 + i
            path = os.path.join(LAB, f"{name}.toml")
            open(path, "w").write(CONFIG.replace("127.0.0.1:18085", f"127.0.0.1:{port}"))
            procs[name] = (subprocess.Popen([binary, "--config", path], env=dict(os.environ, RUST_LOG="warn"),
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port)
            wait_port(port)
        results = {name: [] for name in procs}
        for r in range(ROUNDS):
            for name in (("A", "B") if r % 2 == 0 else ("B", "A")):
                proc, port = procs[name]
                before = cpu_seconds(proc.pid)
                n = wrk(port)
                cpu = cpu_seconds(proc.pid) - before
                results[name].append((n / SECS, cpu * 1e6 / max(n, 1)))
                print(f"  round {r + 1}/{ROUNDS} {name} {n / SECS:9.0f} req/s  {cpu * 1e6 / max(n, 1):5.1f} CPU us/req",
                      flush=True)
        for name in sorted(results):
            rps = statistics.median(x for x, _ in results[name])
            cpu = statistics.median(c for _, c in results[name])
            print(f"{name} {binaries[name]}: median {rps:9.0f} req/s, {cpu:5.1f} CPU us/req")
        a = statistics.median(x for x, _ in results["A"])
        b = statistics.median(x for x, _ in results["B"])
        print(f"B/A: {b / a:.3f}x req/s")
    finally:
        for proc, _ in procs.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)
        subprocess.run(["nginx", "-c", os.path.join(LAB, "nginx.conf"), "-s", "quit"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(LAB, ignore_errors=True)


if __name__ == "__main__":
    main()
