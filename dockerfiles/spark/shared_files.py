"""Run in the Spark image (stdlib only): files that two installed distributions both install.

pip installs a wheel's files over whatever is there, and ``pip check`` reads requirements, not files:
a later layer's wheel that ships a file of another distribution's package replaces it silently.
flashinfer-python 0.7.2.post1 ships ``b12x/__init__.py``, a shim that turns ``import b12x`` into
FlashInfer's embedded copy; installed after b12x 1.5.1 (the ``vllm[b12x]`` extra), it left vLLM's
B12X kernels on FlashInfer's copy and b12x's own vLLM plugins unloadable ("No module named
'b12x.integration'") with ``pip check`` green.

A file recorded (RECORD) by two distributions belongs to the one whose name is the file's top-level
package (``b12x/...`` to the distribution ``b12x``); it must hold that owner's bytes.

- ``--restore`` (the runtime stage, after the layer that installs FlashInfer): reinstall, with
  ``--no-deps``, each owner whose file another distribution replaced, from the exact file the
  dependency layer installed (its URL and sha256 in that layer's pip report);
- ``--check`` (and ``check()`` for check_image.py): fail naming each file, its owner and who
  replaced it.
"""

import base64
import hashlib
import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys
import tempfile


def _name(text):
    return re.sub(r"[-_.]+", "_", text).lower()


def _digest(path):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()


def _claims():
    """Every RECORD entry with a hash: path -> [(distribution, version, recorded hash, installed file)]."""
    claims = {}
    for dist in importlib.metadata.distributions():
        for entry in dist.files or ():
            if entry.hash is None or entry.hash.mode != "sha256":
                continue
            recorded = f"sha256={entry.hash.value}"
            claims.setdefault(str(entry), []).append((dist.metadata["Name"], dist.version, recorded, entry.locate()))
    return claims


def replaced(claims):
    """(path, owner, owner's version, the distribution whose bytes are there or None) for each file
    two distributions record (``claims``) where the owner's bytes are not installed."""
    found = []
    for path, owners in sorted(claims.items()):
        if len({name for name, _, _, _ in owners}) < 2:
            continue
        top = _name(path.split("/", 1)[0])
        owner = next((o for o in owners if _name(o[0]) == top), None)
        if owner is None:
            continue  # no distribution is named after the package: nothing says whose file it is
        name, version, recorded, located = owner
        installed = _digest(pathlib.Path(located)) if pathlib.Path(located).is_file() else None
        if installed == recorded:
            continue
        by = next((o[0] for o in owners if o[0] != name and o[2] == installed), None)
        found.append((path, name, version, by))
    return found


def check():
    """The shared files, each with its owner; raises naming every file an owner lost."""
    claims = _claims()
    lost = replaced(claims)
    if lost:
        said = "; ".join(f"{p} is {by or 'nobody'}'s, not its owner {n} {v}'s" for p, n, v, by in lost)
        raise RuntimeError(
            f"{said}: a later install replaced another distribution's file (pip check does not see it); "
            "the runtime stage restores owners after FlashInfer's layer (shared_files.py --restore)"
        )
    shared = [p for p, owners in claims.items() if len({o[0] for o in owners}) > 1]
    return {"shared": sorted(shared), "replaced": []}


def _archive_hash(reports, name, version):
    """The sha256 of the file pip installed ``name`` ``version`` from, per the layers' pip reports."""
    for report in reports:
        data = json.loads(pathlib.Path(report).read_text())
        for item in data.get("install", ()):
            meta = item.get("metadata", {})
            if _name(meta.get("name", "")) == _name(name) and meta.get("version") == version:
                hashes = item.get("download_info", {}).get("archive_info", {}).get("hashes", {})
                if "sha256" in hashes:
                    return hashes["sha256"]
    sys.exit(f"shared_files: no pip report says which file {name} {version} came from ({', '.join(reports)})")


def restore(reports):
    """Reinstall each owner another distribution's wheel overwrote, from the same file (by its sha256)."""
    owners = sorted({(name, version) for _, name, version, _ in replaced(_claims())})
    for name, version in owners:
        digest = _archive_hash(reports, name, version)
        # Removed after pip ran: nothing of the step's own stays in the layer (two builds, the same bytes).
        with tempfile.TemporaryDirectory() as folder:
            pinned = pathlib.Path(folder) / "pinned.txt"
            pinned.write_text(f"{name}=={version} --hash=sha256:{digest}\n")
            command = [sys.executable, "-m", "pip", "install", "--progress-bar", "off", "--no-deps", "--force-reinstall"]
            command += ["--require-hashes", "--requirement", str(pinned)]
            print("+ " + " ".join(command) + f"  ({name}=={version} --hash=sha256:{digest})", flush=True)
            subprocess.run(command, check=True)
    check()
    print(f"shared_files: {len(owners)} owner(s) restored: {', '.join(f'{n} {v}' for n, v in owners) or 'none'}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--restore"] and len(sys.argv) > 2:
        restore(sys.argv[2:])
    elif sys.argv[1:] == ["--check"]:
        print(json.dumps(check()))
    else:
        sys.exit("usage: shared_files.py --restore PIP_REPORT.json... | --check")
