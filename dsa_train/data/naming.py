"""How the data layer's error messages name its settings.

A message says what to change: under training that is a recipe key (`data.text_field`), but
`dsa-train prepare-data` and `dsa-train eval` take the same settings as flags (`--text-field`,
`--source`, `--data`). A subcommand names its flags for the duration of its run
(`flags_named({...})`), and the messages ask `setting("text_field")` for the name to print.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Iterator, Mapping

# field of DataConfig -> the name a message gives it; a field not listed is the recipe key data.<field>
_FLAG_NAMES: ContextVar[Mapping[str, str]] = ContextVar("dsa_train_data_flag_names", default={})


def setting(field: str) -> str:
    """The name of `DataConfig.<field>` where the user sets it: `data.<field>` or a subcommand's flag."""
    return _FLAG_NAMES.get().get(field, f"data.{field}")


def leave_unset(field: str) -> str:
    """'leave data.tokenizer null' (a recipe) / 'leave --tokenizer out' (a flag)."""
    name = setting(field)
    return f"leave {name} out" if name.startswith("-") else f"leave {name} null"


@contextmanager
def flags_named(names: Mapping[str, str]) -> Iterator[None]:
    """Within the block, messages name the fields of `names` by their flags (e.g. {"sources": "--source"})."""
    token = _FLAG_NAMES.set(dict(names))
    try:
        yield
    finally:
        _FLAG_NAMES.reset(token)
