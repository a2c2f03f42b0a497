"""Run inside a derived local image at build time: break one line of vLLM's CPU path on purpose.

``python3 break_vllm.py WHERE FAULT``: WHERE is ``moe`` (after the experts' kernel call, whose output
is the MoE layer's) or ``attention`` (before the CPU attention backend returns what its kernel wrote);
FAULT is one Python statement on ``output``. Fails the build where vLLM moved the line, so a fault
never silently becomes no fault. A test tool (tests/integration/test_broken_kernels.py), standard
library only.
"""

import sys
import sysconfig
from pathlib import Path

where, fault = sys.argv[1], sys.argv[2]
site = Path(sysconfig.get_paths()["purelib"]) / "vllm"
files = {
    "moe": site / "model_executor/layers/fused_moe/experts/cpu_moe.py",
    "attention": site / "v1/attention/backends/cpu_attn.py",
}
# (the text the fault goes after, the text it goes before)
anchors = {
    "moe": ("            apply_router_weight_on_input,\n        )\n", "\n\nclass X86CPUUnquantizedExperts"),
    "attention": (
        "            kv_cache_dtype=self.kv_cache_dtype,\n        )\n\n",
        "        return output\n\n    def do_kv_cache_update",
    ),
}
path = files[where]
after, before = anchors[where]
text = path.read_text()
if text.count(after + before) != 1:
    sys.exit(f"{path}: the line to break is not there once; this vLLM moved it")
path.write_text(text.replace(after + before, after + "        " + fault + "\n" + before))
print(f"{path}: {fault}")
