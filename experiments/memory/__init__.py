"""The memory study: KV sizes and waste (``reproduce``), capacity, sharing,
hybrid models' capacity, the paper-style figures, and the draggable layout
diagram (``diagram``)."""
