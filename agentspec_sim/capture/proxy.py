"""An OpenAI-compatible recording proxy (aiohttp): agents talk to it as to their server; it forwards every request
to the upstream server unchanged and appends each completed `POST /v1/chat/completions` and `/v1/completions`
call, streamed (SSE) or not, to a trace (agentspec_sim/capture/recorder.py).

What passes through: any method and path (`/v1/models`, `/health`, …) is forwarded and relayed unrecorded;
request headers go upstream except hop-by-hop ones and `Accept-Encoding` (the proxy reads the answer), and
`Authorization` is forwarded and never written anywhere. Upstream error statuses pass through unchanged and are
not recorded; an unreachable upstream answers 502, a timeout before the answer starts 504 (both in OpenAI's error
shape); a stream cut off mid-way ends the client's stream the same way and is not recorded. A request body over
`max_body_bytes` is refused with 413 before anything goes upstream.

`ask_token_ids` adds `"return_token_ids": true` to recorded requests that do not say it (vLLM then returns the
prompt and output token ids, which the trace records exactly; the response carries those fields too). Leave it
off for servers that refuse unknown fields (the hosted OpenAI API does).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from agentspec_sim.capture.exchange import RECORDED_PATHS, Exchange, NotRecordable, StreamAssembler, StreamCut
from agentspec_sim.capture.recorder import Identity, TraceRecorder
from agentspec_sim.io import strict_json

# RFC 9110 §7.6.1 hop-by-hop fields, plus what the proxy sets itself.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer", "trailers",
    "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding",
})
_RESPONSE_DROP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
                            "trailer", "upgrade"})
DEFAULT_MAX_BODY_MB = 64
DEFAULT_TIMEOUT_S = 600.0
DEFAULT_DRAIN_S = 30.0


@dataclass
class ProxyStats:
    """What passed through that is not a recorded call."""

    upstream_errors: Counter = field(default_factory=Counter)  # HTTP status → count
    unreachable: int = 0
    timeouts: int = 0
    dropped_streams: int = 0  # answers the upstream cut off (streamed or not)
    client_gone: int = 0
    too_large: int = 0
    passed_through: int = 0

    def as_dict(self) -> dict:
        return {"upstream_errors": {str(k): v for k, v in sorted(self.upstream_errors.items())},
                "unreachable": self.unreachable, "timeouts": self.timeouts, "dropped_streams": self.dropped_streams,
                "client_gone": self.client_gone, "too_large": self.too_large, "passed_through": self.passed_through}


def upstream_root(url: str) -> str:
    """The server root requests are forwarded under: `http://h:8000/v1` and `http://h:8000/` → `http://h:8000`."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--upstream: expected an http:// or https:// URL, got {url!r}")
    return url


def _error(status: int, message: str, kind: str):
    """A response in OpenAI's error shape, for what the proxy itself answers (never for an upstream's error)."""
    from aiohttp import web

    return web.Response(status=status, content_type="application/json",
                        body=json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode())


