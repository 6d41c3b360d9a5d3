"""The engine's defaults that other parts repeat: EngineConfig, `kvserve serve`'s and `kvserve
plan`'s flags, the CRD's schema, the operator's sizing, the router and the simulator all import
them from here. Torch-free (the operator imports it)."""

BLOCK_SIZE = 16  # tokens per KV-cache block
BLOCK_SIZES = (8, 16, 32)  # the block sizes the attention kernels take
MAX_NUM_SEQS = 256  # sequences one step may run (vLLM's default)
GPU_MEMORY_UTILIZATION = 0.9  # share of device memory the engine may use
SWAP_SPACE_GIB = 4.0  # CPU memory (GiB) for swapped-out blocks (a float: --swap-space's type)
MAX_LORA_RANK = 16  # largest adapter rank served
GPUS_PER_NODE = 8  # the most GPUs one replica (one pod, one node) may use
