"""Reward servers on PyTriton (the only package that imports PyTriton) and their client."""
