"""Page slot ⇄ chunk file: the only code that moves page bytes in and out of the store.

``save_page`` writes a page to a temporary file beside its chunk, with a trailer carrying the
payload checksum and the full keys, then renames it into place: a reader sees a whole chunk or
none. ``load_page`` reads the payload straight into the page slot and the trailer beside it, and
verifies the trailer, the keys and the payload checksum before it reports LOADED. Anything else
is a miss (MISSING) or, for a chunk that fails a check, CORRUPT: counted and quarantined.

Both return futures and never raise I/O errors to the caller: a full disk, a vanished store or a
bad chunk degrades to recomputation with a log line and a counter.

Called by the connector workers (TensorRT-LLM: ``start_load_kv`` / ``save_kv_layer``; MAX:
``load`` / ``offload``), the demo and the benchmarks. One ``PageTransfer`` per namespace.

The package: ``pages`` (statuses, ``LoadVia``, a page's segments), ``core`` (``PageTransfer``:
its state, batches over the threads, host staging), ``saves``, ``loads``, ``later`` (transfers
the serving loop finishes), ``lineage`` (the saves on their way, for the budget) and ``batches``
(how a batch is spread over the threads).
"""
from gdskv.transfer.batches import FOREGROUND_CALLERS, NATIVE_CALLERS, SLICE_PAGES
from gdskv.transfer.core import PageTransfer
from gdskv.transfer.later import REAP_GRACE
from gdskv.transfer.pages import DoneFn, LoadStatus, LoadVia, SaveStatus, page_segments

__all__ = ["FOREGROUND_CALLERS", "NATIVE_CALLERS", "REAP_GRACE", "SLICE_PAGES", "DoneFn", "LoadStatus", "LoadVia",
           "PageTransfer", "SaveStatus", "page_segments"]
