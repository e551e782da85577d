"""tokenmill: an LLM inference and serving engine on PyTorch."""

from tokenmill.config import EngineConfig
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from tokenmill.engine.llm import LLM
        return LLM
    if name == "AsyncLLM":
        from tokenmill.engine.async_llm import AsyncLLM
        return AsyncLLM
    raise AttributeError(name)


__all__ = ["LLM", "AsyncLLM", "SamplingParams", "EngineConfig", "RequestOutput",
           "CompletionOutput"]
