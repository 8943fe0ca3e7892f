"""Guards shared by the experiment commands: results are never destroyed, bad files
never read silently.

* A result directory records the configuration that produced it (``config.json`` for the
  synthetic sweeps, prepared by :func:`studies.kit.result_dir.prepare_result_dir`,
  the ``identity`` of ``metrics.json`` for a CIFAR run). A rerun compares its
  configuration with the record (:func:`diff_keys`): equal -> resume or skip; different
  -> :class:`ConfigMismatchError` naming the directory and the differing keys. With
  ``force`` the old results are moved to a dated backup (:func:`backup`), never deleted.
* Every read of a JSON file, a CSV and a checkpoint names the file when it fails
  (:class:`studies.kit.provenance.ResultFileError`).
* :func:`~studies.kit.guard_csv.read_csv_checked` validates every row of a result
  CSV (parseable, finite, unique key) and reports the bad ones, so that a resume
  recomputes them instead of trusting them.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from studies.kit.provenance import ResultFileError, atomic_write_json, read_json

__all__ = [
    "FORCE_HINT",
    "ConfigMismatchError",
    "diff_keys",
    "describe_diff",
    "backup",
    "write_json_guarded",
    "load_checkpoint",
    "check_run_record",
    "check_existing_run",
    "resume_checkpoint",
    "run_identity",
    "record_identity",
    "RUN_IDENTITY_KEYS",
    "IDENTITY_DEFAULTS",
]

log = logging.getLogger(__name__)

FORCE_HINT = (
    "use another --out, or --force to move the old results to a dated backup "
    "(nothing is deleted)"
)


class ConfigMismatchError(ValueError):
    """Results of another configuration are where this command would write."""


def _normal(obj: Any) -> Any:
    """``obj`` as it reads back from JSON (tuples -> lists, non-string keys ->
    strings)."""
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def diff_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted names of the keys whose values differ between two (nested) configurations.

    Values are compared as they read back from JSON; a key present on one side only
    differs. Non-dict values that differ give ``prefix`` (``"<root>"`` at the top)."""
    old, new = _normal(old), _normal(new)
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new)):
            name = f"{prefix}.{k}" if prefix else str(k)
            if k not in old or k not in new:
                out.append(name)
            else:
                out += diff_keys(old[k], new[k], name)
        return out
    return [] if old == new else [prefix or "<root>"]


def describe_diff(keys: Sequence[str], old: Any, new: Any, limit: int = 8) -> str:
    """``lr: 0.1 -> 0.01; epochs: 6 -> 2`` for the first ``limit`` keys."""
    old, new = _normal(old), _normal(new)

    def get(d, dotted):
        for part in dotted.split("."):
            if not isinstance(d, dict) or part not in d:
                return "<absent>"
            d = d[part]
        return d

    parts = []
    for k in keys[:limit]:
        a, b = repr(get(old, k)), repr(get(new, k))
        parts.append(f"{k}: {a[:60]} -> {b[:60]}")
    more = f"; and {len(keys) - limit} more" if len(keys) > limit else ""
    return "; ".join(parts) + more


def backup(path: str | os.PathLike) -> Path:
    """Move ``path`` (file or folder) to ``<name>.backup-<UTC date and time>`` next to
    it and return the new path. Nothing is deleted; an existing backup name gets a
    counter."""
    path = Path(path)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = path.with_name(f"{path.name}.backup-{stamp}")
    k = 1
    while target.exists():
        target = path.with_name(f"{path.name}.backup-{stamp}-{k}")
        k += 1
    os.replace(path, target)
    log.warning("moved %s to %s", path, target)
    return target


def write_json_guarded(
    path: str | os.PathLike, obj: Any, force: bool = False, ignore: Iterable[str] = ()
) -> bool:
    """Write ``obj`` to the JSON file ``path`` unless it would replace different
    content.

    Same content (up to the keys in ``ignore``): nothing written, returns ``False``.
    Different content: :class:`ConfigMismatchError` naming the file and keys, unless
    ``force`` (the old file goes to a dated backup). Returns ``True`` when the file was
    written."""
    path = Path(path)
    if path.exists():
        old = read_json(path)
        strip = set(ignore)
        keys = [k for k in diff_keys(old, obj) if k.split(".")[0] not in strip]
        if not keys:
            return False
        if not force:
            raise ConfigMismatchError(
                f"{path} exists with other content "
                f"(differing keys: {', '.join(keys)}); {FORCE_HINT}"
            )
        backup(path)
    atomic_write_json(path, obj)
    return True


