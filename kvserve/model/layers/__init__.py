"""Building blocks the model families share: norms, rotary embeddings, packed projections, the gated MLP and
the attention layer that hands q/k/v to the paged attention backend."""
