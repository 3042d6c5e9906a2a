"""Compose a run's config: schema <- recipe <- command-line overrides, then validate.

Recipes are plain YAML files in a recipe directory (the repository's `recipes/` by default, or
`recipe_dir=DIR` / $SKYRL_MTP_RECIPE_DIR for a user's own). They are registered in Hydra's config
store as the `recipe` group, so `recipe=NAME` and Hydra's override grammar work unchanged.
Keys are checked against the schema before composing, so a typo gets a message that names it and
lists the keys that do exist.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import fields, is_dataclass
from pathlib import Path
from typing import Any, get_type_hints

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException, ValidationError

from skyrl_mtp.config.schema import SkyRLConfig
from skyrl_mtp.config.validation import validate_config
from skyrl_mtp.errors import ConfigError, problem

CONFIG_DIR = Path(__file__).resolve().parent
REPO_RECIPE_DIR = CONFIG_DIR.parents[1] / "recipes"
RECIPE_DIR_ENV = "SKYRL_MTP_RECIPE_DIR"
# Keys whose values are free-form mappings (any sub-key is allowed).
_OPEN_KEYS = {"generator.engine_kwargs"}
_CLI_ONLY = ("recipe", "recipe_dir")


def recipe_dirs(explicit: str | os.PathLike | None = None) -> list[Path]:
    """Directories searched for `NAME.yaml`, first match wins: explicit, $SKYRL_MTP_RECIPE_DIR, ./recipes, the repo's."""
    dirs: list[Path] = []
    if explicit is not None:
        path = Path(explicit)
        if not path.is_dir():
            raise ConfigError([problem("recipe_dir", str(explicit), "directory does not exist")])
        dirs.append(path)
    for entry in filter(None, os.environ.get(RECIPE_DIR_ENV, "").split(os.pathsep)):
        dirs.append(Path(entry))
    dirs += [Path.cwd() / "recipes", REPO_RECIPE_DIR]
    unique: list[Path] = []
    for d in dirs:
        if d.is_dir() and d.resolve() not in [u.resolve() for u in unique]:
            unique.append(d)
    return unique


