"""Ollama's API (``/api/*``), one dialect of the gateway: its schema (schema.py), the lowering of
its requests into the typed request chat completions prepare (lowering.py), the renderer of the
neutral output into its replies (render.py), and its model routes (models.py). The routes are
registered in server/api/app.py; errors leave in Ollama's envelope, ``{"error": "..."}``
(server/api/errors.py).
"""
