#!/usr/bin/env python3
"""A 10x burst on a backend with a knee, without and with ratewall's overload protection.

    bench/overload                    # both runs, writes docs/overload.png (PHASES, CONNECTIONS,
                                      # OVERLOAD and OVERLOAD_PLOT change them)
    OVERLOAD_PLOT=/tmp/x.png bench/overload

The backend (bench/load's bench-knee-backend) serves 16 requests at once, 20 ms each: 800
requests/s, and past 16 in flight each request waits its turn. The load (bench-overload-
load, open loop, latency counted from when each request was due) is half free, half pro
API keys: PHASES, by default 5 s at 400 requests/s (half the capacity), 10 s at 8,000
(10x the capacity), 5 s at 400 again. ratewall (release build, memory store) sits in
front, its rate limits far above the load (they never deny); plans `pro` (priority 10)
and `free` (priority 0). Twice:

- none: no `overload`: every request goes to the backend.
- adaptive: `overload = { adaptive = true, ... }` (OVERLOAD below; docs/operations.md
  "Overload protection" says why these settings).

During each run /metrics (ratewall_overload_limit, in_flight, queue_length) and the
backend's GET /max are sampled every 100 ms. Prints per run a table by plan and phase
(by when each request was due: before the burst, in it, after it): requests, answered 200,
shed 503, other answers, unanswered; the 200s' latency p50/p99/max (from when each was
due); `lag p99`, how late the load client itself sent them (its own CPU or connections
short: what of the latency is not the gateway's nor the backend's); then the backend's
most in flight and requests served a second in the burst, the limit's range, the most
queued, and why each 503 was shed (its `detail`). Writes a PNG (matplotlib): latency
by plan over time for both runs, and below each the limit, in flight and queue.

Everything on 127.0.0.1 (ports 18700-18702), stops by itself, and stops what it started
on Ctrl-C or a failure.
"""

import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RELEASE = os.path.join(ROOT, os.environ.get("CARGO_TARGET_DIR") or "target", "release")
PHASES = os.environ.get("PHASES", "5:400,10:8000,5:400")
CONNECTIONS = int(os.environ.get("CONNECTIONS", "512"))
PLOT = os.environ.get("OVERLOAD_PLOT", os.path.join(ROOT, "docs", "overload.png"))
GATEWAY, ADMIN, BACKEND = 18700, 18701, 18702
LAB = tempfile.mkdtemp(prefix="ratewall-overload-")

# The knee is 16 in flight at 20 ms (docs/operations.md, "Choosing the settings"):
# min_limit 4 is surely unloaded; max_limit 100 a ceiling far above the knee, so that the
# controller finds the knee alone; a queue of 16 drains in 20 ms at 800/s (the most a
# queued request adds, one unloaded latency), max_wait 50 ms sheds a request that waited
# longer than that would take; probe_interval 10 s renews the floor within the run (it
# must shed nothing). OVERLOAD='{ … }' tries others.
OVERLOAD = os.environ.get("OVERLOAD") or (
    '{ adaptive = true, min_limit = 4, max_limit = 100, probe_interval = "10s", '
    'max_queue = 16, max_wait = "50ms" }')

CONFIG = """[server]
listen = "127.0.0.1:{gateway}"
admin_listen = "127.0.0.1:{admin}"
[upstream]
url = "http://127.0.0.1:{backend}"
{overload}
[store]
backend = "memory"
[keys]
header = "x-api-key"
[keys.plans]
"bench-free-key" = "free"
"bench-pro-key" = "pro"
[[rules]]
name = "api"
key = "api_key"
rate = "1000000/s"
burst = 100000
[rules.plans.free]
priority = 0
[rules.plans.pro]
priority = 10
"""

procs = []


def start(cmd, out=subprocess.DEVNULL):
    """A process in a process group of its own, stopped by stop_all."""
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.DEVNULL, preexec_fn=os.setpgrp,
                         env=dict(os.environ, RUST_LOG="warn"))
    procs.append(p)
    return p


def stop_all():
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
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
    for port in ports:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            continue
        sys.exit(f"something already listens on 127.0.0.1:{port}: is another bench running?")


def get(port, path):
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=1).read().decode()
    except OSError:
        return None


METRIC = re.compile(r'^(ratewall_overload_(?:limit|in_flight|queue_length))\{([^}]*)\} (\S+)$')


def sample(t0, stop, samples):
    """Every 100 ms: the pool's limit, in flight and queue by priority, and the backend's
    in flight (the most since the last sample)."""
    while not stop.is_set():
        t = time.monotonic() - t0
        s = {"t": t}
        text = get(ADMIN, "/metrics") or ""
        for line in text.splitlines():
            m = METRIC.match(line)
            if not m:
                continue
            name, labels, value = m.groups()
            if name == "ratewall_overload_queue_length":
                prio = re.search(r'priority="(\d+)"', labels).group(1)
                s[f"queue_{prio}"] = float(value)
            else:
                s[name.removeprefix("ratewall_overload_")] = float(value)
        backend = get(BACKEND, "/max")
        if backend:
            fields = backend.split()
            s["backend_max"] = float(fields[3])
            s["served"] = float(fields[5])
        samples.append(s)
        stop.wait(0.1)


