"""The OpenAI-compatible HTTP server (`kvreplay serve`)."""
