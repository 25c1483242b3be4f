"""Decoding strategies at evaluation time (`rollwise eval --decode NAME`)."""
