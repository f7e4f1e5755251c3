"""Every environment switch the kernels read is documented: each `DSA_*` name that appears as a string
in dsa_kernels/ (what `os.environ` is asked for) has a row in docs/kernels.md's switches table, and
the table names nothing the code no longer reads."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"[\"'](DSA_[A-Z0-9_]+)[\"']")


def _read_by_code() -> set[str]:
    names = set()
    for path in (ROOT / "dsa_kernels").rglob("*.py"):
        names |= set(NAME.findall(path.read_text()))
    return names


def _table() -> set[str]:
    text = (ROOT / "docs" / "kernels.md").read_text()
    start = text.index("**Switches**")
    rows = [line for line in text[start:].split("\n\n")[1].splitlines() if line.startswith("| `DSA_")]
    return {name for row in rows for name in re.findall(r"`(DSA_[A-Z0-9_]+)`", row.split("|")[1])}


def test_every_switch_the_kernels_read_is_in_the_table():
    code, table = _read_by_code(), _table()
    assert {"DSA_KERNELS", "DSA_INDEXER_OVERLAP", "DSA_KERNELS_GLUON_SCORES"} <= code  # the scan finds them
    assert code - table == set(), f"read by dsa_kernels/ but not in docs/kernels.md's switches table: {code - table}"
    assert table - code == set(), f"in the switches table but no longer read: {table - code}"
