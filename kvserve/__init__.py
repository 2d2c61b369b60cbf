"""kvserve: an LLM inference and serving engine built around the KV cache."""

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from kvserve.lora_request import LoRARequest
from kvserve.outputs import CompletionOutput, FinishReason, PoolingRequestOutput, RequestOutput
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import BeamSearchParams, SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:  # type checkers see LLM's own type; at run time it is imported when first asked for
    from kvserve.engine.llm import LLM

try:
    __version__ = version("kvserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "unknown"

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "FinishReason", "LoRARequest", "PoolingParams", "PoolingRequestOutput"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch and the model code: import it only when asked for.
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
