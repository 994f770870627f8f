"""Imported first by the fork server of helpers.isolate, and by nothing else.

The server's output reaches the notebook (the kernel captures its stderr), and it preloads
libraries whose imports log notices that teach nothing (helpers.quiet). So this one module,
unlike every other in helpers, changes state when imported: it silences them in the server.
"""

from helpers.quiet import silence_library_notices

silence_library_notices()
