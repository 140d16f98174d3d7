"""The OpenAI-compatible server: `create_app(engine, ServerOptions(...))`; see app.py."""
