"""Hydra's own errors in the project's format: one line, exit 2, a fix that works.

Hydra prints a composition error as a paragraph (the config search path, a `full_key` block, a
pointer to HYDRA_FULL_ERROR) and exits 1; a recipe with a YAML syntax error is a long traceback.
Before Hydra runs, `precompose(argv)` composes the recipe the way `hydra.main` will (same config
directory, name and overrides) and turns what fails into a `ConfigError`:

    dsa-train: --config-name demoo: no such recipe in .../recipes (did you mean demo?) — ...
    dsa-train: data.sources=/data/a.jsonl: data.sources is a list — use data.sources=[/data/a.jsonl]
    dsa-train: recipes/demo.yaml:12: YAML syntax error: ... — fix line 12 of the file
    dsa-train: stages.sparse.steps=abc: Value 'abc' of type 'str' could not be converted to Integer — ...
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

from dsa_train.config.validate import ConfigError

# flags after which Hydra does not compose one job here (help, multirun sweeps, shell completion)
SKIP_FLAGS = {"--help", "-h", "--hydra-help", "--info", "-i", "--multirun", "-m", "--shell-completion", "-sc",
              "--version", "--experimental-rerun"}
VALUE_FLAGS = {"--config-name": "name", "-cn": "name", "--config-path": "path", "-cp": "path",
               "--config-dir": "dir", "-cd": "dir", "--cfg": None, "-c": None, "--package": None, "-p": None}


def split_argv(argv: list[str]) -> tuple[dict[str, str], list[str], bool]:
    """({name|path|dir: value}, overrides, skip) of a Hydra command line."""
    flags: dict[str, str] = {}
    overrides: list[str] = []
    skip = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        key, eq, inline = arg.partition("=")
        if arg in SKIP_FLAGS:
            skip = True
        elif key in VALUE_FLAGS:
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else "")
            if not eq:
                i += 1
            if VALUE_FLAGS[key]:
                flags[VALUE_FLAGS[key]] = value
        elif arg.startswith("-"):
            pass  # another Hydra flag (--resolve, --run): no value
        else:
            overrides.append(arg)
        i += 1
    return flags, overrides, skip


def recipe_names(config_dir: Path) -> list[str]:
    return sorted(p.stem for p in config_dir.glob("*.yaml") if p.stem != "base")


def _yaml_error(path: str, err) -> ConfigError:
    mark = err.problem_mark or err.context_mark
    line = mark.line + 1 if mark is not None else None
    what = " ".join(str(x) for x in (err.context, err.problem) if x) or "not valid YAML"
    return ConfigError(f"{path}{f':{line}' if line else ''}: YAML syntax error: {what}",
                       fix=f"fix {f'line {line} of ' if line else ''}{path} (indentation, a missing ':', an unclosed quote "
                           "or bracket), then run the same command again")


def _yaml_problem(err: BaseException | None) -> ConfigError | None:
    """A YAML syntax error (anywhere in the cause chain) as file:line."""
    import yaml

    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, yaml.MarkedYAMLError):
            mark = err.problem_mark or err.context_mark
            return _yaml_error(mark.name if mark is not None else "a recipe file", err)
        err = err.__cause__ or err.__context__
    return None


def _yaml_file_problem(config_dir: Path, name: str) -> ConfigError | None:
    """Hydra reports a broken YAML file it loads as a missing or unloadable config: parse the
    recipe files ourselves to name the file and line."""
    import yaml

    for f in [config_dir / f"{name}.yaml", *sorted(config_dir.rglob("*.yaml"))]:
        try:
            yaml.safe_load(f.read_text())
        except yaml.MarkedYAMLError as err:
            return _yaml_error(str(f), err)
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
    return None


def _override_value_problem(override: str, cause: BaseException | None) -> ConfigError:
    key, _, value = override.partition("=")
    key = key.lstrip("+~")
    text = str(cause).splitlines()[0].strip() if cause is not None and str(cause).strip() else "not a valid value"
    if "ListConfig" in text or "list" in text.lower() and not value.startswith("["):
        return ConfigError(f"{override}: {key} is a list", fix=f"use {key}=[{value}] (several: {key}=[a,b])")
    if "DictConfig" in text:
        return ConfigError(f"{override}: {key} is a group of keys, not a value",
                           fix=f"set its keys one by one, e.g. {key}.<name>=...")
    return ConfigError(f"{override}: {text}", fix=f"give {key} a value of its type (`dsa-train --cfg job` prints the recipe)")


def _parse_problem(err: BaseException, overrides: list[str]) -> ConfigError:
    bad = next((o for o in overrides if o in str(err)), None)
    if bad is None:
        bad = next((o for o in overrides if not o.isascii()), overrides[0] if overrides else "")
    key, _, value = bad.partition("=")
    if not bad.isascii():
        quoted = value if value.startswith("[") else f"'{value}'"
        if value.startswith("[") and value.endswith("]"):
            quoted = "[" + ",".join(f"'{v.strip()}'" for v in value[1:-1].split(",") if v.strip()) + "]"
        return ConfigError(f"{bad}: Hydra reads unquoted values as ASCII only",
                           fix=f"quote the value: \"{key}={quoted}\" (the double quotes are for the shell)")
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), "cannot parse")
    return ConfigError(f"{bad}: cannot parse this override ({first})",
                       fix="write key=value; quote values holding spaces or special characters: \"key='a value'\"")


def precompose(argv: list[str], default_dir: Path, default_name: str) -> None:
    """Compose the recipe of `argv` as Hydra will; ConfigError (one line) for what fails."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException, MissingConfigException, OverrideParseException

    from dsa_train.config.store import register_configs

    flags, overrides, skip = split_argv(argv)
    if skip:
        return
    primary = Path(flags.get("path") or default_dir).expanduser()  # --config-path replaces the recipes dir
    config_dir = Path(flags.get("dir") or primary).expanduser()  # --config-dir adds one, searched first
    name = flags.get("name") or default_name
    if flags.get("dir") and not config_dir.is_dir():
        raise ConfigError(f"--config-dir {flags['dir']}: no such directory",
                          fix=f"pass a directory of recipes, e.g. --config-dir {default_dir}")
    name = name[:-len(".yaml")] if name.endswith(".yaml") else name
    candidates = [config_dir / f"{name}.yaml", primary / f"{name}.yaml"]
    if not any(c.is_file() for c in candidates):
        from hydra.core.config_store import ConfigStore

        register_configs()
        if ConfigStore.instance().repo.get(f"{name}.yaml") is None:
            names = sorted(set(recipe_names(config_dir)) | set(recipe_names(primary)))
            close = difflib.get_close_matches(name, names, n=3, cutoff=0.5)
            hint = f" (did you mean {' or '.join(close)}?)" if close else ""
            raise ConfigError(f"--config-name {name}: no such recipe in {config_dir}{hint}",
                              fix=f"use one of: {', '.join(names)} (`dsa-train --help` describes each)")
    register_configs()
    # --config-dir: the directory searched first, then the recipes (Hydra's order); the primary
    # config is looked up in the first, the rest of the search path added as hydra.searchpath
    search = [] if config_dir == primary else [f"hydra.searchpath=[file://{primary.resolve()}]"]
    try:
        with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base=None):
            compose(config_name=name, overrides=[*search, *overrides])
    except OverrideParseException as err:
        raise _parse_problem(err, overrides) from None
    except ConfigCompositionException as err:
        yaml_err = _yaml_problem(err)
        if yaml_err is not None:
            raise yaml_err from None
        match = re.search(r"override (\S+)", str(err))
        override = match.group(1) if match else None
        if override:
            full = next((o for o in overrides if o.startswith(override) or o.lstrip("+~").startswith(override)), override)
            raise _override_value_problem(full, err.__cause__) from None
        raise (_yaml_file_problem(config_dir, name) or _composition_problem(err, name)) from None
    except MissingConfigException as err:
        yaml_err = _yaml_file_problem(config_dir, name)
        if yaml_err is not None:
            raise yaml_err from None
        raise ConfigError(f"{_first_line(err)}", fix="`dsa-train --help` lists the recipes; "
                          "each group's options are the files in recipes/<group>/") from None
    except Exception as err:  # noqa: BLE001 -- Hydra and OmegaConf raise many types; all are the recipe's
        yaml_err = _yaml_problem(err) or _yaml_file_problem(config_dir, name)
        if yaml_err is not None:
            raise yaml_err from None
        from omegaconf.errors import OmegaConfBaseException

        if isinstance(err, OmegaConfBaseException):
            raise ConfigError(f"the recipe does not compose: {_first_line(err)}",
                              fix="fix the key it names (`dsa-train --cfg job` prints the composed recipe)") from None
        raise


