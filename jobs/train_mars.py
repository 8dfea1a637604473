"""Ray job entrypoint for training; from the repository root:

    ray job submit --working-dir . -- python jobs/train_mars.py --config configs/quickstart.yaml [key=value]

It is `mars-ray train`: the job's driver connects to the cluster and runs the stages on its workers.
"""

import sys

from mars_ray.cli import main

if __name__ == "__main__":
    main(["train", *sys.argv[1:]])
