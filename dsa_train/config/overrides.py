"""Command-line overrides checked against the structured schema before Hydra composes the recipe.

Hydra rejects an unknown key with a bare "not in StageConfig" and accepts `+key=value` under a
dict-typed node without complaint; here every `key=value`, `+key=value` and `++key=value` is
checked against the dataclasses of `dsa_train.config.schema` (and group choices against the
options in `recipes/<group>/`), and an unknown one fails with its closest matches:

    dsa-train: stages.sparse.stepz: no such key (did you mean stages.sparse.steps?)
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

from dsa_train.config.schema import TrainConfig
from dsa_train.config.validate import ConfigError

# Hydra flags that take the next argument as their value
FLAGS_WITH_VALUE = {"--config-name", "-cn", "--config-path", "-cp", "--config-dir", "-cd", "--cfg", "-c",
                    "--package", "-p", "--experimental-rerun"}
FREE_FORM = object()  # a dict[str, Any] node (model.arch): any key goes


def _node_type(tp):
    """The schema node a field type leads to: a dataclass, ('dict', value type), FREE_FORM, or None (leaf)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or str(origin) == "types.UnionType":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _node_type(args[0]) if len(args) == 1 else None
    if dataclasses.is_dataclass(tp):
        return tp
    if origin is dict:
        value = typing.get_args(tp)[1]
        return ("dict", value) if dataclasses.is_dataclass(value) else FREE_FORM
    if origin is list:
        return None
    return None


def _fields(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def all_keys(cls=TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (dict-of-dataclass nodes as `<name>`)."""
    keys = []
    for name, tp in _fields(cls).items():
        node = _node_type(tp)
        key = f"{prefix}{name}"
        keys.append(key)
        if dataclasses.is_dataclass(node):
            keys += all_keys(node, key + ".")
        elif isinstance(node, tuple):
            keys += all_keys(node[1], key + ".<name>.")
    return keys


def _suggest(word: str, options: list[str]) -> list[str]:
    return difflib.get_close_matches(word, options, n=3, cutoff=0.6)


def check_key(key: str) -> str | None:
    """None when `key` (dotted) is in the schema, else the problem with suggestions."""
    node: Any = TrainConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        if node is FREE_FORM:
            return None
        if isinstance(node, tuple):  # dict of dataclasses: any name (a stage), then its fields
            node = node[1]
            continue
        if node is None:  # past a leaf
            return f"{key}: {'.'.join(parts[:i])} is a value, it has no key {part!r}"
        fields = _fields(node)
        if part not in fields:
            base = ".".join(parts[:i])
            close = [f"{base}.{c}" if base else c for c in _suggest(part, list(fields))]
            if not close:  # perhaps the right name in another section (seq_len -> data.seq_len)
                leaves = [k for k in all_keys() if "<name>" not in k]
                close = [k for k in leaves if k.rsplit(".", 1)[-1] == part][:3] or _suggest(key, leaves)
            hint = f" (did you mean {' or '.join(close)}?)" if close else f" (known keys here: {', '.join(fields)})"
            return f"{key}: no such key{hint}"
        node = _node_type(fields[part])
    return None


def check_group_choice(group: str, choice: str, recipes: Path) -> str | None:
    options = sorted(p.stem for p in (recipes / group).glob("*.yaml")) + ["base"]
    if choice in options or choice in ("null", ""):
        return None
    close = _suggest(choice, options)
    hint = f"did you mean {' or '.join(close)}?" if close else f"options: {', '.join(options)}"
    return f"{group}={choice}: no such {group} option in {recipes / group} ({hint})"


def check_overrides(argv: list[str], recipes: Path) -> None:
    """ConfigError listing every override in `argv` (Hydra's command line) that the schema does not know."""
    from dsa_train.config.store import GROUP_SCHEMAS

    groups = set(GROUP_SCHEMAS) | {p.name for p in recipes.iterdir() if p.is_dir()}
    problems = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
            continue
        if arg.startswith("-"):
            skip_next = arg in FLAGS_WITH_VALUE
            continue
        if "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+~")
        if not key or key.startswith("hydra") or "@" in key:
            continue
        if key in groups and "." not in key:
            problem = check_group_choice(key, value, recipes)
        else:
            problem = check_key(key)
        if problem:
            problems.append(problem)
    if problems:
        raise ConfigError.of(problems)


def recipe_args(parser, argv: list[str]):
    """A subcommand's command line -> (its options, recipe name, Hydra overrides): `parser`'s own
    options, then `--config-name R` / `recipe=R` / `key=value ...`. An option neither knows is
    argparse's one-line error (it would otherwise reach Hydra as an override it cannot parse)."""
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-") and a not in ("--config-name", "-cn")
               and not a.startswith(("--config-name=", "-cn="))]
    dirs = [a for a in unknown if a.split("=", 1)[0] in ("--config-dir", "-cd", "--config-path", "-cp")]
    if dirs:  # training's Hydra flags for recipes elsewhere: the subcommands compose from recipes/ only
        from dsa_train.config.recipes import recipes_dir

        parser.error(f"{dirs[0].split('=', 1)[0]}: {parser.prog} reads the recipes in {recipes_dir()} only; "
                     "copy your recipe there and pass --config-name <its name>")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} -- `{parser.prog} --help` lists the options; "
                     "recipe keys are key=value (e.g. cluster.nodes=2)")
    if rest and rest[-1] in ("--config-name", "-cn"):
        parser.error(f"{rest[-1]} needs a recipe name, e.g. {rest[-1]} demo (`dsa-train --help` lists the recipes)")
    recipe, overrides = split_recipe_args(rest)
    return args, recipe, overrides


def split_recipe_args(args: list[str]) -> tuple[str, list[str]]:
    """-> (recipe name, Hydra overrides) from `--config-name R` / `recipe=R` / `key=value ...`."""
    from dsa_train.config import DEFAULT_RECIPE

    recipe, overrides = DEFAULT_RECIPE, []
    it = iter(args)
    for arg in it:
        if arg in ("--config-name", "-cn"):
            recipe = next(it, recipe)
        elif arg.startswith(("--config-name=", "-cn=")):
            recipe = arg.split("=", 1)[1]
        elif arg.startswith("recipe="):
            recipe = arg.split("=", 1)[1]
        else:
            overrides.append(arg)
    return recipe, overrides
