"""The documents speak of what fsdp2kit does and what was measured, not of how the project was made; and
docs/PERFORMANCE.md opens with its table of current figures, whose every JSON file exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# An issue of this project by number, a working session, device time lent to it, or the machine's other users.
MAKING = re.compile(
    r"\bissues?[ -]#?\d+|\bsessions?\b|\bdevice time\b|\bthis wave\b|\bother (?:jobs|agents|engineers|sessions)\b|"
    r"sharing the machine|\bseed 00\d",
    re.IGNORECASE,
)


def test_no_document_speaks_of_how_the_project_was_made():
    found = [
        f"{path.relative_to(REPO)}:{number}: {match.group(0)}"
        for path in DOCUMENTS
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for match in MAKING.finditer(line)
    ]
    assert not found, "\n".join(found)


def test_performance_opens_with_the_current_figures_and_their_json_files_exist():
    text = (REPO / "docs" / "PERFORMANCE.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[0] == "## Current figures" and "## History" in headings
    table = text.split("## Current figures", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith(("| figure", "| ---"))]
    assert len(rows) >= 20
    cited = {name for row in rows for name in re.findall(r"`([\w.]+\.jsonl?)`", row)}
    assert cited and all((REPO / "docs" / "bench" / name).is_file() for name in cited), cited
    for row in rows:  # figure, value, date, commit, machine, command, JSON
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert len(cells) == 7, row
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", cells[2]), row
