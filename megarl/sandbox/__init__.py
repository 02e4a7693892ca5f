"""Running untrusted Python: the sandbox (runner.py: isolation modes, limits, a memory cgroup per run,
cgroup.py) and a test harness whose verdict the program cannot fake (harness.py). Used by the code
reward (megarl/rewards/code.py) and the `python` tool (megarl/rollout/tools/python_interpreter.py)."""
