"""A seeded mutator over the shipped matrix, a lock file and a patch folder: every mutation ends in
exit 0 or exit 2, never a traceback, and within a time bound (a hang is a failure).

Mutations are of text (lines deleted, doubled, swapped or re-indented; a value swapped for a
hostile one; bytes inserted; the file cut short), of JSON structure (a value replaced by a list,
null, a number, deep nesting or a long string) and of a patch folder (patch.yaml broken the same
ways, removed or made a folder, symlinks out, junk files). The seed is fixed, so a failure repeats.
"""

from __future__ import annotations

import json
import random
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.support import ROOT
from tests.support.cli import Outcome
from tests.support.cli import in_process as sparkbuild

SEED = 17
CASES = {"matrix": 200, "lock": 100, "patch folder": 100}
# Generous: the slowest real input here plans in well under a second; only a hang comes near it.
SECONDS = 20

HOSTILE = [
    "!!int abc",
    "!!float x",
    "!custom x",
    "!!timestamp 2026-99-99",
    "&a [*a]",
    '"a\\nRUN id"',
    "'x\" ; rm -rf /'",
    "null",
    "[]",
    "{}",
    "1e999",
    "9" * 5000,
    "-1",
    "true",
    "2026-01-01",
    "../../etc",
    "/etc",
    "vllm-é",
    "x" * 300,
    "'{vllm_version'",
    "'{date!z}'",
    "'{date:%}'",
    "[" * 200 + "]" * 200,
    "\u2028",
    "'$(id)'",
    "`id`",
    "{a: {b: {c: {d: 1}}}}",
    "*undefined",
    "<<: *a",
]
BYTES = [b"\xff", b"\x00", b"\x1b", b"\t", b"\r", b"\xc3", b"\xe2\x80\xa8", b"{", b"[", b":", b"&", b"*", b"!"]


def mutate_text(rng: random.Random, data: bytes) -> bytes:
    """One to three text mutations of a YAML or JSON document."""
    for _ in range(rng.randint(1, 3)):
        lines = data.split(b"\n")
        i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
        kind = rng.randrange(8)
        if kind == 0:
            del lines[i]
        elif kind == 1:
            lines.insert(i, lines[j])
        elif kind == 2:
            lines[i], lines[j] = lines[j], lines[i]
        elif kind == 3:
            lines[i] = b" " * rng.choice([0, 1, 3, 7]) + lines[i].lstrip()
        elif kind == 4 and b":" in lines[i]:
            key = lines[i].split(b":", 1)[0]
            lines[i] = key + b": " + rng.choice(HOSTILE).encode()
        elif kind == 5:
            at = rng.randrange(len(lines[i]) + 1)
            lines[i] = lines[i][:at] + rng.choice(BYTES) + lines[i][at:]
        elif kind == 6:
            data = b"\n".join(lines)
            lines = data[: rng.randrange(len(data) + 1)].split(b"\n")
        else:
            lines.insert(i, b"bomb: &b0 [x, x, x, x, x, x, x, x, x, x]")
            lines[i + 1 : i + 1] = [f"b{k}: &b{k} [{', '.join([f'*b{k - 1}'] * 10)}]".encode() for k in range(1, 8)]
        data = b"\n".join(lines)
    return data


