"""gdskv as a vLLM (V1) KV connector: ``GdsKvConnector``.

Attach with::

    --kv-transfer-config '{"kv_connector":"GdsKvConnector",
                           "kv_connector_module_path":"gdskv.connectors.vllm",
                           "kv_role":"kv_both","kv_load_failure_policy":"recompute"}'

Store settings come from gdskv's own config (``GDSKV_CONFIG`` / ``GDSKV_STORE``), optionally
overridden by ``kv_connector_extra_config`` (e.g. ``{"store_path": "/mnt/nvme/kv"}``).

vLLM is imported only when ``GdsKvConnector`` is used, so this package imports where vLLM is not
installed. The parts: ``translate`` (vLLM's config, tensors and step objects as gdskv's types),
``scheduler`` and ``worker`` (the two roles over ``gdskv.service.KvService``), ``connector``
(the ``KVConnectorBase_V1`` subclass that delegates to them). See docs/vllm.md.
"""
from __future__ import annotations

from typing import Any

__all__ = ["GdsKvConnector"]


def __getattr__(name: str) -> Any:
    if name == "GdsKvConnector":
        from gdskv.connectors.vllm.connector import GdsKvConnector

        return GdsKvConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
