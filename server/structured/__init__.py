"""Constrained decoding: xgrammar grammars compiled per schema, matched per request."""
