"""The measured figures the README and docs/benchmarks.md quote are the values of the recorded runs they name.

A results table is a markdown table whose header has a `figure` and a `source` column (and, where it has a `date`
column, that date is one its recorded files carry in their names). The figure cell holds the quoted numbers and
nothing else numeric (units, `->`, `x` and `%` may stand beside them); the source cell holds one item per number,
in order, separated by `;`. An item is a link to a file under docs/results/ followed by a key in backticks, or two
such terms joined by ` / ` for a ratio (a term without a link reads the item's previous file), e.g.

    | 0.134 s, 113.5 GB/s | [json](docs/results/X.json) `results[bucket_mb=8192].total_s`; `results[...].gb_per_s` |
    | 0.391 -> 0.469 | [jsonl](docs/results/Y_metrics.jsonl) `[step=0].val/reward`; `[step=120].val/reward` |
    | 2.89x | [verl](docs/results/A.json) `runs.verl.mean_step_s` / [megarl](docs/results/B.json) `runs.megarl.step_s` |

A key is a dotted path into the file: a JSON object, a .jsonl file read as the list of its rows, or a .md file read
as the list of its tables' rows (header -> cell; a cell's value is its first number). `a|b` names several keys of
an object; `[N]` indexes a list; `[k=v,k2<=v2,k3>=v3]` keeps the elements whose fields meet every condition (`=`
compares as text or as numbers); `median(...)`, `mean(...)`, `min(...)`, `max(...)` around a path aggregate the
values it names, which must otherwise be exactly one. A quoted number equals the recorded value to the digits it
shows (a number followed by `%` quotes the value times 100). A `|` inside a table cell is written `\\|`.
"""

import json
import re
import statistics
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
PAGES = [ROOT / "README.md", ROOT / "docs" / "benchmarks.md"]

NUMBER = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?(?:e-?\d+)?)(%?)")
TERM = re.compile(r"\s*(?:\[[^\]]*\]\(([^)\s]+)\))?\s*`([^`]+)`\s*")
AGGREGATES = {"median": statistics.median, "mean": statistics.fmean, "min": min, "max": max}


# ---- reading a recorded result --------------------------------------------------------------------------------


def _table_rows(text: str) -> list[dict]:
    """Every row of every markdown table in `text`, as header -> cell."""
    rows, header = [], None
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            header = None
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        if header is None:
            header = cells
        elif not all(re.fullmatch(r":?-+:?", c) for c in cells if c):
            rows.append(dict(zip(header, cells)))
    return rows


def load_result(path: Path):
    if path.suffix == ".json":
        return json.loads(path.read_text())
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".md":
        return _table_rows(path.read_text())
    raise ValueError(f"{path.name}: a figure's source is a .json, .jsonl or .md file")


def _cell_value(value):
    """A markdown cell's first number; other values as they are."""
    if isinstance(value, str):
        found = NUMBER.search(value.replace("**", ""))
        if found is None:
            raise KeyError(f"no number in cell {value!r}")
        return float(found.group(1).replace(",", ""))
    return value


def _split_path(path: str) -> list[str]:
    """`a.b[k=v.w].c` -> ['a', 'b[k=v.w]', 'c']: dots inside brackets do not split."""
    parts, depth, current = [], 0, ""
    for char in path:
        depth += char == "["
        depth -= char == "]"
        if char == "." and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return parts + [current]


def _matches(element, selector: str) -> bool:
    """Whether `element` (a dict) meets every condition of `selector`: `k=v` (equal as text or as numbers),
    `k<=v`, `k>=v` (as numbers)."""
    if not isinstance(element, dict):
        return False
    for condition in selector.split(","):
        key, op, wanted = re.fullmatch(r"\s*([^<>=]+?)\s*(<=|>=|=)\s*(.*?)\s*", condition).groups()
        if element.get(key) is None:
            return False
        value = element[key]
        if op == "=" and str(value).replace("**", "").strip() == wanted:
            continue
        try:
            number, limit = float(_cell_value(value)), float(wanted)
        except (KeyError, TypeError, ValueError):
            return False
        if not {"=": number == limit, "<=": number <= limit, ">=": number >= limit}[op]:
            return False
    return True


