"""An OpenAI-compatible HTTP endpoint on the rollout engine, for agents that run their own loop (docs/agents.md).

Routes: POST /v1/chat/completions (messages, `tools`, answers with `tool_calls`), POST /v1/completions (a prompt as
text or token ids), GET /v1/models; `"stream": true` answers as server-sent events in OpenAI's chunk shapes. The API
key (`Authorization: Bearer ...`) names one agent run (gateway_record.Record): what the engine is fed and produces for
it is recorded there, token by token, and becomes the run's rows of the step's Batch (gateway_agents.py).

Generation goes through the engine interface (megarl/rollout/base.py) that the built-in agent loop uses, batched the
same way (GenerationBatcher: requests that arrive together are one engine call), so the hf engine and SGLang serve it
by the same code. Sampling follows the run's rollout settings (rollout.temperature, top_p, top_k), never the request's:
the log-probs recorded are the policy's at the temperature training assumes. A request's `max_tokens` (or
`max_completion_tokens`) is capped by agent.max_new_tokens_per_turn, what is left of the segment's
agent.max_response_tokens and of the run's agent.gateway.max_tokens (none left: an empty answer with finish_reason
"length", nothing generated); `n` must be 1. `stop` (a string or up to 4) ends the answer where the first of them
is complete, as OpenAI's does: the text stops before it, finish_reason "stop", and the turn's record keeps the tokens
up to the one that completed it (what the model produced, which the next turn's context extends): the engine
generates on to its own stop or limit and the rest is dropped.
Tool calls of a chat request that offers `tools` are parsed from the model's text by agent.parser (by default the
format the chat template writes: tools/parsers.py) and cut out of the answer's content. A streamed answer's text goes out as the engine produces its
tokens, never past what the recorded answer holds (gateway_stream.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from aiohttp import web

from megarl.config import AgentConfig
from megarl.rollout.agent import GenerationBatcher
from megarl.rollout.base import Generation, RolloutEngine, SamplingParams
from megarl.rollout.gateway_record import ChatLayout, Record, Segment, normalize
from megarl.rollout.gateway_stream import TurnStream
from megarl.rollout.tools.parsers import content_without_calls, resolve_parser

MAX_BODY_BYTES = 64 << 20  # a long agent history in one request


class RequestError(Exception):
    """A request the gateway refuses: its HTTP status and OpenAI's error type."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


