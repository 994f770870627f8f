"""Measurement helpers for the course *Efficient training of transformers on a single GPU*.

Import the submodules you need: ``helpers.scale``, ``helpers.hardware``, ``helpers.timing``,
``helpers.memory``, ``helpers.train``, ``helpers.isolate``, ``helpers.results``, ``helpers.plots``.
Importing this package does nothing else: no printing, no files, no global settings.
"""

__version__ = "0.1.0"
