"""One streamed answer of the gateway (megarl/rollout/gateway.py): server-sent events in OpenAI's chunk shapes, the
text sent as the engine produces the turn's tokens.

The engine hands each token over as it samples it (GenerationBatcher's on_tokens, from the engine's thread); what is
sent is always a prefix of the answer the gateway will record and return whole:
- the latest token's text waits for the next token (the last one of a turn may be the model's stop token, whose text
  the answer leaves out), and so does a character whose bytes are not all there yet;
- with `stop` strings, a tail of the text that could begin one waits until it cannot; once one is complete, nothing
  after its start is ever sent;
- an answer whose text may have tool calls cut out of it (a chat request with `tools`) is sent when its turn has
  ended, as is any answer from an engine that does not hand tokens over.
If what was sent is not how the recorded answer begins after all (a row restarted under new weights,
async.partial=restart, after part of it was sent), the turn is not recorded and the stream ends with an error event.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from aiohttp import web


def sendable(text: str, stops: list[str]) -> tuple[str, bool]:
    """What of a turn's text so far may be sent, and whether that is all of it: the text before the stop string
    whose end comes first, if one is complete (as the whole answer is cut: gateway._cut_at_stop); else the text less
    a trailing incomplete character and less its longest tail that begins a stop string."""
    found = [(i + len(stop), i) for stop in stops if (i := text.find(stop)) >= 0]
    if found:
        return text[:min(found)[1]], True
    text = text.rstrip("\ufffd")
    hold = max((k for stop in stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
    return text[:len(text) - hold], False


class TurnStream:
    """The server-sent events of one answer. `on_tokens(offset, token_ids)` (the engine's thread) feeds it the turn's
    tokens; text goes out from the server's loop as it becomes sendable; `halt()` stops that before the turn is
    recorded, `finish(answer)` sends the rest, the tool calls, the finish reason, usage where asked, then [DONE]."""

    def __init__(self, request: web.Request, tokenizer, chat: bool, model: str, stops: list[str], usage: bool):
        self.request, self.tokenizer, self.chat, self.stops, self.usage = request, tokenizer, chat, stops, usage
        self.head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                     "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": model}
        self.loop = asyncio.get_running_loop()
        self.response: web.StreamResponse | None = None
        self.sent = ""  # the text sent so far
        self.ids: list[int] = []  # the turn's tokens so far
        self.wake = asyncio.Event()
        self.sending: asyncio.Task | None = None
        self.open = True  # text may still go out before the turn ends
        self.gone = False  # the client went away: nothing more is written

    def on_tokens(self, offset: int, token_ids: list[int]) -> None:
        self.loop.call_soon_threadsafe(self._arrive, offset, token_ids)

    def _arrive(self, offset: int, token_ids: list[int]) -> None:
        self.ids[offset:] = token_ids  # an offset below the end: the row restarted, its later tokens dropped
        self.wake.set()
        if self.sending is None:
            self.sending = asyncio.create_task(self._send_progress())

    async def _send_progress(self) -> None:
        while self.open:
            await self.wake.wait()
            self.wake.clear()
            if not self.open:
                break
            text = self.tokenizer.decode(self.ids[:-1], skip_special_tokens=False)
            text, complete = sendable(text, self.stops)
            if not text.startswith(self.sent):  # a restarted row: what comes next is settled at the end
                break
            if len(text) > len(self.sent):
                await self._text(text[len(self.sent):])
            if complete or self.gone:
                break

    async def halt(self) -> None:
        """No text goes out until finish() (the turn is about to be checked against what was sent and recorded)."""
        self.open = False
        self.wake.set()
        if self.sending is not None:
            await self.sending

    @property
    def started(self) -> bool:
        return self.response is not None

    async def finish(self, answer: dict) -> web.StreamResponse:
        """The rest of `answer` (gateway._chat_turn's or _completion_turn's), after halt()."""
        content, start, sent = answer["content"] or "", 0, len(self.sent)
        for piece in _pieces(self.tokenizer, answer["gen"].token_ids, content):  # what is left, token by token
            if start + len(piece) > sent:
                await self._text(piece[max(0, sent - start):])
            start += len(piece)
        await self._start()
        if answer["tool_calls"]:
            calls = [dict(c, index=k) for k, c in enumerate(answer["tool_calls"])]
            await self._send({"index": 0, "delta": {"tool_calls": calls}, "finish_reason": None})
        await self._send({"index": 0, "delta": {}, "finish_reason": answer["finish"]} if self.chat else
                         {"index": 0, "text": "", "finish_reason": answer["finish"], "logprobs": None})
        if self.usage:
            await self._send(None, usage=answer["response"]["usage"])
        return await self._end()

    async def fail(self, message: str, kind: str) -> web.StreamResponse:
        """An error after the stream began (HTTP 200 already sent): an error event in OpenAI's shape, then the end."""
        await self.halt()
        await self._write({"error": {"message": message, "type": kind, "param": None, "code": None}})
        return await self._end()

    async def _start(self) -> None:
        if self.response is None:
            self.response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                        "Cache-Control": "no-cache"})
            await self.response.prepare(self.request)
            if self.chat:
                await self._send({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    async def _text(self, piece: str) -> None:
        if not piece:
            return
        await self._start()
        self.sent += piece
        await self._send({"index": 0, "delta": {"content": piece}, "finish_reason": None} if self.chat else
                         {"index": 0, "text": piece, "finish_reason": None, "logprobs": None})

    async def _send(self, choice: dict | None, **extra) -> None:
        await self._write(self.head | {"choices": [] if choice is None else [choice]} | extra)

    async def _write(self, event: dict) -> None:
        await self._start()
        if self.gone:
            return
        try:
            await self.response.write(f"data: {json.dumps(event)}\n\n".encode())
        except ConnectionError:  # the agent closed the stream; its turn is recorded all the same
            self.gone = True

    async def _end(self) -> web.StreamResponse:
        if not self.gone:
            try:
                await self.response.write(b"data: [DONE]\n\n")
                await self.response.write_eof()
            except ConnectionError:
                self.gone = True
        return self.response


def _pieces(tokenizer, token_ids: list[int], content: str) -> list[str]:
    """`content` cut where its tokens' texts end, when it is the tokens' text; else whole (tool calls cut out)."""
    pieces, text = [], ""
    for k in range(len(token_ids)):
        now = tokenizer.decode(token_ids[:k + 1], skip_special_tokens=False)
        if now.startswith(text) and content.startswith(now) and len(now) > len(text):
            pieces.append(now[len(text):])
            text = now
    return pieces if text == content else [content] if content else []
