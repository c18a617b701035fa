"""The reference engine: a tiny paged-attention decoder on CPU that drives a KV cache connector.

It runs the call sequence of TensorRT-LLM's KV Cache Connector spec (chunked prefill,
append-deltas, sliding windows and several layer groups, async loads and saves, simulated tensor
parallelism) so the product can prove without a GPU that KV restored from the store gives
bit-identical logits to KV computed from scratch. It backs ``gdskv demo`` and ``gdskv prewarm``.

    engine = ReferenceEngine(ModelConfig(seed=1), EngineConfig(tokens_per_block=4), scheduler, [worker])
    [result] = engine.generate([prompt], max_new_tokens=8)
"""
from gdskv.engine.config import EngineConfig, ModelConfig
from gdskv.engine.driver import ConnectorError
from gdskv.engine.requests import EngineRequest, GenerationResult, RequestData, SchedulerOutput
from gdskv.engine.runtime import ReferenceEngine

__all__ = [
    "ConnectorError",
    "EngineConfig",
    "EngineRequest",
    "GenerationResult",
    "ModelConfig",
    "ReferenceEngine",
    "RequestData",
    "SchedulerOutput",
]
