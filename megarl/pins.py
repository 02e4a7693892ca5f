"""Read pins.toml, the one file that names dependency versions."""

import tomllib
from pathlib import Path

PINS_FILE = Path(__file__).resolve().parent.parent / "pins.toml"


def load_pins(path: Path = PINS_FILE) -> dict[str, dict[str, str]]:
    with open(path, "rb") as f:
        return tomllib.load(f)


def requirements(section: str, path: Path = PINS_FILE) -> list[str]:
    """`name==version` lines for one section of the pins file."""
    return [f"{name}=={version}" for name, version in load_pins(path)[section].items()]
