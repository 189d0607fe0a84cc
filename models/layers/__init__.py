"""Layers more than one decoder uses: RoPE and its scalings, mixture-of-experts
routing and experts (``models`` docstring)."""
