# Fragment of mxfp4-cutlass-sm12x for vLLM 0.20.0 - 0.23.0, where CutlassExpertsMxfp4 gates itself in
# Python (vllm/model_executor/layers/fused_moe/experts/cutlass_moe.py); later versions ask the C++
# gate in mxfp4_experts_quant.cu. vLLM's code, not sparkbuild's.

# === supports-current-device ===
# sparkbuild mxfp4-cutlass-sm12x: 120-129 run the SM120 grouped GEMM.
return p.is_cuda() and (
    p.is_device_capability_family(100) or p.is_device_capability_family(120)
)