def _step(nodes: list, part: str) -> list:
    """The values `part` (`name`, `name[selector]...` or `[selector]`) names in each of `nodes`."""
    name, _, rest = part.partition("[")
    selectors = rest[:-1].split("][") if rest else []
    out = []
    for node in nodes:
        if name:  # `a|b` names several keys of an object
            current = [node[n] for n in name.split("|") if isinstance(node, dict) and n in node]
        else:
            current = [node]
        for selector in selectors:
            if selector.lstrip("-").isdigit():
                current = [n[int(selector)] for n in current]
            else:
                current = [e for n in current for e in n if _matches(e, selector)]
        out.extend(current)
    return out


def resolve(data, key: str) -> float:
    """The number `key` names in `data` (see the module's docstring)."""
    aggregate = re.fullmatch(r"(\w+)\((.*)\)", key)
    path = aggregate.group(2) if aggregate else key
    nodes = [data]
    for part in _split_path(path):
        nodes = _step(nodes, part)
        if not nodes:
            raise KeyError(f"{key!r}: nothing at {part!r}")
    values = [float(_cell_value(n)) for n in nodes]
    if aggregate:
        return AGGREGATES[aggregate.group(1)](values)
    if len(values) != 1:
        raise KeyError(f"{key!r} matches {len(values)} values; add a selector or an aggregate")
    return values[0]


# ---- checking a page's results tables -------------------------------------------------------------------------


def quoted_numbers(figure: str) -> list[tuple[str, bool]]:
    """The numbers a figure cell quotes, each with whether a `%` follows it."""
    return [(m.group(1), m.group(2) == "%") for m in NUMBER.finditer(figure.replace("**", ""))]


def source_values(cell: str, page: Path, results: Path) -> list[float]:
    """The recorded value of each item of a source cell (see the module's docstring)."""
    values, current = [], None
    for item in cell.split(";"):
        terms = []
        for term in item.split(" / "):
            found = TERM.fullmatch(term)
            if not found:
                raise ValueError(f"source item {item.strip()!r} is not [file](path) `key`")
            if found.group(1):
                current = (page.parent / found.group(1)).resolve()
                if current.parent != results.resolve() or not current.is_file():
                    raise ValueError(f"{found.group(1)} is not a file under {results.name}/")
            if current is None:
                raise ValueError(f"source item {item.strip()!r} names no file")
            terms.append(resolve(load_result(current), found.group(2)))
        values.append(terms[0] / terms[1] if len(terms) == 2 else terms[0])
    return values


def agrees(quoted: str, percent: bool, value: float) -> bool:
    """Whether `value` rounds to `quoted` at the digits it shows (times 100 where a `%` follows)."""
    mantissa, _, exponent = quoted.replace(",", "").partition("e")
    decimals = len(mantissa.partition(".")[2])
    unit = 10.0 ** (int(exponent) if exponent else 0)
    value = value * 100 if percent else value
    return abs(value - float(mantissa) * unit) <= 0.5 * 10.0**-decimals * unit * (1 + 1e-9)


def figure_rows(page: Path) -> list[dict]:
    return [row for row in _table_rows(page.read_text()) if "figure" in row and "source" in row]