def available_recipes(dirs: list[Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in dirs:
        for path in sorted(d.glob("*.yaml")):
            found.setdefault(path.stem, path)
    return found


def _schema_child(schema_type: Any, name: str) -> tuple[bool, Any]:
    if not is_dataclass(schema_type):
        return False, None
    names = {f.name for f in fields(schema_type)}
    if name not in names:
        return False, None
    return True, get_type_hints(schema_type)[name]


def _allowed_under(schema_type: Any) -> list[str]:
    return sorted(f.name for f in fields(schema_type)) if is_dataclass(schema_type) else []


def check_key(dotted: str) -> str | None:
    """None if `dotted` names a key of the schema, else a message naming it and what is allowed."""
    parts = re.sub(r"\[\d+\]", "", dotted).split(".")
    node: Any = SkyRLConfig
    for i, part in enumerate(parts):
        prefix = ".".join(parts[:i])
        if prefix in _OPEN_KEYS:
            return None
        ok, child = _schema_child(node, part)
        if not ok:
            allowed = _allowed_under(node)
            where = f"under '{prefix}'" if prefix else "at the top level"
            close = difflib.get_close_matches(part, allowed, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            return f"{dotted}: unknown key{hint}; allowed keys {where}: {allowed}"
        node = _unwrap_optional(child)
    return None


def _unwrap_optional(tp: Any) -> Any:
    args = getattr(tp, "__args__", None)
    if args and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else tp
    return tp


def _flatten(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        if prefix in _OPEN_KEYS:
            return []
        out: list[str] = []
        for key, value in node.items():
            if key == "defaults":
                continue
            out += _flatten(value, f"{prefix}.{key}" if prefix else str(key))
        return out
    return [prefix]


def _split_overrides(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    cli: dict[str, str] = {}
    rest: list[str] = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if sep and key in _CLI_ONLY:
            cli[key] = value
        else:
            rest.append(item)
    return cli, rest


def _check_override_keys(overrides: list[str]) -> list[str]:
    problems = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            problems.append(f"{item!r}: overrides must look like key=value")
            continue
        key = key.lstrip("+~")
        if key.startswith("hydra.") or key == "hydra":
            continue
        msg = check_key(key)
        if msg:
            problems.append(f"{key}={value}: " + msg.split(": ", 1)[1])
    return problems


def _register_recipe(name: str, dirs: list[Path]) -> Path:
    recipes = available_recipes(dirs)
    if name not in recipes:
        raise ConfigError([problem("recipe", name, f"no such recipe; available: {sorted(recipes)} "
                                   f"(searched {[str(d) for d in dirs]})")])
    path = recipes[name]
    try:
        node = OmegaConf.load(path)
    except Exception as err:  # noqa: BLE001 - YAML errors come in many types
        raise ConfigError([problem("recipe", name, f"{path} is not valid YAML: {err}")]) from err
    container = OmegaConf.to_container(node, resolve=False)
    if not isinstance(container, dict):
        raise ConfigError([problem("recipe", name, f"{path} must be a YAML mapping")])
    bad = [check_key(k) for k in _flatten(container)]
    bad = [f"recipe {name} ({path}): {m}" for m in bad if m]
    if bad:
        raise ConfigError(bad)
    ConfigStore.instance().store(group="recipe", name=name, node=node, package="_global_")
    return path


def compose_config(overrides: list[str] | None = None) -> DictConfig:
    """Compose schema <- recipe <- overrides with Hydra; no derivation or semantic validation yet."""
    overrides = list(overrides or [])
    cli, rest = _split_overrides(overrides)
    problems = _check_override_keys(rest)
    if problems:
        raise ConfigError(problems)
    ConfigStore.instance().store(name="skyrl_mtp_schema", node=SkyRLConfig)
    hydra_overrides = [o for o in rest if not _targets_open_key(o)]
    open_overrides = [o for o in rest if _targets_open_key(o)]
    if "recipe" in cli:
        _register_recipe(cli["recipe"], recipe_dirs(cli.get("recipe_dir")))
        hydra_overrides.insert(0, f"recipe={cli['recipe']}")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=hydra_overrides)
    except (HydraException, OmegaConfBaseException) as err:
        raise ConfigError([_explain_hydra_error(err)]) from err
    finally:
        GlobalHydra.instance().clear()
    _apply_open_overrides(cfg, open_overrides)
    return cfg


def _targets_open_key(override: str) -> bool:
    key = override.partition("=")[0].lstrip("+~")
    return any(key == k or key.startswith(k + ".") for k in _OPEN_KEYS)


def _apply_open_overrides(cfg: DictConfig, overrides: list[str]) -> None:
    """Set free-form mapping keys ourselves: Hydra cannot assign a mapping into a null or struct dict node."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for item in overrides:
        try:
            parsed = parser.parse_overrides([item])[0]
        except HydraException as err:
            raise ConfigError([f"{item}: cannot parse override ({str(err).splitlines()[0]})"]) from err
        key = parsed.key_or_group
        with open_dict(cfg):
            if parsed.is_delete():
                parent, _, leaf = key.rpartition(".")
                node = OmegaConf.select(cfg, parent) if parent else cfg
                if node is not None and leaf in node:
                    node.pop(leaf)
                continue
            value = parsed.value()
            if "." in key and any(key.startswith(k + ".") for k in _OPEN_KEYS):
                parent = key.rpartition(".")[0]
                if OmegaConf.select(cfg, parent) is None:
                    OmegaConf.update(cfg, parent, {}, merge=False)
            try:
                OmegaConf.update(cfg, key, value, merge=False, force_add=True)
            except OmegaConfBaseException as err:
                raise ConfigError([_explain_hydra_error(err)]) from err


_SCALAR_FORMS = {int: "an integer, e.g. 10", float: "a number, e.g. 0.5", bool: "true or false", str: "a string"}


def schema_type(dotted: str) -> Any:
    """The schema's annotation of key `dotted` (None for a key it does not declare)."""
    node: Any = SkyRLConfig
    for part in dotted.split("."):
        ok, child = _schema_child(_unwrap_optional(node), part)
        if not ok:
            return None
        node = child
    return node


def expected_form(key: str, tp: Any) -> str:
    """What a value of schema type `tp` looks like on the command line, in words, with an example for `key`."""
    args = [a for a in getattr(tp, "__args__", ()) if a is not type(None)]
    optional = type(None) in getattr(tp, "__args__", ())
    origin = getattr(tp, "__origin__", None)
    if origin is list or tp is list:
        form = f"a list: write {key}=[a,b] ({key}=[] for none)"
    elif origin is dict or tp is dict:
        form = f"a mapping: write {key}={{name: value}} or {key}.name=value"
    elif len(args) > 1:
        form = " or ".join(_SCALAR_FORMS.get(a, str(a)).split(",")[0] for a in args)
    else:
        base = args[0] if args else tp
        form = _SCALAR_FORMS.get(base, f"a value of type {getattr(base, '__name__', base)}")
    return form + (" or null" if optional and "null" not in form else "")


def _explain_hydra_error(err: Exception) -> str:
    text = str(err)
    cause = err.__cause__ or err
    cause = cause.__cause__ if isinstance(cause.__cause__, OmegaConfBaseException) else cause
    full_key = getattr(cause, "full_key", None)
    match = re.search(r"full_key: (\S+)", str(cause)) if not full_key else None
    full_key = full_key or (match.group(1) if match else None)
    first = str(cause).splitlines()[0] if str(cause) else text.splitlines()[0]
    if full_key:
        tp = schema_type(full_key)
        if isinstance(cause, ValidationError) and tp is not None:   # a value of the wrong type
            return problem(full_key, getattr(cause, "value", None), "must be " + expected_form(full_key, tp))
        return f"{full_key}: {first}"
    return text.splitlines()[0] if text else repr(err)


def load_config(overrides: list[str] | None = None) -> DictConfig:
    """The validated config of a run; components get their settings from it via skyrl_mtp.trainer.run_plan."""
    cfg = compose_config(overrides)
    validate_config(cfg)
    return cfg


def to_yaml(cfg: DictConfig) -> str:
    return OmegaConf.to_yaml(cfg, resolve=True)


def to_typed(cfg: DictConfig) -> SkyRLConfig:
    """The config as plain dataclasses, for code that wants attribute access with types."""
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]