def load_checkpoint(path: str | os.PathLike, map_location: Any = None) -> dict:
    """``torch.load`` of a checkpoint written by this package; a truncated or corrupt
    file raises :class:`ResultFileError` naming it."""
    import pickle

    import torch

    try:
        ck = torch.load(path, map_location=map_location, weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError, ValueError, OSError) as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        raise ResultFileError(
            f"{path}: checkpoint cannot be read ({type(exc).__name__}: {exc}); "
            "it may be truncated: move it away to restart the run from scratch"
        ) from exc
    if not isinstance(ck, dict):
        raise ResultFileError(
            f"{path}: checkpoint holds a {type(ck).__name__}, expected a dict"
        )
    return ck


def check_run_record(
    where: str | os.PathLike, old: dict, new: dict, force: bool = False
) -> list[str]:
    """Compare the identity ``old`` recorded for a run (at ``where``) with ``new``.

    Keys absent from ``old`` (records older than the key) are not compared. Returns the
    differing keys; raises :class:`ConfigMismatchError` naming ``where`` and them unless
    ``force``."""
    common = {k: new[k] for k in new if k in old}
    keys = diff_keys({k: old[k] for k in common}, common)
    if keys and not force:
        raise ConfigMismatchError(
            f"{where} was produced with another configuration (differing keys: "
            f"{', '.join(keys)}; {describe_diff(keys, old, new)}); {FORCE_HINT}"
        )
    return keys


# -------------------------------------------------------------------- CIFAR run records
#: Settings of a CIFAR run that change its result; with the resolved step size, the
#: batch size, the method's spec and the data's fingerprint they form the run's
#: identity, recorded in metrics.json.
RUN_IDENTITY_KEYS = (
    "dataset",
    "conditioning",
    "method",
    "seed",
    "epochs",
    "model",
    "train_subset",
    "val_size",
    "max_steps",
)


#: Settings that change what a run computes beyond :data:`RUN_IDENTITY_KEYS`, each with
#: the value that a stored identity lacking the key is read with when the record's own
#: ``config`` does not hold it either: records written before a setting existed ran with
#: that value (the 6-epoch study's records predate ``schedule`` and ran ``study6``).
IDENTITY_DEFAULTS = {
    "schedule": "study6",
    "precision": "fp32",
    "channels_last": False,
    "capture": False,
    "eval_test": False,
    "early_stop": None,
    "world_size": 1,
}


def run_identity(
    cfg: dict, lr: float, batch_size: int, method_spec: dict, data: str | None
) -> dict:
    """What must be equal for a CIFAR run directory to be resumed or skipped: the
    settings of :data:`RUN_IDENTITY_KEYS` and :data:`IDENTITY_DEFAULTS` (always all of
    them), the step size, the batch size, the method's settings and the fingerprint of
    the data (when known)."""
    ident = {k: cfg.get(k) for k in RUN_IDENTITY_KEYS}
    ident.update({k: cfg.get(k, d) for k, d in IDENTITY_DEFAULTS.items()})
    ident.update(
        lr=float(lr), batch_size=int(batch_size), method_spec=dict(method_spec)
    )
    if data is not None:
        ident["data"] = data
    return _normal(ident)


#: keys every stored identity holds (those of :func:`run_identity` but the optional
#: data fingerprint and the settings of :data:`IDENTITY_DEFAULTS`): a stored identity
#: without one of them is malformed, since comparing fewer keys would let a different
#: run pass
_STORED_IDENTITY_KEYS = (*RUN_IDENTITY_KEYS, "lr", "batch_size", "method_spec")


def _complete_identity(ident: dict, config: dict) -> dict:
    """``ident`` with every key of :data:`IDENTITY_DEFAULTS` it lacks, read from the
    record's ``config`` or else the documented default."""
    out = dict(ident)
    for k, default in IDENTITY_DEFAULTS.items():
        out.setdefault(k, config.get(k, default))
    return _normal(out)


