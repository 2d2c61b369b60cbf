"""The OpenAI-compatible HTTP server (``kvserve serve``).

``launch`` (flags, lifecycle, SIGTERM drain) -> ``app`` (routes, guards) -> ``completions`` / ``chat``
(requests -> engine -> answers, over ``streaming``'s shared pieces) -> ``engine.async_engine``.
``protocol`` holds the bodies the endpoints share and ``completion_protocol`` / ``chat_protocol`` /
``model_protocol`` each endpoint's own, ``errors`` the error shape, ``metrics`` the Prometheus metrics, ``state``
what the handlers share.
"""
