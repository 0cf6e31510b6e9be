#!/usr/bin/env python3
"""Ask ratewall before a costly job, then settle what it really cost (stdlib only).

    RATEWALL_DECIDE_TOKEN=... python3 decide.py org:42

RATEWALL_URL defaults to http://127.0.0.1:8081 ([decide] listen). The rule "imports"
settles (charge or cost_header in limits.toml), so an allowed answer carries a
reservation: the cost asked for is held until the settle, or stands after settle_within.
docs/service.md has every field.
"""
import json
import os
import sys
import urllib.error
import urllib.request

URL = os.environ.get("RATEWALL_URL", "http://127.0.0.1:8081")
TOKEN = os.environ["RATEWALL_DECIDE_TOKEN"]


def call(path, body):
    """POST `body` as JSON; the answer's JSON. A 4xx is a malformed call (problem+json)."""
    req = urllib.request.Request(
        URL + path, data=json.dumps(body).encode(), method="POST",
        headers={"Authorization": "Bearer " + TOKEN, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as e:
        sys.exit(f"{path}: {e.code} {e.read().decode()}")


def run_import(key):
    """The job itself: here, pretend it used 3 of the 10 units asked for."""
    return 3


def main():
    key = sys.argv[1] if len(sys.argv) > 1 else "org:42"
    d = call("/v1/decide", {"rule": "imports", "key": key, "cost": 10})
    if not d["allowed"]:
        print(f"limited: try again in {d['retry_after']} s ({d['ratelimit']})")
        return 1
    reservation = d.get("reservation")
    try:
        used = run_import(key)
    except Exception:
        if reservation:  # nothing was done: give it all back
            call("/v1/settle", {"reservation": reservation, "refund": True})
        raise
    if reservation:
        call("/v1/settle", {"reservation": reservation, "cost": used})
    print(f"done: {used} units ({d['ratelimit']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
