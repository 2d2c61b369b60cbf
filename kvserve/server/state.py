"""ServerState: what the HTTP handlers share: the engine once loaded, the served names, limits, draining."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Iterator

from kvserve.lora_request import LoRARequest
from kvserve.server.cors import CorsPolicy
from kvserve.server.environment import check_api_keys
from kvserve.server.reasoning_parsers import REASONING_PARSERS
from kvserve.server.errors import RETRY_LATER, APIError, shortened
from kvserve.server.request_log import RequestLog
from kvserve.server.served_adapters import ServedAdapters

if TYPE_CHECKING:
    from kvserve.engine.async_engine import Admission, AsyncEngine
    from kvserve.server.metrics import ServerMetrics

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
# what each engine task serves, for the 400 of a server whose --runner leaves it out (vLLM's "The model does not
# support ... API"), and the --runner that serves it
_TASK_APIS = {"generate": ("text generation (completions, chat, responses, messages)", "generate"),
              "embed": ("embeddings (embeddings, pooling, score, rerank)", "pooling"),
              "token_embed": ("token embeddings (pooling's task token_embed)", "pooling")}


def check_task(engine: AsyncEngine, task: str) -> None:
    """APIError 400 where ``engine`` does not serve ``task`` (``LLMEngine.supported_tasks``: its ``--runner``'s)."""
    tasks = engine.engine.supported_tasks
    if task not in tasks:
        api, runner = _TASK_APIS[task]
        raise APIError(HTTPStatus.BAD_REQUEST, f"the model does not support {api}: this server serves "
                                               f"{', '.join(tasks)} only (its --runner); start it without --runner, "
                                               f"or with --runner {runner}, to serve {task}")


@dataclass(frozen=True)
class ServerSettings:
    """The serving knobs that are not engine configuration."""

    served_model_names: tuple[str, ...]
    model_root: str  # what was loaded: a path or a packaged model's name
    api_keys: tuple[str, ...] = ()  # a request must bring one of them; () requires none
    max_waiting: int | None = None  # None: no limit on the waiting queue
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    shutdown_timeout: float = 30.0
    tool_call_parser: str = "auto"  # the format of the model's own tool calls (``tools.TOOL_CALL_PARSERS``)
    reasoning_parser: str | None = None  # splits a chat answer's thinking off (``reasoning_parsers``); None: not
    cors: CorsPolicy = CorsPolicy()
    request_log: RequestLog = RequestLog()
    # LoRA adapters (--lora-modules) a request selects by naming one in ``model``; loaded as the engine starts
    lora_modules: tuple[LoRARequest, ...] = ()
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter served (``served_adapters``); else a 404 saying so
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        if not self.served_model_names:
            raise ValueError("at least one served model name is needed")
        adapter_names = [adapter.lora_name for adapter in self.lora_modules]
        if clash := set(adapter_names) & set(self.served_model_names):
            raise ValueError(f"--lora-modules: {', '.join(sorted(clash))} is a served model name too: name the "
                             "adapter otherwise")
        if len(set(adapter_names)) < len(adapter_names):
            raise ValueError("--lora-modules: two adapters of one name: name each once")
        check_api_keys(self.api_keys)
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got "
                             f"{self.reasoning_parser!r}")
        if not self.shutdown_timeout >= 0:  # NaN too: it drained nothing
            raise ValueError(f"shutdown_timeout must be >= 0, got {self.shutdown_timeout}")

    @property
    def model_name(self) -> str:
        """The name answers carry in their ``model`` field."""
        return self.served_model_names[0]


@dataclass
class ServerState:
    """Mutable server state: ``engine`` is None while the model loads; ``draining`` once SIGTERM arrived."""

    settings: ServerSettings
    engine: AsyncEngine | None = None
    metrics: ServerMetrics | None = None
    max_model_len: int | None = None  # known once the model is loaded
    draining: bool = False
    load_error: BaseException | None = field(default=None, repr=False)
    adapters: ServedAdapters = field(init=False, repr=False)  # the LoRA adapters served, by name

    def __post_init__(self) -> None:
        self.adapters = ServedAdapters(self.settings.lora_modules, self.settings.served_model_names)

    @property
    def is_ready(self) -> bool:
        return self.engine is not None and self.engine.is_running and not self.draining

    def engine_for(self, model: str | None) -> AsyncEngine:
        """The engine to run a request for ``model`` on (None or empty: the served model, as vLLM takes them),
        or the APIError that says why there is none."""
        served = self.settings.served_model_names + self.adapters.names
        if model and model not in served:
            raise APIError(HTTPStatus.NOT_FOUND, f"the model {shortened(model)!r} does not exist; this server serves "
                                                 f"{', '.join(served)}", param="model")
        if not self.is_ready:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, self.why_not_ready,
                           headers=RETRY_LATER)
        assert self.engine is not None
        return self.engine

    @property
    def failure(self) -> BaseException | None:
        """What stopped the engine if it failed while serving (the server then stops too, so that whatever
        supervises it starts a new one)."""
        return None if self.engine is None else self.engine.failure

    @property
    def why_not_ready(self) -> str:
        if self.draining:
            return "the server is shutting down"
        if self.failure is not None:
            return f"the engine failed ({type(self.failure).__name__}: {self.failure}); the server is stopping"
        return "the model is not loaded yet"

    @contextlib.contextmanager
    def admission(self, model: str | None, task: str = "generate") -> Iterator[tuple[AsyncEngine, Admission | None]]:
        """``engine_for`` plus the waiting-queue limit: 503 with Retry-After while more than ``max_waiting``
        requests wait (``max_waiting=0`` admits a request only when none is waiting). The admission (None without
        a limit) counts the request as waiting until ``generate_many`` (``encode``) queues it; one refused before
        that is closed as the block ends. A ``task`` the engine does not serve (``--runner``) is a 400 first."""
        engine = self.engine_for(model)
        check_task(engine, task)
        max_waiting = self.settings.max_waiting
        if max_waiting is None:
            yield engine, None
            return
        admission = engine.admit(max_waiting)
        if admission is None:
            raise APIError(HTTPStatus.SERVICE_UNAVAILABLE,
                           f"the server is overloaded: {engine.num_waiting()} requests are waiting (over "
                           f"--max-waiting {max_waiting}); retry later",
                           headers=RETRY_LATER)
        with contextlib.closing(admission):
            yield engine, admission
