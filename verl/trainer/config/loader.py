"""One config mechanism for every YAML-configured command: packaged defaults, Hydra's grammar, one-line errors.

``compose(config_dir, config_name, user_file, overrides, rules)``:

1. composes ``<config_dir>/<config_name>.yaml`` with Hydra (so a config with a ``defaults:`` list works
   as in verl);
2. merges a user file over it (``verl train --config F``): every key of F must exist in the defaults,
   except under a mapping whose default is ``{}`` (``override_transformer_config``, ``engine_kwargs``);
3. applies the command-line overrides with Hydra's override grammar: ``k=v``, ``+k=v`` (add),
   ``++k=v`` (add or override), ``~k`` (delete), lists ``k=[a,b]``, ``1e-6`` as a float;
   a section another verl version spells differently (``aliases``) lands under this config's name, and
   sections that configure machinery this stack does not have (``ignored``: Hydra's job runner, Ray)
   are dropped with one warning line each, in the file and on the command line;
4. resolves ``${...}`` interpolations;
5. checks every leaf: its type is the default's type (an int is a float; an integral float such as
   ``1e3`` is an int), or what its :class:`Rule` says, plus the rule's choices and range.

The defaults (the YAML) are the one source of keys and default values; rules only add what a default
cannot say. Any problem raises one :class:`ConfigError` whose message is one line naming the key, what
was expected and what was found; commands print it and exit 2.
"""

from __future__ import annotations

import copy
import difflib
import functools
import os
from collections.abc import Mapping, Sequence
from typing import Any

from verl.utils.config_checks import ConfigError, Rule, check_value, rule
from verl.utils.logging_utils import get_logger

__all__ = ["PACKAGED_CONFIG_DIR", "ConfigError", "Rule", "check_value", "compose", "config_dir_from_cli",
           "deep_get", "named_defaults", "override_value", "read_user_file", "resolve_path", "rule"]

logger = get_logger(__name__)

PACKAGED_CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------- key paths and did-you-mean
def _leaf_paths(tree: Any, prefix: str = "") -> list[str]:
    if not isinstance(tree, Mapping):
        return [prefix.rstrip(".")]
    out = []
    for key, value in tree.items():
        out.append(prefix + str(key))
        if isinstance(value, Mapping) and value:
            out.extend(_leaf_paths(value, prefix + str(key) + "."))
    return out


def _did_you_mean(dotted: str, defaults: Mapping[str, Any]) -> str:
    parent, _, leaf = dotted.rpartition(".")
    node: Any = defaults
    for part in parent.split(".") if parent else []:
        node = node.get(part) if isinstance(node, Mapping) else None
    siblings = [f"{parent}.{k}" if parent else str(k) for k in node] if isinstance(node, Mapping) else []
    guess = difflib.get_close_matches(dotted, siblings, n=1) or difflib.get_close_matches(
        dotted, _leaf_paths(defaults), n=1, cutoff=0.75)
    if guess:
        return f"a known key (did you mean '{guess[0]}'?)"
    if siblings:
        shown = sorted(k.rpartition(".")[2] for k in siblings)
        return f"one of {shown[:12]}{' ...' if len(shown) > 12 else ''} under {parent or '<root>'}"
    return "a known key"


def _unknown(dotted: str, defaults: Mapping[str, Any], hint: str = "") -> ConfigError:
    leaf = dotted.rpartition(".")[2]
    return ConfigError(f"{dotted}: unknown key: expected {_did_you_mean(dotted, defaults)}, found '{leaf}'{hint}")


def _is_open(default: Any) -> bool:
    """A mapping whose default is ``{}`` takes any keys (verl's override_* and engine_kwargs)."""
    return isinstance(default, Mapping) and not default