def read_csv(path):
    rows = []
    with open(path) as f:
        next(f)
        for line in f:
            cls, due, sent, done, status, shed = line.rstrip("\n").split(",")
            rows.append((cls, float(due) / 1e3, float(sent) / 1e3 if sent else None,
                         float(done) / 1e3 if done else None, int(status), shed))
    return rows


def pct(values, q):
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, math.ceil(q * len(v)) - 1)]


def burst_window():
    """The burst phase: the phase of the highest rate, (start, end) in seconds."""
    t, best = 0.0, (0.0, 0.0, 0.0)
    for p in PHASES.split(","):
        secs, rate = (float(x) for x in p.split(":"))
        if rate > best[0]:
            best = (rate, t, t + secs)
        t += secs
    return best[1], best[2]


def run(name, overload):
    check_free((GATEWAY, ADMIN, BACKEND))
    path = os.path.join(LAB, f"{name}.toml")
    open(path, "w").write(CONFIG.format(gateway=GATEWAY, admin=ADMIN, backend=BACKEND,
                                        overload=f"overload = {overload}" if overload else ""))
    start([os.path.join(RELEASE, "bench-knee-backend"), f"127.0.0.1:{BACKEND}", "16", "20"])
    gw = start([os.path.join(RELEASE, "ratewall"), "--config", path])
    wait_port(BACKEND)
    wait_port(GATEWAY)
    wait_port(ADMIN)
    csv = os.path.join(LAB, f"{name}.csv")
    samples, stop = [], threading.Event()
    t0 = time.monotonic()
    sampler = threading.Thread(target=sample, args=(t0, stop, samples), daemon=True)
    sampler.start()
    load = subprocess.run([os.path.join(RELEASE, "bench-overload-load"), f"127.0.0.1:{GATEWAY}", csv,
                           PHASES, str(CONNECTIONS)], capture_output=True, text=True)
    stop.set()
    sampler.join()
    if load.returncode != 0:
        sys.exit(f"bench-overload-load failed: {load.stderr}")
    if gw.poll() is not None:
        sys.exit("ratewall exited during the run")
    stop_all()
    rows = read_csv(csv)
    print(f"\n{name}: overload = {overload or 'none'}")
    print(f"load: {load.stdout.strip()}")
    report(rows, samples)
    return rows, samples


def report(rows, samples):
    b0, b1 = burst_window()
    print(f"{'plan':<5} {'phase':<8} {'requests':>8} {'200':>7} {'503':>7} {'other':>6} {'unans.':>6}"
          f" {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'lag p99':>8}")
    def phase_of(t):
        return "before" if t < b0 else "burst" if t < b1 else "after"

    for cls in ("pro", "free"):
        for phase in ("before", "burst", "after"):
            sel = [r for r in rows if r[0] == cls and phase_of(r[1]) == phase]
            ok = [(r[3] - r[1]) * 1e3 for r in sel if r[4] == 200]
            shed = sum(1 for r in sel if r[4] == 503)
            unanswered = sum(1 for r in sel if r[4] == 0)
            other = len(sel) - len(ok) - shed - unanswered
            lag = [(r[2] - r[1]) * 1e3 for r in sel if r[2] is not None]
            print(f"{cls:<5} {phase:<8} {len(sel):>8} {len(ok):>7} {shed:>7} {other:>6} {unanswered:>6}"
                  f" {pct(ok, 0.5):>8.1f} {pct(ok, 0.99):>8.1f} {max(ok, default=float('nan')):>8.1f}"
                  f" {pct(lag, 0.99):>8.1f}")
    for phase in ("before", "burst", "after"):
        sel = [s for s in samples if phase_of(s["t"]) == phase]
        backend = max((s.get("backend_max", 0) for s in sel), default=0)
        line = f"{phase:<8} backend max in flight {backend:.0f}"
        if phase == "burst" and len(sel) > 1 and "served" in sel[0]:
            rate = (sel[-1]["served"] - sel[0]["served"]) / (sel[-1]["t"] - sel[0]["t"])
            line += f", served {rate:.0f}/s"
        limits = [s["limit"] for s in sel if "limit" in s]
        if limits:
            queue = max((s.get("queue_0", 0) + s.get("queue_10", 0) for s in sel), default=0)
            line += (f"; limit min {min(limits):.0f} median {statistics.median(limits):.0f} max {max(limits):.0f}"
                     f"; most queued {queue:.0f}")
        print(line)
    # Why each was shed, from its 503's detail: `full` (the queue full of its priority or
    # higher: for pro, no free request was queued then), `evicted` (a higher priority took
    # its place), `waited` (max_wait).
    for cls in ("pro", "free"):
        reasons = {}
        for r in rows:
            if r[0] == cls and r[4] == 503:
                k = (phase_of(r[1]), r[5])
                reasons[k] = reasons.get(k, 0) + 1
        if reasons:
            print(f"{cls} 503s by phase and reason: "
                  + ", ".join(f"{p} {k} {v}" for (p, k), v in sorted(reasons.items())))


