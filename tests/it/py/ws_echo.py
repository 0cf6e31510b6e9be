#!/usr/bin/env python3
"""A WebSocket echo backend for the end-to-end tests (`websockets`' asyncio server).

Run by tests/it/common/websocket.rs. It listens on a free port of 127.0.0.1 and says
what it saw on stdout, one JSON object a line:

- `{"listening": <port>}` once bound;
- `{"opened": <path>, "key": <Sec-WebSocket-Key sent?>}` for each handshake;
- `{"closed": <path>, "received": <data messages>, "code": <close code received>,
  "reason": <its reason>}` when a socket has ended. `code` is null when no close frame
  came (the TCP connection just ended).

It picks the subprotocol `chat.v2` where a client offers it (and none otherwise).

By path:
- `/close/<code>/<reason>`: the first message is echoed, then the server starts the
  closing handshake with that code and (percent-decoded) reason;
- anything else: every message is echoed as it came, text as text, binary as binary.

It exits when its standard input ends (the test that ran it is gone).
"""

import asyncio
import json
import sys
import urllib.parse

from websockets.asyncio.server import serve
from websockets.exceptions import ConnectionClosed


def say(**fields):
    print(json.dumps(fields), flush=True)


async def echo(ws):
    path = ws.request.path
    say(opened=path, key="Sec-WebSocket-Key" in ws.request.headers)
    received = 0
    try:
        async for message in ws:
            received += 1
            await ws.send(message)
            if path.startswith("/close/"):
                _, _, code, reason = path.split("/", 3)
                await ws.close(int(code), urllib.parse.unquote(reason))
                break
    except ConnectionClosed:
        pass
    await ws.wait_closed()
    close = ws.protocol.close_rcvd
    say(
        closed=path,
        received=received,
        code=close.code if close else None,
        reason=close.reason if close else None,
    )


def pick(connection, subprotocols):
    return "chat.v2" if "chat.v2" in subprotocols else None


async def main():
    # No keepalive pings (the tests time silences), no size limit (a 1 MiB message is
    # echoed whole); permessage-deflate is accepted where a client offers it.
    async with serve(
        echo,
        "127.0.0.1",
        0,
        ping_interval=None,
        max_size=None,
        select_subprotocol=pick,
    ) as server:
        say(listening=server.sockets[0].getsockname()[1])
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    asyncio.run(main())
