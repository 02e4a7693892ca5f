"""Command agents (agent.gateway.command, megarl/rollout/gateway_command.py): a program per run, given the endpoint, its
own key and the prompt row; its reward on its stdout's last JSON line; a crash or a hang counted and dropped, a hang's
whole process group killed."""

import sys
import textwrap
import time
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from megarl.config import AgentConfig, ConfigError, load_config
from megarl.models.tiny import build_tiny_model
from megarl.rollout.gateway_agents import GatewayAgents
from megarl.rollout.gateway_command import reward_from_output
from tests.rollout.test_gateway import TEMPLATE, Scripted, rollout

AGENT = """
import json, os, sys
from openai import OpenAI

row = json.load(sys.stdin)
assert row == json.loads(open(os.environ["MEGARL_ROW_FILE"]).read()), "stdin and MEGARL_ROW_FILE differ"
assert os.environ["OPENAI_API_BASE"] == os.environ["OPENAI_BASE_URL"]
client = OpenAI(max_retries=0)  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
messages = [{"role": "user", "content": row["prompt"]}]
for follow_up in ("and then?", None):
    reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=20).choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    if follow_up:
        messages.append({"role": "user", "content": follow_up})
print("a log line that is not JSON")
print(json.dumps({"reward": 0.5 + 0.25 * (row["answer"] == "19")}))
print("done")
"""
CRASH = """
import sys
from openai import OpenAI
OpenAI(max_retries=0).chat.completions.create(model="policy", messages=[{"role": "user", "content": "q"}])
sys.exit("the agent's own bug")
"""
HANG = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(f"{child.pid}\\n")
time.sleep(120)
"""


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    tok = AutoTokenizer.from_pretrained(build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3))
    tok.chat_template = TEMPLATE
    return tok


def agents_of(engine, tok, command, timeout_s=60.0) -> GatewayAgents:
    cfg = AgentConfig(enabled=True, max_new_tokens_per_turn=20, max_response_tokens=100)
    cfg.gateway.command, cfg.gateway.timeout_s, cfg.gateway.max_concurrent = command, timeout_s, 4
    return GatewayAgents(engine, tok, cfg)


def script(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def alive(pid: int) -> bool:
    """A process that runs (a zombie, dead but not reaped, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_command_agent_talks_many_turns_and_gives_its_reward(tok, tmp_path):
    engine = Scripted(tok, ["first", "second"])
    command = [sys.executable, script(tmp_path, "agent.py", AGENT)]
    rows = [{"prompt": "12+7=", "answer": "19", "extra_info": {"split": "train"}}, {"prompt": "1+1=", "answer": "3"}]
    finished, counts = rollout(agents_of(engine, tok, command), rows)
    assert counts["agents"] == 2 and counts["agents_crashed"] == 0 and counts["requests"] == 4
    [seg], [other] = finished
    assert [t["role"] for t in seg.turns] == ["assistant", "context", "assistant"]  # one segment, two turns
    assert tok.decode(seg.prompt_ids) == "U:12+7=<eos>A:"
    assert seg.response_ids[slice(*seg.turns[0]["span"])] == engine.calls[0][1].token_ids
    assert seg.summary()["agent_reward"] == 0.75 and other.summary()["agent_reward"] == 0.5


def test_crashing_and_hanging_commands_are_counted_and_dropped(tok, tmp_path):
    engine = Scripted(tok, ["ok"])
    crash = [sys.executable, script(tmp_path, "crash.py", CRASH)]
    finished, counts = rollout(agents_of(engine, tok, crash), [{"prompt": "q", "answer": ""}])
    assert finished == [] and counts["agents_crashed"] == 1 and counts["requests"] == 1

    pids = tmp_path / "pids"
    hang = f"{sys.executable} {script(tmp_path, 'hang.py', HANG)} {pids}"  # a shell string: /bin/sh -c
    agents = agents_of(engine, tok, hang, timeout_s=4.0)
    start = time.monotonic()
    finished, counts = rollout(agents, [{"prompt": "q", "answer": ""}], close=False)
    assert time.monotonic() - start < 15 and finished == [] and counts["agents_timed_out"] == 1
    child = int(pids.read_text())
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:  # the command's thread kills its group as its limit passes
        time.sleep(0.05)
    assert not alive(child)  # its child, in its process group, went with it
    agents.close()


@pytest.mark.parametrize("stdout, reward", [
    ('x\n{"reward": 1}\nbye\n', 1.0), ("0.25\n", 0.25), ('{"reward": null}\n', None), ("no json\n", None),
    ('{"reward": 2}\n{"steps": 3}\n', None),  # the last JSON line says nothing of a reward: megarl's reward
])
def test_the_reward_is_the_last_json_line(stdout, reward):
    assert reward_from_output(stdout) == reward


def test_a_non_finite_reward_is_an_error():
    with pytest.raises(ValueError, match="finite number"):
        reward_from_output('{"reward": NaN}\n')


@pytest.mark.parametrize("command, refusal", [
    ("[]", "empty list"),
    ("'  '", "is empty"),
    ("[no-such-agent-binary, x]", "executable 'no-such-agent-binary' not found"),
    ("'no-such-agent-binary --flag'", "executable 'no-such-agent-binary' not found"),
    ("[python3, 3]", "non-empty strings"),
])
def test_config_refuses_a_command_that_cannot_run(command, refusal):
    with pytest.raises(ConfigError, match=refusal):
        load_config(overrides=["model.path=tiny", "data.task=reverse", "trainer.steps=1", "agent.enabled=true",
                               f"agent.gateway.command={command}"])


def test_config_takes_a_command_as_a_list_or_a_string_and_not_with_a_function():
    base = ["model.path=tiny", "data.task=reverse", "trainer.steps=1", "agent.enabled=true"]
    cfg = load_config(overrides=[*base, "agent.gateway.command=[python3, agent.py, --fast]"])
    assert cfg.agent.gateway.command == ["python3", "agent.py", "--fast"] and cfg.agent.gateway.in_use
    cfg = load_config(overrides=[*base, "agent.gateway.command=FOO=1 python3 agent.py | tee log"])
    assert cfg.agent.gateway.command == "FOO=1 python3 agent.py | tee log"
    with pytest.raises(ConfigError, match="both set"):
        load_config(overrides=[*base, "agent.gateway.command=[python3]", "agent.gateway.function=m:f"])
    with pytest.raises(ConfigError, match="agent.gateway.command is set: needs agent.enabled=true"):
        load_config(overrides=[*base[:-1], "agent.gateway.command=[python3]"])
