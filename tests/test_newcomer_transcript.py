"""docs/newcomer.md shows exactly README.md's commands in README order (scripts/newcomer_transcript.py regenerates
it): a README change makes this fail until the transcript is made again. No command runs here."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def transcript_script():
    spec = importlib.util.spec_from_file_location("newcomer_transcript", ROOT / "scripts" / "newcomer_transcript.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def test_the_transcript_shows_the_readmes_commands_in_readme_order():
    script = transcript_script()
    readme = script.readme_commands((ROOT / "README.md").read_text())
    assert readme, "README.md has no shell block"
    shown = script.documented_commands((ROOT / "docs" / "newcomer.md").read_text())
    assert shown == readme, f"docs/newcomer.md is stale: regenerate it with {script.REGENERATE}"


def test_commands_are_read_from_shell_blocks_only_joined_and_without_comments():
    readme = "\n".join([
        "intro `python not_a_command.py`",
        "```bash",
        "bash scripts/quickstart.sh   # the first command",
        "# a comment line",
        "",
        "python -m megarl.train --config a.yaml \\",
        "    trainer.steps=5   # continued",
        "                     # a comment continuing the one above",
        "echo 'a # inside quotes' x#y",
        "```",
        "```python",
        "import megarl",
        "```",
        "```yaml",
        "trainer: {steps: 3}",
        "```",
        "~~~sh",
        "source .venv/bin/activate",
        "~~~",
        "```",
        "plain fence, no language",
        "```",
        "```shell",
        "tensorboard --logdir runs",
        "```",
    ])
    assert transcript_script().readme_commands(readme) == [
        "bash scripts/quickstart.sh", "python -m megarl.train --config a.yaml trainer.steps=5",
        "echo 'a # inside quotes' x#y", "source .venv/bin/activate", "tensorboard --logdir runs"]


def test_a_section_heading_gives_back_its_command_even_with_backticks():
    script = transcript_script()
    commands = ["python -m megarl.train --help", "echo `date` and ``two``"]
    transcripts = [script.Transcript(c, "out\n```\nmore", "", 1.0, 0, False, None, []) for c in commands]
    doc = "\n\n".join(script.section(n, t, 30.0) for n, t in enumerate(transcripts, start=1))
    assert script.documented_commands(doc) == commands
    assert "````text\nout\n```\nmore\n````" in doc  # the output's own fence does not end its block
