import re
import tomllib
from pathlib import Path

from setuptools import find_packages, setup

here = Path(__file__).resolve().parent
pins = tomllib.loads((here / "pins.toml").read_text())
version = re.search(r'__version__ = "([^"]+)"', (here / "megarl" / "__init__.py").read_text()).group(1)


def exact(section):
    return [f"{name}=={v}" for name, v in pins[section].items()]


# torch is pinned per platform: CPU installs take pins.cpu.torch (scripts/quickstart.sh installs it
# first), GPU images ship pins.gpu.torch. The range admits both and nothing else.
torch_range = f"torch>={pins['gpu']['torch']},<={pins['cpu']['torch']}"

setup(
    name="megarl",
    version=version,
    description="Megatron-centric reinforcement learning for LLM post-training",
    packages=find_packages(include=["megarl", "megarl.*"]),
    include_package_data=True,
    python_requires=">=3.11",
    install_requires=[torch_range] + exact("common"),
    extras_require={
        "test": exact("test") + exact("trackers"),  # the suite reads each tracker's files back
        "trackers": exact("trackers"),
        "gpu": [f"sglang=={pins['gpu']['sglang']}"],
    },
    entry_points={"console_scripts": ["megarl-train=megarl.train:main"]},
)