def record_identity(rec: dict, where: str | os.PathLike | None = None) -> dict:
    """The identity stored in a metrics record, or the one rebuilt from its fields for
    records written before identities were stored (without the data fingerprint, which
    is then not compared); a key of :data:`IDENTITY_DEFAULTS` it lacks is read from the
    record's ``config``, else with its documented default.

    A record that is not a dict, or whose ``identity`` is not a dict holding every key
    of :func:`run_identity`, raises :class:`ResultFileError` naming ``where`` (the
    file): a record that cannot be compared is refused, never taken as equal."""
    where = "run record" if where is None else str(where)
    if not isinstance(rec, dict):
        raise ResultFileError(
            f"{where}: the record is a {type(rec).__name__}, expected a JSON object"
        )
    c = rec.get("config", {})
    if not isinstance(c, dict):
        raise ResultFileError(
            f"{where}: 'config' is a {type(c).__name__}, expected a JSON object"
        )
    if "identity" in rec:
        ident = rec["identity"]
        if not isinstance(ident, dict):
            raise ResultFileError(
                f"{where}: 'identity' is a {type(ident).__name__} ({ident!r:.60}), "
                "expected a JSON object of the run's settings; the run cannot be "
                "compared with the one asked for"
            )
        missing = [k for k in _STORED_IDENTITY_KEYS if k not in ident]
        if missing:
            raise ResultFileError(
                f"{where}: 'identity' lacks the keys {', '.join(missing)}; the run "
                "cannot be compared with the one asked for"
            )
        return _complete_identity(ident, c)
    ident = {k: c[k] for k in RUN_IDENTITY_KEYS if k in c}
    for k in ("lr", "batch_size", "method_spec"):
        if k in rec:
            ident[k] = rec[k]
    return _complete_identity(ident, c)


def check_existing_run(
    rdir: str | os.PathLike,
    ckpt_path: str | os.PathLike,
    identity: dict,
    force: bool = False,
) -> dict | None:
    """Decide what a CIFAR run may do with what is already in ``rdir`` (and its
    checkpoint).

    Returns the finished record when the run is complete with this identity (skip),
    ``None`` when the run may start or resume. Raises :class:`ConfigMismatchError`
    (naming the directory and the differing keys) when ``rdir/metrics.json`` was written
    with another identity, and when it records epochs of an unfinished run whose
    checkpoint is gone (starting over would overwrite them: the budget-cut records are
    such runs). With ``force`` the old directory and checkpoint are moved to a dated
    backup instead. An unreadable ``metrics.json`` raises
    :class:`~studies.kit.provenance.ResultFileError` naming it (backed up with
    ``force``)."""
    rdir, ckpt_path = Path(rdir), Path(ckpt_path)
    mp = rdir / "metrics.json"
    if not mp.is_file():
        return None

    def move_away(reason: str) -> None:
        log.warning("%s; --force: moving it to a backup", reason)
        backup(rdir)
        if ckpt_path.is_file():
            backup(ckpt_path)

    try:
        rec = read_json(mp)
        old = record_identity(rec, mp)
    except ResultFileError as exc:
        if not force:
            raise
        move_away(str(exc))
        return None
    keys = check_run_record(rdir, old, identity, force)
    if keys:
        move_away(
            f"{rdir} was produced with another configuration "
            f"(differing keys: {', '.join(keys)})"
        )
        return None
    if rec.get("complete"):
        return rec
    if rec.get("epochs") and not ckpt_path.is_file():
        msg = (
            f"{mp} records {len(rec['epochs'])} epoch(s) of an unfinished run "
            f"whose checkpoint {ckpt_path} is missing: starting over would "
            "overwrite them"
        )
        if not force:
            raise ConfigMismatchError(f"{msg}; {FORCE_HINT}")
        move_away(msg)
    return None


def resume_checkpoint(
    ckpt_path: str | os.PathLike,
    identity: dict,
    map_location: Any = None,
    force: bool = False,
    rdir: str | os.PathLike | None = None,
) -> dict | None:
    """The checkpoint of a CIFAR run to resume from, or ``None`` (no checkpoint: start
    afresh).

    A checkpoint that cannot be read, or that was written with another identity, raises
    (naming the file and the differing keys) unless ``force``, which moves it (and the
    run directory ``rdir``, whose record the fresh start would overwrite) to a dated
    backup and returns ``None``."""
    ckpt_path = Path(ckpt_path)
    if not ckpt_path.is_file():
        return None
    try:
        ck = load_checkpoint(ckpt_path, map_location)
        check_run_record(
            ckpt_path,
            record_identity(ck.get("record", {}), ckpt_path),
            identity,
            force=False,
        )
    except (ResultFileError, ConfigMismatchError) as exc:
        if not force:
            raise
        log.warning("%s; --force: moving it to a backup", exc)
        backup(ckpt_path)
        if rdir is not None and Path(rdir).exists():
            backup(rdir)
        return None
    return ck