def rolling_p99(rows, cls, step=0.25):
    """The p99 latency (ms) of the answered-200 requests of `cls`, by due time, per `step` s."""
    bins = {}
    for r in rows:
        if r[0] == cls and r[4] == 200:
            bins.setdefault(int(r[1] / step), []).append((r[3] - r[1]) * 1e3)
    x, y = [], []
    for k in sorted(bins):
        if x and k * step - x[-1] > step:
            # No answer in between: a gap in the line, not a slope across it.
            x.append(float("nan"))
            y.append(float("nan"))
        x.append((k + 0.5) * step)
        y.append(pct(bins[k], 0.99))
    return x, y


def plot(results):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    b0, b1 = burst_window()
    fig, axes = plt.subplots(2, len(results), figsize=(13, 7.5), sharex=True, sharey="row",
                             gridspec_kw={"height_ratios": [3, 2]}, squeeze=False)
    colours = {"pro": "tab:blue", "free": "tab:orange"}
    for col, (name, overload, rows, samples) in enumerate(results):
        top, bottom = axes[0][col], axes[1][col]
        for cls in ("free", "pro"):
            ok = [r for r in rows if r[0] == cls and r[4] == 200]
            top.scatter([r[1] for r in ok], [(r[3] - r[1]) * 1e3 for r in ok], s=1, alpha=0.15,
                        color=colours[cls], rasterized=True, linewidths=0)
            x, y = rolling_p99(rows, cls)
            top.plot(x, y, color=colours[cls], lw=1.6, label=f"{cls}: p99 of 200s per 250 ms")
            shed = [r[1] for r in rows if r[0] == cls and r[4] == 503]
            unanswered = sum(1 for r in rows if r[0] == cls and r[4] == 0)
            # No latency to draw for these: their counts go in the legend.
            if shed:
                top.plot([], [], " ", label=f"{cls}: {len(shed)} shed (503)")
            if unanswered:
                top.plot([], [], " ", label=f"{cls}: {unanswered} unanswered at the end")
        top.set_yscale("log")
        top.axvspan(b0, b1, color="grey", alpha=0.08)
        top.set_title(f"{name}: overload = {overload or 'none'}" if not overload else
                      f"{name}: overload = {{ adaptive = true, … }}", fontsize=10)
        top.grid(True, which="both", alpha=0.3)
        top.legend(fontsize=8, loc="upper left")
        t = [s["t"] for s in samples]
        bottom.plot(t, [s.get("backend_max", float("nan")) for s in samples], color="black", lw=1,
                    label="backend in flight (most per 100 ms)")
        if any("limit" in s for s in samples):
            bottom.plot(t, [s.get("limit", float("nan")) for s in samples], color="tab:green", lw=1.6,
                        label="ratewall_overload_limit")
            bottom.plot(t, [s.get("in_flight", float("nan")) for s in samples], color="tab:purple", lw=1,
                        label="ratewall_overload_in_flight")
            bottom.plot(t, [s.get("queue_10", 0) for s in samples], color=colours["pro"], lw=1, ls="--",
                        label="queue_length, pro (10)")
            bottom.plot(t, [s.get("queue_0", 0) for s in samples], color=colours["free"], lw=1, ls="--",
                        label="queue_length, free (0)")
        bottom.set_yscale("symlog", linthresh=10)
        bottom.axvspan(b0, b1, color="grey", alpha=0.08)
        bottom.axhline(16, color="grey", lw=0.8, ls=":")
        bottom.grid(True, which="both", alpha=0.3)
        bottom.legend(fontsize=8, loc="upper left")
        bottom.set_xlabel("time (s): when each request was due")
    axes[0][0].set_ylabel("latency (ms), from when due")
    axes[1][0].set_ylabel("requests")
    fig.suptitle(f"A backend of 16 x 20 ms (800 req/s) under {PHASES} (s:req/s, half free, half pro)",
                 fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(PLOT), exist_ok=True)
    fig.savefig(PLOT, dpi=110)
    print(f"\nplot: {os.path.relpath(PLOT, ROOT)}")


def main():
    print("building ratewall and bench/load (release)...", flush=True)
    subprocess.run(["cargo", "build", "--release", "--quiet", "--bin", "ratewall"], cwd=ROOT, check=True)
    subprocess.run(["cargo", "build", "--release", "--quiet", "-p", "ratewall-bench"], cwd=ROOT, check=True)
    print(f"phases {PHASES} (s:req/s, both plans), {CONNECTIONS} connections a plan; "
          f"backend 16 permits x 20 ms; {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, "
          f"load average {os.getloadavg()[0]:.2f}")
    results = []
    for name, overload in (("none", None), ("adaptive", OVERLOAD)):
        rows, samples = run(name, overload)
        results.append((name, overload, rows, samples))
    plot(results)


def stop(signum, _frame):
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
