"""The decision API from Python's `requests` (tests/it/service.rs runs this).

    python3 decide_client.py <base url> <token> <rule> <key>

<rule> settles (a reservation per allowed decision), lets 5 of <key> pass and refills
at 1/h: nothing comes back during the run but what is settled or refunded. Each step
is checked here; the last line printed is "ok" when every one held.
"""

import json
import re
import sys

import requests

base, token, rule, key = sys.argv[1:5]
s = requests.Session()
s.headers["Authorization"] = f"Bearer {token}"
HEX32 = re.compile(r"^[0-9a-f]{32}$")


def post(path, body, want=200):
    r = s.post(base + path, json=body, timeout=30)
    assert r.status_code == want, f"POST {path} {body}: {r.status_code} {r.text}"
    return r.json()


def decide(**extra):
    a = post("/v1/decide", {"rule": rule, "key": key, **extra})
    print("decide", json.dumps(extra), "->", json.dumps(a))
    return a


def remaining(a):
    [r] = a["rules"]
    assert r["rule"] == rule, a
    return r["remaining"]


# A decide: allowed, one of 5 taken, a reservation to settle it by.
a = decide()
assert a["allowed"] is True and a["status"] == 200 and a["dry_run"] is False, a
assert remaining(a) == 4, a
assert HEX32.match(a["reservation"]), a
assert a["ratelimit"] and a["ratelimit_policy"], a

# A settle at cost 3: two more are charged.
settled = post("/v1/settle", {"reservation": a["reservation"], "cost": 3})
assert settled["settled"] is True, settled
# Settled once: a second settlement of the same reservation is 404 (problem+json).
r = s.post(base + "/v1/settle", json={"reservation": a["reservation"], "cost": 1}, timeout=30)
assert r.status_code == 404, (r.status_code, r.text)
assert r.headers["content-type"].startswith("application/problem+json"), r.headers
assert r.json()["status"] == 404, r.text

b = decide()
assert b["allowed"] is True and remaining(b) == 1, b

# A refund gives that one back whole.
refunded = post("/v1/settle", {"reservation": b["reservation"], "refund": True})
assert refunded["settled"] is True, refunded
post("/v1/settle", {"reservation": b["reservation"], "refund": True}, want=404)

# What is left now, charging nothing: 2 (5, less the settled 3).
c = decide(dry_run=True)
assert c["allowed"] is True and c["dry_run"] is True and remaining(c) == 2, c
assert "reservation" not in c, c

# Exactly those 2, then 429 (answered 200: a decision, not an error).
for want in (1, 0):
    d = decide()
    assert d["allowed"] is True and remaining(d) == want, d
e = decide()
assert e["allowed"] is False and e["status"] == 429 and e["retry_after"] >= 1, e
assert "reservation" not in e, e

# A batch from the same library: a list answered in order (`limit` and `remaining`
# count requests of each call's cost: 3 left of 5 is 1 call of 2).
batch = post("/v1/decide", [{"rule": rule, "key": key + "-b", "cost": 2},
                            {"rule": rule, "key": key + "-c", "cost": 1}])
assert [(x["rules"][0]["limit"], remaining(x)) for x in batch] == [(2, 1), (5, 4)], batch

# The token is checked: a wrong one is 401 with its challenge.
r = requests.post(base + "/v1/decide", json={"rule": rule, "key": key},
                  headers={"Authorization": "Bearer not-the-token-at-all"}, timeout=30)
assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), r
print("ok")
