"""The runtime's HTTP API (docs/RUNTIME.md): OpenAI-compatible completions and chat, models, health, metrics."""

from moe_runtime.server.app import create_app

__all__ = ["create_app"]
