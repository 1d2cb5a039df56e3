"""A decoder's compute layers over the paged KV cache: attention (decode, prefill chunks, cold
tier, need probe) and projections (packed, panel and quantized-block weights). Models build on them."""
