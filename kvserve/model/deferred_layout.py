"""DeferredLayouts: the dense copies of a GGUF's block weights, laid out on a thread of their own after start-up.

The default layout keeps a GGUF's weights in their blocks for steps of a few tokens and a dense copy (dequantized,
then packed into panels and oneDNN's blocked format) for larger ones. Laying that copy out was about 0.7 s of the
default model's 1.2 s build on 2 cores, all of it before /health could answer. With
``ModelConfig.dense_layouts_in_background`` (``kvserve serve`` sets it) loading leaves those layers
``pending_dense`` (``GGMLLinearMethod(defer_dense=True)``) and this thread lays them out while the server already
answers: until a layer's copy is there, its larger steps multiply the blocks themselves as
``--load-format mmap`` does, slower but correct, so nothing waits for it. The copies are written into fresh
tensors and handed to a layer last, so a step on the engine's thread sees either the blocks or the whole copy.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time

import torch

from kvserve.model.layers.linear import Linear

logger = logging.getLogger(__name__)


class DeferredLayouts:
    """Lays out every ``pending_dense`` layer of a model, once, on a daemon thread started by ``start``."""

    def __init__(self, layers: list[Linear]) -> None:
        self._layers = layers
        self._done = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvserve-dense-layouts", daemon=True)
        self.error: BaseException | None = None  # what stopped it; the layers left pending keep their blocks

    @classmethod
    def start(cls, model: torch.nn.Module) -> DeferredLayouts | None:
        """The layouts of ``model``'s pending layers, under way; None when it has none."""
        layers = [layer for layer in model.modules()
                  if isinstance(layer, Linear) and getattr(layer, "pending_dense", None) is not None]
        if not layers:
            return None
        layouts = cls(layers)
        # a daemon thread still inside a torch op when the interpreter exits aborts the process
        atexit.register(layouts.stop)
        layouts._thread.start()
        return layouts

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Whether every layout is done (or given up), waiting up to ``timeout`` seconds (None: until it is)."""
        return self._done.wait(timeout)

    def stop(self) -> None:
        """Stop after the layer being laid out (those left keep their blocks) and wait for that."""
        self._stopping.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        started = time.monotonic()
        try:
            with torch.inference_mode():
                for layer in self._layers:
                    if self._stopping.is_set():
                        return
                    layer.method.lay_out_dense(layer)
        except Exception as error:  # e.g. no memory for a copy: those layers go on multiplying their blocks
            self.error = error
            logger.warning("dense layouts for batched steps stopped (%s); the layers without one keep "
                           "multiplying their GGUF blocks", error)
        else:
            logger.info("dense layouts of %d layers ready for batched steps, laid out in %.1f s",
                        len(self._layers), time.monotonic() - started)
        finally:
            self._done.set()
            atexit.unregister(self.stop)  # which held the model for as long as the process lives