def mutate_json(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """The same document with one value somewhere replaced by something of another shape."""
    if isinstance(value, dict) and value and (depth == 0 or rng.random() < 0.7):
        key = rng.choice(sorted(value))
        return {**value, key: mutate_json(rng, value[key], depth + 1)}
    return rng.choice(
        [
            [],
            None,
            17,
            "abc",
            {"x": None},
            [[[[[[[[[[]]]]]]]]]],
            "x" * 100_000,
            {"v0.33.0": "0" * 39},
            {"": "sha256:" + "a" * 64},
            True,
        ]
    )


def classify(outcome: Outcome, what: str) -> int:
    assert outcome.code in (0, 2), f"{what}: exit {outcome.code}\n{outcome.err[-3000:]}"
    assert "Traceback" not in outcome.err, f"{what}\n{outcome.err[-3000:]}"
    if outcome.code == 2:
        assert outcome.err.startswith("error: ") or "\nerror: " in outcome.err, outcome.err[-2000:]
    return outcome.code


@pytest.fixture
def workspace(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "patches", tmp_path / "patches")
    return tmp_path


def test_mutations_of_the_shipped_matrix(workspace: Path) -> None:
    rng = random.Random(SEED)
    shipped = (ROOT / "matrix.yaml").read_bytes()
    outcomes: Counter[int] = Counter()
    for case in range(CASES["matrix"]):
        path = workspace / "matrix.yaml"
        path.write_bytes(mutate_text(rng, shipped))
        outcomes[classify(sparkbuild("plan", "--matrix", str(path), seconds=SECONDS), f"matrix case {case}")] += 1
    print(f"fuzz matrix: {CASES['matrix']} cases, exit 0: {outcomes[0]}, exit 2: {outcomes[2]}")
    assert outcomes[2] > CASES["matrix"] // 4  # the mutator does break things


def test_mutations_of_a_lock_file(workspace: Path) -> None:
    rng = random.Random(SEED)
    (workspace / "matrix.yaml").write_bytes((ROOT / "matrix.yaml").read_bytes())
    lock = {
        "format": 1,
        "resolved_at": "2026-11-21T01:17:00Z",
        "git": {
            "https://github.com/vllm-project/vllm.git": {"v0.33.0": "1" * 40},
            "https://github.com/NVIDIA/cutlass.git": {"v4.7.1": "2" * 40},
            "https://github.com/flashinfer-ai/flashinfer.git": {"v0.7.2.post1": "3" * 40},
        },
        "images": {"nvidia/cuda:13.0.2-devel-ubuntu24.04": "sha256:" + "4" * 64},
    }
    outcomes: Counter[int] = Counter()
    for case in range(CASES["lock"]):
        text = json.dumps(mutate_json(rng, lock)).encode() if case % 2 else mutate_text(rng, json.dumps(lock, indent=2).encode())
        path = workspace / "matrix.lock.json"
        path.write_bytes(text)
        outcome = sparkbuild("plan", "--matrix", str(workspace / "matrix.yaml"), "--lock", str(path), seconds=SECONDS)
        outcomes[classify(outcome, f"lock case {case}")] += 1
    print(f"fuzz lock: {CASES['lock']} cases, exit 0: {outcomes[0]}, exit 2: {outcomes[2]}")
    assert outcomes[0] and outcomes[2]


def break_folder(rng: random.Random, folder: Path) -> None:
    """One structural break of a patch folder, or a text mutation of its patch.yaml."""
    meta = folder / "patch.yaml"
    kind = rng.randrange(10)
    if kind == 0:
        meta.unlink()
    elif kind == 1:
        meta.unlink()
        meta.mkdir()
    elif kind == 2:
        (folder / "leak").symlink_to(rng.choice(["/etc/passwd", "../../..", "/dev/zero"]))
    elif kind == 3:
        (folder.parent / "stray").mkdir(exist_ok=True)
    elif kind == 4:
        (folder / "junk.bin").write_bytes(bytes(rng.randrange(256) for _ in range(512)))
    else:
        meta.write_bytes(mutate_text(rng, meta.read_bytes()))


def test_mutations_of_a_patch_folder(workspace: Path) -> None:
    rng = random.Random(SEED)
    matrix = (ROOT / "matrix.yaml").read_text()
    (workspace / "matrix.yaml").write_text(f"patches_dir: {workspace / 'patches'}\n{matrix}")
    tree = workspace / "tree"
    (tree / "csrc").mkdir(parents=True)
    (tree / "CMakeLists.txt").write_text('set(CUDA_SUPPORTED_ARCHS "7.0;8.0;9.0;10.0;12.0")\n')
    pristine = workspace / "pristine"
    shutil.copytree(workspace / "patches", pristine)
    outcomes: Counter[int] = Counter()
    for case in range(CASES["patch folder"]):
        shutil.rmtree(workspace / "patches")
        shutil.copytree(pristine, workspace / "patches", symlinks=True)
        break_folder(rng, workspace / "patches" / rng.choice(["cmake-arch-sm121", "e2m1-software"]))
        planned = sparkbuild("plan", "--matrix", str(workspace / "matrix.yaml"), seconds=SECONDS)
        outcomes[classify(planned, f"patch case {case} (plan)")] += 1
        patches = str(workspace / "patches")
        checked = sparkbuild(
            "patch", "check", "--source", str(tree), "--as-version", "0.33.0", "--patches", patches, seconds=SECONDS
        )
        outcomes[classify(checked, f"patch case {case} (patch check)")] += 1
    print(f"fuzz patch folder: {CASES['patch folder']} cases x 2 commands, exit 0: {outcomes[0]}, exit 2: {outcomes[2]}")
    assert outcomes[2] > CASES["patch folder"] // 2
