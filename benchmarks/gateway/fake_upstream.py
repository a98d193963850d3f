"""A fast fake OpenAI upstream for the gateway benchmark: raw asyncio, canned answers, keep-alive.

It answers every POST with one canned chat completion (with ``usage``) and every GET with a small JSON
document (``/v1/models`` lists the model, ``/health`` is empty), so proxies can health-check and
discover it. It parses just enough HTTP/1.1 (request line, headers, ``Content-Length`` body) to serve
keep-alive connections, and costs a few microseconds per request, so what a benchmark measures on top of
it is the proxy.

Run: ``python benchmarks/gateway/fake_upstream.py --port 9100``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import cast

MODEL = "tiny"
_ANSWER = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": 12,
            "completion_tokens": 1,
            "total_tokens": 13,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
).encode()
_MODELS = json.dumps(
    {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "bench", "max_model_len": 2048}],
    }
).encode()


def _response(body: bytes) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\nConnection: keep-alive\r\n\r\n"
        + body
    )


_POST_REPLY = _response(_ANSWER)
_MODELS_REPLY = _response(_MODELS)
_EMPTY_REPLY = _response(b"{}")


class _Http(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transport is no subclass of it

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value.strip())
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            method, _, rest = head.partition(b" ")
            path = rest.split(b" ", 1)[0]
            assert self.transport is not None
            if method == b"POST":
                self.transport.write(_POST_REPLY)
            elif path.startswith(b"/v1/models"):
                self.transport.write(_MODELS_REPLY)
            else:
                self.transport.write(_EMPTY_REPLY)


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Http, host, port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        asyncio.run(serve(args.host, args.port))
        return
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
