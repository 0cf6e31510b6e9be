#!/usr/bin/env python3
"""RSS of ratewall (memory store) under a flood of rotating keys: does memory stay flat?

    bench/soak                  # SOAK_SECS=300 by default; prints RSS every 10 s

Runs the memory-store gateway in front of an upstream that answers at once (nginx `return
200` from bench/peers), and wrk with a key that changes every request, never repeating
(every request creates a new tracked key). With a refill of 100 ms per token, a key's
state is swept 100 ms after its request, so RSS must level off instead of growing with the
number of keys seen. Everything on 127.0.0.1; stops by itself.
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SECS = int(os.environ.get("SOAK_SECS", "300"))
LAB = tempfile.mkdtemp(prefix="ratewall-soak-")

CONFIG = """[server]
listen = "127.0.0.1:18095"
[upstream]
url = "http://127.0.0.1:18080"
[[rules]]
name = "per-key"
key = "api_key"
rate = "10/s"
burst = 10
"""

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


def wait_port(port):
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    sys.exit(f"nothing listens on {port}")


def main():
    subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "ratewall"], cwd=ROOT, check=True)
    conf = open(os.path.join(HERE, "peers", "nginx.conf")).read().replace("/tmp/lab/nginx", LAB)
    for d in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        os.makedirs(os.path.join(LAB, d), exist_ok=True)
    open(os.path.join(LAB, "nginx.conf"), "w").write(conf)
    open(os.path.join(LAB, "soak.toml"), "w").write(CONFIG)
    open(os.path.join(LAB, "soak.lua"), "w").write(WRK_SCRIPT)
    subprocess.run(["nginx", "-c", os.path.join(LAB, "nginx.conf")], check=True)
    gw = subprocess.Popen([os.path.join(ROOT, "target", "release", "ratewall"), "--config",
                           os.path.join(LAB, "soak.toml")], env=dict(os.environ, RUST_LOG="warn"),
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(18080)
        wait_port(18095)
        start_rss = rss_kib(gw.pid)
        wrk = subprocess.Popen(["wrk", "-t1", "-c32", f"-d{SECS}s", "-s", os.path.join(LAB, "soak.lua"),
                                "http://127.0.0.1:18095/"], stdout=subprocess.PIPE, text=True)
        print(f"{'t (s)':>6} {'RSS (KiB)':>10}   start {start_rss} KiB", flush=True)
        samples = []
        t0 = time.time()
        while wrk.poll() is None:
            time.sleep(10)
            samples.append(rss_kib(gw.pid))
            print(f"{time.time() - t0:6.0f} {samples[-1]:>10}", flush=True)
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
        subprocess.run(["nginx", "-c", os.path.join(LAB, "nginx.conf"), "-s", "quit"],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(LAB, ignore_errors=True)


if __name__ == "__main__":
    main()
