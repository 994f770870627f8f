"""Imported first by the fork server (helpers.forkserver), and by nothing else.

The server's output reaches the notebook (the kernel captures its stderr), and it preloads
libraries whose imports log notices that teach nothing (helpers.quiet). So this one module,
unlike every other in helpers, changes state when imported: it silences them in the server.

It also asks torch to answer ``torch.cuda.is_available()`` from NVML
(``PYTORCH_NVML_BASED_CUDA_CHECK=1``, torch's documented fork-safe check). The server must
never initialise CUDA, or the experiments forked from it could not use the GPU. That check is
not enough on its own: torchao's import reads the GPU's properties (torch's ``has_triton``),
and transformers' modeling code imports torchao wherever it is installed, so on a GPU the
server imports only torch and transformers (``helpers.forkserver.PRELOAD_CUDA``; found on an
H200, reports/gpu/README.md).
"""

import os

from helpers.quiet import silence_library_notices

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
silence_library_notices()
