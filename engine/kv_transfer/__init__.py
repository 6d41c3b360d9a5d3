"""KV transfer between replicas (vLLM v1's kv_transfer): the connector interface
(`base.KVConnectorBase_V1`), its configuration (`config.KVTransferConfig`), the factory that picks
a connector by name or module path, and the built-in `KVServeConnector` (blocks pulled over TCP
from a prefill replica by a decode replica)."""
