"""Prewarm runners for engines in processes of their own: TensorRT-LLM's and vLLM's offline
``LLM``, Modular MAX's, each with gdskv's connector; a missing engine is a usage problem."""
from __future__ import annotations

import os
from typing import Any, Optional

from gdskv.cli._common import UsageProblem
from gdskv.cli.prewarm.prompts import Prompt
from gdskv.cli.prewarm.runners import ExternalRunner, Outcome, StoreDelta
from gdskv.cli.prewarm.tokenizers import HfTokenizer, tokenize
from gdskv.config import GdsKvConfig


ENGINE_MODULES = {"trtllm": "tensorrt_llm", "vllm": "vllm", "max": "max"}
"""The module each external engine's runner imports."""
ENGINE_NAMES = {"trtllm": "TensorRT-LLM", "vllm": "vLLM", "max": "Modular MAX"}


def missing_engine(engine: str) -> UsageProblem:
    """The usage problem of ``--engine`` naming an engine this Python does not have: asked by
    ``prewarm`` before it makes the store, and by each runner where the import still fails."""
    return UsageProblem(f"--engine {engine} needs {ENGINE_NAMES[engine]} ({ENGINE_MODULES[engine]} does not import in this Python)")


class TrtllmRunner(ExternalRunner):
    """TensorRT-LLM's LLM API with gdskv's connector (needs ``tensorrt_llm``)."""

    def __init__(self, cfg: GdsKvConfig, model: str, tokenizer: Optional[str], max_tokens: int,
                 engine_args: dict[str, Any]) -> None:
        try:
            from tensorrt_llm import LLM, SamplingParams
            from tensorrt_llm.llmapi.llm_args import KvCacheConfig, KvCacheConnectorConfig
        except ImportError:
            raise missing_engine("trtllm") from None
        os.environ["GDSKV_STORE"] = cfg.store_path
        self.params = SamplingParams(max_tokens=1)
        self.llm = LLM(model=model, tokenizer=tokenizer, kv_cache_config=KvCacheConfig(enable_block_reuse=True),
                       kv_connector_config=KvCacheConnectorConfig(connector_module="gdskv.connectors.trtllm",
                                                                  connector_scheduler_class="GdsKvScheduler",
                                                                  connector_worker_class="GdsKvWorker"),
                       **engine_args)
        self.tok = HfTokenizer(self.llm.tokenizer)
        self.max_tokens = max_tokens
        self.delta = StoreDelta(cfg)

    def run(self, prompt: Prompt) -> Outcome:
        ids = tokenize(self.tok, prompt, self.max_tokens)
        self.llm.generate([ids], self.params)
        return Outcome()

    def stop(self) -> None:
        self.llm.shutdown()


class MaxRunner(ExternalRunner):
    """Modular MAX's offline ``LLM`` with gdskv's KVConnector installed (needs ``max``), watched
    so that an engine that stops fails the run instead of hanging it (``OfflineLlm``)."""

    def __init__(self, cfg: GdsKvConfig, model: str, max_tokens: int, engine_args: dict[str, Any]) -> None:
        from gdskv.connectors.max.interpreter import workers_run_this_python

        workers_run_this_python()
        try:
            from max.pipelines.lib import PipelineArgs
        except ImportError:
            raise missing_engine("max") from None
        from gdskv.connectors.max import ENV_HOOK, ENV_MODEL, install
        from gdskv.connectors.max.offline import OfflineLlm

        os.environ["GDSKV_STORE"] = cfg.store_path
        os.environ.setdefault(ENV_MODEL, os.path.abspath(model) if os.path.isdir(model) else model)
        os.environ[ENV_HOOK] = "1"  # MAX's spawned model worker installs the hook too (gdskv.cli.main)
        install()
        self.llm = OfflineLlm(PipelineArgs.from_flat_kwargs(model_path=model, kv_connector_config={"type": "rust_tiered"},
                                                            **engine_args))
        self.hf: Optional[HfTokenizer] = None
        self.model, self.max_tokens = model, max_tokens
        self.delta = StoreDelta(cfg)

    def run(self, prompt: Prompt) -> Outcome:
        if prompt.error:
            raise ValueError(prompt.error)
        if prompt.messages is not None:
            self.hf = self.hf or HfTokenizer.load(self.model)
            text = self.hf.render_chat_text(prompt.messages)
        else:
            text = prompt.text or ""
        if not text.strip():
            raise ValueError("empty prompt")
        # MAX offloads the blocks a step committed at its next step: one token would end the
        # request before its prompt's blocks are written.
        self.llm.generate([text], max_new_tokens=2)
        return Outcome()

    def stop(self) -> None:
        self.llm.close()


class VllmRunner(ExternalRunner):
    """vLLM's offline ``LLM`` with gdskv's KV connector (needs ``vllm``): the kv-transfer-config
    of docs/vllm.md, ``kv_load_failure_policy="recompute"`` included. vLLM's own prefix cache stays
    on (a prompt repeated within the run is served from the device); the connector saves every
    full block it computes. The store's path reaches vLLM's workers in
    ``kv_connector_extra_config``, the rest of gdskv's config as every server gets it."""

    def __init__(self, cfg: GdsKvConfig, model: str, tokenizer: Optional[str], max_tokens: int,
                 engine_args: dict[str, Any]) -> None:
        try:
            from vllm import LLM, SamplingParams
            from vllm.config import KVTransferConfig
        except ImportError:
            raise missing_engine("vllm") from None
        self.params = SamplingParams(max_tokens=1)
        self.llm = LLM(model=model, tokenizer=tokenizer, kv_transfer_config=KVTransferConfig(
            kv_connector="GdsKvConnector", kv_connector_module_path="gdskv.connectors.vllm", kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config={"store_path": cfg.store_path}),
            **engine_args)
        self.tok = HfTokenizer(self.llm.get_tokenizer())
        self.max_tokens = max_tokens
        self.delta = StoreDelta(cfg)

    def run(self, prompt: Prompt) -> Outcome:
        ids = tokenize(self.tok, prompt, self.max_tokens)
        self.llm.generate([{"prompt_token_ids": ids}], self.params, use_tqdm=False)
        return Outcome()

    def stop(self) -> None:
        del self.llm