def _composition_problem(err: BaseException, name: str) -> ConfigError:
    """A recipe file that does not compose: the key it names (with suggestions) when there is one."""
    from dsa_train.config.overrides import check_key

    texts = []
    e = err
    while e is not None and len(texts) < 5:
        texts.append(str(e))
        e = e.__cause__ or e.__context__
    full_key = next((m.group(1) for t in texts for m in [re.search(r"full_key: (\S+)", t)] if m), None)
    where = next((m.group(1) for t in texts for m in [re.search(r"In '([^']+)'", t)] if m), name)
    if full_key:
        found = check_key(full_key)
        detail = found or next((_first_line(Exception(t)) for t in texts[1:] if t.strip()), _first_line(err))
        return ConfigError(f"recipe {where}: {detail}", fix="fix that key in the recipe file (`dsa-train --config-name "
                                                            f"{name} --cfg job` prints the composed recipe)")
    cause = next((_first_line(Exception(t)) for t in texts[1:] if t.strip()), _first_line(err))
    return ConfigError(f"recipe {where} does not compose: {cause}",
                       fix=f"check it and the overrides against `dsa-train --config-name {name} --cfg job`")


def _first_line(err: BaseException) -> str:
    return next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)


def compose_checked(recipe: str, overrides: list[str] | None = None) -> DictConfig:
    """`compose_recipe` for a subcommand's command line (`dsa-train plan`, `launch`): an unknown key
    (with suggestions) and what Hydra refuses (no such recipe, a value of the wrong type, an override
    that does not parse) are one ConfigError, as for training (`precompose`)."""
    from dsa_train.config.overrides import check_overrides
    from dsa_train.config.recipes import compose_recipe, recipes_dir

    overrides = list(overrides or [])
    argv = ["--config-name", recipe, *overrides]
    check_overrides(argv, recipes_dir())
    try:
        return compose_recipe(recipe, overrides)
    except Exception:
        precompose(argv, recipes_dir(), recipe)  # raises the ConfigError of what failed
        raise
