"""Python files a user names in the config (`reward.functions`, `env.name`): `path/to/file.py:name`.

A relative path is taken from the launch directory. Each file is imported once per process (the
start-up validation and the run share it); a missing file, a failing import or a missing name is a
ConfigError naming the config key, the file and what it holds.
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Optional

from colo_rl.errors import USER_CODE_FAILURES, ConfigError, failure_text


def split_spec(spec: str) -> Optional[tuple[str, str]]:
    """`path/to/file.py:name` -> (path, name); None for anything else (a registered name)."""
    path, sep, name = spec.rpartition(":")
    if sep and path.endswith(".py"):
        return path, name
    return None


def resolve_path(spec: str, key: str, base_dir: Optional[Path] = None) -> Path:
    """The absolute path of `spec`'s file; ConfigError when there is no such file."""
    path = Path(split_spec(spec)[0]).expanduser()
    if not path.is_absolute():
        path = (base_dir or Path.cwd()) / path
    path = path.resolve()
    if not path.is_file():
        raise ConfigError(f"{key}: {spec!r}: no file {path} (a relative path is taken from the directory the run is "
                          f"launched in)")
    return path


_LOADED: dict[Path, Any] = {}


def load_module(path: Path, key: str):
    """Import a user's file once per process; an import error is a ConfigError naming the file."""
    if path in _LOADED:
        return _LOADED[path]
    mod_name = f"colo_rl_user_{abs(hash(str(path)))}"
    spec = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module  # dataclasses / pickling inside the file look themselves up here
    if str(path.parent) not in sys.path:  # helpers beside the file import as they would from a script
        sys.path.append(str(path.parent))
    try:
        spec.loader.exec_module(module)
    except USER_CODE_FAILURES as e:  # the user's file: re-raised with its name
        sys.modules.pop(mod_name, None)
        raise ConfigError(f"{key}: importing {path} failed: {failure_text(e)}") from e
    _LOADED[path] = module
    return module


def load_object(spec: str, key: str, base_dir: Optional[Path] = None) -> tuple[Any, Path]:
    """The callable `spec` names and its file's path; ConfigError for a bad path or a missing name."""
    path = resolve_path(spec, key, base_dir)
    module = load_module(path, key)
    name = split_spec(spec)[1]
    obj = getattr(module, name, None) if name.isidentifier() else None
    if not callable(obj):
        found = sorted(n for n, v in vars(module).items()
                       if (inspect.isfunction(v) or inspect.isclass(v)) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        what = "is not callable" if hasattr(module, name) else "is not defined"
        raise ConfigError(f"{key}: {spec!r}: {name!r} {what} in {path} (it defines: {found})")
    return obj, path
