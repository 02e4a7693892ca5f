"""Rewards that read a multi-turn trajectory (`sample["trajectory"]`, megarl.rollout.agent.Trajectory.summary:
every turn, tool call and tool result), not only the final answer.

  tool_answer   0.5 when a tool call in the conversation returned the answer (the model asked the
                right question) + 0.5 when the final answer is exactly right. An answer guessed without
                the tool gets 0.5 at most, so on a task the model cannot do unaided (the `mul` task)
                the full reward needs the tool. Without a trajectory (single-turn rollouts): 0.5 for
                the right answer.
"""

from __future__ import annotations

from megarl.rewards import REWARDS


def tool_returned(trajectory: dict | None, answer: str) -> bool:
    """Whether some tool call of the conversation returned exactly `answer` (stripped) without error."""
    for turn in (trajectory or {}).get("turns", []):
        if turn["role"] == "tool" and any(not c["error"] and c["result"].strip() == answer.strip()
                                          for c in turn["calls"]):
            return True
    return False


@REWARDS.register("tool_answer")
def tool_answer(response: str, answer: str, sample: dict) -> float:
    return 0.5 * tool_returned(sample.get("trajectory"), answer) + 0.5 * (response.strip() == answer.strip())
