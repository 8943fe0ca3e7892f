"""Provenance and atomic result files for long runs.

Every result directory gets a ``provenance.json`` with the command line, the full
configuration, the git commit, the device, the date, the seeds and the wall time, and
every file is written atomically (to a temporary file in the same directory, then
renamed) so that an interrupted run never leaves a half-written result.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kwng.scale_switch import REPO_ROOT

__all__ = [
    "ResultFileError",
    "atomic_write_text",
    "atomic_write_json",
    "read_json",
    "git_commit",
    "device_name",
    "run_command",
    "make_provenance",
    "index_provenance",
    "write_provenance",
]


class ResultFileError(ValueError):
    """A result, record or checkpoint file exists but cannot be read (truncated,
    corrupt, wrong type). The message names the file; the original error is chained."""


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        # mkstemp creates 0600; result files are meant to be shared
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(
        path, json.dumps(obj, indent=1, sort_keys=True, default=_default) + "\n"
    )


def read_json(path: str | os.PathLike) -> Any:
    """Parse the JSON file ``path``. A missing file raises ``FileNotFoundError``; a file
    that is truncated, not UTF-8 or not JSON raises :class:`ResultFileError` naming
    ``path``."""
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ResultFileError(
            f"{path}: not a readable JSON file ({exc}); it may be truncated or "
            "corrupt: move it away or rerun with --force"
        ) from exc


def _default(o):
    try:
        import numpy as np
        import torch
    except ImportError:  # pragma: no cover
        return str(o)
    if isinstance(o, torch.Tensor):
        return o.tolist()
    if isinstance(o, (np.ndarray, np.generic)):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    return str(o)


def git_commit(cwd: str | os.PathLike | None = None) -> str:
    """``$KWNG_GIT_COMMIT`` if set, else the current git commit (with ``+dirty`` if the
    tree has changes), or ``"unknown"``."""
    cwd = cwd or REPO_ROOT
    # set by the GPU scripts: the copied tree's .git may be stale
    if os.environ.get("KWNG_GIT_COMMIT"):
        return os.environ["KWNG_GIT_COMMIT"]
    try:
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=cwd, capture_output=True,
                                  text=True, check=True, timeout=10).stdout.strip()

        dirty = git("status", "--porcelain", "--untracked-files=no")
        return git("rev-parse", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("KWNG_GIT_COMMIT", "unknown")


def device_name(device: str | None = None) -> str:
    """A readable name of the compute device (GPU model or CPU)."""
    import torch

    if (device is None or str(device).startswith("cuda")) and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def run_command() -> str:
    """The command line of this process as it can be typed again: ``python -m <module>
    ...`` when run as a module (``sys.argv[0]`` is then the module's file, which cannot
    be run as a script), each argument quoted for a POSIX shell."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    python = os.path.basename(sys.executable) or "python"
    if name:
        module = name[: -len(".__main__")] if name.endswith(".__main__") else name
        head = [python, "-m", module]
    else:
        head = [python, *sys.argv[:1]]
    return shlex.join(head + list(sys.argv[1:]))


def make_provenance(
    config: dict, seeds: Any = None, device: str | None = None, **extra
) -> dict:
    """The provenance record: command, configuration, commit, device, date, seeds,
    versions."""
    import torch

    record = {
        "command": run_command(),
        "config": config,
        "git_commit": git_commit(),
        "device": device_name(device),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "seeds": seeds,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    record.update(extra)
    return record


def index_provenance(directory: str | os.PathLike) -> dict:
    """Write ``directory/provenance.json`` gathered from the result files in it.

    For a directory whose commands write several result files, each with its own record
    (a ``provenance`` key inside a JSON result, or a ``<part>.provenance.json`` file),
    the directory record lists them under ``files`` and carries at the top the keys of
    every record (command, config, git commit, device, date, seeds, wall time): the
    latest record's command, commit, device and date, each file's config and seeds, the
    summed wall time of the last calls (``wall_time_s``) and of every call, interrupted
    ones included (``wall_time_total_s``: a record without it counts its
    ``wall_time_s``). Nothing is recomputed; the file is rewritten from what is there.
    """
    directory = Path(directory)
    files = {}
    for f in sorted(directory.glob("*.json")):
        if f.name == "provenance.json":
            continue
        data = read_json(f)
        rec = data if f.name.endswith(".provenance.json") else data.get("provenance")
        if isinstance(rec, dict) and "command" in rec and "date" in rec:
            files[f.name] = rec
    if not files:
        raise ValueError(f"no result file with a provenance record in {directory}")
    latest = max(files.values(), key=lambda r: r["date"])
    record = {
        "command": latest["command"],
        "config": {name: r.get("config") for name, r in files.items()},
        "git_commit": latest["git_commit"],
        "device": latest["device"],
        "date": latest["date"],
        "seeds": {name: r.get("seeds") for name, r in files.items()},
        "wall_time_s": sum(r.get("wall_time_s") or 0.0 for r in files.values()),
        "wall_time_total_s": sum(r.get("wall_time_total_s", r.get("wall_time_s")) or 0.0
                                 for r in files.values()),
        "files": files,
    }
    atomic_write_json(directory / "provenance.json", record)
    return record


def write_provenance(directory: str | os.PathLike, config: dict, seeds: Any = None,
                     device: str | None = None, **extra) -> dict:
    """Write ``directory/provenance.json`` atomically and return the record."""
    record = make_provenance(config, seeds, device, **extra)
    atomic_write_json(Path(directory) / "provenance.json", record)
    return record
