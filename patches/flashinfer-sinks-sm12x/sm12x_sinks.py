# Fragments of flashinfer-sinks-sm12x, spliced into vllm/v1/attention/backends/flashinfer.py by
# builder/patch/rules/flashinfer_sinks_sm12x.py. vLLM's code, written at column 0; `$word` is filled
# in from the tree (a `$word` alone on a line: the statement it replaces, kept as it was).
#
# Two layouts: up to 0.24 the builder decides `can_use_trtllm` and FlashInfer's decode picks XQA
# off SM10x by itself; from 0.25 the builder picks the decode kernel (XQA on SM90, trtllm-gen on
# SM10x) and supports_sink() admits SM10x alone.

# === helper ===
def sparkbuild_sm12x_sinks() -> bool:
    """sparkbuild flashinfer-sinks-sm12x: attention sinks through FlashInfer on SM12x.

    FlashInfer's XQA decode kernel serves SM12x and takes sinks, and
    BatchAttentionWithAttentionSinkWrapper prefills with them. Upstream vLLM serves sinks on
    SM12x the same way from the release that has the change linked in the patch.
    """
    capability = current_platform.get_device_capability()
    return capability is not None and capability.major == 12

# === supports-sink ===
# sparkbuild flashinfer-sinks-sm12x: XQA decode and the sink prefill wrapper serve SM12x.
return supports_trtllm_attention() or sparkbuild_sm12x_sinks()

# === supports-sink-family ===
# sparkbuild flashinfer-sinks-sm12x: XQA decode and the sink prefill wrapper serve SM12x.
return sparkbuild_sm12x_sinks()

# === builder ===
# sparkbuild flashinfer-sinks-sm12x: on SM12x, decode through FlashInfer's XQA kernel and
# prefill through BatchAttentionWithAttentionSinkWrapper (bf16/fp16 KV only).
self.sinks_on_sm12x = (
    self.has_sinks
    and not can_use_trtllm
    and sparkbuild_sm12x_sinks()
    and self.num_qo_heads % self.num_kv_heads == 0
    and self.kv_cache_dtype in (torch.float16, torch.bfloat16)
)
if self.sinks_on_sm12x:
    self.use_trtllm_decode_attention = True
if self.has_sinks and not can_use_trtllm and not self.sinks_on_sm12x:

# === builder-xqa ===
# sparkbuild flashinfer-sinks-sm12x: on SM12x, decode through FlashInfer's XQA kernel (as
# SM90 does) and prefill through BatchAttentionWithAttentionSinkWrapper (bf16/fp16 KV, no DCP).
self.sinks_on_sm12x = (
    self.has_sinks
    and sparkbuild_sm12x_sinks()
    and self.dcp_world_size == 1
    and self.num_qo_heads % self.num_kv_heads == 0
    and self.kv_cache_dtype in (torch.float16, torch.bfloat16)
)
if self.sinks_on_sm12x:
    self.use_trtllm_decode_attention = True
    self.flashinfer_trtllm_api_decode_kernel = FlashInferDecodeKernel.XQA
# On SM12x sinks take the path above or none; elsewhere what supports_sink() says.
if self.has_sinks and not self.sinks_on_sm12x and (
    sparkbuild_sm12x_sinks() or not FlashInferBackend.supports_sink()
):

# === build-check ===
# sparkbuild flashinfer-sinks-sm12x: the sink wrapper prefills; decodes must be XQA.
if self.has_sinks and not (self.sinks_on_sm12x and $decode):

# === prefill-wrapper ===
if self.sinks_on_sm12x:  # sparkbuild flashinfer-sinks-sm12x
    self._prefill_wrapper = BatchAttentionWithAttentionSinkWrapper(
        self._get_workspace_buffer(),
        get_kv_cache_layout(),
        backend="fa2",
        q_data_type=$q_dtype,
        kv_data_type=self.kv_cache_dtype,
        head_dim_qk=self.head_dim,
        head_dim_vo=self.head_dim,
        window_left=self.window_left,
    )
else:
    $original

# === prefill-run ===
if isinstance(prefill_wrapper, BatchAttentionWithAttentionSinkWrapper):
    # sparkbuild flashinfer-sinks-sm12x: the AttentionSink variant takes the
    # sinks and its softmax scale as extra arguments.
    prefill_wrapper.run(
        $query,
        $kv_cache,
        self.sinks,
        $sm_scale,
        v_scale=$v_scale,
        out=$out,
    )
else:
    $original

# === decode-layout ===
# sparkbuild flashinfer-sinks-sm12x: XQA reads the cache in the layout given below.
assert get_kv_cache_layout() == "HND" or sparkbuild_sm12x_sinks()

# === decode-kv-layout ===
kv_layout=get_kv_cache_layout(),