# --------------------------------------------------------------------------- composition
def _compose_named(config_dir: str, config_name: str):
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.errors import HydraException, MissingConfigException

    name = config_name[:-5] if config_name.endswith(".yaml") else config_name
    if not os.path.isdir(config_dir):
        raise ConfigError(f"--config-path: expected a directory of YAML configs, found nothing at {config_dir}")
    if not os.path.isfile(os.path.join(config_dir, name + ".yaml")):
        have = sorted(f[:-5] for f in os.listdir(config_dir) if f.endswith(".yaml"))
        raise ConfigError(f"--config-name: expected one of {have} in {config_dir}, found '{config_name}'")
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None, job_name="verl"):
            return hydra_compose(config_name=name)
    except MissingConfigException as err:
        raise ConfigError(f"{config_dir}/{name}.yaml: {_first_line(err)}") from None
    except HydraException as err:
        raise ConfigError(f"{config_dir}/{name}.yaml: {_first_line(err)}") from None


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def read_user_file(path: str) -> dict[str, Any]:
    """A ``--config`` YAML file as a plain mapping (interpolations unresolved); one-line errors."""
    import yaml
    from omegaconf import OmegaConf

    if not os.path.isfile(path):
        raise ConfigError(f"--config: expected a YAML file, found nothing at {path}")
    try:
        with open(path, encoding="utf-8") as fh:
            loaded = OmegaConf.load(fh)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}:{where} expected valid YAML, found {getattr(err, 'problem', None) or err}") \
            from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: expected UTF-8 YAML, found byte {err.object[err.start]:#04x} at offset "
                          f"{err.start}") from None
    container = OmegaConf.to_container(loaded, resolve=False)
    if container is None:
        return {}
    if not isinstance(container, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, found {type(container).__name__}")
    return container


def _move_section(tree: dict[str, Any], alias: str, target: str, source: str) -> None:
    """The subtree at dotted ``alias`` moved to dotted ``target`` (another verl version's name for it)."""
    *parents, leaf = alias.split(".")
    node: Any = tree
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or leaf not in node:
        return
    value = node.pop(leaf)
    *target_parents, target_leaf = target.split(".")
    dest: Any = tree
    for part in target_parents:
        dest = dest.setdefault(part, {})
    if isinstance(value, dict) and isinstance(dest.get(target_leaf), dict):
        both = sorted(set(value) & set(dest[target_leaf]))
        if both:
            raise ConfigError(f"{target}.{both[0]}: expected it once (in {source}), found it under both "
                              f"{alias} and {target}")
        dest[target_leaf].update(value)
    else:
        dest[target_leaf] = value


def _check_user_keys(tree: Any, defaults: Any, prefix: str, source: str, root: Mapping[str, Any]) -> None:
    """Every key of a user file must exist in the defaults (any key under an open mapping)."""
    if not isinstance(tree, Mapping):
        return
    for key, value in tree.items():
        dotted = prefix + str(key)
        if not isinstance(defaults, Mapping) or key not in defaults:
            raise _unknown(dotted, root, f" (in {source})")
        default = defaults[key]
        if _is_open(default):
            continue
        if isinstance(default, Mapping):
            if value is not None and not isinstance(value, Mapping):
                raise ConfigError(f"{dotted}: expected a mapping (in {source}), found {type(value).__name__} {value!r}")
            _check_user_keys(value or {}, default, dotted + ".", source, root)


_MISSING = object()  # OmegaConf.select's default: tells an absent key from a null one


# Top-level sections every command drops with a warning: Hydra's own job settings (run dir, logging).
HYDRA_IGNORED = {"hydra": "it configures Hydra's job runner, which verl-hpc does not use"}


def _parse_override(parser, item: str):
    from hydra.errors import HydraException

    try:
        return parser.parse_overrides([item])
    except HydraException as err:
        detail = [line.strip() for line in str(err).splitlines()
                  if line.strip() and not line.startswith("See ") and line.strip() != "^"
                  and not line.startswith("Error parsing")]
        found = detail[0].split(": ", 1)[-1] if detail else "a parse error"
        if found == item:
            found = "no key=value"
        raise ConfigError(f"override {item!r}: expected key=value in Hydra's override grammar (e.g. "
                          f"trainer.total_training_steps=3, +new.key=1, ~key), found {found}") from None


def override_value(overrides: Sequence[str], key: str) -> tuple[bool, Any]:
    """(True, the value) of the last ``key=v`` / ``+key=v`` / ``++key=v`` in ``overrides``, else (False, None).
    For a selector that decides what to compose before the overrides are applied."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = None
    found: tuple[bool, Any] = (False, None)
    for item in overrides:
        if item.lstrip("+~").split("=", 1)[0].strip() != key:
            continue
        parser = parser or OverridesParser.create()
        override = _parse_override(parser, item)[0]
        if not override.is_delete():
            found = (True, override.value())
    return found


def _renamed(dotted: str, aliases: Mapping[str, str]) -> str:
    for alias, target in aliases.items():
        if dotted == alias or dotted.startswith(alias + "."):
            return target + dotted[len(alias):]
    return dotted


def _warn_ignored(dropped: Mapping[str, list[str]], ignored: Mapping[str, str]) -> None:
    for root, items in dropped.items():
        logger.warning("config: %s ignored: %s", ", ".join(items), ignored[root])


def _apply_overrides(cfg, overrides: Sequence[str], defaults: Mapping[str, Any],
                     ignored: Mapping[str, str] = HYDRA_IGNORED, aliases: Mapping[str, str] | None = None) -> None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    parser = OverridesParser.create()
    dropped: dict[str, list[str]] = {}
    for item in overrides:
        parsed = _parse_override(parser, item)
        override = parsed[0]
        root = override.key_or_group.split(".", 1)[0]
        if root in ignored:
            dropped.setdefault(root, []).append(item)
            continue
        written = override.key_or_group
        if aliases:
            override.key_or_group = _renamed(written, aliases)
        key = override.key_or_group
        if not (override.is_add() or override.is_force_add()) and OmegaConf.select(cfg, key, default=_MISSING) \
                is _MISSING and not override.is_delete():
            parent = key.rpartition(".")[0]
            parent_default = OmegaConf.select(cfg, parent) if parent else None
            hint = f" (to add a key use +{item})" if parent and parent_default is not None else ""
            if key != written:
                hint += f" (written {written})"
            raise _unknown(key, defaults, hint)
        if override.is_delete() and override.value() is None and _delete_key(cfg, key):
            continue  # Hydra cannot delete a key whose value is null (it reads as absent)
        try:
            ConfigLoaderImpl._apply_overrides_to_config(parsed, cfg)
        except (HydraException, OmegaConfBaseException) as err:
            raise ConfigError(f"override {item!r}: {_first_line(err)}") from None
    _warn_ignored(dropped, ignored)


def _delete_key(cfg, key: str) -> bool:
    from omegaconf import DictConfig, OmegaConf, open_dict

    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if not isinstance(parent, DictConfig) or leaf not in parent:
        return False
    with open_dict(parent):
        del parent[leaf]
    return True


@functools.lru_cache(maxsize=8)
def _composed_defaults(config_dir: str, config_name: str):
    """The named config as Hydra composes it and its resolved defaults, once per process (a compose costs
    ~0.15 s; callers deep-copy what they change)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    base = _compose_named(config_dir, config_name)
    try:
        return base, OmegaConf.to_container(base, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(f"{config_dir}/{config_name}: {_first_line(err)}") from None


def named_defaults(config_dir: str, config_name: str) -> dict[str, Any]:
    """The resolved defaults of ``config_dir/config_name`` (a copy)."""
    return copy.deepcopy(_composed_defaults(config_dir, config_name)[1])


def compose(config_dir: str, config_name: str, user_file: str | None, overrides: Sequence[str],
            rules: Mapping[str, Rule], ignored: Mapping[str, str] = HYDRA_IGNORED,
            aliases: Mapping[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """Defaults <- user file <- overrides, interpolations resolved, every leaf checked (module docstring).

    ``ignored``: top-level section -> why it is dropped (one warning line per section); ``aliases``: dotted
    section -> the dotted section of this config it means.
    Returns the plain nested dict and the directory that relative paths in the user file resolve
    against (the repository root for a file in ``configs/``, else the file's directory; the working
    directory when there is no file).
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    composed, resolved_defaults = _composed_defaults(config_dir, config_name)
    base, defaults = copy.deepcopy(composed), copy.deepcopy(resolved_defaults)
    base_dir = os.getcwd()
    OmegaConf.set_struct(base, False)
    if user_file is not None:
        user = read_user_file(user_file)
        dropped = {root: [root] for root in ignored if user.pop(root, None) is not None}
        _warn_ignored(dropped, ignored)
        for alias, target in (aliases or {}).items():
            _move_section(user, alias, target, user_file)
        _check_user_keys(user, defaults, "", user_file, defaults)
        try:
            base = OmegaConf.merge(base, user)
        except OmegaConfBaseException as err:
            raise ConfigError(f"{user_file}: {_first_line(err)}") from None
        config_dir_of_file = os.path.dirname(os.path.abspath(user_file))
        base_dir = os.path.dirname(config_dir_of_file) if os.path.basename(config_dir_of_file) == "configs" \
            else config_dir_of_file
    _close_known_mappings(base, defaults)
    _apply_overrides(base, overrides, defaults, ignored, aliases)
    try:
        resolved = OmegaConf.to_container(base, resolve=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None)
        raise ConfigError(f"{key or 'config'}: expected a resolvable ${{...}} interpolation, found "
                          f"{_first_line(err)}") from None
    added = _check_tree(resolved, defaults, rules, "")
    for key in added:
        logger.warning("config: %s was added (+) but verl-hpc does not read it", key)
    return resolved, base_dir


def _close_known_mappings(cfg, defaults: Mapping[str, Any]) -> None:
    """Struct mode (unknown keys need ``+``) everywhere except under the open mappings."""
    from omegaconf import DictConfig, OmegaConf

    OmegaConf.set_struct(cfg, True)

    def walk(node, default):
        if not isinstance(node, DictConfig) or not isinstance(default, Mapping):
            return
        for key in list(node.keys()):
            child_default = default.get(key)
            child = node._get_node(key)
            if _is_open(child_default) and isinstance(child, DictConfig):
                OmegaConf.set_struct(child, False)
            elif isinstance(child, DictConfig):
                walk(child, child_default)

    walk(cfg, defaults)


# --------------------------------------------------------------------------- leaf checks
def _check_tree(tree: dict[str, Any], defaults: Mapping[str, Any], rules: Mapping[str, Rule],
                prefix: str) -> list[str]:
    """Check (and normalise in place) every leaf of ``tree``; returns the added keys nobody reads.
    A known key deleted with ``~`` reads as null."""
    added = [prefix + str(k) for k in tree if k not in defaults]
    for key, default in defaults.items():
        dotted = prefix + str(key)
        if key not in tree:
            tree[key] = copy.deepcopy(default) if isinstance(default, Mapping) else None
            if not isinstance(default, Mapping) and not (dotted in rules and rules[dotted].nullable) \
                    and default is not None:
                raise ConfigError(f"{dotted}: expected a value (it was deleted with ~{dotted}), found none")
            continue
        value = tree[key]
        if isinstance(default, Mapping):
            if _is_open(default):
                if value is not None and not isinstance(value, Mapping):
                    raise ConfigError(f"{dotted}: expected a mapping, found {type(value).__name__} {value!r}")
                if value is None:
                    tree[key] = {}
                continue
            if not isinstance(value, Mapping):
                raise ConfigError(f"{dotted}: expected a mapping, found {type(value).__name__} {value!r}")
            added += _check_tree(value, default, rules, dotted + ".")
        else:
            tree[key] = check_value(dotted, value, default, rules.get(dotted))
    return added


def deep_get(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        node = node[part]
    return node


def resolve_path(path: str | None, base_dir: str) -> str | None:
    """``~`` expanded; relative paths resolve against the working directory first, then ``base_dir``."""
    if path is None:
        return None
    path = os.path.expanduser(path)
    if os.path.isabs(path) or os.path.exists(path):
        return os.path.abspath(path)
    candidate = os.path.join(base_dir, path)
    return os.path.abspath(candidate) if os.path.exists(candidate) else os.path.abspath(path)


def config_dir_from_cli(config_path: str | None, module_file: str) -> str:
    """Hydra's ``--config-path``: absolute, or relative to the module declaring the entry point (verl's
    ``--config-path=config`` from ``verl/trainer/main_ppo.py`` is ``verl/trainer/config``), or to the
    working directory."""
    if config_path is None:
        return PACKAGED_CONFIG_DIR
    path = os.path.expanduser(config_path)
    if os.path.isabs(path):
        return path
    beside_module = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(module_file)), path))
    return beside_module if os.path.isdir(beside_module) else os.path.abspath(path)
