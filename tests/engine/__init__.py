"""Tests of the engine: encoder, heads, backends, default models."""
