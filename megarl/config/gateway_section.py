"""`agent.gateway`: rollouts by the user's own agent code, which calls the rollout engine through an OpenAI-compatible
HTTP endpoint (megarl/rollout/gateway.py) while megarl records the token ids and log-probs behind it."""

from __future__ import annotations

from dataclasses import dataclass

from megarl.config.fields import SECONDS, SEQUENCES, TOKENS, opt


@dataclass
class GatewayConfig:
    function: str = opt("", "the agent: package.module:function or file.py:function, called as "
                            "agent(base_url, api_key, row) -> reward or None (None: reward.name scores it) once per "
                            "sample, in a thread of its own; empty = off (the built-in agent loop runs)")
    # an argv list or a shell string: the loader passes either through (validation checks it)
    command: object = opt("", "the agent as a command run once per sample (an argv list, or a string for /bin/sh "
                              "-c) with OPENAI_BASE_URL, OPENAI_API_KEY (the sample's own key) and MEGARL_ROW_FILE "
                              "(the prompt row as JSON, also on its stdin); the last JSON line of its stdout may give "
                              "the reward (a number or {\"reward\": ...}); exclusive with function")
    max_concurrent: int = opt(16, "agents running at once", min=1, **SEQUENCES)
    timeout_s: float = opt(300.0, "an agent still running this long after it started is dropped (counted in "
                                  "agent/agents_timed_out; a function's thread is left to end by itself, a "
                                  "command's process group is killed)",
                           min=0, min_exclusive=True, **SECONDS)
    max_tokens: int = opt(4096, "tokens the model may generate for one agent, over all its requests; a request past "
                                "them gets an empty answer with finish_reason length", min=1, **TOKENS)
    host: str = opt("127.0.0.1", "address the gateway listens on (the agents run on the rollout worker's host)")
    port: int = opt(0, "port the gateway listens on; 0 = a free one", min=0, max=65535)

    @property
    def in_use(self) -> bool:
        """Whether the user's agents (a function or a command) run the rollouts."""
        return bool(self.function or self.command)
