"""gdskv: a persistent KV-cache store for LLM serving (Zarr on NVMe, cuFile or POSIX I/O)."""
__version__ = "0.1.0"
