def sparkbuild_sm12x_sinks() -> bool:
    """sparkbuild flashinfer-sinks-sm12x: attention sinks through FlashInfer on SM12x.

    FlashInfer's trtllm_batch_decode_with_kv_cache picks its XQA kernel off SM10x, and XQA takes
    sinks; BatchAttentionWithAttentionSinkWrapper prefills with them. Upstream vLLM serves sinks on
    SM12x the same way from the release that has the change linked in the patch.
    """
    capability = current_platform.get_device_capability()
    return capability is not None and capability.major == 12
