"""vLLM's CPU communicator, joining ranks through shared memory only where they share a machine."""

import os

import torch
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator


class NodeAwareCpuCommunicator(CpuCommunicator):  # type: ignore[misc]
    def _all_group_ranks_share_shm_group_name(self) -> bool:
        hosts = [""] * self.world_size
        torch.distributed.all_gather_object(hosts, os.environ.get("VLLM_HOST_IP", ""), group=self.device_group)
        return len(set(hosts)) == 1 and bool(super()._all_group_ranks_share_shm_group_name())
