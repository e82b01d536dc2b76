"""Speculative decoding: drafters and acceptance (issue #34)."""