class RecordingProxy:
    """The aiohttp application; `stats` and `recorder.stats` count what happened."""

    def __init__(self, upstream: str, recorder: TraceRecorder, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 max_body_bytes: int = DEFAULT_MAX_BODY_MB << 20, ask_token_ids: bool = False) -> None:
        self.root = upstream_root(upstream)
        self.recorder = recorder
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self.ask_token_ids = ask_token_ids
        self.stats = ProxyStats()
        self._session = None

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app) -> None:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=None, connect=min(30.0, self.timeout_s), sock_read=self.timeout_s)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0),
                                              auto_decompress=True, skip_auto_headers=("User-Agent",))

    async def _stop(self, app) -> None:
        if self._session is not None:
            await self._session.close()

    # ---- handling ------------------------------------------------------------------------------------------

    async def _handle(self, request):
        import aiohttp
        from aiohttp import web

        sent_s = self.recorder.now_s()
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.stats.too_large += 1
            return _error(413, f"request body over the proxy's limit of {self.max_body_bytes:,} bytes",
                          "invalid_request_error")
        recorded = request.method == "POST" and request.path in RECORDED_PATHS
        exchange, who = None, None
        if recorded:
            exchange, who, body = self._open_exchange(request, body)
        else:
            self.stats.passed_through += 1
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        url = self.root + request.path_qs
        try:
            upstream = await self._session.request(request.method, url, data=body or None, headers=headers,
                                                   allow_redirects=False)
        except TimeoutError:
            self.stats.timeouts += 1
            return _error(504, "upstream timed out", "upstream_timeout")
        except aiohttp.ClientError as exc:
            self.stats.unreachable += 1
            return _error(502, f"upstream unreachable: {exc}", "upstream_unreachable")
        async with upstream:
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _RESPONSE_DROP}
            if upstream.status >= 400 and recorded:
                self.stats.upstream_errors[upstream.status] += 1
                exchange = None
            streamed = upstream.content_type == "text/event-stream"
            if not streamed:
                try:
                    data = await upstream.read()
                except TimeoutError:
                    self.stats.timeouts += 1
                    return _error(504, "upstream timed out", "upstream_timeout")
                except aiohttp.ClientError as exc:  # the answer was cut off
                    self.stats.dropped_streams += 1
                    return _error(502, f"upstream answer cut off: {exc}", "upstream_unreachable")
                if exchange is not None:
                    self._record_whole(exchange, who, data, sent_s)
                return web.Response(status=upstream.status, headers=out_headers, body=data)
            return await self._relay_stream(request, upstream, out_headers, exchange, who, sent_s)

    def _open_exchange(self, request, body: bytes) -> tuple[Exchange | None, Identity | None, bytes]:
        try:
            parsed = strict_json.loads(body)
        except (ValueError, UnicodeDecodeError):
            self.recorder.skip("request body is not JSON")
            return None, None, body
        if not isinstance(parsed, dict):
            self.recorder.skip("request body is not a JSON object")
            return None, None, body
        try:
            exchange = Exchange.for_request(request.path, parsed)
        except NotRecordable as exc:
            self.recorder.skip(str(exc))
            return None, None, body
        if self.ask_token_ids and "return_token_ids" not in parsed:
            body = json.dumps({**parsed, "return_token_ids": True}).encode()
        return exchange, Identity.of(request.headers, parsed), body

    def _record_whole(self, exchange: Exchange, who: Identity, data: bytes, sent_s: float) -> None:
        done_s = self.recorder.now_s()
        try:
            response = json.loads(data)
            if not isinstance(response, dict):
                raise NotRecordable("response is not a JSON object")
            exchange.take_response(response)
            self._record(exchange, who, sent_s, None, done_s)
        except NotRecordable as exc:
            self.recorder.skip(str(exc))
        except ValueError:
            self.recorder.skip("response is not JSON")

    def _record(self, exchange: Exchange, who: Identity, sent_s: float, first_s: float | None, done_s: float) -> None:
        """Append the call; a trace that cannot be written (a full disk) never fails the agent's request."""
        try:
            self.recorder.record(exchange, who, sent_s, first_s, done_s)
        except OSError as exc:
            self.recorder.skip(f"trace not written ({exc.strerror or exc})")

    async def _relay_stream(self, request, upstream, headers: dict, exchange: Exchange | None,
                            who: Identity | None, sent_s: float):
        import aiohttp
        from aiohttp import web

        response = web.StreamResponse(status=upstream.status, headers=headers)
        await response.prepare(request)
        assembler = StreamAssembler(exchange) if exchange is not None else None
        first_s = None
        chunks = upstream.content.iter_any().__aiter__()
        while True:
            # Reading the upstream and writing the client fail apart: aiohttp's error for a client that went away
            # (ClientConnectionResetError) is also a ClientError, so only where it happened tells them apart.
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                break
            except (aiohttp.ClientError, TimeoutError):
                # The upstream cut the stream: cut the client's too (no terminating chunk), so it fails as it would.
                self.stats.dropped_streams += 1
                if request.transport is not None:
                    request.transport.close()
                return response
            if assembler is not None:
                if first_s is None:
                    first_s = self.recorder.now_s()
                assembler.feed(chunk)
            try:
                await response.write(chunk)
            except (ConnectionError, RuntimeError, aiohttp.ClientError):  # the client went away mid-answer
                self.stats.client_gone += 1
                return response
        with contextlib.suppress(ConnectionError, RuntimeError):
            await response.write_eof()
        if assembler is not None:
            done_s = self.recorder.now_s()
            try:
                self._record(assembler.finish(), who, sent_s, first_s, done_s)  # type: ignore[arg-type]
            except StreamCut:
                self.stats.dropped_streams += 1
            except NotRecordable as exc:
                self.recorder.skip(str(exc))
        return response


