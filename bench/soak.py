#!/usr/bin/env python3
"""RSS of ratewall (memory store) under a flood of rotating keys: does memory stay flat?

    bench/soak                  # both runs below, SOAK_SECS=300 each by default
    bench/soak expire           # only the first; bench/soak flood: only the second

Runs the memory-store gateway in front of an upstream that answers at once (nginx `return
200` from bench/peers), and wrk with a key that changes every request, never repeating
(every request creates a new tracked key). Prints RSS every 10 s, and the store's key
count and evictions (from /metrics).

- expire: a token bucket refilling a token in 100 ms: a key's state is swept 100 ms after
  its request, so RSS levels off by time, far below max_keys.
- flood: a `1000/d` fixed window, whose states would live for a day: only `[store]
  max_keys` (100,000 here) bounds them. RSS must level off once the store holds max_keys,
  with the least recently used keys evicted to make room.

Everything on 127.0.0.1; stops by itself.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SECS = int(os.environ.get("SOAK_SECS", "300"))
LAB = tempfile.mkdtemp(prefix="ratewall-soak-")

CONFIGS = {
    "expire": """[server]
listen = "127.0.0.1:18095"
admin_listen = "127.0.0.1:18096"
[upstream]
url = "http://127.0.0.1:18080"
[[rules]]
name = "per-key"
key = "api_key"
rate = "10/s"
burst = 10
""",
    "flood": """[server]
listen = "127.0.0.1:18095"
admin_listen = "127.0.0.1:18096"
[upstream]
url = "http://127.0.0.1:18080"
[store]
max_keys = 100000
[[rules]]
name = "daily"
key = "api_key"
algorithm = "fixed_window"
rate = "1000/d"
""",
}

WRK_SCRIPT = """
local counter = 0
local id = tostring(math.random(1, 1000000000))
request = function()
  counter = counter + 1
  return wrk.format("GET", "/", { ["x-api-key"] = "soak-" .. id .. "-" .. counter }, nil)
end
"""


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def store_metrics():
    """The memory store's key count and evictions, from /metrics."""
    try:
        text = urllib.request.urlopen("http://127.0.0.1:18096/metrics", timeout=2).read().decode()
    except OSError:
        return "?", "?"
    keys, evicted = "?", 0
    for line in text.splitlines():
        if line.startswith('ratewall_store_keys{store="memory"}'):
            keys = line.split()[-1]
        if line.startswith('ratewall_store_evictions_total{store="memory"'):
            evicted += int(float(line.split()[-1]))
    return keys, evicted


def wait_port(port):
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on {port}")


def run(mode):
    open(os.path.join(LAB, "soak.toml"), "w").write(CONFIGS[mode])
    gw = subprocess.Popen([os.path.join(ROOT, "target", "release", "ratewall"), "--config",
                           os.path.join(LAB, "soak.toml")], env=dict(os.environ, RUST_LOG="warn"),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(18095)
        start_rss = rss_kib(gw.pid)
        wrk = subprocess.Popen(["wrk", "-t1", "-c32", f"-d{SECS}s", "-s", os.path.join(LAB, "soak.lua"),
                                "http://127.0.0.1:18095/"], stdout=subprocess.PIPE, text=True)
        print(f"\n{mode}: {CONFIGS[mode].split('[[rules]]')[1].strip().replace(chr(10), ', ')}")
        print(f"{'t (s)':>6} {'RSS (KiB)':>10} {'keys':>8} {'evicted':>10}   start {start_rss} KiB",
              flush=True)
        samples = []
        t0 = time.time()
        while wrk.poll() is None:
            time.sleep(10)
            samples.append(rss_kib(gw.pid))
            keys, evicted = store_metrics()
            print(f"{time.time() - t0:6.0f} {samples[-1]:>10} {keys:>8} {evicted:>10}", flush=True)
        out = wrk.communicate()[0]
        total = [l for l in out.splitlines() if "requests in" in l]
        print(total[0].strip() if total else out)
        if len(samples) >= 4:
            half = samples[len(samples) // 2:]
            print(f"RSS over the second half: min {min(half)} KiB, max {max(half)} KiB "
                  f"({(max(half) - min(half)) / max(min(half), 1) * 100:.1f}% spread); "
                  f"first sample {samples[0]} KiB, last {samples[-1]} KiB")
    finally:
        gw.send_signal(signal.SIGTERM)
        gw.wait(timeout=15)


def main():
    modes = sys.argv[1:] or ["expire", "flood"]
    for m in modes:
        if m not in CONFIGS:
            sys.exit(f"unknown run {m!r}: expire or flood")
    subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "ratewall"], cwd=ROOT, check=True)
    conf = open(os.path.join(HERE, "peers", "nginx.conf")).read().replace("/tmp/lab/nginx", LAB)
    for d in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(LAB, d), exist_ok=True)
    open(os.path.join(LAB, "nginx.conf"), "w").write(conf)
    open(os.path.join(LAB, "soak.lua"), "w").write(WRK_SCRIPT)
    subprocess.run(["nginx", "-c", os.path.join(LAB, "nginx.conf")], check=True)
    try:
        wait_port(18080)
        for m in modes:
            run(m)
    finally:
        subprocess.run(["nginx", "-c", os.path.join(LAB, "nginx.conf"), "-s", "quit"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(LAB, ignore_errors=True)


if __name__ == "__main__":
    main()
