"""kvproto: model-checked protocols for a shared KV-cache store."""