@dataclass
class ProxySummary:
    url: str
    output: str
    recorded: dict
    passed: dict

    def line(self) -> str:
        r, p = self.recorded, self.passed
        statuses = ", ".join(f"{k}: {v}" for k, v in p["upstream_errors"].items())
        errors = f"{sum(p['upstream_errors'].values())} upstream errors" + (f" ({statuses})" if statuses else "")
        other = ", ".join(f"{v} {k}" for k, v in r["not_recorded"].items())
        return (f"{self.output}: {r['recorded']} calls recorded ({r['as_token_ids']} as the server's token ids"
                + (f", {r['resumed_calls']} were there before" if r["resumed_calls"] else "") + "); not recorded: "
                f"{errors}, {p['timeouts']} timeouts, {p['unreachable']} unreachable, "
                f"{p['dropped_streams']} answers cut off, {p['client_gone']} clients gone, {p['too_large']} too large"
                + (f", {other}" if other else "") + f"; {p['passed_through']} other requests passed through")

    def as_dict(self) -> dict:
        return {"url": self.url, "output": self.output, "recorded": self.recorded, "passed": self.passed}


class ProxyServer:
    """Runs a RecordingProxy until `stop()` (any thread) or, with `handle_signals`, SIGINT / SIGTERM; then waits up to
    `drain_s` for calls in flight, closes the trace and returns the summary from `run()`."""

    def __init__(self, proxy: RecordingProxy, host: str = "127.0.0.1", port: int = 0, drain_s: float = DEFAULT_DRAIN_S,
                 on_ready: Callable[[str], None] | None = None, on_tick: Callable[[ProxySummary], None] | None = None,
                 handle_signals: bool = False) -> None:
        self.proxy, self.host, self.port, self.drain_s = proxy, host, port, drain_s
        self.on_ready, self.on_tick, self.handle_signals = on_ready, on_tick, handle_signals
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None

    def summary(self) -> ProxySummary:
        return ProxySummary(self.url or "", str(self.proxy.recorder.path), self.proxy.recorder.stats.as_dict(),
                            self.proxy.stats.as_dict())

    def run(self) -> ProxySummary:
        try:
            asyncio.run(self._main())
        finally:
            self.proxy.recorder.close()
        return self.summary()

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)

    async def _main(self) -> None:
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        if self.handle_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._loop.add_signal_handler(sig, self._stopping.set)
        runner = web.AppRunner(self.proxy.app(), access_log=None, shutdown_timeout=self.drain_s)
        await runner.setup()
        site = web.TCPSite(runner, self.host, self.port, reuse_address=True)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()  # the upstream session made at setup is closed: no "Unclosed client session"
            raise
        bound = runner.addresses[0]
        self.url = f"http://{self.host if ':' not in self.host else '[' + self.host + ']'}:{bound[1]}"
        if self.on_ready is not None:
            self.on_ready(self.url)
        last = (0, 0)
        try:
            while not self._stopping.is_set():
                with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), 5.0)
                now = (self.proxy.recorder.stats.recorded, sum(self.proxy.stats.as_dict()["upstream_errors"].values()))
                if self.on_tick is not None and now != last and not self._stopping.is_set():
                    self.on_tick(self.summary())
                last = now
        finally:
            await runner.cleanup()  # stops listening, waits up to drain_s for handlers in flight, then cancels
