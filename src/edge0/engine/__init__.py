"""The engine: a loaded model, its plan, pool, backend and scheduler."""
