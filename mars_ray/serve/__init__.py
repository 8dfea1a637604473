"""Ray Serve: the engine (continuous multi-token batching), the OpenAI app, and its configuration."""
