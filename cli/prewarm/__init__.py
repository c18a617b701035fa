"""``gdskv prewarm PROMPTS...``: compute the KV of known prompts once, so servers start warm.

Prompt sources: ``.txt`` (one prompt per blank-line-separated paragraph), ``.jsonl`` (one object
per line with ``prompt``, or ``messages`` rendered with the tokenizer's chat template), or a
directory (every ``.txt`` / ``.jsonl`` directly in it, in name order). Each prompt is tokenized and
prefilled (one output token) through an engine with gdskv's connector attached, so its full blocks
land in the store:

- ``reference`` (default, runs anywhere): the CPU reference engine (``gdskv.engine``) driving the
  TensorRT-LLM connector (``gdskv.connectors.trtllm``). Its model is
  ``reference_model_config(vocab)``: deterministic weights, so every process that builds it shares
  the namespace. Without ``--tokenizer`` the text is tokenized by ``ByteTokenizer`` (UTF-8 bytes).
- ``trtllm``: TensorRT-LLM's ``LLM`` with the connector config, ``generate(..., max_tokens=1)``.
- ``vllm``: vLLM's offline ``LLM`` with gdskv's KV connector (``gdskv.connectors.vllm``,
  ``kv_load_failure_policy="recompute"``), ``generate(..., max_tokens=1)``.
- ``max``: Modular MAX's offline ``LLM`` with gdskv's KVConnector installed.

Prompts that cannot run (empty, an empty file, longer than ``--max-prompt-tokens``, unreadable
lines, an engine error) are reported and skipped; the others go on. Exit 1 when any prompt failed.
Progress: a bar on a terminal, else a status line every ``gdskv --status-every`` seconds that
names the blocks the current prompt has written so far (a long prompt shows progress within
seconds).
"""
from gdskv.cli.prewarm.command import check_store, parse_engine_args, prewarm
from gdskv.cli.prewarm.prompts import Prompt, read_prompts
from gdskv.cli.prewarm.reference import reference_model_config, reference_stack
from gdskv.cli.prewarm.runners import StoreDelta
from gdskv.cli.prewarm.tokenizers import ByteTokenizer, HfTokenizer, tokenize

__all__ = ["ByteTokenizer", "HfTokenizer", "Prompt", "StoreDelta", "check_store", "parse_engine_args", "prewarm",
           "read_prompts", "reference_model_config", "reference_stack", "tokenize"]
