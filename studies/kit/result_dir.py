"""Preparing a result directory for a configuration without destroying anything.

A study records the configuration that produced its results next to them and compares
it with the one asked for on every run (:func:`prepare_result_dir`): equal -> resume or
skip; different -> :class:`~studies.kit.guard.ConfigMismatchError` naming the
record and the differing keys, unless ``force``, which moves the old results to dated
backups (:func:`~studies.kit.guard.backup`). Two layouts:

* a directory per study (the synthetic sweeps and the flow): ``config.json`` and
  ``provenance.json``; ``force`` moves the whole directory;
* a directory shared by the *parts* of a study (the Fisher–Rao sweep and flow):
  ``<part>.config.json`` and ``<part>.provenance.json``; ``force`` moves only that
  part's record, provenance and result files, the other part's files stay.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from studies.kit.guard import (
    FORCE_HINT,
    ConfigMismatchError,
    backup,
    describe_diff,
    diff_keys,
)
from studies.kit.provenance import atomic_write_json, read_json

__all__ = ["prepare_result_dir"]

log = logging.getLogger(__name__)


def _mismatch(out: Path, cfg_path: Path, cfg: dict, part: str | None) -> str | None:
    """What keeps ``out`` from holding results of ``cfg`` (``None``: nothing)."""
    if cfg_path.exists():
        old = read_json(cfg_path)
        keys = diff_keys(old, cfg)
        if keys:
            where = out if part is None else cfg_path
            return (f"{where} holds results of another configuration (differing keys: "
                    f"{', '.join(keys)}; {describe_diff(keys, old, cfg)})")
    elif part is None and out.is_dir() and any(out.iterdir()):
        return f"{out} holds files but no {cfg_path.name} recording their configuration"
    return None


def prepare_result_dir(out: str | os.PathLike, cfg: dict, force: bool = False, *,
                       part: str | None = None, files: tuple[Path, ...] = ()) -> dict:
    """Make ``out`` ready for results of ``cfg`` and return the previous provenance (a
    resume) or ``{}``.

    Without ``part`` the directory is the study's: ``out`` absent or empty -> created
    and ``cfg`` recorded in ``out/config.json``; the record equal to ``cfg`` -> kept,
    the previous ``provenance.json`` returned; another record, or files but no record ->
    :class:`~studies.kit.guard.ConfigMismatchError` naming ``out`` and the
    differing keys, unless ``force``, which moves ``out`` to a dated backup and starts
    afresh.

    With ``part`` the directory is shared: the record is ``out/<part>.config.json``,
    the provenance ``out/<part>.provenance.json``; another record is refused the same
    way, and ``force`` moves the record, the provenance and ``files`` (this part's
    results) to dated backups, leaving the other parts' files where they are.
    """
    out = Path(out)
    cfg_path = out / ("config.json" if part is None else f"{part}.config.json")
    prov_path = out / ("provenance.json" if part is None else f"{part}.provenance.json")
    problem = _mismatch(out, cfg_path, cfg, part)
    if problem is not None:
        if not force:
            raise ConfigMismatchError(f"{problem}; {FORCE_HINT}")
        log.warning("%s; --force: moving them to a backup", problem)
        for f in ([out] if part is None else [cfg_path, prov_path, *files]):
            if f.exists():
                backup(f)
    out.mkdir(parents=True, exist_ok=True)
    if not cfg_path.exists():
        atomic_write_json(cfg_path, cfg)
        return {}
    # same configuration: left as it is (a finished rerun changes no file)
    return read_json(prov_path) if prov_path.exists() else {}
