"""Imported first by the fork server (helpers.forkserver), and by nothing else.

The server's output reaches the notebook (the kernel captures its stderr), and it preloads
libraries whose imports log notices that teach nothing (helpers.quiet). So this one module,
unlike every other in helpers, changes state when imported: it silences them in the server.

It also asks torch to answer ``torch.cuda.is_available()`` from NVML
(``PYTORCH_NVML_BASED_CUDA_CHECK=1``, torch's documented fork-safe check). The server must
never initialise CUDA, or the experiments forked from it could not use the GPU; the preloaded
libraries do not ask, but with torchao installed (lesson 16's optional fp8 package, which
transformers imports when it builds a model) the import does.
"""

import os

from helpers.quiet import silence_library_notices

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
silence_library_notices()
