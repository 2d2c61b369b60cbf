"""The OpenAI-compatible HTTP server (``kvserve serve``).

``launch`` (flags, lifecycle, SIGTERM drain) -> ``app`` (routes, guards) -> ``completions`` / ``chat``
(requests -> engine -> answers, over ``streaming``'s shared pieces) -> ``engine.async_engine``.
``protocol`` holds the bodies, ``errors`` the error shape, ``metrics`` the Prometheus metrics, ``state`` what the
handlers share.
"""
