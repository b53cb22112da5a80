"""Every figure table backed by ``results/<figure>/`` is rebuilt from that directory's raw logs (issue 57 item 4).

Each ``results/<figure>/`` holds the command, the machine (``logs/machine.txt``), the raw logs and
``summarize.py``, whose ``--markdown`` prints every table the figure has, each after a marker line
``<!-- results/<figure>:<table> -->``. A Markdown file that shows the table (the figure's own README.md, which must,
and README.md or docs/ where they cite it) carries the same marker right above it. This test runs each
``summarize.py`` on its logs and requires every marked table, wherever it is, to be the rebuilt one line for line:
a README cannot drift from the logs, and a table no log backs cannot sit in a results README unmarked.
"""

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"
MARKER = re.compile(r"^<!-- results/([\w.-]+):([\w.-]+) -->$")
FIGURES = sorted(p.name for p in RESULTS.iterdir() if p.is_dir()) if RESULTS.is_dir() else []


def tables(lines: list[str]) -> dict[tuple[str, str], list[str]]:
    """(figure, table) -> the table's lines: the ``|`` lines right below each marker line."""
    found: dict[tuple[str, str], list[str]] = {}
    for i, line in enumerate(lines):
        match = MARKER.match(line.strip())
        if match is None:
            continue
        if match.groups() in found:
            raise AssertionError(f"marker {line.strip()} twice in one file")
        rows = []
        for row in lines[i + 1:]:
            if not row.startswith("|"):
                break
            rows.append(row.rstrip())
        found[match.groups()] = rows
    return found


def unmarked_rows(lines: list[str]) -> list[str]:
    """The table lines of a Markdown file that no marker covers."""
    covered, inside = [], False
    for line in lines:
        if MARKER.match(line.strip()):
            inside = True
            continue
        if line.startswith("|"):
            if not inside:
                covered.append(line.rstrip())
        else:
            inside = False
    return covered


def rebuilt(figure: str) -> dict[tuple[str, str], list[str]]:
    here = RESULTS / figure
    proc = subprocess.run([sys.executable, str(here / "summarize.py"), str(here / "logs"), "--markdown"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return tables(proc.stdout.splitlines())


def mismatches(documented: dict, derived: dict, figure: str) -> list[str]:
    """What differs between a file's marked tables of ``figure`` and the rebuilt ones."""
    problems = []
    for key, rows in documented.items():
        if key[0] != figure:
            continue
        if key not in derived:
            problems.append(f"{key}: marked, but summarize.py prints no such table")
        elif rows != derived[key]:
            diff = [f"  documented: {a}\n  rebuilt:    {b}" for a, b in zip(rows, derived[key], strict=False)
                    if a != b] or [f"  {len(rows)} rows documented, {len(derived[key])} rebuilt"]
            problems.append(f"{key}:\n" + "\n".join(diff))
    return problems


def _markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(RESULTS.glob("*/README.md"))]


def test_every_results_entry_has_its_command_machine_logs_and_summarize():
    assert FIGURES, "results/: expected at least one figure directory"
    for figure in FIGURES:
        here = RESULTS / figure
        readme = (here / "README.md").read_text(encoding="utf-8")
        assert (here / "summarize.py").is_file() and (here / "logs" / "machine.txt").is_file(), figure
        assert "Command" in readme and ((here / "run.sh").is_file() or "```" in readme), figure
        machine = (here / "logs" / "machine.txt").read_text(encoding="utf-8")
        assert re.search(r"torch \d", machine) and re.search(r"^\d+$", machine, re.M), (figure, machine)  # nproc


@pytest.mark.parametrize("figure", FIGURES)
def test_every_marked_table_is_rebuilt_from_the_raw_logs(figure):
    derived = rebuilt(figure)
    assert derived, f"results/{figure}/summarize.py --markdown: expected marked tables, found none"
    own = (RESULTS / figure / "README.md").read_text(encoding="utf-8").splitlines()
    # The figure's own README shows every table, marked, and no table rows outside them.
    assert set(tables(own)) >= set(derived), set(derived) - set(tables(own))
    assert unmarked_rows(own) == [], f"results/{figure}/README.md: table rows no log backs"
    problems = []
    for path in _markdown_files():
        found = tables(path.read_text(encoding="utf-8").splitlines())
        problems += [f"{path.relative_to(REPO)} {p}" for p in mismatches(found, derived, figure)]
    assert problems == [], "\n".join(problems)


def test_a_changed_figure_or_a_missing_row_is_caught():
    figure = FIGURES[0]
    derived = rebuilt(figure)
    key, rows = next(iter(derived.items()))
    # The last digit of the last row, one more.
    changed = [*rows[:-1], re.sub(r"(\d)(?!.*\d)", lambda m: str((int(m.group(1)) + 1) % 10), rows[-1])]
    assert changed[-1] != rows[-1]
    assert mismatches({key: changed}, derived, figure) and mismatches({key: rows[:-1]}, derived, figure)
    assert mismatches({key: rows}, derived, figure) == []
    marked = [f"<!-- results/{figure}:{key[1]} -->", *rows, "", "| an unbacked | row |"]
    assert tables(marked)[key] == rows and unmarked_rows(marked) == ["| an unbacked | row |"]
