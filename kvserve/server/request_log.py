"""``--enable-log-requests``: one INFO line for each request as it is queued (its prompt and sampling params, as
vLLM logs them, cut to ``--max-log-len``) and one as it ends (how, its tokens, its time), each naming the id its
answer carries, so that an operator can follow a request a client reports."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncGenerator, Sequence

if TYPE_CHECKING:
    from kvserve.engine.input_processor import PromptInput
    from kvserve.outputs import PoolingRequestOutput, RequestOutput
    from kvserve.pooling_params import PoolingParams
    from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def add_request_log_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction, default=False,
                        help="log each request's prompt and sampling params as it is queued, and how it ended "
                             "(default: off)")
    parser.add_argument("--max-log-len", type=int, default=None,
                        help="the characters of a prompt's text, and the ids of its token ids, that a request's "
                             "line shows (default: all)")


@dataclass(frozen=True)
class RequestLog:
    """Whether requests are logged, and how much of a prompt a line shows (None: all of it)."""

    enabled: bool = False
    max_log_len: int | None = None

    def __post_init__(self) -> None:
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"--max-log-len must be >= 0, got {self.max_log_len}")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> RequestLog:
        return cls(args.enable_log_requests, args.max_log_len)

    def queued(self, request_id: str, engine_id: str, prompts: Sequence[PromptInput],
               params: SamplingParams | PoolingParams) -> LoggedRequest | None:
        """One line for each prompt of the request (a batch's ``{request_id}-{i}``), naming the engine's id
        where it is not the answer's (the engine's own lines name that one); the request's record, which logs its
        end (None: requests are not logged)."""
        if not self.enabled:
            return None
        for i, prompt in enumerate(prompts):
            suffix = "" if len(prompts) == 1 else f"-{i}"
            engine = "" if engine_id == request_id else f" (engine id {engine_id}{suffix})"
            logger.info("request %s%s%s queued: %s, params: %s", request_id, suffix, engine, self._prompt(prompt),
                        self._params(params))
        return LoggedRequest(request_id, len(prompts))

    def _prompt(self, prompt: PromptInput) -> str:
        text = prompt if isinstance(prompt, str) else prompt.get("prompt")
        ids = None if isinstance(prompt, str) else prompt.get("prompt_token_ids")
        shown = [f"prompt: {self._cut(text)!r}"] if text is not None else []
        if ids is not None:
            shown.append(f"prompt_token_ids: {self._cut(list(ids))} ({len(ids)} tokens)")
        return ", ".join(shown)

    def _params(self, params: SamplingParams | PoolingParams) -> str:
        """``params`` as their repr shows them, each list, string or dict cut to ``max_log_len`` items (an
        ``allowed_token_ids`` of the whole vocabulary, a thousand ``bad_words``: a line of megabytes)."""
        if self.max_log_len is None:
            return repr(params)
        shown = [f"{f.name}={self._cut_field(getattr(params, f.name))}" for f in dataclasses.fields(params) if f.repr]
        return f"{type(params).__name__}({', '.join(shown)})"

    def _cut_field(self, value: Any) -> str:
        limit = self.max_log_len or 0
        if not isinstance(value, (list, tuple, str, dict)):  # a constraint: its repr cut (a schema of 64K)
            shown = repr(value)
            return shown if len(shown) <= limit else f"{shown[:limit]}... ({len(shown)} characters)"
        if len(value) <= limit:
            return repr(value)
        cut = dict(list(value.items())[:limit]) if isinstance(value, dict) else value[:limit]
        return f"{cut!r} ({len(value)} {'characters' if isinstance(value, str) else 'items'})"

    def _cut(self, value: Any) -> Any:
        return value if self.max_log_len is None else value[:self.max_log_len]


@dataclass
class LoggedRequest:
    """A logged request, for the line that says how it ended."""

    request_id: str
    num_prompts: int
    start: float = field(default_factory=time.monotonic)

    def ended_early(self, error: BaseException) -> None:
        """The line of a request that ended before any output: refused as it was queued, or its client gone."""
        if not isinstance(error, Exception):  # cancelled: the client went away
            how = "was aborted (its client went away)"
        else:
            how = f"{'was refused' if isinstance(error, ValueError) else 'failed'} ({type(error).__name__}: {error})"
        self._log(how, [""] * self.num_prompts)

    async def watched(self, stream: AsyncGenerator[list[RequestOutput], None]
                      ) -> AsyncGenerator[list[RequestOutput], None]:
        """``stream``; once it ends (finished, failed, or closed by a client gone) a line for each request."""
        outputs: list[RequestOutput] = []
        how = "was aborted (its client went away)"  # closed or cancelled before its end
        try:
            async for outputs in stream:
                yield outputs
            how = "finished"
        except Exception as error:
            how = f"failed ({type(error).__name__}: {error})"
            raise
        finally:
            await stream.aclose()
            self._log(how, [_counts(out) for out in outputs])

    def pooled(self, outputs: Sequence[PoolingRequestOutput]) -> None:
        """The lines of a pooling request's prompts, pooled."""
        self._log("finished", [f"{len(out.prompt_token_ids)} prompt tokens ({out.num_cached_tokens} cached), pooled"
                               for out in outputs])

    def _log(self, how: str, details: list[str]) -> None:
        seconds = time.monotonic() - self.start
        for i, detail in enumerate(details):
            named = self.request_id if len(details) == 1 else f"{self.request_id}-{i}"
            logger.info("request %s %s after %.3f s%s", named, how, seconds, f": {detail}" if detail else "")


def _counts(out: RequestOutput) -> str:
    reasons = ", ".join(str(s.finish_reason) for s in out.outputs if s.finish_reason is not None) or "none"
    num_output = sum(len(s.token_ids) for s in out.outputs)
    return (f"{len(out.prompt_token_ids)} prompt tokens ({out.num_cached_tokens} cached), {num_output} output "
            f"tokens, finish reasons: {reasons}")
