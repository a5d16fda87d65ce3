"""torchft's import, in one place: its log level set before it initialises, the error that names the ``[ft]`` extra
when it is missing, and its one warning silenced."""

from __future__ import annotations

import os
import warnings

# torchft's Rust side logs every quorum and commit at INFO to stderr: warnings only, unless the user asked otherwise
# (read when torchft's extension initialises its logger, so before the import)
os.environ.setdefault("RUST_LOG", "warn")

try:  # torchft is optional ("lightning-sync[ft]"); the strategies check for it before they get here
    from torchft import Manager
    from torchft.checkpointing.pg_transport import PGTransport
    from torchft.coordination import LighthouseClient, LighthouseServer
    from torchft.process_group import ProcessGroupGloo
except ImportError as _err:  # pragma: no cover - exercised where torchft is not installed
    raise ImportError(
        'fault tolerance needs torchft: pip install "lightning-sync[ft]" (torchft 0.2 and its OpenTelemetry '
        f"dependencies); importing it failed with {type(_err).__name__}: {_err}"
    ) from _err

__all__ = ["LighthouseClient", "LighthouseServer", "Manager", "PGTransport", "ProcessGroupGloo"]

# torchft's PGTransport wraps its pickled metadata with torch.frombuffer on an immutable bytes object (read only)
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning, module=r"torchft\.")
