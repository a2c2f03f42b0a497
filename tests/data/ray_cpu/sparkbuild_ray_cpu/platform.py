"""vLLM's CPU platform with a Ray device (the package's docstring says why)."""

from vllm.platforms.cpu import CpuPlatform


class RayCpuPlatform(CpuPlatform):  # type: ignore[misc]
    ray_device_key = "GPU"

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "sparkbuild_ray_cpu.communicator.NodeAwareCpuCommunicator"
