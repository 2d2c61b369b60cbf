"""PoolingParams: what a pooling request asks for (vLLM's offline shape), validated once at construction.

A pooling request runs its prompt and returns hidden states instead of drawing tokens: ``embed`` one vector for
the prompt (the engine's pooler: ``ModelConfig.pooling_type``), ``token_embed`` one for each prompt token."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from kvserve.sampling_params import InvalidParameter

POOLING_TASKS = ("embed", "token_embed")


@dataclass(frozen=True)
class PoolingParams:
    """``normalize``: each vector scaled to unit length (None: the engine's ``pooling_normalize``).
    ``truncate_prompt_tokens``: keep the prompt's last k tokens (-1: ``max_model_len``), as ``SamplingParams``'s.
    ``dimensions``: vLLM's Matryoshka truncation; kvserve's input processor refuses it, naming it, as vLLM does for
    a model not trained for it (no model kvserve serves is)."""

    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.task not in POOLING_TASKS:
            raise InvalidParameter("task", f"task must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidParameter("normalize", f"normalize must be true, false or null, got {self.normalize!r}")
        for name in ("dimensions", "truncate_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
                raise InvalidParameter(name, f"{name} must be an integer, got {value!r}")
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens >= 1
                                                            or self.truncate_prompt_tokens == -1):
            raise InvalidParameter("truncate_prompt_tokens", "truncate_prompt_tokens must be >= 1 or -1 "
                                   f"(max_model_len), got {self.truncate_prompt_tokens}")

    def pools_every_token(self, pooling_type: str) -> bool:
        """Whether pooling reads the hidden state of every prompt token (so none may come from the prefix cache),
        not the last one's alone."""
        return self.task == "token_embed" or pooling_type != "LAST"


class UnsupportedTask(ValueError):
    """A request for a task (vLLM's names: "generate", "embed", "token_embed") the engine's ``--runner`` does not
    serve."""

    def __init__(self, task: str, runner: str) -> None:
        super().__init__(f"this engine runs with runner={runner!r}, which does not serve {task!r} requests "
                         "(--runner auto serves generation and pooling both)")
        self.task = task
