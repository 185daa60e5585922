"""The engine's settings (k3_lm parameters, SERVING.md §4.4), validated once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int = 256  # most sequences in one step
    max_model_len: int = 131072  # prompt + output
    max_num_batched_tokens: int = 8192  # tokens per step, decode tokens included (chunked prefill beyond it)
    max_queued_requests: int = 0  # 0 = no limit; beyond it add() raises Unavailable
    step_timeout_s: float = 300.0  # a step running longer fails the engine ([HLT-7])
    stop_tombstone_ttl_s: float = 30.0  # how long an unmatched stop id is remembered ([CAN-7])
    prefix_caching: bool = True
    # Tokens between KDA prefix snapshots (a multiple of block_size): a smaller interval lets prompts that
    # share only a beginning reuse more of it, and takes more snapshot slots. Points a whole number of
    # 64-token KDA chunks into a chunk are taken inside it; others end the chunk (scheduler.py).
    snapshot_interval: int = 1024
    block_size: int = 64  # tokens per MLA latent block
    gpu_memory_utilization: float = 0.90  # of the GPU's total memory, for weights, cache and workspace
    cpu_cache_gb: float = 4.0  # MLA blocks + KDA slots on a CPU
    # Schedule step N+1 while step N runs on the GPU (its drawn ids stay there as N+1's decode inputs), so
    # the host's per-step work hides behind the device's; steps with penalty or bad-word rows still wait.
    async_scheduling: bool = True
    # While requests decode, the prompts longer than a prefill step measured at start-up to run in this
    # many ms take only that many tokens a step, so their chunks hold back the decoding requests' next
    # tokens by about that much; shorter prompts go whole. 0: no bound but the step budget. Only where
    # steps are measured (CUDA graphs on a GPU). On the H200 at `small`, 40 ms bounds long prompts' ITL
    # p99 to 36 ms (107 without) at 15 % of their throughput, other loads unchanged (docs/parameters.md).
    decode_stall_ms: float = 40.0
    # While requests decode, new prompts wait up to this long so that several are prefilled in one step,
    # whose fixed cost (~6 ms at `small` on an H200) is then paid once; 0: admitted at once.
    max_prefill_delay_ms: float = 0.0
    enforce_eager: bool = False  # True: no CUDA graphs (decode steps, single-sequence prefill chunks; ENGINE.md §7)
    num_blocks: int | None = None  # fixed pool sizes instead (tests): both or neither
    num_slots: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_model_len", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_queued_requests < 0:
            raise ValueError(f"EngineConfig.max_queued_requests must be >= 0, got {self.max_queued_requests}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"EngineConfig.step_timeout_s must be > 0, got {self.step_timeout_s}")
        if not self.stop_tombstone_ttl_s >= 0:
            raise ValueError(f"EngineConfig.stop_tombstone_ttl_s must be >= 0, got {self.stop_tombstone_ttl_s}")
        if self.snapshot_interval < self.block_size or self.snapshot_interval % self.block_size:
            raise ValueError(f"EngineConfig.snapshot_interval {self.snapshot_interval} must be a multiple of "
                             f"block_size {self.block_size}")
        if not self.max_prefill_delay_ms >= 0:
            raise ValueError(f"EngineConfig.max_prefill_delay_ms must be >= 0, got {self.max_prefill_delay_ms}")
        if not self.decode_stall_ms >= 0:
            raise ValueError(f"EngineConfig.decode_stall_ms must be >= 0, got {self.decode_stall_ms}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"EngineConfig.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if (self.num_blocks is None) != (self.num_slots is None):
            raise ValueError("EngineConfig.num_blocks and num_slots are set together")
