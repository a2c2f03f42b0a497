"""A check model's making, cut short, for comparing machines: ``python short_making.py STEPS``.

Trains each trained recipe (the dense ``alphabet``, ``moe-alphabet``, ``gptoss-mxfp4``) for STEPS steps
(its fault phase from half of them, as in the full making) with sparkbuild's own code, writes gpt-oss's
MXFP4 checkpoint, reads the check prompts' logprobs in float32 and in bf16 (what the proof's reference
and its bf16 variant compute), and prints a sha256 of each as JSON. Run it in a process whose
environment holds the making's pins (tests/models/test_arithmetic.py), or not, to see what they do: a
difference in the last bit of any product changes these digests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from sparkbuild.models import making, model, training
from sparkbuild.models.moe import mxfp4, recipe, reference, trained


def digest(tensors: dict[str, Any]) -> str:
    h = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        h.update(name.encode())
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def readings(net: Any, fast: Any, r: recipe.MoeRecipe) -> dict[str, str]:
    torch, _ = training.libs()
    out = {}
    for dtype in ("float32", "bfloat16"):
        got = reference.read(reference.Loaded(net=net.to(getattr(torch, dtype)), fast=fast, loader=dtype), r.task())
        out[f"reading_{dtype}"] = hashlib.sha256(json.dumps([got.expected, got.margin]).encode()).hexdigest()[:16]
    net.to(torch.float32)
    return out


def main(steps: int) -> dict[str, Any]:
    torch, _ = training.libs()
    if sys.argv[2:] == ["pinned"]:
        making.pin_torch()
    found: dict[str, Any] = {"capability": torch.backends.cpu.get_cpu_capability(), "mkldnn": torch.backends.mkldnn.enabled}
    with tempfile.TemporaryDirectory() as tmp:
        dense, _, _ = model.train(dataclasses.replace(model.RECIPES["alphabet"], steps=steps))
        found["alphabet"] = digest(dense.state_dict())
        for name in ("moe-alphabet", "gptoss-mxfp4"):
            r = dataclasses.replace(recipe.RECIPES[name], steps=steps)
            net, fast = trained.train(r)
            found[name] = {"weights": digest(net.state_dict()), **readings(net, fast, r)}
            if r.scheme == "mxfp4":
                mxfp4.write(net, fast, Path(tmp) / name)
                found[name]["checkpoint"] = hashlib.sha256((Path(tmp) / name / "model.safetensors").read_bytes()).hexdigest()[:16]
    return found


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
