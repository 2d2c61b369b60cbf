"""The names of the KV cache's quantized encodings (``--kv-cache-dtype``), apart from their torch definitions.

Plain data, no torch: the configuration and the command line (``kvserve serve --help``) list the names without
importing torch. ``kv/quant.py`` defines each encoding (``ENCODINGS``) and checks at import that it defines these,
in this order; ``kv/csrc/encodings.h`` is the C kernels' twin, their codes (``quant.C_ENCODING_CODES``).
"""

from __future__ import annotations

KV_ENCODING_NAMES = ("int8", "fp8", "int4")