def _stop_strings(stop) -> list[str]:
    """A request's `stop`, as OpenAI takes it: None, a string, or a list of at most 4 strings, none empty."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise RequestError(f"stop must be a non-empty string or a list of at most 4 of them, not {stop!r}")
    return stops


def _error(message: str, status: int, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": None, "code": None}},
                             status=status)


class Gateway:
    """The server, on an event loop in a thread of its own, from construction until close(). `begin(params)` before
    each rollout sets its sampling; `open()` issues a key for one agent run, `close_record()` revokes it."""

    def __init__(self, engine: RolloutEngine, tokenizer, config: AgentConfig, model_name: str = "megarl"):
        self.engine, self.tokenizer, self.config, self.model_name = engine, tokenizer, config, model_name
        self.layout = ChatLayout(tokenizer, config.observation_template)
        self.parser_name, self.parser = resolve_parser(config.parser, tokenizer)
        self.records: dict[str, Record] = {}
        self.batcher: GenerationBatcher | None = None
        self.engine_thread = ThreadPoolExecutor(1, thread_name_prefix="megarl-gateway-engine")
        self.loop = asyncio.new_event_loop()
        started, failed = threading.Event(), []
        self.thread = threading.Thread(target=self._serve, args=(started, failed), daemon=True,
                                       name="megarl-gateway")
        self.thread.start()
        started.wait()
        if failed:
            raise failed[0]
        self.base_url = f"http://{config.gateway.host}:{self.port}/v1"

    def _serve(self, started: threading.Event, failed: list) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.add_routes([web.post("/v1/chat/completions", self._chat), web.post("/v1/completions", self._completion),
                        web.get("/v1/models", self._models)])
        self.runner = web.AppRunner(app, access_log=None)
        try:
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, self.config.gateway.host, self.config.gateway.port)
            self.loop.run_until_complete(site.start())
            self.port = site._server.sockets[0].getsockname()[1]
        except BaseException as e:  # noqa: B036  (raised in the constructor's thread)
            failed.append(e)
            started.set()
            return
        started.set()
        self.loop.run_forever()

    def begin(self, params: SamplingParams) -> None:
        """The sampling of the rollout about to start (its seed advances with each engine call, as the agent loop's)."""
        self.batcher = GenerationBatcher(self.engine, params, self.engine_thread)

    def open(self, prompt_index: int, policy_version: int) -> Record:
        record = Record(prompt_index, policy_version, self.config.gateway.max_tokens)
        self.records[record.key] = record
        return record

    def close_record(self, record: Record) -> None:
        record.closed = True
        self.records.pop(record.key, None)

    def close(self) -> None:
        # aiohttp's cleanup waits for requests still in flight (an agent past its timeout may still be calling):
        # bounded, and the server's loop stops either way
        try:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout=30)
        except FutureTimeout:
            logging.getLogger(__name__).warning("the gateway closed with requests still in flight")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        self.engine_thread.shutdown(wait=False)

    # --- requests ----------------------------------------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "created": 0, "owned_by": "megarl"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=True)

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        return await self._answer(request, chat=False)

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        stream = None
        try:
            record = self._record(request)
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise RequestError("the body is not JSON") from None
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            if body.get("n", 1) != 1:
                raise RequestError("n must be 1: each choice would be a trajectory of its own")
            body["stop"] = _stop_strings(body.get("stop"))  # refused before anything is recorded
            if body.get("stream"):
                stream = TurnStream(request, self.tokenizer, chat, body.get("model") or self.model_name, body["stop"],
                                    bool((body.get("stream_options") or {}).get("include_usage")))
            async with record.lock:
                answer = await (self._chat_turn(record, body, stream) if chat else
                                self._completion_turn(record, body, stream))
        except RequestError as e:
            return await _refuse(stream, str(e), e.status, e.kind)
        except (ValueError, KeyError, TypeError) as e:  # a malformed message or prompt
            return await _refuse(stream, f"{type(e).__name__}: {e}", 400, "invalid_request_error")
        except Exception as e:  # the engine's error; after part of a stream went out, the stream says so
            if stream is None or not stream.started:
                if stream is not None:
                    await stream.halt()
                raise
            return await stream.fail(f"{type(e).__name__}: {e}", "server_error")
        if stream is not None:
            return await stream.finish(answer)
        return web.json_response(answer["response"])

    def _record(self, request: web.Request) -> Record:
        auth = request.headers.get("Authorization", "")
        key = auth[len("Bearer "):] if auth.startswith("Bearer ") else ""
        record = self.records.get(key)
        if record is None or record.closed:
            raise RequestError("unknown or expired API key: each agent run has its own key, valid while it runs",
                               401, "authentication_error")
        if self.batcher is None:
            raise RequestError("no rollout is running", 503, "server_error")
        return record

    async def _generate(self, record: Record, seg: Segment, body: dict, stream: TurnStream | None,
                        parse: bool = True):
        """The model's turn after the segment's context: its Generation, text (special tokens kept, the stop token
        left out), tool calls (with `parse`), and whether its last token is the model's stop token (None: nothing was
        generated); not recorded yet (_keep). `stream`: hears the tokens as they come."""
        a, t = self.config, seg.trajectory
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or a.max_new_tokens_per_turn
        limit = min(int(asked), a.max_new_tokens_per_turn, record.room(), a.max_response_tokens - len(t.response_ids))
        record.requests += 1
        if limit <= 0:  # the budget is spent: an empty answer cut by length, as a turn that hit it would end
            return Generation(0, [], [], "length"), "", [], None
        stops = body.get("stop")
        gen = await self.batcher.generate(seg.context(), limit, record.key,
                                          on_tokens=None if stream is None else stream.on_tokens)
        stopped = gen.finish_reason == "stop"
        text = self.tokenizer.decode(gen.token_ids[:-1] if stopped else gen.token_ids, skip_special_tokens=False)
        if stops:
            whole = len(gen.token_ids)
            gen, text = self._cut_at_stop(gen, text, stops, len(seg.context()))
            stopped = stopped and len(gen.token_ids) == whole
        return gen, text, self.parser(text)[:a.max_tool_calls_per_turn] if parse else [], stopped

    @staticmethod
    async def _keep(record: Record, seg: Segment, turn: tuple, content: str, stream: TurnStream | None) -> None:
        """Record a turn (_generate's), whose answer's text is `content`, unless a stream already sent text that is
        not how `content` begins (gateway_stream.py): then the turn is dropped and the request fails."""
        if stream is not None:
            await stream.halt()
            if not content.startswith(stream.sent):
                raise RequestError("the answer was generated again (its row restarted under new weights) after part "
                                   "of it was streamed: ask again", 500, "server_error")
        gen, text, calls, stopped = turn
        if stopped is not None:
            record.record_turn(seg, gen, text, calls, stop_token=stopped)

    def _cut_at_stop(self, gen: Generation, text: str, stops: list[str], context_len: int) -> tuple[Generation, str]:
        """The answer up to the stop string whose end comes first: its text before that string, its tokens through
        the first whose decoding completes it (a prefix's text only grows, so the search halves)."""
        found = [(i + len(stop), i) for stop in stops if (i := text.find(stop)) >= 0]
        if not found:
            return gen, text
        end, start = min(found)
        lo, hi = 1, len(gen.token_ids)
        while lo < hi:  # the shortest token prefix whose text reaches `end`
            mid = (lo + hi) // 2
            if len(self.tokenizer.decode(gen.token_ids[:mid], skip_special_tokens=False)) >= end:
                hi = mid
            else:
                lo = mid + 1
        routed = gen.routed_experts
        cut = dataclasses.replace(
            gen, token_ids=gen.token_ids[:lo], logprobs=gen.logprobs[:lo], finish_reason="stop",
            versions=gen.versions[:lo] if gen.versions is not None else None,
            routed_experts=routed[:context_len + lo - 1] if routed is not None else None)
        return cut, text[:start]

    async def _chat_turn(self, record: Record, body: dict, stream: TurnStream | None) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list")
        messages, tools = [normalize(m) for m in messages], body.get("tools") or None
        seg = record.chat_context(self.layout, messages, tools)
        prompt_tokens = len(seg.context())
        # tool calls only where the request offers tools (as OpenAI's API): the text a call takes is not content,
        # which is known when the turn has ended, so such a turn is streamed then
        turn = await self._generate(record, seg, body, None if tools else stream, parse=bool(tools))
        gen, text, calls, _ = turn
        valid = [c for c in calls if not c.error]
        content = text if len(valid) < len(calls) or not calls else content_without_calls(text, calls)
        await self._keep(record, seg, turn, content, stream)
        tool_calls = [{"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                       "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in valid]
        message = {"role": "assistant", "content": content or (None if tool_calls else "")} | (
            {"tool_calls": tool_calls} if tool_calls else {})
        seg.messages = messages + [normalize(message)]
        finish = "tool_calls" if tool_calls else "stop" if gen.finish_reason == "stop" else "length"
        choice = {"index": 0, "message": message, "finish_reason": finish,
                  "logprobs": {"content": self._token_logprobs(gen)} if body.get("logprobs") else None}
        return {"response": self._envelope("chat.completion", body, choice, prompt_tokens, gen),
                "gen": gen, "content": content, "tool_calls": tool_calls, "finish": finish}

    async def _completion_turn(self, record: Record, body: dict, stream: TurnStream | None) -> dict:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of one prompt
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(i, int) for i in prompt))):
            raise RequestError("prompt must be a string or a list of token ids (one prompt)")
        seg = record.completion_context(self.tokenizer, prompt)
        prompt_tokens = len(seg.context())
        turn = await self._generate(record, seg, body, stream)
        gen, text, _, _ = turn
        await self._keep(record, seg, turn, text, stream)
        finish = "stop" if gen.finish_reason == "stop" else "length"
        logprobs = None
        if body.get("logprobs") is not None and body.get("logprobs") is not False:
            pieces = [self.tokenizer.decode([i], skip_special_tokens=False) for i in gen.token_ids]
            logprobs = {"tokens": pieces, "token_logprobs": list(gen.logprobs), "top_logprobs": None,
                        "text_offset": [sum(map(len, pieces[:k])) for k in range(len(pieces))]}
        choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
        return {"response": self._envelope("text_completion", body, choice, prompt_tokens, gen), "gen": gen,
                "content": text, "tool_calls": [], "finish": finish}

    def _envelope(self, kind: str, body: dict, choice: dict, prompt_tokens: int, gen) -> dict:
        completion = len(gen.token_ids)
        return {"id": ("chatcmpl-" if kind == "chat.completion" else "cmpl-") + uuid.uuid4().hex, "object": kind,
                "created": int(time.time()), "model": body.get("model") or self.model_name, "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}

    def _token_logprobs(self, gen) -> list[dict]:
        out = []
        for token, logprob in zip(gen.token_ids, gen.logprobs):
            piece = self.tokenizer.decode([token], skip_special_tokens=False)
            out.append({"token": piece, "logprob": logprob, "bytes": list(piece.encode()), "top_logprobs": []})
        return out


async def _refuse(stream: TurnStream | None, message: str, status: int, kind: str) -> web.StreamResponse:
    """A refused request: an error answer, or, once its stream began, an error event ending the stream."""
    if stream is not None and stream.started:
        return await stream.fail(message, kind)
    if stream is not None:
        await stream.halt()
    return _error(message, status, kind)
