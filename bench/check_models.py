"""The attention-only ablation of the MoE check models' task (docs/check-models.md).

Reproduce with:  .venv/bin/python bench/check_models.py [--out bench/results/check-models.json]

For each MoE recipe that trains its own model (moe-alphabet: Qwen3-MoE; gptoss-mxfp4: gpt-oss), trains the
check model and its attention-only twin, the same recipe with every expert's output zeroed throughout
training (so nothing but attention, embeddings and norms can learn), and reports for each the share of
answer letters right on 512 held-out chains and on the check prompts, with the expected letters fed back.
The check model is also read with its experts zeroed (the ablation the making proves on every model).
Minutes on 2 cores; the numbers are accuracies, not timings, and depend on no machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sparkbuild.models import moe, training  # noqa: E402
from sparkbuild.models.moe import reference, trained  # noqa: E402
from sparkbuild.models.moe.recipe import MoeRecipe  # noqa: E402
from sparkbuild.models.moe.task import Encoder  # noqa: E402


def accuracy(r: MoeRecipe, net: Any, fast: Any, *, zeroed: bool = False) -> dict[str, float]:
    torch, _ = training.libs()
    task = r.task()
    ids = Encoder(task, fast)(task.sample(512, torch.Generator().manual_seed(999)))
    prompts = torch.tensor([fast.encode(p + a) for p, a in task.check_prompts()])
    handles = [m.register_forward_hook(lambda _m, _i, out: out * 0) for m in reference.experts(net)] if zeroed else []
    try:
        with torch.no_grad():
            held = net(input_ids=ids).logits[:, task.far - 1 : -1].argmax(-1) == ids[:, task.far :]
            cut = prompts.shape[1] - task.answer
            checks = net(input_ids=prompts).logits[:, cut - 1 : -1].argmax(-1) == prompts[:, cut:]
    finally:
        for handle in handles:
            handle.remove()
    return {
        "held_out_letters": round(float(held.float().mean()), 4),
        "check_answer_letters": round(float(checks.float().mean()), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "check-models.json")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    for name in ("moe-alphabet", "gptoss-mxfp4"):
        r = moe.RECIPES[name]
        net, fast = trained.train(r)
        twin, twin_fast = trained.train(r, attention_only=True)
        results[name] = {
            "arch": r.arch,
            "task": r.task().describe(),
            "steps": r.steps,
            "check_model": accuracy(r, net, fast),
            "check_model_experts_zeroed": accuracy(r, net, fast, zeroed=True),
            "attention_only_twin": accuracy(r, twin, twin_fast, zeroed=True),
        }
        print(json.dumps({name: results[name]}, indent=2), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
