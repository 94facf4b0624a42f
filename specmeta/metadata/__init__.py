"""Metadata builders: one module per attention backend, plus the layout they share."""
