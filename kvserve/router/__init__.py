"""A router in front of kvserve replicas: data parallelism with cache-aware routing (``kvserve router``)."""
