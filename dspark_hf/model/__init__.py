"""The draft model: its config, layers, heads, reduced vocabulary, checkpoint formats and auto classes."""
