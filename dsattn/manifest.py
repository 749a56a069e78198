"""A checkpoint step's manifest: the size and sha256 of every file orbax committed, so a
restore can tell the step it saved from one changed on disk since (orbax reads whatever bytes
it finds: flipped bytes restore as wrong weights without an error).

`dsattn-manifest.json` lies in the step directory beside orbax's files (orbax ignores it, and
deletes it with the step). It is written after the commit, to a temporary file renamed into
place, and seals itself: `seal` is the sha256 of its file table, so a garbled manifest is
told from a damaged checkpoint. A step whose save promised a manifest (PROMISE in orbax's
custom metadata, committed with the step) and has none was interrupted between commit and
manifest, or lost it: it does not verify. A step without either was saved by an earlier
dsattn: `verify` returns False and the caller loads it unverified.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "dsattn-manifest.json"
PROMISE = "dsattn_manifest"  # key of orbax's custom_metadata: a manifest follows the commit
_METADATA = "_CHECKPOINT_METADATA"  # orbax's own record of the step, with custom_metadata


class Damaged(Exception):
    """What is wrong with a step, in a few words that name the file."""


def _digest(path: Path) -> str:
    with open(path, "rb") as f:  # hashlib reads in chunks, without the GIL
        return hashlib.file_digest(f, "sha256").hexdigest()


def _seal(files: dict) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def write(step_dir) -> None:
    """Record every file of a committed step in its manifest, atomically (a reader sees the
    whole manifest or none)."""
    step_dir = Path(step_dir)
    files = {p.relative_to(step_dir).as_posix(): {"size": p.stat().st_size,
                                                   "sha256": _digest(p)}
             for p in sorted(step_dir.rglob("*"))
             if p.is_file() and not p.name.startswith(MANIFEST)}
    tmp = step_dir / f"{MANIFEST}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump({"version": 1, "files": files, "seal": _seal(files)}, f, indent=1,
                      sort_keys=True)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the manifest
        os.replace(tmp, step_dir / MANIFEST)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk: no half manifest left beside the step
        raise


def _promised(step_dir: Path) -> bool:
    """Whether the step's save promised a manifest (orbax's metadata says so)."""
    try:
        meta = json.loads((step_dir / _METADATA).read_text())
    except FileNotFoundError:
        return False  # orbax versions without the file: saved before manifests
    except (OSError, ValueError) as e:
        raise Damaged(f"{_METADATA}: unreadable ({type(e).__name__}), and no {MANIFEST}")
    return bool((meta.get("custom_metadata") or {}).get(PROMISE))


def verify(step_dir, items=None) -> bool:
    """True if the step's own files and those of `items` (its item directories; default:
    all) match its manifest. False if it has no manifest because it was saved without one
    (before dsattn wrote them). Damaged, naming the file and what is wrong, otherwise."""
    step_dir = Path(step_dir)
    try:
        record = json.loads((step_dir / MANIFEST).read_text())
        files = record["files"]
        sealed = record["seal"] == _seal(files)
    except FileNotFoundError:
        if _promised(step_dir):
            raise Damaged(f"no manifest ({MANIFEST}), though its save recorded that one "
                          f"follows: deleted, or the save was interrupted before it") from None
        return False
    except OSError as e:
        raise Damaged(f"{MANIFEST}: cannot be read ({type(e).__name__}: {e.strerror})") from None
    except (ValueError, KeyError, TypeError):
        sealed = False
    if not sealed:
        raise Damaged(f"{MANIFEST}: the manifest is garbled (not the one its save wrote)")
    for name, want in sorted(files.items()):
        top = name.split("/")[0]
        if items is not None and "/" in name and top not in items:
            continue  # another item's file: not read by this restore
        path = step_dir / name
        try:
            size = path.stat().st_size
            if size == want["size"]:
                digest = _digest(path)
        except FileNotFoundError:
            raise Damaged(f"{name}: missing") from None
        except OSError as e:
            raise Damaged(f"{name}: cannot be read ({type(e).__name__}: {e.strerror})") from None
        if size < want["size"]:
            raise Damaged(f"{name}: truncated ({size} of {want['size']} bytes)")
        if size != want["size"]:
            raise Damaged(f"{name}: {size} bytes, {want['size']} when saved")
        if digest != want["sha256"]:
            raise Damaged(f"{name}: content differs from when it was saved (sha256)")
    return True