def problems(page: Path, results: Path = RESULTS) -> list[str]:
    """Each results-table row of `page` whose figure is not what its recorded files say, or whose date is not one
    of theirs, named with the reason; [] when every row checks out."""
    found = []
    for row in figure_rows(page):
        where = f"{page.name}: {row['figure']!r}"
        try:
            values = source_values(row["source"], page, results)
        except (KeyError, ValueError, OSError) as e:
            found.append(f"{where}: {e}")
            continue
        numbers = quoted_numbers(row["figure"])
        if not numbers or len(numbers) != len(values):
            found.append(f"{where} quotes {len(numbers)} numbers, its source gives {len(values)}")
            continue
        for (quoted, percent), value in zip(numbers, values):
            if not agrees(quoted, percent, value):
                found.append(f"{where} quotes {quoted}, the record says {value:.6g}")
        names = [Path(target).name for target in re.findall(r"\]\(([^)\s]+)\)", row["source"])]
        if "date" in row and not any(name.startswith(row["date"] + "_") for name in names):
            found.append(f"{where} is dated {row['date']}, its records are {names}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_each_quoted_figure_is_its_recorded_value(page):
    assert len(figure_rows(page)) >= 8, f"{page.name}: no results table (columns `figure` and `source`)"
    assert problems(page) == []


def test_a_figure_that_is_not_the_record_is_named(tmp_path):
    """The check fails on a rounded-wrong figure, a wrong count of numbers, a missing key or file, a wrong date;
    and passes the same rows written right."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "2026-01-02_run.json").write_text(json.dumps({"runs": [{"n": 8, "s": 0.1341}, {"n": 4, "s": 0.2}],
                                                             "mfu": 0.4327, "a": 3.0, "b": 2.0}))
    (results / "2026-01-02_m.jsonl").write_text("\n".join(json.dumps({"step": i, "r": i / 10}) for i in range(4)))
    link, metrics = "[x](results/2026-01-02_run.json)", "[m](results/2026-01-02_m.jsonl)"
    rows = {
        "right": [f"| 0.134 s | 2026-01-02 | {link} `runs[n=8].s` |", f"| 43.3% | 2026-01-02 | {link} `mfu` |",
                  f"| 1.50x | 2026-01-02 | {link} `a` / `b` |",
                  f"| 0.0 -> 0.3, 0.15 | 2026-01-02 | {metrics} `[step=0].r`; `[step=3].r`; `mean([step>=0].r)` |"],
        "wrong": [f"| 0.135 s | 2026-01-02 | {link} `runs[n=8].s` |", f"| 43.4% | 2026-01-02 | {link} `mfu` |",
                  f"| 1.5x, 2 | 2026-01-02 | {link} `a` / `b` |", f"| 0.1 | 2026-01-02 | {link} `runs[n=2].s` |",
                  f"| 0.2 | 2026-01-02 | {link} `runs.s` |", f"| 1 | 2026-01-02 | [x](results/none.json) `a` |",
                  f"| 3 | 2026-01-03 | {link} `a` |"],
    }
    for kind, lines in rows.items():
        page = tmp_path / f"{kind}.md"
        page.write_text("\n".join(["| figure | date | source |", "| --- | --- | --- |", *lines]) + "\n")
        found = problems(page, results)
        assert len(found) == (0 if kind == "right" else len(lines)), found


def test_readme_prose_quotes_no_measured_figure():
    """Outside its results table and code blocks the README states no measurement (a time, a rate, a ratio, a
    before -> after): those belong in the table, where they are checked."""
    measured = re.compile(r"\d(?:\.\d+)?\s*(?:%|x\b|s\b|ms\b|GB/s|tok/s|min\b)|\d\s*->\s*\d")
    in_code = False
    for number, line in enumerate((ROOT / "README.md").read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        if in_code or line.lstrip().startswith("|"):
            continue
        prose = re.sub(r"`[^`]*`|\([^)]*\.md[^)]*\)", "", line)  # inline code and link targets
        assert not measured.search(prose), f"README.md:{number} quotes a measurement outside its results table"


def test_readme_starts_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    first = [line.split("#")[0].strip() for line in blocks[0].splitlines() if line.strip()]
    assert first[:2] == ["bash scripts/quickstart.sh", "bash scripts/test.sh"]


LINK = re.compile(r"\[[^\]]*\]\(([^)\s#]+)(?:#[^)]*)?\)")


@pytest.mark.parametrize(
    "page",
    [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(RESULTS.glob("journal-*.md"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_relative_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if "://" not in target and not target.startswith("mailto:"):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"
