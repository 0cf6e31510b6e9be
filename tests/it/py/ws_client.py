#!/usr/bin/env python3
"""A WebSocket client for the end-to-end tests (`websockets`' asyncio client), driven
line by line by tests/it/common/websocket.rs.

    ws_client.py URL [--header NAME:VALUE]... [--deflate] [--subprotocol NAME]...

It connects (no keepalive pings, no size limit; permessage-deflate offered only with
`--deflate`, subprotocols only as given) and prints one JSON line: `{"open": true,
"extensions": [...], "subprotocol": <the one picked, or null>}`, or
`{"open": false, "status": <HTTP status>, "headers": {...}}` for an answer other than
101 (then it exits), or `{"open": false, "error": "..."}`.

Then it reads commands from stdin, one JSON object a line, and answers each with one
JSON line:

- `{"send": "text"}` -> `{"sent": true}`
- `{"send_binary": n, "seed": s}` -> `{"sent": true, "sha256": ...}`: n pseudo-random bytes
- `{"send_fragments": n, "fragment": m, "seed": s}` -> as `send_binary`, one message of
  n bytes sent as fragments of m bytes
- `{"send_zeros": n}` -> as `send_binary`, n zero bytes (permessage-deflate, where it was
  negotiated, sends them in a small fraction of that)
- `{"recv": seconds}` -> `{"text": ...}` | `{"binary": n, "sha256": ...}` |
  `{"timeout": true}` | `{"closed": CLOSED}`
- `{"ping": "payload"}` -> `{"pong": true}` once its pong came (`{"closed": CLOSED}` if not)
- `{"close": code, "reason": r}` -> `{"closed": CLOSED}` after the closing handshake
- `{"wait_closed": seconds}` -> `{"closed": CLOSED, "after_ms": t}` | `{"timeout": true}`
- `{"pace": rate, "seconds": s}` -> send a text frame `rate` times a second for `s`
  seconds or until the socket closes, reading the echoes meanwhile:
  `{"sent": n, "echoed": m, "closed": CLOSED or null, "elapsed_ms": t}`

A failed send answers `{"sent": false, "closed": CLOSED}`. CLOSED is `{"code": <close code
received, 1006 when none>, "reason": ..., "sent_code": <close code sent, or null>}`.
"""

import argparse
import asyncio
import hashlib
import json
import random
import sys
import time

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus


def say(**fields):
    print(json.dumps(fields), flush=True)


def closed(ws):
    sent = ws.protocol.close_sent
    return {
        "code": ws.close_code,
        "reason": ws.close_reason,
        "sent_code": sent.code if sent else None,
    }


def payload(n, seed):
    return random.Random(seed).randbytes(n)


async def pace(ws, rate, seconds):
    echoed = 0

    async def read():
        nonlocal echoed
        try:
            async for _ in ws:
                echoed += 1
        except ConnectionClosed:
            pass

    reader = asyncio.create_task(read())
    start = time.monotonic()
    sent = 0
    try:
        while time.monotonic() - start < seconds:
            await ws.send(f"frame {sent}")
            sent += 1
            delay = start + sent / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
    except ConnectionClosed:
        pass
    elapsed = time.monotonic() - start
    # The last echoes, or the end of a socket being closed.
    try:
        await asyncio.wait_for(asyncio.shield(reader), 1.0)
    except asyncio.TimeoutError:
        pass
    reader.cancel()
    gone = ws.protocol.state.name == "CLOSED"
    return {
        "sent": sent,
        "echoed": echoed,
        "closed": closed(ws) if gone else None,
        "elapsed_ms": int(elapsed * 1000),
    }


async def run(ws, command):
    try:
        if "send" in command:
            await ws.send(command["send"])
            return {"sent": True}
        if "send_binary" in command:
            data = payload(command["send_binary"], command.get("seed", 0))
            await ws.send(data)
            return {"sent": True, "sha256": hashlib.sha256(data).hexdigest()}
        if "send_zeros" in command:
            data = bytes(command["send_zeros"])
            await ws.send(data)
            return {"sent": True, "sha256": hashlib.sha256(data).hexdigest()}
        if "send_fragments" in command:
            data = payload(command["send_fragments"], command.get("seed", 0))
            m = command["fragment"]
            await ws.send([data[i : i + m] for i in range(0, len(data), m)])
            return {"sent": True, "sha256": hashlib.sha256(data).hexdigest()}
    except ConnectionClosed:
        return {"sent": False, "closed": closed(ws)}
    try:
        if "recv" in command:
            try:
                message = await asyncio.wait_for(ws.recv(), command["recv"])
            except asyncio.TimeoutError:
                return {"timeout": True}
            if isinstance(message, str):
                return {"text": message}
            return {"binary": len(message), "sha256": hashlib.sha256(message).hexdigest()}
        if "ping" in command:
            waiter = await ws.ping(command["ping"])
            await asyncio.wait_for(waiter, 10)
            return {"pong": True}
        if "close" in command:
            await ws.close(command["close"], command.get("reason", ""))
            return {"closed": closed(ws)}
    except ConnectionClosed:
        return {"closed": closed(ws)}
    if "wait_closed" in command:
        start = time.monotonic()
        try:
            await asyncio.wait_for(ws.wait_closed(), command["wait_closed"])
        except asyncio.TimeoutError:
            return {"timeout": True}
        return {"closed": closed(ws), "after_ms": int((time.monotonic() - start) * 1000)}
    if "pace" in command:
        return await pace(ws, command["pace"], command["seconds"])
    return {"error": f"unknown command {command}"}


async def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--header", action="append", default=[])
    parser.add_argument("--deflate", action="store_true")
    parser.add_argument("--subprotocol", action="append", default=[])
    args = parser.parse_args()
    headers = [tuple(h.split(":", 1)) for h in args.header]
    try:
        ws = await connect(
            args.url,
            additional_headers=headers,
            compression="deflate" if args.deflate else None,
            subprotocols=args.subprotocol or None,
            ping_interval=None,
            max_size=None,
            open_timeout=10,
            close_timeout=5,
        )
    except InvalidStatus as e:
        say(open=False, status=e.response.status_code, headers=dict(e.response.headers))
        return
    except Exception as e:  # noqa: BLE001 - the test reads what went wrong
        say(open=False, error=repr(e))
        return
    extensions = ws.response.headers.get_all("Sec-WebSocket-Extensions")
    say(open=True, extensions=extensions, subprotocol=ws.subprotocol)
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            break
        say(**await run(ws, json.loads(line)))


if __name__ == "__main__":
    asyncio.run(main())
