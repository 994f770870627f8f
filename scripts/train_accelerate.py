"""Train the course's combination with a hand-written Accelerate loop (lesson 07).

    python scripts/train_accelerate.py --max-steps 3              # one process
    accelerate launch --num_processes 2 scripts/train_accelerate.py --max-steps 3
    accelerate launch --cpu --num_processes 2 scripts/train_accelerate.py --cpu   # no GPU

The loop itself is ``helpers.lessons.accelerate_loop.accelerate_train``, run by the measuring
wrapper ``train_loop``; each process prints one JSON line.
"""

import sys

from helpers.lessons.accelerate_loop import main

if __name__ == "__main__":
    sys.exit(main())
