"""The rehearsal's swap for a cluster formed with Ray (tests/verify/test_multi_node_ray.py): a vLLM
platform plugin, installed only in a test image derived from the local CPU image, never shipped.

vLLM's CPU platform does not run under Ray: it names no Ray device (``ray_device_key`` is empty in
``vllm/platforms/cpu.py``, and ``vllm/v1/executor/ray_utils.py`` raises "current platform cpu does not
support ray"), because a CPU server has no device to place ranks on. A Spark's platform is CUDA, whose
Ray device is the GPU. This plugin is vLLM's own CPU platform with two changes, and nothing else:

- its Ray device is "GPU", as CUDA's (each Ray node here declares one GPU, a Spark's one: the test's
  ``ray start --num-gpus 1``), so vLLM's Ray executor places one rank on each node as on two Sparks;
- its communicator asks whether the ranks of a group run at one address (``VLLM_HOST_IP``) before it
  joins them through shared memory: vLLM's CPU communicator compares only a name made from the
  distributed init method, which Ray gives every node alike, and then opens shared memory the other
  node's container does not have ("open shm in SHMManager failed"). On a Spark the ranks talk through
  NCCL, which has no such step.

Loaded through vLLM's ``vllm.platform_plugins`` entry point (the dist-info beside this package).
"""


def register() -> str:
    """vLLM's platform plugin hook: the platform class to use."""
    return "sparkbuild_ray_cpu.platform.RayCpuPlatform"
