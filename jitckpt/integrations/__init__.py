"""Adapters of ``jitckpt.resumable`` for training frameworks (imported on demand)."""
