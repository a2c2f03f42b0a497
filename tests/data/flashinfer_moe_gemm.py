"""Compile, as FlashInfer's own JIT would on a GB10, the grouped GEMM gpt-oss's MoE runs on there
(FlashInfer's CUTLASS fused MoE, MXFP8 activations x MXFP4 weights), one instantiation of it.

Run inside an image with FlashInfer and its JIT's nvcc: ``python3 flashinfer_moe_gemm.py OUT
[--gencode FLAG]``. FlashInfer reads the GPU's capability from torch; there is no GPU here, so
``FLASHINFER_CUDA_ARCH_LIST=12.1`` says what a GB10 reports (FlashInfer's own setting for that). The
module is FlashInfer's ``gen_cutlass_fused_moe_sm120_module()`` (the one its CUTLASS MoE loads on
SM120/SM121), its sources generated and its ninja file written by FlashInfer itself; the compile is
that ninja file's own command for the generated file holding the SM120 FP8 x FP4 (MXFPX) instantiations,
with two changes, said here: the source is a copy of that file with only the bfloat16-output
instantiation kept (one of the eight, to bound the compile), and the object goes to OUT.
``--gencode`` replaces FlashInfer's ``-gencode`` (a build for another target, to show what it would
hold). Prints one JSON object: FlashInfer's version, the instantiation, the command, the object.
Standard library and FlashInfer only.
"""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

INSTANTIATION = re.compile(
    r"#if defined\(ENABLE_FP8\) && defined\(ENABLE_FP4\)\n\s*INSTANTIATE_TMA_WARP_SPECIALIZED_MOE_GEMM\(Sm120, "
    r"__nv_fp8_e4m3, SafeFP4, __nv_bfloat16,.*?#endif\n",
    re.S,
)


def main() -> None:
    out = Path(sys.argv[1])
    gencode = sys.argv[sys.argv.index("--gencode") + 1] if "--gencode" in sys.argv else None
    os.environ["FLASHINFER_CUDA_ARCH_LIST"] = "12.1"
    import flashinfer  # type: ignore[import-not-found]  # the image's
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm120_module  # type: ignore[import-not-found]

    spec = gen_cutlass_fused_moe_sm120_module()
    spec.write_ninja()
    generated = [Path(s) for s in spec.sources if "gemm_grouped_sm120" in str(s)]
    source = next(s for s in sorted(generated) if INSTANTIATION.search(s.read_text()))
    text = source.read_text()
    kept = INSTANTIATION.search(text)
    assert kept is not None
    first, last = text.index("#if defined"), text.rindex("#endif") + len("#endif")
    trimmed = out / source.name
    trimmed.write_text(text[:first] + kept.group(0) + text[last:])
    # The ninja file's own command for that object ("build OBJ: cuda_compile SRC").
    stem = source.name.removesuffix(".cu")
    built = [ln.split()[1].rstrip(":") for ln in spec.ninja_path.read_text().splitlines() if ln.startswith("build ")]
    (obj,) = [b for b in built if stem in b and b.endswith(".o")]
    asked = ["ninja", "-f", str(spec.ninja_path), "-t", "commands", obj]
    listed = subprocess.run(asked, capture_output=True, text=True, check=True)
    command = shlex.split(listed.stdout.strip().splitlines()[-1])
    command = [str(trimmed) if a == str(source) else str(out / "gemm.o") if a == obj else a for a in command]
    if gencode is not None:
        command = [f"-gencode={gencode}" if a.startswith("-gencode=") else a for a in command]
    command = [a for a in command if a not in ("--generate-dependencies-with-compile", "-MF") and not a.endswith(".o.d")]
    subprocess.run(command, check=True, cwd=spec.build_dir if spec.build_dir.is_dir() else out)
    print(json.dumps({
        "flashinfer": flashinfer.__version__,
        "instantiation": " ".join(kept.group(0).split("\n", 1)[1].rsplit("#endif", 1)[0].split()),
        "command": command,
        "object": str(out / "gemm.o"),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
