"""A fast fake OpenAI upstream for the gateway benchmark: raw asyncio, canned answers, keep-alive.

It answers every POST with one canned chat completion (with ``usage``) and every GET with a small JSON
document (``/v1/models`` lists the model, ``/health`` is empty), so proxies can health-check and
discover it. A POST whose body asks for ``"stream": true`` is answered as vLLM streams a chat
completion: Server-Sent Events in chunked encoding, ``--stream-chunks`` content chunks
``--chunk-interval`` seconds apart, a usage-only chunk when ``stream_options.include_usage`` asks for
it, then ``data: [DONE]``. ``POST /tokenize`` (vLLM's, which precise routing asks) is answered with
``--tokenize-tokens`` token ids (0: as any other POST), and the canned completion reports
``--cached-tokens`` of its prompt cached (what a precise routing decision predicted). It parses just
enough HTTP/1.1 (request line, headers, ``Content-Length`` body) to serve keep-alive connections, and
costs a few microseconds per request, so what a benchmark measures on top of it is the proxy.

Run: ``python benchmarks/gateway/fake_upstream.py --port 9100 [--stream-chunks 16 --chunk-interval 0.25]``.
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
#: ``POST /tokenize``'s answer (``--tokenize-tokens``); ``None``: answered as any other POST.
_TOKENIZE_REPLY: bytes | None = None


def configure_routing(tokenize_tokens: int, cached_tokens: int) -> None:
    """``/tokenize`` answers ``tokenize_tokens`` ids (1000, 1001, ...) and completions report
    ``cached_tokens`` of their prompt cached."""
    global _POST_REPLY, _TOKENIZE_REPLY  # noqa: PLW0603 - set once, before serving
    if tokenize_tokens:
        tokens = list(range(1000, 1000 + tokenize_tokens))
        _TOKENIZE_REPLY = _response(
            json.dumps({"count": len(tokens), "max_model_len": 2048, "tokens": tokens}).encode()
        )
    answer = json.loads(_ANSWER)
    answer["usage"]["prompt_tokens"] = max(answer["usage"]["prompt_tokens"], tokenize_tokens)
    answer["usage"]["total_tokens"] = answer["usage"]["prompt_tokens"] + 1
    answer["usage"]["prompt_tokens_details"]["cached_tokens"] = cached_tokens
    _POST_REPLY = _response(json.dumps(answer).encode())


_MODELS_REPLY = _response(_MODELS)
_EMPTY_REPLY = _response(b"{}")
_STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
    b"Connection: keep-alive\r\n\r\n"
)


def _chunk(event: dict[str, object] | str) -> bytes:
    """One SSE event as one HTTP chunk."""
    data = b"data: " + (event.encode() if isinstance(event, str) else json.dumps(event).encode()) + b"\n\n"
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _delta(content: str | None, finish: str | None) -> bytes:
    delta = {} if content is None else {"content": content}
    return _chunk(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": MODEL,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
    )


class StreamShape:
    """How streamed answers look: ``chunks`` content chunks (tokens ``t0``, ``t1``, ...), ``interval_s``
    apart. Set once by ``main``/``serve``."""

    chunks = 16
    interval_s = 0.25


def _usage_chunk(chunks: int) -> bytes:
    return _chunk(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 1700000000,
            "model": MODEL,
            "choices": [],
            "usage": {"prompt_tokens": 12, "completion_tokens": chunks, "total_tokens": 12 + chunks},
        }
    )


class _Http(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        #: A stream is being written: later requests on this connection wait for it (HTTP/1.1 order).
        self.streaming: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transport is no subclass of it

    def connection_lost(self, exc: Exception | None) -> None:
        if self.streaming is not None:
            self.streaming.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._serve()

    async def _stream(self, usage: bool) -> None:
        shape = StreamShape
        transport = self.transport
        assert transport is not None
        transport.write(_STREAM_HEAD + _delta("", None))
        for i in range(shape.chunks):
            await asyncio.sleep(shape.interval_s)
            if transport.is_closing():
                return
            transport.write(_delta(f"t{i} ", "stop" if i == shape.chunks - 1 else None))
        tail = (_usage_chunk(shape.chunks) if usage else b"") + _chunk("[DONE]") + b"0\r\n\r\n"
        transport.write(tail)
        self.streaming = None
        if self.buf:
            self._serve()

    def _serve(self) -> None:
        while self.streaming is None and self.transport is not None:
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
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            method, _, rest = head.partition(b" ")
            path = rest.split(b" ", 1)[0]
            assert self.transport is not None
            if method == b"POST":
                if _TOKENIZE_REPLY is not None and path == b"/tokenize":
                    self.transport.write(_TOKENIZE_REPLY)
                    continue
                if b'"stream"' in body and json.loads(body).get("stream"):
                    usage = b'"include_usage"' in body
                    self.streaming = asyncio.get_running_loop().create_task(self._stream(usage))
                    return
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
    parser.add_argument(
        "--stream-chunks", type=int, default=StreamShape.chunks, help="content chunks per stream"
    )
    parser.add_argument(
        "--chunk-interval", type=float, default=StreamShape.interval_s, help="seconds between stream chunks"
    )
    parser.add_argument("--tokenize-tokens", type=int, default=0, help="token ids POST /tokenize answers")
    parser.add_argument(
        "--cached-tokens", type=int, default=0, help="cached prompt tokens completions report"
    )
    args = parser.parse_args()
    configure_routing(args.tokenize_tokens, args.cached_tokens)
    StreamShape.chunks = args.stream_chunks
    StreamShape.interval_s = args.chunk_interval
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        asyncio.run(serve(args.host, args.port))
        return
    uvloop.run(serve(args.host, args.port))


if __name__ == "__main__":
    main()
