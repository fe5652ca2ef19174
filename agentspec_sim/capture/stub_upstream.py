"""A small deterministic OpenAI-compatible server (aiohttp), for the proxy's fault tests and its overhead benchmark.

It answers `POST /v1/chat/completions` and `/v1/completions`, streamed or not, the way vLLM does with
`return_token_ids`: the answer's text is a fixed function of the request (the word count of the last message),
token ids are one per character (`ord`), and so are the prompt ids, of a plain rendering of the messages. A chat
request with `tools` whose last message is the user's gets a call of the first tool (`finish_reason`
"tool_calls"). It is not a model.

Faults, chosen per request by the header `X-Stub-Fault`: `500` (an error status), `slow` (sleeps `X-Stub-Delay-S`
seconds before answering), `drop` (a stream cut after two events, no `[DONE]`), `garbage` (a 200 that is not JSON),
`trickle` (a stream that sleeps `X-Stub-Delay-S` seconds between events: a client may leave mid-answer).

    python -m agentspec_sim.capture.stub_upstream [--port P]
"""

from __future__ import annotations

import argparse
import asyncio
import json


def answer_text(body: dict) -> str:
    last = (body["messages"][-1].get("content") if "messages" in body else body.get("prompt")) or ""
    last = last if isinstance(last, str) else json.dumps(last)
    return f"echo {len(last.split())} words"


def _prompt_ids(body: dict) -> list[int]:
    """One id per character of a plain rendering (`<role>content` per message, an assistant's content bare), so a
    conversation that re-sends an answer extends the earlier prompt + output ids, as a real template does."""
    if "messages" not in body:
        p = body.get("prompt")
        return list(p) if isinstance(p, list) else [ord(c) for c in str(p)]
    text = "".join(m.get("content") or "" if m.get("role") == "assistant" else f"<{m.get('role')}>{m.get('content')}"
                   for m in body["messages"])
    return [ord(c) for c in text]


async def _completion(request):
    from aiohttp import web

    fault = request.headers.get("X-Stub-Fault")
    if fault == "slow":
        await asyncio.sleep(float(request.headers.get("X-Stub-Delay-S", "1")))
    if fault == "500":
        return web.json_response({"error": {"message": "stub failure", "type": "internal", "code": 500}}, status=500)
    if fault == "garbage":
        return web.Response(status=200, body=b"not json", content_type="application/json")
    body = await request.json()
    chat = request.path.endswith("/chat/completions")
    text = answer_text(body)
    ids = [ord(c) for c in text]
    with_ids = bool(body.get("return_token_ids"))
    model = body.get("model", "stub")
    tool = _tool_call(body) if chat else None
    finish = "tool_calls" if tool else "stop"
    if not body.get("stream"):
        choice = {"index": 0, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
            if tool:
                choice["message"]["tool_calls"] = [tool]
        else:
            choice["text"] = text
        if with_ids:
            choice["token_ids"] = ids
        out = {"id": "cmpl-stub", "object": "chat.completion" if chat else "text_completion", "model": model,
               "choices": [choice], "usage": {"prompt_tokens": 3, "completion_tokens": len(ids)}}
        if with_ids:
            out["prompt_token_ids"] = _prompt_ids(body)
        return web.json_response(out)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for n, event in enumerate(_stream_events(text, chat, tool, finish, with_ids, model, body)):
        await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        if fault == "trickle":
            await asyncio.sleep(float(request.headers.get("X-Stub-Delay-S", "0.2")))
        if fault == "drop" and n == 1:
            request.transport.close()  # cut the connection mid-stream, as a crashed server does
            return response
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _stream_events(text: str, chat: bool, tool: dict | None, finish: str, with_ids: bool, model: str,
                   body: dict) -> list[dict]:
    """The events of a streamed answer: the text 4 characters at a time, a tool call's arguments in two pieces,
    the finish reason on the last event."""
    choices: list[dict] = []
    for n in range(0, len(text), 4):
        piece = text[n:n + 4]
        choice: dict = {"index": 0, "finish_reason": None}
        if chat:
            choice["delta"] = {"content": piece} if n else {"role": "assistant", "content": piece}
        else:
            choice["text"] = piece
        if with_ids:
            choice["token_ids"] = [ord(c) for c in piece]
        choices.append(choice)
    if tool:
        args, fn = tool["function"]["arguments"], tool["function"]["name"]
        choices.append({"index": 0, "finish_reason": None, "delta": {"tool_calls": [
            {"index": 0, "id": tool["id"], "type": "function", "function": {"name": fn, "arguments": args[:5]}}]}})
        choices.append({"index": 0, "finish_reason": None, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": args[5:]}}]}})
    choices[-1]["finish_reason"] = finish
    events = [{"id": "cmpl-stub", "model": model, "choices": [c]} for c in choices]
    if with_ids:
        events[0]["prompt_token_ids"] = _prompt_ids(body)
    return events


def _tool_call(body: dict) -> dict | None:
    tools = body.get("tools")
    if not tools or body["messages"][-1].get("role") != "user":
        return None
    name = tools[0].get("function", {}).get("name", "tool")
    turn = len(body["messages"])
    return {"id": f"call_{turn}", "type": "function",
            "function": {"name": name, "arguments": json.dumps({"cmd": f"ls -{turn}"})}}


async def _models(request):
    from aiohttp import web

    return web.json_response({"object": "list", "data": [{"id": "stub", "object": "model"}]})


def stub_app():
    from aiohttp import web

    app = web.Application()
    app.router.add_post("/v1/chat/completions", _completion)
    app.router.add_post("/v1/completions", _completion)
    app.router.add_get("/v1/models", _models)
    return app


def main(argv: list[str] | None = None) -> None:
    from aiohttp import web

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    web.run_app(stub_app(), host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
