"""Speculative decoding: draft proposers and chain acceptance (KDA replay lives with the KDA layer)."""
