"""Turning a model into text: the generation loop, sampling, speculative decoding."""
