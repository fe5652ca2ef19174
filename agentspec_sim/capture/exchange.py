"""One OpenAI-compatible call as the proxy saw it: the request body and the completed response, streamed or not.

`Exchange` is what the recorder turns into a trace call. It is built from the request's JSON body and either
the whole response (`from_response`) or the server-sent events of a streamed one, fed as they pass
(`StreamAssembler`). Only the first choice is recorded (a request with `n` > 1 samples several answers to one
prompt; the trace holds one).

Token ids: vLLM returns them when the request says `"return_token_ids": true` (vLLM 0.32 / 0.33,
`ChatCompletionRequest.return_token_ids`, `CompletionRequest.return_token_ids`): the response's top-level
`prompt_token_ids` and each choice's `token_ids`; streamed, `prompt_token_ids` comes in the first chunk and
every chunk's choice carries the ids of its delta. Without them the call is recorded as text and tokenized by
the trace's tokenizer when loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from agentspec_sim.trace.convert.openai_chat import content_text, message_text

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
RECORDED_PATHS = (CHAT_PATH, COMPLETIONS_PATH)

# Request fields that shape the output: kept in the call's `extra.sampling` (everything else of the body is
# either the prompt, the identity, or transport).
SAMPLING_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "max_tokens", "max_completion_tokens", "min_tokens", "n", "seed",
    "stop", "stop_token_ids", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "ignore_eos", "response_format", "tool_choice", "parallel_tool_calls", "reasoning_effort",
)


class NotRecordable(ValueError):
    """A request or response the trace cannot hold (the call still passes through); says why."""


class StreamCut(NotRecordable):
    """A streamed answer that ended before `data: [DONE]`: the upstream dropped it."""


@dataclass(slots=True)
class Exchange:
    """A completed call: what was asked (`messages` or `prompt`) and what came back."""

    api: str  # "chat" or "completions"
    request: dict
    messages: list[dict] | None = None  # chat: the messages as sent
    prompt: str | list[int] | None = None  # completions: the prompt as sent (text or ids)
    output_text: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    model: str | None = None
    usage: dict | None = None
    streamed: bool = False

    @classmethod
    def for_request(cls, path: str, body: dict) -> Exchange:
        """The exchange a request opens; raises NotRecordable for a prompt the trace cannot hold."""
        if path == CHAT_PATH:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise NotRecordable("messages: expected a non-empty list of message objects")
            return cls("chat", body, messages=messages, streamed=bool(body.get("stream")))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # one prompt in a batch of one
        if isinstance(prompt, str) and prompt:
            return cls("completions", body, prompt=prompt, streamed=bool(body.get("stream")))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return cls("completions", body, prompt=prompt, streamed=bool(body.get("stream")))
        raise NotRecordable("prompt: expected one prompt (a non-empty string or list of token ids)")

    def take_response(self, response: dict) -> None:
        """Fill the output from a whole (non-streamed) response."""
        choice = _first_choice(response)
        if self.api == "chat":
            message = choice.get("message")
            if not isinstance(message, dict):
                raise NotRecordable("choices[0].message: missing")
            self.output_text = content_text(message.get("content"))
            calls = message.get("tool_calls")
            self.tool_calls = list(calls) if isinstance(calls, list) else []
        else:
            text = choice.get("text")
            if not isinstance(text, str):
                raise NotRecordable("choices[0].text: missing")
            self.output_text = text
        self.finish_reason = choice.get("finish_reason")
        self.output_token_ids = _ids(choice.get("token_ids"))
        self.prompt_token_ids = _ids(response.get("prompt_token_ids")) or _ids(choice.get("prompt_token_ids"))
        self._take_common(response)

    def _take_common(self, response: dict) -> None:
        if isinstance(response.get("model"), str):
            self.model = response["model"]
        if isinstance(response.get("usage"), dict):
            self.usage = {k: v for k, v in response["usage"].items() if k in ("prompt_tokens", "completion_tokens")}

    @property
    def output_message_text(self) -> str:
        """The output as the model wrote it: the text, with tool calls rendered the way the chat template does."""
        if self.api == "chat":
            return message_text({"role": "assistant", "content": self.output_text, "tool_calls": self.tool_calls})
        return self.output_text

    @property
    def sampling(self) -> dict:
        return {k: self.request[k] for k in SAMPLING_FIELDS if k in self.request}


def _first_choice(response: dict) -> dict:
    choices = response.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise NotRecordable("choices: the response has no choices[0]")
    first = next((c for c in choices if isinstance(c, dict) and c.get("index", 0) == 0), choices[0])
    return first


def _ids(value: object) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        return list(value)
    return None


class StreamAssembler:
    """Rebuilds a streamed response from its server-sent events, fed as raw bytes in any chunking.

    Only `data:` fields matter (OpenAI-compatible servers send nothing else that carries the answer); the
    stream is complete when `data: [DONE]` arrives. Choice 0's deltas are joined: content, tool-call pieces by
    their `index` (name once, arguments concatenated), token ids, the finish reason.
    """

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.done = False
        self._buffer = b""
        self._text: list[str] = []
        self._ids: list[int] = []
        self._has_ids = False
        self._tools: dict[int, dict] = {}
        self.error: str | None = None

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk
        while True:
            end = self._buffer.find(b"\n")
            if end < 0:
                return
            line, self._buffer = self._buffer[:end].rstrip(b"\r"), self._buffer[end + 1:]
            if line.startswith(b"data:"):
                self._event(line[5:].strip())

    def _event(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            self.error = "an event that is not JSON"
            return
        if not isinstance(event, dict):
            return
        if "error" in event and "choices" not in event:
            self.error = "the server sent an error event"
            return
        x = self.exchange
        ids = _ids(event.get("prompt_token_ids"))
        if ids is not None:
            x.prompt_token_ids = ids
        x._take_common(event)
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            if x.api == "chat":
                delta = choice.get("delta") or {}
                if isinstance(delta.get("content"), str):
                    self._text.append(delta["content"])
                for piece in delta.get("tool_calls") or ():
                    self._tool_piece(piece)
            elif isinstance(choice.get("text"), str):
                self._text.append(choice["text"])
            pids = _ids(choice.get("prompt_token_ids"))
            if pids is not None and x.prompt_token_ids is None:
                x.prompt_token_ids = pids
            ids = _ids(choice.get("token_ids"))
            if ids is not None:
                self._has_ids = True
                self._ids.extend(ids)
            if choice.get("finish_reason") is not None:
                x.finish_reason = choice["finish_reason"]

    def _tool_piece(self, piece: object) -> None:
        if not isinstance(piece, dict):
            return
        call = self._tools.setdefault(int(piece.get("index", len(self._tools))), {"function": {"arguments": ""}})
        fn = piece.get("function") or {}
        if isinstance(fn.get("name"), str):
            call["function"]["name"] = fn["name"]
        if isinstance(fn.get("arguments"), str):
            call["function"]["arguments"] += fn["arguments"]
        if isinstance(piece.get("id"), str):
            call["id"] = piece["id"]

    def finish(self) -> Exchange:
        """The assembled exchange; raises NotRecordable for a stream that did not complete."""
        if self.error:
            raise NotRecordable(f"stream: {self.error}")
        if not self.done:
            raise StreamCut("stream: ended before [DONE] (dropped)")
        x = self.exchange
        x.output_text = "".join(self._text)
        x.tool_calls = [self._tools[i] for i in sorted(self._tools)]
        x.output_token_ids = self._ids if self._has_ids else None
        return x
