"""The HTTP API: OpenAI request and response models, the FastAPI app, SSE streams, tools and
tokenization. It drives the engine (server.engine) and maps the ring's typed errors to HTTP."""
